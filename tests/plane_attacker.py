"""A process without the data plane's secret trying every operation (tests/test_dataplane_security.py).

    python tests/plane_attacker.py '{"controller": ..., "units": [...], "server_public": ..., "uid": 65534}'

Imports everything first, then (with ``uid``, run as root) drops to that user, then
sends each operation on its own DEALER socket, plain and with a CURVE keypair of its own
(knowing the servers' public key), waits ``wait`` seconds once for all, and prints a JSON
report: which requests got any reply, how the real client failed and how fast, and
whether it could open the units' shared-memory files. Bounded: a few seconds.
"""

from __future__ import annotations

import asyncio  # noqa: F401  (imported before dropping privileges: the stdlib may be unreadable then)
import glob
import json
import os
import sys
import time

import msgpack
import zmq
import zmq.utils.monitor  # noqa: F401

from asyncflow.dataplane.transport.auth import Credentials
from asyncflow.dataplane.transport.client import ZmqDataPlane


def requests(ctrl: str, units: list[str]) -> list[tuple[str, str, dict]]:
    out = [(ctrl, "get_meta", {"task": "t", "fields": ["x"], "n": 1, "partition": None, "sampler": None,
                               "min_n": None, "block": False, "timeout": None}),
           (ctrl, "stats", {}), (ctrl, "alloc", {"partition": "evil", "n": 1, "timeout": 0}),
           (ctrl, "clear", {"partition": 0}), (ctrl, "save", {"path": "/tmp/asyncflow-evil"}),
           (ctrl, "close", {}), (ctrl, "shutdown", {})]
    for u in units:
        out += [(u, "gather", {"rows": [0], "fields": ["x"]}), (u, "drop", {"rows": [0]}),
                (u, "write", {"rows": [10**6], "cols": [["x", "f", "<f4", [1]]]}), (u, "shutdown", {})]
    return out


def attack(ctrl: str, units: list[str], server_public: str, wait: float) -> list[str]:
    """Every request, plain and with a stranger's CURVE keys; the ones that got a reply."""
    ctx, socks = zmq.Context(), []
    sp, ss = zmq.curve_keypair()
    for mode in ("plain", "curve"):
        for endpoint, op, args in requests(ctrl, units):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            if mode == "curve":
                s.curve_publickey, s.curve_secretkey = sp, ss
                s.curve_serverkey = server_public.encode()
            s.connect(endpoint)
            frames = [msgpack.packb({"op": op, "id": 1, "a": args, "tok": ""})]
            if op == "write":
                frames.append(b"\0" * 4)
            s.send_multipart(frames)
            socks.append((f"{mode}:{op}@{endpoint}", s))
    time.sleep(wait)
    answered = [name for name, s in socks if s.poll(0)]
    ctx.destroy(linger=0)
    return answered


def main() -> None:
    cfg = json.loads(sys.argv[1])
    if cfg.get("uid") is not None:
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])
    report: dict = {"uid": os.getuid()}
    if cfg.get("units") is not None:
        report["answered"] = attack(cfg["controller"], cfg["units"], cfg["server_public"], cfg.get("wait", 1.0))
    for name, creds in [("no_keys", None), ("stranger_keys", Credentials(
            cfg["server_public"], "", *[k.decode() for k in zmq.curve_keypair()]))]:
        t = time.monotonic()
        try:
            ZmqDataPlane(cfg["controller"], credentials=creds, deadline=cfg.get("deadline", 3.0)).stats()
            report[name] = ["answered", 0.0]
        except Exception as exc:
            report[name] = [f"{type(exc).__name__}: {exc}", time.monotonic() - t]
    opened, seen = [], glob.glob("/dev/shm/afdp-*")
    report["shm_seen"] = len(seen)
    for path in seen:
        try:
            with open(path, "rb") as fh:
                fh.read(1)
            opened.append(path)
        except OSError:
            pass
    report["shm_opened"] = opened
    print(json.dumps(report), flush=True)
    os._exit(0)  # no interpreter teardown (the client's loop thread)


if __name__ == "__main__":
    main()
