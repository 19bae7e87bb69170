"""Contract of :class:`asyncflow.dataplane.api.DataPlaneClient`, run against every deployment.

One parametrised fixture, one entry per implementation (adding one is one line in
``KINDS``): the in-process ``DataPlane``, the ZeroMQ client ``ZmqDataPlane`` (a controller
and two storage units in child processes) and the Ray actor client ``RayDataPlane``. Each
kind keeps one shared deployment for the module (tests use their own partition and task
names, so they do not see each other's rows) and starts a fresh one where a test needs the
whole state (``load``) or ends it (``close``).
"""

from __future__ import annotations

import pathlib
import shutil
import threading
import time

import numpy as np
import pytest
import torch

from asyncflow.dataplane import (
    BatchMeta,
    DataPlane,
    Field,
    HandoutExpired,
    QueueClosed,
    QueueTimeout,
    Schema,
    SchemaError,
)
from asyncflow.dataplane.api import DataPlaneClient

torch.set_num_threads(1)

SCHEMA = Schema([Field("ids", "int64", ragged=True), Field("r", "float32"), Field("v", "int32", (2,))])
STATS_KEYS = {"live_rows", "partitions", "consumed", "dropped", "puts", "gets", "rows_allocated"}


class Kind:
    """Deployments of one implementation: ``shared`` (module-wide) and ``fresh()`` ones."""

    def __init__(self, new):
        self._new, self._cleanups, self._shared = new, [], None
        self._state: dict[int, pathlib.Path | None] = {}  # a deployment's state folder (None: any path)

    @property
    def shared(self) -> DataPlaneClient:
        if self._shared is None:
            self._shared = self.fresh()
        return self._shared

    def fresh(self) -> DataPlaneClient:
        plane, cleanup, state = self._new()
        self._cleanups.append(cleanup)
        self._state[id(plane)] = state
        return plane

    def state_folder(self, plane: DataPlaneClient, default: pathlib.Path) -> pathlib.Path:
        """Where ``plane`` may save and load: its deployment's state folder (the distributed
        plane writes only there), or ``default``."""
        return self._state[id(plane)] or default

    def teardown(self) -> None:
        for cleanup in reversed(self._cleanups):
            cleanup()


def _local(**kw):
    return DataPlane(SCHEMA, **kw), lambda: None, None


def _zmq(**kw):
    from asyncflow.dataplane.transport.deploy import launch

    dep = launch(SCHEMA, n_storage=2, token="contract", **kw)
    client = dep.client()

    def cleanup():
        client.disconnect()
        dep.shutdown()
        shutil.rmtree(dep.folder, ignore_errors=True)  # (what a test saved in its state folder)

    return client, cleanup, pathlib.Path(dep.state_dir)


_ray = {}


def _fresh_with_ttl(kind: Kind, ttl: float) -> DataPlaneClient:
    """A fresh deployment whose hand-outs expire after ``ttl`` seconds."""
    plane, cleanup, state = kind._new(handout_ttl=ttl)
    kind._cleanups.append(cleanup)
    kind._state[id(plane)] = state
    return plane


def _ray_plane(**kw):
    if kw:
        pytest.skip("the Ray launcher's data plane takes no handout_ttl")
    if "launcher" not in _ray:
        from asyncflow.launch.ray_launcher import RayLauncher

        _ray["launcher"] = RayLauncher(num_cpus=2)
    launcher = _ray["launcher"]
    # kind="ray" before anything else started Ray: the launcher must start (and own) it
    plane = launcher.data_plane(SCHEMA, kind="ray")
    assert launcher._owns, "RayLauncher.data_plane(kind='ray') started Ray behind the launcher's back"
    return plane, lambda: launcher.release(plane), None


KINDS = {
    "local": _local,
    "zmq": _zmq,
    "ray": _ray_plane,
}


@pytest.fixture(scope="module", params=[
    "local",
    "zmq",
    pytest.param("ray", marks=pytest.mark.ray),
])
def kind(request):
    k = Kind(KINDS[request.param])
    yield k
    k.teardown()
    if request.param == "ray" and "launcher" in _ray:
        import ray

        _ray.pop("launcher").shutdown()
        assert not ray.is_initialized()


@pytest.fixture
def plane(kind) -> DataPlaneClient:
    return kind.shared


def _put(plane, partition, n=3, **kw):
    ids = [np.arange(k + 1, dtype=np.int64) for k in range(n)]
    return plane.put({"ids": ids, "r": np.arange(n, dtype=np.float32)}, partition=partition, **kw)


# --------------------------------------------------------------------------- the contract


