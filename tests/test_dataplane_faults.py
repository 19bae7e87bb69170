"""Fault tests of the distributed data plane: real processes killed with ``kill -9``.

* a consumer killed between ``get_meta`` and ``get_data``: its rows go to the next
  consumer of the task once the hand-out TTL (short here) passes, each row exactly once;
* a storage unit killed: every call that needs it raises ``DataPlaneUnavailable`` naming
  it within the client deadline (short here), a client made after the death too; the
  controller, flooded with drops for the dead unit, keeps answering, and a ``save`` fails
  with ``DataPlaneUnavailable`` naming the unit while other calls are still answered;
* the controller killed: existing clients (one parked in ``get_meta``) and new ones raise
  ``DataPlaneUnavailable`` within the deadline.

Every wait is bounded; each test starts its own deployment (it kills a part of it).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import pytest

from asyncflow.dataplane import DataPlaneUnavailable, Field, Schema
from asyncflow.dataplane.transport.deploy import launch
from asyncflow.dataplane.transport.protocol import shard_of

SCHEMA = Schema([Field("x", "int64"), Field("ids", "int64", ragged=True)])
DEADLINE = 2.0  # the clients' deadline here (30 s by default)
SLACK = 4.0  # scheduling slack on a loaded machine


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def _bounded(fn, *args, limit=DEADLINE + SLACK, **kw):
    """``fn(*args)`` must raise DataPlaneUnavailable within ``limit`` seconds; its message."""
    start = time.monotonic()
    with pytest.raises(DataPlaneUnavailable) as info:
        fn(*args, **kw)
    assert time.monotonic() - start < limit, (fn, time.monotonic() - start)
    return str(info.value)


def _put(plane, n, partition="p"):
    return plane.put({"x": np.arange(n), "ids": [np.arange(k % 3) for k in range(n)]}, partition=partition)


_CONSUMER = """
import sys, time, msgpack
from asyncflow.dataplane.transport.client import ZmqDataPlane
plane = ZmqDataPlane.__new__(ZmqDataPlane)
plane.__setstate__(msgpack.unpackb(sys.stdin.buffer.read()))
print(plane.stats()["live_rows"], flush=True)
meta = plane.get_meta("train", ["x"], n=4, partition="p", timeout=None if sys.argv[1] == "wait" else 10)
print(" ".join(map(str, meta.rows)), flush=True)
time.sleep(60)  # killed here, before get_data
"""


def _consumer(plane, how="take"):
    """A consumer process that takes 4 rows with get_meta (``how="wait"``: waits for them
    without a timeout) and then waits to be killed; it prints the live rows when connected."""
    proc = subprocess.Popen([sys.executable, "-c", _CONSUMER, how], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    proc.stdin.write(msgpack.packb(plane.__getstate__()))
    proc.stdin.close()
    return proc


def test_rows_of_a_killed_consumer_go_to_the_next_one():
    ttl = 1.5
    dep = launch(SCHEMA, n_storage=2, handout_ttl=ttl)
    plane = dep.client(deadline=10)
    proc = None
    try:
        rows = _put(plane, 8)
        proc = _consumer(plane)
        assert int(proc.stdout.readline()) == 8
        taken = [int(r) for r in proc.stdout.readline().split()]
        assert taken == rows[:4]
        assert plane.stats()["in_flight"] == {"train": 4}
        _kill(proc.pid)
        proc.wait(10)
        killed_at = time.monotonic()
        got: list[int] = []
        first_back = None
        while len(got) < 8:
            meta, data = plane.get_batch("train", ["x", "ids"], n=4, partition="p", timeout=20)
            assert data["x"].tolist() == [rows.index(r) for r in meta.rows]
            if set(meta.rows) & set(taken) and first_back is None:
                first_back = time.monotonic() - killed_at
            got += meta.rows
        assert sorted(got) == rows  # every row exactly once: the killed consumer's came back
        assert first_back is not None and first_back < ttl + SLACK
        assert plane.get_meta("train", ["x"], n=1, partition="p", block=False).rows == []
        s = plane.stats()
        assert s["consumed"]["train"] == 8 and s["in_flight"] == {}
    finally:
        if proc is not None and proc.poll() is None:
            _kill(proc.pid)
        plane.disconnect()
        dep.shutdown()


def test_a_consumer_killed_while_waiting_in_get_meta_takes_no_rows():
    dep = launch(SCHEMA, n_storage=2, handout_ttl=3.0)  # rows answered to the dead waiter come back by then
    plane = dep.client(deadline=10)
    proc = _consumer(plane, "wait")
    try:
        assert int(proc.stdout.readline()) == 0
        deadline = time.monotonic() + 10
        while plane.stats()["waiting"] < 1:  # parked on the controller
            assert time.monotonic() < deadline
            time.sleep(0.05)
        _kill(proc.pid)
        proc.wait(10)
        rows = _put(plane, 4)  # at once: the parked request may still be answered (its reply bounces)
        meta = plane.get_meta("train", ["x"], n=4, partition="p", timeout=10)
        assert meta.rows == rows and plane.get_data(meta)["x"].tolist() == [0, 1, 2, 3]
    finally:
        if proc.poll() is None:
            _kill(proc.pid)
        plane.disconnect()
        dep.shutdown()


@pytest.mark.slow
def test_a_killed_storage_unit_fails_every_call_that_needs_it_and_nothing_else():
    dep = launch(SCHEMA, n_storage=2, unit_deadline=DEADLINE)
    plane = dep.client(deadline=DEADLINE)
    try:
        rows = _put(plane, 128)  # rows 0..63 on unit 0, 64..127 on unit 1
        many = _put(plane, 2048, "many")  # 1024 rows on each unit
        dead = plane.storage_endpoints()[0]
        meta = plane.get_meta("t", ["x"], n=64, partition="p")
        _kill(dep.processes[0].pid)
        dep.processes[0].join(10)
        assert dead in _bounded(plane.get_data, meta)
        assert dead in _bounded(plane.get_batch, "u", ["x"], n=64, partition="p")
        _bounded(_put, plane, 128, "q")  # a put that has rows on the dead unit
        fresh = dep.client(deadline=DEADLINE)  # created after the death: its connect needs every unit
        assert dead in _bounded(fresh.stats)
        fresh.disconnect()
        start = time.monotonic()
        for row in many:  # 1024 drop messages for the dead unit (more than a socket queues)
            if shard_of(row, 2) == 0:
                plane.clear_rows([row])
        plane.clear_rows(rows[:64])  # the dead unit's rows of p
        assert time.monotonic() - start < 60
        start = time.monotonic()
        assert plane.stats()["live_rows"] == 64 + 1024 + 128  # (q's rows stay allocated)
        assert time.monotonic() - start < 1.0
        answered: list[float] = []

        def ask():
            time.sleep(0.3)
            t = time.monotonic()
            plane.stats()
            answered.append(time.monotonic() - t)

        t = threading.Thread(target=ask)
        t.start()
        msg = _bounded(plane.save, "snap", limit=DEADLINE + SLACK + 1)  # the unit cannot save its share
        t.join(10)
        assert "storage unit 0" in msg and dead in msg
        assert answered and answered[0] < 1.0  # served while the save waited for the dead unit
        meta = plane.get_meta("v", ["x"], n=64, partition="p", timeout=5)  # unit 1's rows still work
        assert plane.get_data(meta)["x"].tolist() == list(range(64, 128))
    finally:
        plane.disconnect()
        dep.shutdown()
        shutil.rmtree(dep.folder, ignore_errors=True)  # (the live unit's half of the save)


@pytest.mark.slow
def test_a_killed_controller_fails_every_client_within_the_deadline():
    dep = launch(SCHEMA, n_storage=2)
    plane, other = dep.client(deadline=DEADLINE), dep.client(deadline=DEADLINE)
    try:
        _put(plane, 4)
        assert other.stats()["live_rows"] == 4
        errors: list[BaseException] = []

        def wait():  # parked server-side without a timeout: only the connection monitor ends it
            try:
                plane.get_meta("w", ["ids", "x"], n=100, partition="p")
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=wait)
        t.start()
        time.sleep(0.5)
        _kill(dep.processes[-1].pid)  # the controller starts last
        start = time.monotonic()
        t.join(DEADLINE + 15)  # ZMTP heartbeats notice a silent peer within ~10 s at worst
        assert not t.is_alive() and len(errors) == 1 and isinstance(errors[0], DataPlaneUnavailable), errors
        assert time.monotonic() - start < 15
        _bounded(other.stats)
        _bounded(_put, other, 4)
        _bounded(other.get_meta, "t", ["x"], n=1, partition="p", timeout=0.5, limit=0.5 + DEADLINE + SLACK)
        fresh = dep.client(deadline=DEADLINE)
        assert dep.endpoint in _bounded(fresh.stats)
        fresh.disconnect()
    finally:
        plane.disconnect()
        other.disconnect()
        dep.shutdown()
