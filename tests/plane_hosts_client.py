"""A data-plane client run in another network namespace by tests/test_dataplane_hosts.py.

argv[1]: JSON ``{"controller": endpoint, "keys": key file, "deadline": s, "dev": veth}``.
Puts rows (one field big enough that shared memory would be tried, filled with a marker
text), reads them back while a raw packet socket records every frame on ``dev`` (the
link to the unit's host: the marker must not appear, the data is encrypted), then asks
with a client key that is not the job's, of the controller and of the unit (both must
refuse). Prints one JSON line.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

import numpy as np
import zmq

from asyncflow.dataplane import DataPlaneUnavailable
from asyncflow.dataplane.transport.auth import Credentials, secure_client
from asyncflow.dataplane.transport.client import ZmqDataPlane
from asyncflow.dataplane.transport.deploy import read_keys
from asyncflow.dataplane.transport.protocol import pack_header


MARKER = b"ASYNCFLOW-PLAINTEXT-MARKER-0123456789abcdef-"


def sniff(dev: str, stop: threading.Event, seen: list[bytes]) -> None:
    """Every link-layer frame on ``dev`` (both ways) until ``stop``."""
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
    s.bind((dev, 0))
    s.settimeout(0.05)
    with s:
        while not stop.is_set():
            try:
                seen.append(s.recv(1 << 18))
            except TimeoutError:
                pass


def ping_unit(unit: str, creds: Credentials, wait_s: float) -> bool:
    """A raw CURVE client with ``creds``'s client keys pings the unit: answered?"""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    secure_client(sock, creds)
    sock.connect(unit)
    sock.send_multipart([pack_header({"op": "ping", "id": 1})])
    answered = bool(sock.poll(int(wait_s * 1000)))
    ctx.destroy(linger=0)
    return answered


def bulk_pings(unit: str, creds: Credentials, wait_s: float) -> dict:
    """The unit's sealed bulk port, asked for over CURVE with the job's keys: a ping sealed
    under the session is answered; one under a random key (the real session id) or a
    random session is not (the random session gets only a notice naming its id)."""
    from asyncflow.dataplane.transport.protocol import unpack_header  # reason: test helper, keep imports short
    from asyncflow.dataplane.transport.sealed import TO_SERVER, Session, notice_of

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    secure_client(sock, creds)
    sock.connect(unit)
    sock.send_multipart([pack_header({"op": "bulk_session", "id": 1})])
    got = unpack_header(sock.recv_multipart()[0])["r"] if sock.poll(int(wait_s * 1000)) else None
    out = {"session": got is not None}
    if got is not None:
        host = unit.rsplit(":", 1)[0]
        for name, sid, key in (("forged_key", got["sid"], bytes(32)), ("forged_session", bytes(8), got["key"]),
                               ("job", got["sid"], got["key"])):
            bulk = ctx.socket(zmq.DEALER)
            bulk.linger = 0
            bulk.connect(host + ":" + got["endpoint"].rsplit(":", 1)[1])
            bulk.send_multipart(Session(sid, key, TO_SERVER).seal(pack_header({"op": "ping", "id": 1}), [], bytearray))
            reply = bulk.recv_multipart() if bulk.poll(int(wait_s * 1000)) else None
            out[name] = reply is not None and notice_of(reply) is None  # answered (a notice names an unknown id)
            out[name + "_notice"] = reply is not None and notice_of(reply) == sid
    ctx.destroy(linger=0)
    return out


def round_trip(plane: ZmqDataPlane, cfg: dict, part: str = "p") -> dict:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 4)).astype(np.float32)
    n = 8 * 128 * 1024 * 4  # 4 MiB: over shared memory's threshold
    wide = np.frombuffer((MARKER * (n // len(MARKER) + 1))[:n], np.float32).reshape(8, -1)
    stop, seen = threading.Event(), []
    spy = threading.Thread(target=sniff, args=(cfg["dev"], stop, seen), daemon=True)
    spy.start()
    time.sleep(0.2)
    rows = plane.put({"x": x, "wide": wide}, partition=part)
    meta, data = plane.get_batch("t", ["x", "wide"], n=8, partition=part, timeout=cfg["deadline"])
    time.sleep(0.2)
    stop.set()
    spy.join(5)
    order = np.argsort(meta.rows)
    wire = b"".join(seen)
    return {"rows": list(rows), "units": plane.storage_endpoints(), "transports": plane.transports(),
            "equal": np.asarray(data["x"])[order].tobytes() == x.tobytes()
            and np.asarray(data["wide"])[order].tobytes() == wide.tobytes(),
            "wire_bytes": len(wire), "marker_on_wire": wire.count(MARKER[:24])}


def main() -> None:
    cfg = json.loads(sys.argv[1])
    creds = read_keys(cfg["keys"]).for_client()
    plane = ZmqDataPlane(cfg["controller"], credentials=creds, deadline=cfg["deadline"])
    out = round_trip(plane, cfg)
    plane.disconnect()
    curve = ZmqDataPlane(cfg["controller"], credentials=creds, deadline=cfg["deadline"], sealed=False)  # CURVE socket
    out["curve"] = round_trip(curve, cfg, part="p2")
    curve.disconnect()
    stranger = Credentials(creds.server_public, "", *[k.decode() for k in zmq.curve_keypair()])
    t0 = time.monotonic()
    try:
        ZmqDataPlane(cfg["controller"], credentials=stranger, deadline=cfg["deadline"]).stats()
        out["stranger"] = "answered"
    except DataPlaneUnavailable as exc:
        out["stranger"] = str(exc)[:200]
    out["stranger_s"] = time.monotonic() - t0
    out["unit_answers_job"] = ping_unit(out["units"][0], creds, 5.0)
    out["unit_answers_stranger"] = ping_unit(out["units"][0], stranger, 3.0)
    out["bulk"] = bulk_pings(out["units"][0], creds, 3.0)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
