"""The asyncio core of the ZeroMQ client, ``put_nowait`` without round trips, and
``get_batch`` atomic with respect to ``clear`` (controller + storage units in their own
processes; one deployment for the module, each test on its own partitions and tasks)."""

from __future__ import annotations

import asyncio
import pickle
import random
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncflow.dataplane import Field, Schema
from asyncflow.dataplane.transport.client_async import AsyncZmqDataPlane
from asyncflow.dataplane.transport.client import ZmqDataPlane
from asyncflow.dataplane.transport.deploy import launch

SCHEMA = Schema([Field("uid", "int64"), Field("x", "float32", (4,)), Field("ids", "int64", ragged=True)])


@pytest.fixture(scope="module")
def dep():
    d = launch(SCHEMA, n_storage=2, transport="ipc")
    yield d
    d.shutdown()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def rows_of(uids):
    return {"uid": uids, "x": np.repeat(np.asarray(uids, np.float32)[:, None], 4, 1),
            "ids": [np.full(u % 5 + 1, u) for u in uids]}


def check(data):
    """Every returned row is complete and its fields belong together."""
    for u, x, ids in zip(data["uid"].tolist(), data["x"], data["ids"]):
        assert (x == u).all() and len(ids) == u % 5 + 1 and (ids == u).all(), (u, x, ids)


def test_concurrent_get_meta_waiters_are_woken_by_puts(dep):
    async def main():
        plane = AsyncZmqDataPlane(dep.endpoint, credentials=dep.credentials)
        waiters = [asyncio.create_task(plane.get_meta(f"w{i}", ["uid"], n=2, partition="aw", timeout=20))
                   for i in range(4)]
        await asyncio.sleep(0.2)
        assert (await plane.stats())["waiting"] == 4  # all parked at once, on one socket
        assert not any(w.done() for w in waiters)
        assert (await plane.get_meta("other", ["uid"], n=1, partition="aw-x", block=False)).rows == []
        rows = await plane.put(rows_of([1, 2]), partition="aw")
        metas = await asyncio.gather(*waiters)
        assert [m.rows for m in metas] == [rows] * 4  # each task gets the rows once
        meta, data = await plane.get_batch("w0b", ["uid", "x", "ids"], n=2, partition="aw")
        check(data)
        await plane.aclose()

    run(main())


def test_async_core_pickles_and_refuses_a_second_loop(dep):
    plane = AsyncZmqDataPlane(dep.endpoint, credentials=dep.credentials)
    assert run(plane.put(rows_of([3]), partition="pk")) != []
    with pytest.raises(RuntimeError, match="another event loop"):
        run(plane.stats())
    copy = pickle.loads(pickle.dumps(plane))
    assert run(copy.get_batch("pk", ["uid"], n=1, partition="pk"))[1]["uid"].tolist() == [3]


def test_put_nowait_returns_before_the_round_trip_and_errors_surface_next_call(dep):
    plane = ZmqDataPlane(dep.endpoint, credentials=dep.credentials)
    rows = plane.put({"uid": [7, 8]}, partition="nw")
    good = np.arange(40, dtype=np.int64)
    for k in range(0, 20, 4):  # puts sent before the failing one
        plane.put_nowait(rows_of(good[k:k + 4].tolist()), partition="nw-ok")
    plane.put_nowait({"x": np.zeros((2, 4), np.float32)}, partition="nw", rows=rows)
    plane.put_nowait({"x": np.ones((2, 4), np.float32)}, partition="nw", rows=rows)  # fields are write-once
    with pytest.raises(ValueError, match="already written|being written"):
        for _ in range(200):  # the next call of this client raises it, once the put failed
            plane.stats()
            time.sleep(0.01)
    for k in range(20, 40, 4):  # and after it
        plane.put_nowait(rows_of(good[k:k + 4].tolist()), partition="nw-ok")
    plane.flush()  # the error was reported once; the rest all land
    meta, data = plane.get_batch("nw", ["uid", "x", "ids"], n=40, partition="nw-ok")
    assert sorted(data["uid"].tolist()) == good.tolist()
    check(data)
    assert plane.get_batch("nw", ["x"], n=2, partition="nw")[1]["x"].tolist() == [[0.0] * 4] * 2
    plane.put_nowait({"ids": [[1], [2]]}, partition="nw", rows=rows)
    plane.put_nowait({"ids": [[1], [2]]}, partition="nw", rows=rows)
    with pytest.raises(ValueError, match="already written|being written"):
        plane.flush()
    plane.disconnect()


