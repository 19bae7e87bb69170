"""Data plane throughput and latency: ours (in process, distributed) vs TransferQueue 0.1.11.

One command::

    PYTHONPATH=. python benchmarks/data_plane.py            # both payload shapes
    PYTHONPATH=. python benchmarks/data_plane.py --small    # the small shape only

Payloads (float32, fixed length, as TransferQueue's ``scripts/performance_test/perftest.py``):

* ``tq-perf``: global batch 1024 x 9 fields x seq len 8192 (~302 MB per put);
* ``small``:   128 x 4 x 1024 (~2 MB per put).

For each system: one put of the whole batch as new rows (writer = this process), then one
get of every field of every row; the best of ``--iters`` runs (partition cleared between
runs), in GB/s (1 GB = 2**30 bytes, as TransferQueue's script). ``cold put`` is the first
run's put alone: our storage units reuse the shared memory of cleared rows
(``asyncflow.dataplane.transport.shm``, recycling), as every training step after the first does, so the
first put is the one that pays for fresh pages (about half the speed on this machine). The distributed deployment
and TransferQueue both keep the data in other processes (2 storage units each), so their
figures include the process hops; the in-process ``DataPlane`` is the no-network bound.
Distributed systems, named by control socket + how big buffers move (the ``via`` column
prints what the client's handshake chose per storage unit):

* ``tcp+shm`` / ``ipc+shm``: the default, same-host shared memory for messages of at least
  ``--shm-min`` bytes (``asyncflow.dataplane.transport.shm``), frames below;
* ``tcp`` / ``ipc``: shared memory off (``use_shm=False``): every byte in ZeroMQ frames,
  what a client on another host gets, on the units' sealed bulk ports (AES-256-GCM under a
  session key handed out over CURVE, ``asyncflow.dataplane.transport.sealed``; the default of
  every secure deployment);
* ``tcp-curve``: ``tcp`` with the frames on the units' CURVE sockets (``sealed=False``):
  the cross-host path as it was before the bulk ports;
* ``tcp-plain`` / ``tcp+shm-plain``: CURVE off (``launch(secure=False)``, loopback only,
  nothing authenticated or encrypted): the same paths without any cipher, to separate the
  cost of authentication and encryption from the transport's (printed as ratios at the end,
  and, for payloads of 0.1 GB or more, as CPU seconds per GB of the client process and of the
  server processes, every thread, with each secure path's extra CPU over its plain twin:
  what a loaded machine distorts less than wall time).
First, ``get_meta`` latency of a client in this process against the controller process
(non-blocking, 1 row, 2000 calls): p50/p99, measured before any throughput run, while no
Ray is running (TransferQueue's Ray start-up, measured, doubles it for ~20 s).

TransferQueue is optional (``pip install -e .[bench]``); without it that column is skipped
with a message. It starts Ray with 8 logical CPUs (its actors ask for one each).
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import time
from collections.abc import Sequence

import numpy as np

from asyncflow.dataplane import DataPlane, Field, Schema
from asyncflow.dataplane.transport.deploy import launch

_TICKS = os.sysconf("SC_CLK_TCK")
SHAPES = {"tq-perf": (1024, 9, 8192), "small": (128, 4, 1024)}


def payload(batch: int, n_fields: int, seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {f"field_{i}": rng.standard_normal((batch, seq), dtype=np.float32) for i in range(n_fields)}


def gbytes(data: dict[str, np.ndarray]) -> float:
    return sum(v.nbytes for v in data.values()) / 2**30


def cpu_s(pids: Sequence[int]) -> tuple[float, float]:
    """CPU seconds (user + system, every thread) of this process and of ``pids`` (the
    servers; read from ``/proc``, so 0 where there is none)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    servers = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            servers += (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
    return me.ru_utime + me.ru_stime, servers


def bench_ours(plane, data: dict[str, np.ndarray], iters: int,
               pids: Sequence[int] = ()) -> tuple[float, float, float, list[float]]:
    """Best put and get times, the first put, and the median CPU seconds of a put and a get
    ``[put client, put servers, get client, get servers]`` (busy time of every thread)."""
    fields, n = list(data), len(next(iter(data.values())))
    put_t, get_t, cpu = [], [], []
    for i in range(iters):
        c0, t = cpu_s(pids), time.perf_counter()
        plane.put(data, partition=f"b{i}")
        c1, put_t_i = cpu_s(pids), time.perf_counter() - t
        t = time.perf_counter()
        meta, got = plane.get_batch("bench", fields, n=n, partition=f"b{i}")
        get_t.append(time.perf_counter() - t)
        c2 = cpu_s(pids)
        put_t.append(put_t_i)
        cpu.append([c1[0] - c0[0], c1[1] - c0[1], c2[0] - c1[0], c2[1] - c1[1]])
        assert len(meta.rows) == n and got[fields[0]].shape == data[fields[0]].shape
        del got
        plane.clear(f"b{i}")
        gc.collect()
    return min(put_t), min(get_t), put_t[0], [float(np.median(c)) for c in zip(*cpu)]


def bench_tq(data: dict[str, np.ndarray], iters: int) -> tuple[float, float, float] | str:
    try:
        import ray
        import torch
        import transfer_queue as tq
        from tensordict import TensorDict
    except ImportError as exc:
        return f"skipped: transferqueue not installed ({exc}); pip install -e .[bench]"
    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    tq.init()
    n = len(next(iter(data.values())))
    fields = TensorDict({k: torch.from_numpy(v) for k, v in data.items()}, batch_size=n)
    keys = [f"k{i}" for i in range(n)]
    put_t, get_t = [], []
    try:
        for i in range(iters):
            t = time.perf_counter()
            tq.kv_batch_put(keys=keys, partition_id=f"b{i}", fields=fields)
            put_t.append(time.perf_counter() - t)
            t = time.perf_counter()
            got = tq.kv_batch_get(keys=keys, partition_id=f"b{i}")
            get_t.append(time.perf_counter() - t)
            assert tuple(got["field_0"].shape)[0] == n  # a jagged tensor [n, j] in 0.1.11
            del got
            tq.kv_clear(keys=keys, partition_id=f"b{i}")
            gc.collect()
    finally:
        tq.close()
    return min(put_t), min(get_t), put_t[0]


def get_meta_latency(plane, calls: int = 2000) -> tuple[float, float]:
    plane.put({"x": np.arange(calls + 10, dtype=np.int64)}, partition="lat")
    lat = []
    for _ in range(calls):
        t = time.perf_counter()
        plane.get_meta("lat", ["x"], n=1, partition="lat", block=False)
        lat.append(time.perf_counter() - t)
    plane.clear("lat")
    ms = np.array(lat) * 1e3
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99))