def test_is_a_data_plane_client(plane):
    assert isinstance(plane, DataPlaneClient)


def test_round_trip_in_meta_order(plane):
    ids = [np.arange(k, dtype=np.int64) for k in (3, 1, 0, 2)]
    rows = plane.put({"ids": ids, "r": [1.0, 2.0, 3.0, 4.0]}, partition="rt")
    assert len(rows) == 4 and rows == sorted(rows)
    assert plane.put({"v": np.arange(8).reshape(4, 2)}, partition="rt", rows=rows) == rows
    meta = plane.get_meta("rt", ["ids", "r", "v"], n=4, partition="rt")
    assert (meta.partition, meta.rows, meta.fields, meta.dropped) == ("rt", rows, ["ids", "r", "v"], [])
    back = BatchMeta("rt", rows[::-1], ["ids", "r", "v"])  # any order: answered in the meta's order
    data = plane.get_data(back)
    assert [x.tolist() for x in data["ids"]] == [x.tolist() for x in ids[::-1]]
    assert data["r"].dtype == np.float32 and data["r"].tolist() == [4.0, 3.0, 2.0, 1.0]
    assert data["v"].shape == (4, 2) and data["v"].tolist() == [[6, 7], [4, 5], [2, 3], [0, 1]]
    assert plane.get_data(meta, ["r"]).keys() == {"r"}
    meta2, data2 = plane.get_batch("rt2", ["r"], n=2, partition="rt")
    assert meta2.rows == rows[:2] and data2["r"].tolist() == [1.0, 2.0]


def test_row_handed_once_and_never_before_its_fields(plane):
    rows = plane.put({"ids": [[1], [2]]}, partition="once")
    assert plane.get_meta("once", ["ids", "r"], n=2, partition="once", block=False).rows == []
    with pytest.raises(QueueTimeout):
        plane.get_meta("once", ["ids", "r"], n=1, partition="once", timeout=0.1)
    plane.put({"r": [5.0]}, partition="once", rows=rows[1:])
    assert plane.get_meta("once", ["ids", "r"], n=2, partition="once", min_n=1).rows == rows[1:]
    plane.put({"r": [4.0]}, partition="once", rows=rows[:1])
    assert plane.get_meta("once", ["ids", "r"], n=2, partition="once", min_n=1).rows == rows[:1]
    assert plane.get_meta("once", ["ids", "r"], n=2, partition="once", block=False).rows == []  # all consumed
    assert plane.get_meta("other", ["ids"], n=2, partition="once").rows == rows  # per task


def test_waiting_consumer_gets_rows_when_produced(plane):
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("m", plane.get_meta("wake", ["r"], n=2, partition="wake",
                                                                            timeout=10)))
    t.start()
    time.sleep(0.1)
    rows = plane.put({"r": [1.0, 2.0]}, partition="wake")
    t.join(10)
    assert got["m"].rows == rows


def test_put_is_all_or_nothing_and_names_the_field(plane):
    before = plane.stats()
    with pytest.raises(SchemaError, match="'ids'"):
        plane.put({"r": [1.0, 2.0], "ids": [[1], [[2]]]}, partition="aon")
    with pytest.raises(SchemaError, match="'nope'"):
        plane.put({"r": [1.0], "nope": [1]}, partition="aon")
    after = plane.stats()
    assert (after["rows_allocated"], after["live_rows"]) == (before["rows_allocated"], before["live_rows"])
    assert "aon" not in after["partitions"]
    rows = plane.put({"r": [1.0, 2.0]}, partition="aon")
    with pytest.raises(SchemaError, match="'v'"):  # into existing rows: the bad field, nothing of the good one
        plane.put({"ids": [[1], [2]], "v": [[1, 2]]}, partition="aon", rows=rows)
    assert plane.get_meta("aon", ["ids"], n=2, partition="aon", block=False).rows == []


def test_fields_are_write_once(plane):
    rows = plane.put({"r": [1.0, 2.0]}, partition="wo")
    with pytest.raises(ValueError, match=f"row {rows[0]} field 'r' was already written"):
        plane.put({"r": [9.0]}, partition="wo", rows=rows[:1])
    _, data = plane.get_batch("wo", ["r"], n=2, partition="wo")
    assert data["r"].tolist() == [1.0, 2.0]


def test_nonblocking_and_timeout(plane):
    assert plane.get_meta("nb", ["r"], n=1, partition="nb", block=False).rows == []
    meta, data = plane.get_batch("nb", ["r"], n=1, partition="nb", block=False)
    assert meta.rows == [] and len(meta) == 0
    start = time.monotonic()
    with pytest.raises(QueueTimeout, match="'nb'"):
        plane.get_meta("nb", ["r"], n=1, partition="nb", timeout=0.2)
    assert 0.15 <= time.monotonic() - start < 3.0