def test_put_nowait_does_not_wait_for_the_servers(dep):
    plane = ZmqDataPlane(dep.endpoint, credentials=dep.credentials)
    plane.stats()
    block = np.zeros((4096, 4), np.float32)
    t = time.perf_counter()
    for _ in range(20):
        plane.put({"uid": np.arange(4096), "x": block}, partition="nt")
    sync_s = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(20):
        plane.put_nowait({"uid": np.arange(4096), "x": block}, partition="nt")
    nowait_s = time.perf_counter() - t
    plane.flush()
    assert plane.stats()["partitions"]["nt"] == 40 * 4096
    assert nowait_s < sync_s, (nowait_s, sync_s)  # four round trips each, not waited for
    plane.clear("nt")
    plane.disconnect()


def test_one_sync_client_shared_by_threads(dep):
    plane = ZmqDataPlane(dep.endpoint, credentials=dep.credentials)
    got = []
    t = threading.Thread(target=lambda: got.append(plane.get_meta("th", ["uid"], n=1, partition="th", timeout=10)))
    t.start()
    time.sleep(0.2)
    rows = plane.put({"uid": [1]}, partition="th")  # same client, while the other thread waits
    t.join(10)
    assert got[0].rows == rows
    plane.disconnect()
    assert plane.stats()["live_rows"] >= 1  # reconnects after disconnect


@pytest.mark.parametrize("how", ["partition", "rows"])
def test_clear_between_meta_and_fetch_never_loses_the_batch(dep, monkeypatch, how):
    """The window of a distributed get_batch, forced: a clear arrives after the controller
    handed the rows out and before the storage units are read."""

    async def main():
        plane, other = (AsyncZmqDataPlane(dep.endpoint, credentials=dep.credentials),
                        AsyncZmqDataPlane(dep.endpoint, credentials=dep.credentials))
        part = f"win-{how}"
        rows = await plane.put(rows_of(list(range(100, 200))), partition=part)
        real = plane.get_data

        async def clear_first(meta, fields=None):
            await (other.clear(part) if how == "partition" else other.clear_rows(meta.rows))
            assert (await other.stats())["deferred_drops"] == len(meta.rows)
            return await real(meta, fields)

        monkeypatch.setattr(plane, "get_data", clear_first)
        meta, data = await plane.get_batch("win", ["uid", "x", "ids"], n=100, partition=part)
        assert meta.rows == rows and data["uid"].tolist() == list(range(100, 200))
        check(data)
        for _ in range(100):  # the unpin is sent without waiting; the drops follow it
            s = await other.stats()
            if s["deferred_drops"] == 0 and s["pinned"] == 0:
                break
            await asyncio.sleep(0.01)
        assert (s["deferred_drops"], s["pinned"]) == (0, 0)
        with pytest.raises(ValueError, match="not stored|does not exist"):
            await real(meta)  # the bytes are freed now
        await plane.aclose()
        await other.aclose()

    run(main())


_examples = iter(range(10**6))


@settings(deadline=None, max_examples=8, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(n_rows=st.integers(8, 60), batch=st.integers(1, 9), consumers=st.integers(1, 4),
       clears=st.lists(st.tuples(st.booleans(), st.integers(0, 6)), min_size=1, max_size=6),
       seed=st.integers(0, 2**16))
def test_get_batch_racing_clears_returns_complete_data_or_nothing(dep, n_rows, batch, consumers, clears, seed):
    """Consumers loop on get_batch while a clearer frees random rows and finally the whole
    partition, at random moments: a get never fails and never returns a partial row."""
    part = f"race-{next(_examples)}"
    rnd = random.Random(seed)

    async def main():
        plane = AsyncZmqDataPlane(dep.endpoint, credentials=dep.credentials)
        rows = await plane.put(rows_of(list(range(n_rows))), partition=part)
        await plane.seal(part)
        got: list[int] = []
        finished = asyncio.Event()

        async def consume(i):
            client = AsyncZmqDataPlane(dep.endpoint, credentials=dep.credentials)  # its own sockets
            while True:
                meta, data = await client.get_batch("race", ["uid", "x", "ids"], n=batch, partition=part,
                                                    block=False)
                if not meta.rows:
                    if finished.is_set():
                        break
                    await asyncio.sleep(0.002)
                    continue
                check(data)
                got.extend(data["uid"].tolist())
                for _ in range(rnd.randrange(3)):
                    await asyncio.sleep(0)
            await client.aclose()

        async def clear():
            live = list(rows)
            for whole, pause in clears:
                for _ in range(pause):
                    await asyncio.sleep(0)
                some = rnd.sample(live, k=min(len(live), rnd.randrange(1, 8)))
                if some and not whole:
                    await plane.clear_rows(some)
                    live = [r for r in live if r not in some]
            await plane.clear(part)
            finished.set()

        await asyncio.gather(clear(), *[consume(i) for i in range(consumers)])
        assert len(got) == len(set(got)) and set(got) <= set(range(n_rows))  # none duplicated
        s = await plane.stats()
        assert part not in s["partitions"] and s["pinned"] == 0
        await plane.aclose()

    run(main())
