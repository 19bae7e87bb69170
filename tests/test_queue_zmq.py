"""The distributed data plane (controller + storage units in their own processes, ZeroMQ).

One deployment per module (starting processes costs ~1 s); each test uses its own
partitions and task names so tests do not see each other's rows. Tests that close the
plane or need a capacity start their own small deployment.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from asyncflow.dataplane import (
    BatchMeta,
    DataPlane,
    DataPlaneUnavailable,
    Field,
    QueueClosed,
    QueueTimeout,
    Schema,
    SchemaError,
)
from asyncflow.dataplane.core.samplers import GroupSampler, TokenBalancedSampler
from asyncflow.dataplane.transport.auth import secure_client
from asyncflow.dataplane.transport.protocol import shard_of
from asyncflow.dataplane.transport.client import ZmqDataPlane
from asyncflow.dataplane.transport.deploy import launch

SCHEMA = Schema([Field("ids", "int64", ragged=True), Field("r", "float32"), Field("v", "int32", (2,))])
TOKEN = "test-token"


@pytest.fixture(scope="module")
def dep():
    d = launch(SCHEMA, n_storage=2, token=TOKEN)
    yield d
    d.shutdown()
    shutil.rmtree(d.folder, ignore_errors=True)  # with what was saved in its state folder


@pytest.fixture
def plane(dep):
    c = dep.client()
    yield c
    c.disconnect()


def test_round_trip_sharded_in_sampler_order(plane):
    ids = [np.arange(k, dtype=np.int64) for k in (3, 1, 0, 5, 2)]
    rows = plane.put({"ids": ids, "r": [1, 2, 3, 4, 5]}, partition="rt", tags={"tokens": [3, 1, 0, 5, 2]})
    plane.put({"v": np.arange(10).reshape(5, 2)}, partition="rt", rows=rows)
    meta, data = plane.get_batch("rt", ["ids", "r", "v"], n=5, partition="rt", sampler=TokenBalancedSampler(2))
    assert sorted(meta.rows) == rows and meta.rows != rows  # balanced order, rows on both units
    pos = [rows.index(r) for r in meta.rows]
    assert [x.tolist() for x in data["ids"]] == [ids[i].tolist() for i in pos]
    assert data["r"].tolist() == [float(i + 1) for i in pos]
    assert data["v"].tolist() == [[2 * i, 2 * i + 1] for i in pos]
    assert plane.tags(rows[:2]) == {"tokens": [3, 1]}


def test_errors_name_field_and_row_and_change_nothing(plane):
    rows = plane.put({"r": [1.0, 2.0]}, partition="err")
    with pytest.raises(SchemaError, match="field 'ids' row 1: expected 1-D"):
        plane.put({"ids": [[1], [[2]]]}, partition="err", rows=rows)
    with pytest.raises(ValueError, match=f"row {rows[0]} field 'r' was already written"):
        plane.put({"r": [3.0]}, partition="err", rows=rows[:1])
    with pytest.raises(SchemaError, match="unknown field 'nope'"):
        plane.get_meta("err", ["nope"], n=1)
    with pytest.raises(ValueError, match="cannot be sent"):
        plane.get_meta("err", ["r"], n=1, sampler=lambda *a: None)
    meta, data = plane.get_batch("err", ["r"], n=2, partition="err")
    assert data["r"].tolist() == [1.0, 2.0]


def test_blocked_get_meta_does_not_block_other_clients(dep, plane):
    got = {}

    def wait():
        c = dep.client()  # another client, another socket
        got["meta"] = c.get_meta("blk", ["r"], n=1, partition="blk", timeout=10)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.1)
    start = time.monotonic()
    for _ in range(20):  # others keep working while it waits
        plane.get_batch("blk-other", ["r"], n=1, partition="blk-x", block=False)
    assert plane.stats()["waiting"] >= 1
    assert time.monotonic() - start < 2.0
    rows = plane.put({"r": [7.0]}, partition="blk")
    t.join(5)
    assert got["meta"].rows == rows


def test_timeout_and_nonblocking(plane):
    start = time.monotonic()
    with pytest.raises(QueueTimeout, match="task 'to' waiting for 1..1 rows"):
        plane.get_meta("to", ["r"], n=1, partition="to", timeout=0.2)
    assert 0.15 < time.monotonic() - start < 2.0
    assert plane.get_meta("to", ["r"], n=1, partition="to", block=False).rows == []


def test_reset_consumption_and_clear_rows(plane):
    rows = plane.put({"r": [1.0, 2.0, 3.0]}, partition="rc")
    assert plane.get_meta("rc", ["r"], n=3, partition="rc").rows == rows
    plane.reset_consumption("rc")
    plane.clear_rows([rows[1]])
    meta, data = plane.get_batch("rc", ["r"], n=2, partition="rc")
    assert meta.rows == [rows[0], rows[2]] and data["r"].tolist() == [1.0, 3.0]
    with pytest.raises(ValueError, match=f"row {rows[1]}"):
        plane.get_data(BatchMeta("rc", [rows[1]], ["r"]))


def test_save_load_across_deployments(dep, plane):
    state = Path(dep.state_dir)  # the servers save and load only in their state folder
    plane.put({"ids": [[1, 2], [3]], "r": [1.0, 2.0]}, partition="sv", tags={"group": [0, 0]})
    plane.save("s")
    local = DataPlane(SCHEMA)  # a distributed save loads in process, and back
    local.load(state / "s")
    meta, data = local.get_batch("sv", ["ids", "r"], n=2, partition="sv", sampler=GroupSampler(2))
    assert [x.tolist() for x in data["ids"]] == [[1, 2], [3]]
    local.save(state / "l")
    plane.clear("sv")
    plane.load(state / "l")
    assert plane.get_meta("sv", ["r"], n=2, partition="sv", block=False).rows == []  # consumed in 'local'
    assert len(plane.get_batch("sv2", ["ids"], n=2, partition="sv")[1]["ids"]) == 2


def test_pickled_client_reconnects(dep, plane):
    rows = plane.put({"r": [5.0]}, partition="pk")
    copy = pickle.loads(pickle.dumps(plane))
    assert copy.get_batch("pk", ["r"], n=1, partition="pk")[1]["r"].tolist() == [5.0]
    # endpoint, token and the client's keys (no server secret) only
    assert b"test-token" in pickle.dumps(plane) and len(pickle.dumps(plane)) < 500
    assert dep.credentials.server_secret.encode() not in pickle.dumps(plane)
    assert rows


def _raw(endpoint, frames, creds=None):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if creds is not None:
        secure_client(s, creds)
    s.connect(endpoint)
    s.send_multipart(frames)
    assert s.poll(5000), "no reply"
    reply = msgpack.unpackb(s.recv_multipart()[0], raw=False)
    s.close()
    return reply


def _units(plane):
    return plane.storage_endpoints()


def test_malformed_requests_get_error_replies_and_data_survives(dep, plane):
    rows = plane.put({"ids": [[9, 9]], "r": [9.0]}, partition="mal")
    hdr = lambda op, **a: msgpack.packb({"op": op, "id": 1, "a": a, "tok": TOKEN})
    bad = [
        [b"\xff\x00garbage"],
        [msgpack.packb([1, 2, 3])],
        [hdr("no_such_op")],
        [hdr("get_meta", task="x", fields=["nope"], n=1, partition=None, sampler=None, min_n=None,
             block=False, timeout=None)],
        [hdr("get_meta", task="x")],
        [hdr("commit", partition="mal", rows=[10**9], fields=["r"], tags={}, abort=False)],
        [msgpack.packb({"op": "stats", "id": 1, "tok": "wrong"})],
    ]
    for frames in bad:
        reply = _raw(dep.endpoint, frames, dep.credentials)
        assert reply["ok"] is False and reply["err"]["msg"], frames
    assert _raw(dep.endpoint, bad[-1], dep.credentials)["err"]["type"] == "PermissionError"
    unit = _units(plane)[shard_of(rows[0], 2)]
    for spec, buffers in [
        ([["nope", "f", "<f4", [1]]], [np.zeros(1, np.float32).tobytes()]),  # unknown field
        ([["r", "f", "<f8", [1]]], [np.zeros(1).tobytes()]),  # bad dtype
        ([["r", "f", "|O", [1]]], [b"12345678"]),  # object dtype
        ([["r", "f", "<f4", [1]]], [b"123"]),  # wrong byte count
        ([["r", "f", "<f4", [1]]], []),  # missing frame
        ([["r", "f", "<f4", [1]]], [np.zeros(1, np.float32).tobytes()]),  # write-once
    ]:
        frames = [msgpack.packb({"op": "write", "id": 1, "tok": TOKEN, "a": {"rows": rows, "cols": spec}}), *buffers]
        reply = _raw(unit, frames, dep.credentials)
        assert reply["ok"] is False, spec
    assert _raw(unit, [b"\x00"], dep.credentials)["ok"] is False
    meta, data = plane.get_batch("mal", ["ids", "r"], n=1, partition="mal")
    assert data["ids"][0].tolist() == [9, 9] and data["r"].tolist() == [9.0]
    with pytest.raises(PermissionError):
        ZmqDataPlane(dep.endpoint, token="wrong", credentials=dep.credentials).stats()
    with pytest.raises(DataPlaneUnavailable, match="authentication refused"):
        ZmqDataPlane(dep.endpoint, token=TOKEN, deadline=5).stats()  # no keys: refused at the handshake


def test_close_wakes_every_waiter_and_capacity_waits():
    d = launch(SCHEMA, n_storage=1, capacity=2, transport="ipc")
    try:
        plane = d.client()
        plane.put({"r": [1.0, 2.0]}, partition="a")
        with pytest.raises(QueueTimeout, match="room for 1 new rows"):
            plane.put({"r": [3.0]}, partition="b", timeout=0.1)
        threading.Timer(0.2, d.client().clear, args=("a",)).start()
        assert plane.put({"r": [3.0]}, partition="b", timeout=5) == [2]
        errors = []

        def wait(i):
            try:
                d.client().get_meta(f"w{i}", ["ids"], n=1)
            except QueueClosed as e:
                errors.append(e)

        threads = [threading.Thread(target=wait, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.2)
        plane.close()
        for t in threads:
            t.join(5)
        assert len(errors) == 3
        with pytest.raises(QueueClosed):
            plane.put({"r": [1.0]}, partition="c")
        assert plane.get_data(BatchMeta("b", [2], ["r"]))["r"].tolist() == [3.0]  # data stays readable
    finally:
        d.shutdown()


def test_storage_unit_sends_a_put_block_back_without_stacking():
    from asyncflow.dataplane.transport.protocol import decode_columns, encode_columns
    from asyncflow.dataplane.transport.storage_server import StorageServer

    unit = StorageServer(SCHEMA)
    try:
        block = np.arange(12, dtype=np.int32).reshape(6, 2)
        spec, buffers = encode_columns({"v": block, "r": np.ones(6, np.float32)})
        unit.write({"a": {"rows": list(range(10, 16)), "cols": spec}}, buffers)
        stored = unit.storage._columns["v"][10]

        def gather(rows):
            spec, frames = unit.gather({"a": {"rows": rows, "fields": ["v", "r"]}}, [])
            return decode_columns(spec, frames), frames

        cols, frames = gather([11, 12, 13])  # consecutive rows of one block: a view of it
        assert cols["v"].tolist() == block[1:4].tolist() and np.shares_memory(frames[0], stored.base)
        for rows in ([13, 11], [11, 13], [15, 10]):  # anything else is stacked, in request order
            cols, frames = gather(rows)
            assert cols["v"].tolist() == [block[r - 10].tolist() for r in rows]
            assert not np.shares_memory(frames[0], stored.base)
        unit.drop({"a": {"rows": [12]}}, [])
        with pytest.raises(ValueError, match="row 12 field 'v' is not stored"):
            gather([11, 12, 13])
        assert gather([13, 14])[0]["v"].tolist() == block[3:5].tolist()
    finally:
        unit.ctx.destroy(linger=0)


def test_launch_does_not_run_the_callers_main_script_in_the_servers(tmp_path):
    """A spawned child would re-import the caller's script (in a training script: torch,
    transformers, seconds per server); the servers need none of it."""
    marks = tmp_path / "imports.txt"
    script = tmp_path / "job.py"
    script.write_text(
        "import os\n"
        f"open({str(marks)!r}, 'a').write(__name__ + '\\n')\n"
        "from asyncflow.dataplane import Field, Schema\n"
        "from asyncflow.dataplane.transport.deploy import launch\n"
        "if __name__ == '__main__':\n"
        "    dep = launch(Schema([Field('x', 'int64')]), n_storage=2)\n"
        "    c = dep.client()\n"
        "    print(c.put({'x': [1, 2, 3]}, partition=0))\n"
        "    c.disconnect()\n"
        "    dep.shutdown()\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             [os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH")])])})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[0, 1, 2]"
    assert marks.read_text().split() == ["__main__"]  # not "__mp_main__" once per server
