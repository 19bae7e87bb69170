"""The data plane against a buggy or compromised worker holding the job's keys, and against
dead servers (issue 34). Raw requests go on DEALER sockets with the job's keys, so they
reach the request loops as any client's would. Checked:

* a commit that names fields its client never wrote (or wrote to the wrong unit, or with a
  forged or another write's receipt) is refused, naming row, field and unit, and honest
  consumers never see those rows (before: the rows became ready and every ``get_batch`` of
  them failed with "row ... field 'key' is not stored");
* a frame over ``max_msg_bytes`` is refused at its header (the unit's memory does not grow by
  it), a message of smaller frames over it gets an error reply naming the limit (before:
  taken whole and served), and meanwhile another client's reads keep their latency within
  3x + 10 ms of unloaded (medians); an honest put bigger than the limit is split below it
  (before: its message was dropped and the put failed with "connection lost");
* a client made while a storage unit or the controller is dead fails within 5 s naming it
  (before: 30 s, "did not answer");
* a controller restarted on its port without ``load`` refuses to serve, naming the unit that
  holds rows and the fix, and serves after ``load``, its row ids continuing (before: it
  handed out row 0 again).
"""

from __future__ import annotations

import os
import signal
import statistics
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from asyncflow.dataplane import BatchMeta, Field, Schema
from asyncflow.dataplane.core.rules import DataPlaneUnavailable
from asyncflow.dataplane.transport.auth import secure_client
from asyncflow.dataplane.transport.controller_server import ControllerServer
from asyncflow.dataplane.transport.deploy import launch
from asyncflow.dataplane.transport.protocol import encode_columns, pack_header, unpack_header
from asyncflow.dataplane.transport.sealed import TO_SERVER, Session

SCHEMA = Schema([Field("x", "float32", (4,)), Field("key", "int64", ragged=True)])
LIMIT = 8 << 20  # max_msg_bytes of the size tests' deployment


def _sock(dep, endpoint, ctx=None):
    s = (ctx or zmq.Context.instance()).socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)
    secure_client(s, dep.credentials)
    s.connect(endpoint)
    return s


def _ask(dep, endpoint, op, args, frames=(), wait=10.0):
    """One request on a fresh authenticated socket: its reply header (None if unanswered)."""
    s = _sock(dep, endpoint)
    try:
        s.send_multipart([msgpack.packb({"op": op, "id": 7, "a": args}), *frames])
        return msgpack.unpackb(s.recv_multipart()[0], strict_map_key=False) if s.poll(int(wait * 1000)) else None
    finally:
        s.close(0)


def _write(dep, unit, rows, columns):
    """A raw write of ``columns`` at ``rows`` to storage unit ``unit``: its receipt."""
    spec, buffers = encode_columns(columns)
    reply = _ask(dep, dep.client().storage_endpoints()[unit], "write", {"rows": rows, "cols": spec}, buffers)
    assert reply["ok"], reply
    return (reply["r"] or {}).get("receipt")  # (None from a unit that gives no receipts)


def test_a_commit_of_what_was_not_written_is_refused_and_honest_consumers_never_see_it():
    d = launch(SCHEMA, n_storage=2)
    plane = d.client()
    try:
        rows = _ask(d, d.endpoint, "alloc", {"partition": "p", "n": 2, "timeout": 0})["r"]
        assert rows == [0, 1]  # both on unit 0 (blocks of 64 ids go round-robin)
        x = {"x": np.ones((2, 4), np.float32)}
        key = {"key": [np.arange(3), np.arange(2)]}
        mac_x = _write(d, 0, rows, x)

        def commit(fields, receipts):
            return _ask(d, d.endpoint, "commit", {"partition": "p", "rows": rows, "fields": fields, "tags": {},
                                                  "abort": False, "receipts": receipts})

        lies = {  # what a liar may try -> what the refusal names
            "no receipt": (["x", "key"], [], "row 0 field 'key' has no receipt from storage unit 0"),
            "x's receipt for x and key": (["x", "key"], [[0, [[0, 2]], mac_x]], "does not match what storage unit 0"),
            "a forged receipt": (["key"], [[0, [[0, 2]], os.urandom(16)]], "does not match"),
            "another unit's name": (["x"], [[1, [[0, 2]], mac_x]], "row 0 lives on storage unit 0, not on unit 1"),
            "half the rows": (["x"], [[0, [[0, 1]], mac_x]], "does not match"),
        }
        mac_wrong_unit = _write(d, 1, rows, key)  # key written where rows 0-1 do not live
        lies["the wrong unit's receipt"] = (["key"], [[1, [[0, 2]], mac_wrong_unit]], "lives on storage unit 0")
        lies["it under unit 0's name"] = (["key"], [[0, [[0, 2]], mac_wrong_unit]], "does not match")
        for what, (fields, receipts, why) in lies.items():
            reply = commit(fields, receipts)
            assert reply["ok"] is False and reply["err"]["type"] == "PermissionError", what
            assert why in reply["err"]["msg"] and "commit refused" in reply["err"]["msg"], (what, reply)
        got = plane.get_meta("consumer", ["x", "key"], n=2, partition="p", block=False)
        assert got.rows == []  # nothing was committed: no honest get_batch meets "not stored"
        assert commit(["x"], [[0, [[0, 2]], mac_x]])["ok"]  # the truth is accepted
        meta, data = plane.get_batch("consumer", ["x"], n=2, partition="p")
        assert meta.rows == rows and data["x"].tolist() == x["x"].tolist()
        assert plane.get_meta("consumer", ["x", "key"], n=2, partition="p", block=False).rows == []
        assert commit(["key"], [[0, [[0, 2]], _write(d, 0, rows, key)]])["ok"]  # key, written where it lives
        meta, data = plane.get_batch("both", ["x", "key"], n=2, partition="p")
        assert [k.tolist() for k in data["key"]] == [[0, 1, 2], [0, 1]]
        rows = plane.put({"x": np.zeros((130, 4), np.float32), "key": [np.arange(1)] * 130}, partition="q")
        assert plane.get_batch("c", ["x", "key"], n=130, partition="q")[0].rows == rows  # honest puts: both units
    finally:
        plane.disconnect()
        d.shutdown()