def test_put_nowait_then_flush(plane):
    for k in range(3):
        plane.put_nowait({"r": [float(k)]}, partition="pn", tags={"group": [k]})
    plane.flush()
    meta, data = plane.get_batch("pn", ["r"], n=3, partition="pn", block=False, min_n=0)
    assert sorted(data["r"].tolist()) == [0.0, 1.0, 2.0]
    with pytest.raises(SchemaError, match="'ids'"):  # raised by put_nowait itself, or at the latest by flush
        plane.put_nowait({"ids": [[[1]]]}, partition="pn")
        plane.flush()
    plane.flush()  # reported once


def test_seal_gives_the_short_last_batch(plane):
    rows = _put(plane, "seal", n=3)
    plane.seal("seal")
    assert plane.get_meta("seal", ["r"], n=2, partition="seal").rows == rows[:2]
    assert plane.get_meta("seal", ["r"], n=2, partition="seal", timeout=5).rows == rows[2:]  # short, at once
    assert plane.get_meta("seal", ["r"], n=2, partition="seal", timeout=5).rows == []  # exhausted: empty, at once
    with pytest.raises(ValueError, match="seal"):
        plane.put({"r": [1.0]}, partition="seal")


def test_clear_and_clear_rows(plane):
    rows = _put(plane, "clr", n=3)
    plane.clear_rows([rows[1]])
    meta, data = plane.get_batch("clr", ["r"], n=2, partition="clr")
    assert meta.rows == [rows[0], rows[2]] and data["r"].tolist() == [0.0, 2.0]
    with pytest.raises(ValueError, match=f"row {rows[1]}"):
        plane.get_data(BatchMeta("clr", [rows[1]], ["r"]))
    with pytest.raises(ValueError, match=f"row {rows[1]}"):  # all-or-nothing: rows[0] stays
        plane.clear_rows([rows[0], rows[1]])
    assert plane.get_data(BatchMeta("clr", [rows[0]], ["r"]))["r"].tolist() == [0.0]
    plane.clear("clr")
    assert "clr" not in plane.stats()["partitions"]
    with pytest.raises(ValueError):
        plane.get_data(meta)
    plane.clear("clr")  # unknown partition: a no-op
    assert plane.put({"r": [7.0]}, partition="clr")  # the name starts a new partition


def test_reset_consumption(plane):
    rows = _put(plane, "rst", n=2)
    assert plane.get_meta("rst", ["r"], n=2, partition="rst").rows == rows
    assert plane.get_meta("rst", ["r"], n=2, partition="rst", block=False).rows == []
    plane.reset_consumption("rst")
    assert plane.get_meta("rst", ["r"], n=2, partition="rst").rows == rows


def test_tags(plane):
    rows = plane.put({"r": [1.0, 2.0, 3.0]}, partition="tag", tags={"group": [7, 7, 8], "tokens": [3, 1, 2]})
    assert plane.tags(rows) == {"group": [7, 7, 8], "tokens": [3, 1, 2]}
    plane.put({"v": [[1, 2]]}, partition="tag", rows=rows[:1], tags={"tokens": [9]})  # merged, last write wins
    assert plane.tags(rows[:2]) == {"group": [7, 7], "tokens": [9, 1]}
    with pytest.raises(SchemaError, match="tag"):
        plane.put({"r": [1.0]}, partition="tag", tags={"group": [1, 2]})  # one per row


def test_stats(plane):
    before = plane.stats()
    rows = _put(plane, "st", n=2)
    plane.get_meta("st-task", ["r"], n=2, partition="st")
    s = plane.stats()
    assert STATS_KEYS <= set(s)
    assert s["partitions"]["st"] == 2 and s["consumed"]["st-task"] == 2
    assert s["puts"] == before["puts"] + 1 and s["gets"] > before["gets"]
    assert s["rows_allocated"] == before["rows_allocated"] + 2 and s["live_rows"] == before["live_rows"] + 2
    assert len(rows) == 2


