"""The data plane's servers against hostile or broken requests from an authenticated peer.

One deployment (``launch``, secure by default); raw requests are sent on DEALER sockets
holding the job's keys, so they reach the request loop. Checked: a FIFO at a segment name
does not block a storage unit; row lengths that overflow are refused; a huge ``alloc`` is
refused at once without memory growth; a message over the size limit is dropped; 10,000
``get_meta`` waiters of clients that went away are reaped and put latency recovers; API
slips (``fields`` as a str, ``n=True``) are errors naming the fix; and a hypothesis fuzz of
generated multipart messages never crashes, hangs or stalls a well-behaved client.
Every wait is bounded (seconds).
"""

from __future__ import annotations

import os
import shutil
import statistics
import time

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncflow.dataplane import Field, Schema, SchemaError
from asyncflow.dataplane.transport import shm
from asyncflow.dataplane.transport.auth import secure_client
from asyncflow.dataplane.transport.controller_server import MAX_ROWS
from asyncflow.dataplane.transport.deploy import launch

SCHEMA = Schema([Field("x", "float32", (4,)), Field("ids", "int64", ragged=True)])


@pytest.fixture(scope="module")
def dep():
    d = launch(SCHEMA, n_storage=2, max_msg_bytes=8 << 20)
    yield d
    d.shutdown()
    shutil.rmtree(d.folder, ignore_errors=True)  # with what was saved in its state folder


@pytest.fixture(scope="module")
def plane(dep):
    c = dep.client(deadline=10)
    yield c
    c.disconnect()


def _sock(dep, endpoint):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)
    secure_client(s, dep.credentials)
    s.connect(endpoint)
    return s


def _ask(dep, endpoint, op, args, frames=(), wait=3.0):
    """One request on a fresh authenticated socket: its reply header, or None by ``wait``."""
    s = _sock(dep, endpoint)
    try:
        s.send_multipart([msgpack.packb({"op": op, "id": 7, "a": args}), *frames])
        if not s.poll(int(wait * 1000)):
            return None
        return msgpack.unpackb(s.recv_multipart()[0], strict_map_key=False)
    finally:
        s.close(0)


def _round_trip(plane, partition):
    """A well-behaved put + get: the servers still serve."""
    rows = plane.put({"x": np.ones((2, 4), np.float32), "ids": [np.arange(3), np.arange(1)]}, partition=partition)
    meta, data = plane.get_batch("ok", ["x", "ids"], n=2, partition=partition)
    assert meta.rows == rows and data["ids"][0].tolist() == [0, 1, 2]


def _rss_kb(pid):
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS"))


@pytest.mark.skipif(not shm.enabled(), reason="shared memory is off here")
def test_a_fifo_at_a_segment_name_does_not_block_the_unit(dep, plane):
    prefix = plane._run("transports") and plane._core._shm_prefix[0]
    unit = plane.storage_endpoints()[0]
    name = f"{prefix}c{os.getpid()}-fifo"
    requests = [("shm_probe", {"shm": [[name, 0, 16]]}),  # the probe a client asks for at connect
                ("write", {"rows": [1 << 40], "cols": [["x", "f", "<f4", [1, 4]]], "shm": [[name, 0, 16]]})]
    try:
        for op, args in requests:
            os.mkfifo(os.path.join(shm.SHM_DIR, name), 0o600)  # (the probe unlinks its segment)
            t = time.monotonic()
            reply = _ask(dep, unit, op, args)
            assert time.monotonic() - t < 3
            assert reply is not None and reply["ok"] is False and "regular file" in reply["err"]["msg"], reply
            shm.unlink(name)
        _round_trip(plane, "fifo")
    finally:
        shm.unlink(name)


def test_overflowing_row_lengths_are_refused(dep, plane):
    unit = plane.storage_endpoints()[0]
    for lengths in ([2**62, 2**62, 2**62, 2**62 + 4], [-1, 5], [2**63 - 1, 1], [4, 0, 0]):
        spec = [["ids", "r", "<i8", [len(lengths)]]]
        reply = _ask(dep, unit, "write", {"rows": list(range(10**6, 10**6 + len(lengths))), "cols": spec},
                     [np.zeros(4, np.int64).tobytes()[:8 * 3], np.array(lengths, np.int64).tobytes()])
        assert reply is not None and reply["ok"] is False, lengths
    huge = [["x", "f", "<f4", [2**62, 2**62]]]
    reply = _ask(dep, unit, "write", {"rows": [10**6], "cols": huge}, [b""])
    assert reply["ok"] is False and "bad dtype" in reply["err"]["msg"]
    _round_trip(plane, "overflow")