def _rss_kb(pid):
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS"))


def _medians(plane, meta, seconds=None, n=40):
    """Median latency of the victim's reads: ``n`` of them, or as many as fit in ``seconds``."""
    times, end = [], time.monotonic() + (seconds or 0)
    while len(times) < n or (seconds and time.monotonic() < end):
        t = time.perf_counter()
        assert plane.get_data(meta)["x"].shape == (2, 4)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def test_an_oversized_frame_is_refused_at_its_header_and_stalls_no_other_client():
    """An attacker thread (its own ZeroMQ context, so only the unit is shared with the victim)
    sends frames of 3x the limit, every 50 ms for 3 s, to the unit's CURVE socket and to its
    bulk port; the victim's reads meanwhile. Then messages of frames each under the limit but
    over it together, to the unit (both sockets) and the controller: an error reply each.
    (Such a message is only refused once ZeroMQ has taken it whole, frames decrypted: it costs
    the server what legit traffic of its size costs, so it is not part of the latency check.)"""
    d = launch(SCHEMA, n_storage=1, max_msg_bytes=LIMIT)
    victim = d.client(deadline=20)
    try:
        victim.put({"x": np.ones((2, 4), np.float32), "key": [np.arange(2)] * 2}, partition=0)
        meta, unit = BatchMeta(0, [0, 1], ["x"]), victim.storage_endpoints()[0]
        _medians(victim, meta, n=10)  # (warm: the first reads connect and fill caches)
        unloaded = _medians(victim, meta, seconds=1.0)
        got = _ask(d, unit, "bulk_session", {})["r"]
        me = Session(got["sid"], got["key"], TO_SERVER)
        ctx = zmq.Context()
        curve, bulk = _sock(d, unit, ctx), ctx.socket(zmq.DEALER)
        bulk.setsockopt(zmq.LINGER, 0)
        bulk.connect(got["endpoint"])
        stop, rss, big = threading.Event(), _rss_kb(d.processes[0].pid), bytes(3 * LIMIT)

        def attack():
            while not stop.is_set():
                curve.send_multipart([pack_header({"op": "ping", "id": 1, "a": {}}), big], copy=False)
                bulk.send_multipart([me.seal(pack_header({"op": "ping", "id": 1}), [], bytes)[0], big], copy=False)
                stop.wait(0.05)

        attacker = threading.Thread(target=attack)
        attacker.start()
        try:
            during = _medians(victim, meta, seconds=3.0)
        finally:
            stop.set()
            attacker.join(30)
        print(f"victim's read: {unloaded * 1e3:.2f} ms unloaded, {during * 1e3:.2f} ms beside the oversized frames")
        assert during <= 3 * unloaded + 0.010
        assert not curve.poll(500) and not bulk.poll(0)  # no answer: refused at the frame's header
        assert _rss_kb(d.processes[0].pid) - rss < 3 * LIMIT // 1024  # kB: never buffered
        part = bytes(LIMIT - 4096)  # three of them: over the limit together
        for endpoint in (unit, d.endpoint):
            reply = _ask(d, endpoint, "ping", {}, [part] * 3)
            assert reply["ok"] is False and f"over this server's limit of {LIMIT} bytes" in reply["err"]["msg"]
        fresh = ctx.socket(zmq.DEALER)  # (the attacker's sockets still queue oversized frames, each a reconnect)
        fresh.setsockopt(zmq.LINGER, 0)
        fresh.connect(got["endpoint"])
        fresh.send_multipart(me.seal(pack_header({"op": "ping", "id": 9}), [part] * 3, bytearray))
        assert fresh.poll(10_000)
        reply = unpack_header(me.open(fresh.recv_multipart())[0])
        assert reply["id"] == 9 and f"over this server's limit of {LIMIT} bytes" in reply["err"]["msg"]
        assert _medians(victim, meta, n=3) > 0  # and the unit serves on
        for sock in (curve, bulk, fresh):
            sock.close(0)
        ctx.term()
    finally:
        victim.disconnect()
        d.shutdown()