def test_save_then_load_into_a_fresh_deployment(kind, tmp_path):
    src = kind.shared
    rows = src.put({"ids": [[1, 2], [3]], "r": [1.0, 2.0]}, partition="sv", tags={"group": [4, 5]})
    src.ack(src.get_meta("sv-task", ["r"], n=1, partition="sv"))  # acknowledged: saved as consumed
    src.get_meta("sv-late", ["r"], n=2, partition="sv")  # in flight: saved as not consumed
    src.seal("sv")
    src_dir = kind.state_folder(src, tmp_path)
    src.save(src_dir / "state")
    dst = kind.fresh()
    dst_dir = kind.state_folder(dst, tmp_path)
    if dst_dir != src_dir:  # the saved files move between deployments as a folder
        shutil.copytree(src_dir / "state", dst_dir / "state")
    dst.load(dst_dir / "state")
    assert dst.tags(rows) == {"group": [4, 5]}
    meta, data = dst.get_batch("sv-task", ["ids", "r"], n=2, partition="sv", timeout=5)  # consumption kept...
    assert meta.rows == rows[1:] and [x.tolist() for x in data["ids"]] == [[3]]  # ...and the seal (short batch)
    assert dst.get_meta("sv-late", ["r"], n=2, partition="sv", timeout=5).rows == rows
    meta, data = dst.get_batch("sv-new", ["ids", "r"], n=2, partition="sv")
    assert [x.tolist() for x in data["ids"]] == [[1, 2], [3]] and data["r"].tolist() == [1.0, 2.0]
    with pytest.raises(ValueError, match="seal"):
        dst.put({"r": [1.0]}, partition="sv")
    assert max(dst.put({"r": [1.0]}, partition="sv2")) > max(rows)  # row ids are never reused


def test_rows_not_acknowledged_go_back_once(kind):
    """Ack-based consumption: a hand-out acknowledged by get_data is consumed; one given
    back (nack) or left past the TTL returns to the task, once; the late consumer's get_data
    is refused (HandoutExpired), so no row reaches two successful consumers."""
    plane = kind.shared
    rows = _put(plane, "ack", n=4)
    first = plane.get_meta("ack", ["r"], n=2, partition="ack")
    assert first.rows == rows[:2] and first.handout is not None
    assert plane.get_data(first)["r"].tolist() == [0.0, 1.0]  # acknowledged
    assert plane.get_data(first)["r"].tolist() == [0.0, 1.0]  # re-reading stays allowed
    second = plane.get_meta("ack", ["r"], n=2, partition="ack")
    assert second.rows == rows[2:]
    assert plane.get_meta("ack", ["r"], n=1, partition="ack", block=False).rows == []  # in flight: not ready
    assert plane.stats()["in_flight"].get("ack") == 2
    plane.nack(second)
    with pytest.raises(HandoutExpired):
        plane.get_data(second)  # given back: not this consumer's any more
    again = plane.get_meta("ack", ["r"], n=2, partition="ack", timeout=5)
    assert again.rows == rows[2:]  # given back: handed out again, in row order
    plane.ack(again)
    assert plane.get_meta("ack", ["r"], n=1, partition="ack", block=False).rows == []
    assert plane.stats()["consumed"]["ack"] == 4 and plane.stats()["in_flight"].get("ack", 0) == 0


def test_an_expired_handout_goes_to_the_next_consumer(kind):
    plane = _fresh_with_ttl(kind, 0.5)
    rows = _put(plane, "ttl", n=2)
    late = plane.get_meta("ttl", ["r"], n=2, partition="ttl")
    start = time.monotonic()
    nxt = plane.get_meta("ttl", ["r"], n=2, partition="ttl", timeout=10)  # waits for the expiry
    assert nxt.rows == rows and 0.3 < time.monotonic() - start < 5
    with pytest.raises(HandoutExpired):
        plane.get_data(late)  # the rows are nxt's now
    with pytest.raises(HandoutExpired):
        plane.ack(late)
    assert plane.get_data(nxt)["r"].tolist() == [0.0, 1.0]
    assert plane.stats()["consumed"]["ttl"] == 2


def test_close_wakes_waiters_and_refuses_calls(kind):
    plane = kind.fresh()
    rows = plane.put({"r": [1.0]}, partition=0)
    meta = plane.get_meta("cl", ["r"], n=1, partition=0)
    errors = []

    def wait():
        try:
            plane.get_meta("cl-wait", ["ids"], n=1, partition=0, timeout=20)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.2)
    start = time.monotonic()
    plane.close()
    t.join(10)
    assert not t.is_alive() and time.monotonic() - start < 5.0
    assert len(errors) == 1 and isinstance(errors[0], QueueClosed), errors
    with pytest.raises(QueueClosed):
        plane.put({"r": [2.0]}, partition=0)
    with pytest.raises(QueueClosed):
        plane.get_meta("cl", ["r"], n=1, partition=0, block=False)
    assert plane.get_data(meta)["r"].tolist() == [1.0] and meta.rows == rows  # stored data stays readable
