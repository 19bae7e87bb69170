"""What a hand-off between processes costs here: a ZeroMQ round trip on one core vs across two.

A data-plane call is a chain of such hand-offs (the role's thread, its ZeroMQ I/O thread,
a server process, and back). This script times a plain DEALER/ROUTER echo of one small
message between two processes, with both pinned to one core and with each on its own
core, alternating, so the machine's drift favours neither. Where a wake-up across cores
costs an interrupt between virtual CPUs (as in this Firecracker VM), the second is two
to four times the first (2.25-2.43x here, idle), which is why a role's helper threads
stay on its core (``asyncflow/workflow/cores.py``).

    python benchmarks/round_trip.py --rounds 3
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time


def _echo(addr: str, core: int) -> None:
    import zmq

    os.sched_setaffinity(0, {core})
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(addr)
    while True:
        frames = sock.recv_multipart()
        if frames[1] == b"stop":
            return
        sock.send_multipart(frames)


def round_trip_us(client_core: int, server_core: int, n: int) -> float:
    """Mean microseconds of one echo, the client on ``client_core``, the server on ``server_core``."""
    import zmq

    addr = "ipc:///tmp/asyncflow-round-trip-%d" % os.getpid()
    server = mp.get_context("spawn").Process(target=_echo, args=(addr, server_core))
    server.start()
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {client_core})
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(addr)
    try:
        for _ in range(200):  # connect and warm up
            sock.send(b"x")
            sock.recv()
        t = time.perf_counter()
        for _ in range(n):
            sock.send(b"x")
            sock.recv()
        return (time.perf_counter() - t) / n * 1e6
    finally:
        sock.send(b"stop")
        server.join()
        sock.close(0)
        ctx.term()
        os.sched_setaffinity(0, before)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="one-core / two-core pairs")
    ap.add_argument("-n", type=int, default=3000, help="round trips per measurement")
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs two cores")
    a, b = cores[:2]
    for i in range(args.rounds):
        same = round_trip_us(a, a, args.n)
        across = round_trip_us(a, b, args.n)
        print(f"round {i + 1}: one core {same:6.0f} us, two cores {across:6.0f} us ({across / same:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