def test_a_huge_alloc_is_refused_at_once_without_memory_growth(dep, plane):
    ctl = dep.processes[-1]  # the controller starts last
    before = _rss_kb(ctl.pid)
    for n in (10**9, MAX_ROWS + 1, 2**63, True, -3):
        t = time.monotonic()
        reply = _ask(dep, dep.endpoint, "alloc", {"partition": "huge", "n": n, "timeout": 0})
        assert reply is not None and reply["ok"] is False, n
        assert time.monotonic() - t < 1, n
    assert _rss_kb(ctl.pid) - before < 20_000  # kB: nothing was allocated
    _round_trip(plane, "huge")


def test_a_message_over_the_size_limit_is_dropped_and_the_server_goes_on(dep, plane):
    unit = plane.storage_endpoints()[1]
    big = bytes(9 << 20)  # 9 MiB > the 8 MiB limit of this deployment
    reply = _ask(dep, unit, "write", {"rows": [10**7], "cols": [["x", "f", "<f4", [len(big) // 16, 4]]]},
                 [big], wait=1.0)
    assert reply is None  # dropped unread (the peer is disconnected)
    assert _ask(dep, unit, "ping", {})["r"] == "pong"
    _round_trip(plane, "size")


def test_api_slips_are_errors_naming_the_fix(plane):
    with pytest.raises(SchemaError, match=r"got the str 'x'; pass \['x'\]"):
        plane.get_meta("t", "x", n=1, block=False)
    for n in (True, 0, 1.5):
        with pytest.raises(ValueError, match=r"n must be >= 1 \(an int, not a bool\)"):
            plane.get_meta("t", ["x"], n=n, block=False)


def _put_latency(plane, partition, k=15):
    times = []
    for _ in range(k):
        t = time.perf_counter()
        plane.put({"x": np.ones((1, 4), np.float32), "ids": [np.arange(2)]}, partition=partition)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def test_abandoned_waiters_are_reaped_and_put_latency_recovers(dep, plane):
    base = _put_latency(plane, "lat0")
    socks = [_sock(dep, dep.endpoint) for _ in range(10)]
    args = {"task": "abandoned", "fields": ["x"], "n": 1, "partition": "never", "sampler": None,
            "min_n": None, "block": True, "timeout": None}
    for s in socks:
        for i in range(1000):
            s.send(msgpack.packb({"op": "get_meta", "id": i, "a": args}))
    deadline = time.monotonic() + 20
    while plane.stats()["waiting"] < 10_000 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert plane.stats()["waiting"] == 10_000
    for s in socks:
        s.close(0)  # the clients go away without a word
    while plane.stats()["waiting"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert plane.stats()["waiting"] == 0
    assert _put_latency(plane, "lat1") < 3 * base + 0.005


_OPS = ["ping", "hello", "alloc", "check_write", "commit", "get_meta", "seal", "clear", "clear_rows", "tags",
        "stats", "unpin", "reset_consumption", "write", "gather", "drop", "nbytes", "shm_hello", "shm_probe",
        "shm_lease", "save", "no_such_op"]
_scalar = (st.none() | st.booleans() | st.integers(-3, 100) | st.sampled_from([2**62, 2**64 - 1, -2**63])
           | st.floats(allow_nan=True) | st.text(max_size=8) | st.binary(max_size=16))
_value = st.recursive(_scalar, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)
_args = st.dictionaries(st.sampled_from(["partition", "n", "timeout", "rows", "fields", "cols", "tags", "abort",
                                         "task", "sampler", "min_n", "block", "pin", "lease", "shm", "pid",
                                         "path", "unit", "n_units", "live"]), _value, max_size=8)
_header = st.fixed_dictionaries({"op": st.sampled_from(_OPS), "id": _scalar, "a": _args}, optional={
    "noreply": st.booleans(), "tok": _scalar})
_message = st.one_of(
    st.tuples(_header.map(lambda h: msgpack.packb(h)), st.lists(st.binary(max_size=64), max_size=3)),
    st.tuples(st.binary(max_size=32), st.lists(st.binary(max_size=16), max_size=2)))


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(msg=_message, to_unit=st.booleans())
def test_fuzzed_messages_never_crash_hang_or_stall_the_servers(dep, plane, msg, to_unit):
    head, frames = msg
    if b"shutdown" in head or b"close" in head or b"load" in head:
        return  # an authenticated client may stop the plane; that is not a fault
    endpoint = plane.storage_endpoints()[0] if to_unit else dep.endpoint
    s = _sock(dep, endpoint)
    try:
        s.send_multipart([head, *frames])
        t = time.monotonic()
        plane.stats()  # the controller answers a well-behaved client at once
        assert time.monotonic() - t < 5
    finally:
        s.close(0)
    assert all(p.is_alive() for p in dep.processes)


def test_after_the_fuzz_the_plane_still_serves(dep, plane):
    _round_trip(plane, "after-fuzz")
    assert all(p.is_alive() for p in dep.processes)