def cost_lines(shape: str, results: dict) -> list[str]:
    """The price of authentication and encryption per path: each secure system's speed
    over its ``-plain`` twin's (the same path with no keys) in this run."""
    out = []
    for secure, plain in (("tcp", "tcp-plain"), ("tcp-curve", "tcp-plain"), ("tcp+shm", "tcp+shm-plain")):
        a, b = results.get(secure), results.get(plain)
        if isinstance(a, tuple) and isinstance(b, tuple):
            out.append(f"{shape}: cost of auth+encryption, {secure} / {plain}: put x{b[0] / a[0]:.2f}, "
                       f"get x{b[1] / a[1]:.2f} of the plain speed")
    return out


def cpu_lines(shape: str, gb: float, results: dict) -> list[str]:
    """CPU per GB moved (median run; client process / server processes, every thread):
    what the machine pays per path, which a load on the machine changes less than it
    changes wall times; and each secure path's extra CPU over its ``-plain`` twin. Only for
    payloads of 0.1 GB or more: the servers' CPU is read in clock ticks (10 ms)."""
    out: list[str] = []
    if gb < 0.1:
        return out
    for system, r in results.items():
        if isinstance(r, tuple) and len(r) > 3 and system != "in-process":
            pc, ps, gc_, gs = (x / gb for x in r[3])
            out.append(f"{shape}: CPU s/GB {system}: put {pc:.3f} client + {ps:.3f} servers = {pc + ps:.3f}, "
                       f"get {gc_:.3f} + {gs:.3f} = {gc_ + gs:.3f}")
    for secure, plain in (("tcp", "tcp-plain"), ("tcp-curve", "tcp-plain"), ("tcp+shm", "tcp+shm-plain")):
        a, b = results.get(secure), results.get(plain)
        if isinstance(a, tuple) and isinstance(b, tuple):
            put, get = (sum(a[3][k:k + 2]) - sum(b[3][k:k + 2]) for k in (0, 2))
            out.append(f"{shape}: extra CPU of auth+encryption, {secure} over {plain}: put {put / gb:+.3f} s/GB, "
                       f"get {get / gb:+.3f} s/GB (both ends)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="only the small shape")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--no-tq", action="store_true", help="skip TransferQueue")
    ap.add_argument("--systems", default="tcp+shm,tcp+shm-plain,tcp,tcp-curve,tcp-plain,ipc+shm,ipc",
                    help="distributed systems to run, comma-separated (default: all seven)")
    ap.add_argument("--shm-min", type=int, default=None, help="shared-memory threshold in bytes per message")
    args = ap.parse_args()
    systems = [x for x in args.systems.split(",") if x]
    shapes = {"small": SHAPES["small"]} if args.small else SHAPES
    dep = launch(Schema([Field("x", "int64")]), n_storage=2)
    try:
        p50, p99 = get_meta_latency(dep.client())
    finally:
        dep.shutdown()
    print(f"{'shape':8} {'system':13} {'GB':>6} {'put GB/s':>9} {'get GB/s':>9} {'cold put':>9}  via")
    ratios: list[str] = []
    costs: list[str] = []
    for name, (b, f, s) in shapes.items():
        data = payload(b, f, s)
        gb = gbytes(data)
        schema = Schema([Field(k, "float32", (s,)) for k in data])
        results = {"in-process": bench_ours(DataPlane(schema), data, args.iters)}
        via = {"in-process": "-"}
        for system in systems:
            base, _, variant = system.partition("-")  # e.g. "tcp+shm", "plain"
            dep = launch(schema, n_storage=2, transport=base.split("+")[0], secure=variant != "plain")
            try:
                client = dep.client(use_shm=base.endswith("+shm"), sealed=variant != "curve")
                if args.shm_min is not None:
                    client._core.shm_min_bytes = args.shm_min
                via[system] = ",".join(client.transports())
                results[system] = bench_ours(client, data, args.iters, [p.pid for p in dep.processes])
            finally:
                dep.shutdown()
        results["transferqueue"] = "skipped (--no-tq)" if args.no_tq else bench_tq(data, args.iters)
        for system, r in results.items():
            if isinstance(r, str):
                print(f"{name:8} {system:13} {r}", flush=True)
            else:
                print(f"{name:8} {system:13} {gb:6.3f} {gb / r[0]:9.2f} {gb / r[1]:9.2f} {gb / r[2]:9.2f}"
                      f"  {via.get(system, '')}", flush=True)
        if not isinstance(results["transferqueue"], str):
            for system in systems:
                (dp_, dg, dc), (tp, tg, tc) = results[system][:3], results["transferqueue"]
                ratios.append(f"{name}: {system}/transferqueue put x{tp / dp_:.2f}, get x{tg / dg:.2f}"
                              f" (cold put x{tc / dc:.2f})")
        costs += cost_lines(name, results) + cpu_lines(name, gb, results)
        del data
        gc.collect()
    for line in ratios:
        print(line)
    for line in costs:
        print(line)
    print(f"get_meta latency, client process -> controller process: p50 {p50:.3f} ms, p99 {p99:.3f} ms")


if __name__ == "__main__":
    main()