@pytest.mark.parametrize("how", ["sealed", "curve"])
def test_an_honest_put_bigger_than_the_limit_is_split_below_it(how):
    d = launch(SCHEMA, n_storage=1, max_msg_bytes=LIMIT)
    plane = d.client(use_shm=False, sealed=how == "sealed")
    try:
        x = np.random.default_rng(0).standard_normal((20_000, 4), dtype=np.float32)
        key = [np.arange(i % 200) for i in range(20_000)]  # 16 MB of int64 in all: three messages at least
        rows = plane.put({"x": x, "key": key}, partition=0)
        _, got = plane.get_batch("t", ["x", "key"], n=len(rows), partition=0)
        assert np.array_equal(got["x"], x) and all(np.array_equal(a, b) for a, b in zip(got["key"], key))
        allocated = plane.stats()["rows_allocated"]
        with pytest.raises(ValueError, match="row 0 of the put is .* bytes.*max_msg_bytes=8388608"):
            plane.put({"x": np.ones((1, 4), np.float32), "key": [np.arange(LIMIT // 8)]}, partition=1)
        assert plane.stats()["rows_allocated"] == allocated  # refused before anything was sent
    finally:
        plane.disconnect()
        d.shutdown()


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_a_client_made_while_a_unit_or_the_controller_is_dead_fails_within_5_s_naming_it(transport):
    d = launch(SCHEMA, n_storage=2, transport=transport)
    try:
        units = d.client().storage_endpoints()
        for victim, name in ((1, f"storage unit 1 ({units[1]})"), (2, f"the data plane's controller {d.endpoint}")):
            os.kill(d.processes[victim].pid, signal.SIGKILL)
            d.processes[victim].join(5)
            t = time.monotonic()
            with pytest.raises(DataPlaneUnavailable) as err:
                d.client().stats()
            assert time.monotonic() - t < 5
            assert str(err.value).startswith(f"{name} refused the connection"), err.value
    finally:
        d.shutdown()


def test_a_controller_restarted_without_load_refuses_to_serve_until_it_loads(tmp_path):
    d = launch(SCHEMA, n_storage=1, state_dir=tmp_path)
    plane = d.client()
    restarted = None
    try:
        first = plane.put({"x": np.ones((3, 4), np.float32), "key": [np.arange(2)] * 3}, partition=0)
        plane.save("s")
        plane.disconnect()
        os.kill(d.processes[-1].pid, signal.SIGKILL)  # the controller dies; the unit keeps its rows
        d.processes[-1].join(5)
        restarted = ControllerServer(SCHEMA, _unit_endpoints(d), bind=d.endpoint,
                                     creds=d.credentials, state_dir=str(tmp_path))
        thread = threading.Thread(target=restarted.serve_forever, daemon=True)
        thread.start()
        plane = d.client()
        with pytest.raises(DataPlaneUnavailable, match=r"storage unit 0 \(tcp://.*restarted without load"):
            plane.put({"x": np.ones((1, 4), np.float32), "key": [np.arange(1)]}, partition=1)
        with pytest.raises(DataPlaneUnavailable, match="refuses to serve"):
            plane.get_meta("t", ["x"], n=1, partition=0, block=False)
        assert "holds 6 values of earlier rows" in plane.stats()["not_serving"]
        plane.load("s")
        assert plane.stats()["not_serving"] == ""
        assert plane.put({"x": np.ones((1, 4), np.float32), "key": [np.arange(1)]}, partition=1) == [3]
        meta, data = plane.get_batch("t", ["x", "key"], n=3, partition=0)
        assert meta.rows == first and data["x"].tolist() == [[1.0] * 4] * 3
        plane.shutdown_servers()
        thread.join(10)
    finally:
        plane.disconnect()
        if restarted is not None:
            restarted.running = False
        d.shutdown()


def _unit_endpoints(dep) -> list[str]:
    """The unit endpoints of ``dep`` (its labels: "storage unit k (<endpoint>)")."""
    return [label.split("(", 1)[1].rstrip(")") for label in dep.labels if label.startswith("storage unit")]
