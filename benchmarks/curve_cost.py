"""What CURVE (the data plane's default authentication + encryption) costs on loopback.

    PYTHONPATH=. python benchmarks/curve_cost.py [--iters 5]

For ``secure`` off and on (``launch(secure=...)``), with shared memory on (the default on
one host: big buffers skip the socket) and off (every byte in ZeroMQ frames, what a client
on another host gets): best-of-``iters`` put and get of one batch (``small``: 128 x 4 x
1024 float32, 2 MiB; ``big``: 8 x that), in GB/s, and the p50 latency of a non-blocking
1-row ``get_meta`` (500 calls). Deployments alternate so that machine noise hits both.
"""

from __future__ import annotations

import argparse

from data_plane import bench_ours, gbytes, get_meta_latency, payload

from asyncflow.dataplane import Field, Schema
from asyncflow.dataplane.transport.deploy import launch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    shapes = {"small": payload(128, 4, 1024), "big": payload(1024, 4, 1024)}
    schema = Schema([Field(f"field_{i}", "float32", (1024,)) for i in range(4)] + [Field("x", "int64")])
    print(f"{'secure':>6} {'shm':>5} {'shape':>6} {'put GB/s':>9} {'get GB/s':>9} {'get_meta p50 ms':>16}")
    for use_shm in (True, False):
        for secure in (False, True, False, True):
            dep = launch(schema, n_storage=2, secure=secure)
            try:
                plane = dep.client(use_shm=use_shm)
                p50, _ = get_meta_latency(plane, 500)
                for name, data in shapes.items():
                    put, get, _ = bench_ours(plane, data, args.iters)
                    print(f"{secure!s:>6} {use_shm!s:>5} {name:>6} {gbytes(data) / put:9.2f} "
                          f"{gbytes(data) / get:9.2f} {p50:16.3f}", flush=True)
                plane.disconnect()
            finally:
                dep.shutdown()


if __name__ == "__main__":
    main()
