"""The same-host shared-memory path of the distributed data plane (asyncflow.queue.shm).

Checked: big puts/gets go through /dev/shm segments and return exactly the data; each put
slice is one segment owned by its unit until the last of its rows is dropped (counted
here by hand); nothing is left in /dev/shm after clear, shutdown, a killed unit or a client
that died before sending; a foreign name or ref cannot make a unit read another file;
save during a deferred clear writes only live rows. A hypothesis test mixes sizes across
the threshold with clears, frame-only puts and out-of-order (exported) gets.
"""

from __future__ import annotations

import itertools
import os
import signal
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncflow.queue import BatchMeta, DataPlane, Field, Schema, shm
from asyncflow.queue.protocol import encode_columns
from asyncflow.queue.zmq_launch import launch
from asyncflow.queue.zmq_storage import StorageServer

SCHEMA = Schema([Field("x", "float32", (64,)), Field("ids", "int64", ragged=True)])  # x: 256 bytes a row
MIN = 4096  # the clients' threshold here: 16 rows of x

pytestmark = pytest.mark.skipif(not shm.enabled(), reason="no /dev/shm")


def files(prefixes, kind: str = "") -> list[str]:
    return sorted(n for n in os.listdir(shm.SHM_DIR) for p in prefixes if n.startswith(p + kind))


def ours() -> set[str]:
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith("afdp-")}


def settled(prefixes, kind: str, n: int) -> bool:
    """Drops reach the units after ``clear`` returns (the controller sends them without a
    reply): wait up to 5 s for ``n`` files of ``kind``."""
    for _ in range(500):
        if len(files(prefixes, kind)) == n:
            return True
        time.sleep(0.01)
    return False


def client(dep):
    c = dep.client()
    c._core.shm_min_bytes = MIN
    return c


@pytest.fixture(scope="module")
def dep():
    d = launch(SCHEMA, n_storage=2, token="tok")
    yield d
    d.shutdown()


def test_big_puts_use_one_segment_per_slice_freed_at_the_last_drop():
    before = ours()
    d = launch(SCHEMA, n_storage=2, token="tok")
    dp = client(d)
    try:
        assert dp.transports() == ["shm", "shm"]
        prefixes = dp._core._shm_prefix
        x = np.arange(200 * 64, dtype=np.float32).reshape(200, 64)
        rows = dp.put({"x": x}, partition="big")
        assert rows == list(range(200))  # slices 0-63 | 64-127 | 128-191 (16 KB each) | 192-199 (2 KB)
        assert len(files(prefixes, "s")) == 3  # the 2 KB slice (< MIN) went as frames
        more = dp.put({"x": x[:20]}, partition="more")  # rows 200-219: 5 KB, on unit 1 after 192-199
        small = dp.put({"x": x[:10]}, partition="more")  # rows 220-229: 2.5 KB: frames
        assert len(files(prefixes, "s")) == 4 and more == list(range(200, 220))
        meta, got = dp.get_batch("t", ["x"], n=200, partition="big")
        assert meta.rows == rows and np.array_equal(got["x"], x)
        # rows 192-229: one slice on unit 1 over three blocks: stacked, 9.5 KB, exported
        span = dp.get_data(BatchMeta("big", list(range(192, 230)), ["x"]))["x"]
        assert np.array_equal(span, np.concatenate([x[192:], x[:20], x[:10]]))
        assert files(prefixes, "x") == []  # the client unlinked the export once mapped
        dp.clear_rows(rows[:63])  # row 63 still lives in the first segment
        assert len(files(prefixes, "s")) == 4
        assert dp.get_data(BatchMeta("big", [63], ["x"]))["x"].tolist() == [x[63].tolist()]
        dp.clear_rows([63])
        assert settled(prefixes, "s", 3)
        kept = got["x"]  # a mapping outlives the unlink
        dp.clear("big")
        dp.clear("more")
        assert settled(prefixes, "", 0) and np.array_equal(kept, x) and small == list(range(220, 230))
    finally:
        dp.disconnect()
        d.shutdown()
    assert ours() - before == set()


def test_shutdown_and_a_killed_unit_leave_nothing():
    before = ours()
    d = launch(SCHEMA, n_storage=2)
    dp = client(d)
    dp.put({"x": np.ones((128, 64), np.float32)}, partition=0)
    prefixes = dp._core._shm_prefix
    assert len(files(prefixes, "s")) == 2
    # a client that died after writing its segment, before sending it
    shm.write_segment(prefixes[1], "c", [np.ones(1000, np.uint8)])
    assert len(files(prefixes)) == 3
    os.kill(d.processes[0].pid, signal.SIGKILL)  # unit 0 dies with its segment
    d.processes[0].join(5)
    dp.disconnect()
    d.shutdown(timeout=2)
    assert ours() - before == set()


def test_unit_sweeps_stale_client_segments_only(tmp_path):
    unit = StorageServer(SCHEMA)
    try:
        p = unit.shm.prefix
        stale, _ = shm.write_segment(p, "c", [np.ones(8, np.uint8)])
        fresh, _ = shm.write_segment(p, "c", [np.ones(8, np.uint8)])
        owned, refs = shm.write_segment(p, "c", [np.ones((2, 64), np.float32)])
        spec, _ = encode_columns({"x": np.ones((2, 64), np.float32)})
        unit.write({"a": {"rows": [0, 1], "cols": spec, "shm": refs}}, [])
        old = time.time() - shm.STALE_S - 1
        for name in files([p]):
            os.utime(os.path.join(shm.SHM_DIR, name), (old, old))
        os.utime(os.path.join(shm.SHM_DIR, fresh))
        unit.shm.sweep(time.monotonic())
        assert files([p]) == sorted([fresh, f"{p}s1"])  # the stale one went; the stored one stays
    finally:
        unit.close()
    assert files([p]) == []


def test_foreign_names_and_refs_cannot_read_other_files(tmp_path):
    unit = StorageServer(SCHEMA)
    p = unit.shm.prefix
    spec, _ = encode_columns({"x": np.ones((1, 64), np.float32)})
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 256)
    link = os.path.join(shm.SHM_DIR, f"{p}c1-link")
    os.symlink(secret, link)
    short, _ = shm.write_segment(p, "c", [np.ones(100, np.uint8)])
    try:
        for name, exc in [("/etc/passwd", PermissionError), (f"{p}c1/../../etc/passwd", PermissionError),
                          (f"{p}../secret", PermissionError), ("afdp-1-00000000-c1-x", PermissionError),
                          (f"{p}s1", PermissionError),  # owned names are not adoptable
                          (f"{p}c1-link", OSError),  # O_NOFOLLOW
                          (short, ValueError)]:  # 256 bytes asked of a 100-byte file
            with pytest.raises(exc):
                unit.write({"a": {"rows": [5], "cols": spec, "shm": [[name, 0, 256]]}}, [])
        with pytest.raises(ValueError, match="outside"):
            unit.shm.adopt([[shm.write_segment(p, "c", [np.ones(256, np.uint8)])[0], -8, 256]], [])
        assert unit.storage.nbytes() == 0 and unit.shm.refs == {}
        assert files([p]) == [f"{p}c1-link"]  # every refused segment was unlinked; the link is untouched
    finally:
        os.unlink(link)
        unit.close()
    assert secret.read_bytes() == b"s" * 256


def test_save_during_a_deferred_clear_writes_only_live_rows(dep, tmp_path):
    dp = client(dep)
    try:
        a = dp.put({"x": np.zeros((20, 64), np.float32)}, partition="sa")
        b = dp.put({"x": np.ones((3, 64), np.float32)}, partition="sb")
        meta, lease = dp._run("_get_meta", "t", ["x"], 20, "sa", None, None, True, None, True)
        assert meta.rows == a and lease is not None
        dp.clear("sa")  # deferred: the lease holds a's bytes
        assert dp.stats()["deferred_drops"] == 20
        dp.save(tmp_path)
        saved = []
        for name in sorted(tmp_path.glob("data-*.npz")):
            with np.load(name) as arrays:
                saved += arrays["x::rows"].tolist()
        assert sorted(saved) == b  # a's 20 rows are not part of the saved state
        local = DataPlane(SCHEMA)
        local.load(tmp_path)
        assert local.stats()["live_rows"] == 3 and local._storage.nbytes() == 3 * 256

        async def unpin():
            dp._core._ctrl.send("unpin", {"lease": lease}, noreply=True)

        dp._thread.run(unpin())
        assert dp.stats()["deferred_drops"] == 0 and settled(dp._core._shm_prefix, "", 0)
        _, got = local.get_batch("r", ["x"], n=3, partition="sb")
        assert got["x"].tolist() == [[1.0] * 64] * 3
    finally:
        dp.clear("sb")
        dp.disconnect()


_part = itertools.count()


@settings(deadline=None, max_examples=15, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(ops=st.lists(st.one_of(
    st.tuples(st.just("put"), st.integers(1, 150), st.booleans()),  # rows, also a ragged field
    st.tuples(st.just("clear"), st.integers(0, 3), st.booleans()),  # which live put; whole partition?
    st.tuples(st.just("get"), st.integers(0, 3), st.booleans()),  # which live put; or every live row?
), min_size=1, max_size=12))
def test_random_sizes_across_the_threshold_with_clears(dep, ops):
    dp = client(dep)
    prefixes = dp._core._shm_prefix
    live: list[tuple[str, list[int], np.ndarray, list]] = []
    try:
        for op, k, flag in ops:
            if op == "put":
                part = f"h{next(_part)}"
                x = np.random.default_rng(k).standard_normal((k, 64)).astype(np.float32)
                ids = [np.arange(r % 7 + 40 * flag, dtype=np.int64) for r in range(k)]
                rows = dp.put({"x": x, "ids": ids} if flag else {"x": x}, partition=part)
                live.append((part, rows, x, ids if flag else None))
            elif live:
                part, rows, x, ids = live[k % len(live)]
                if op == "get" and flag:  # every live row, ascending: slices span puts (exports)
                    every = sorted((r, i, j) for i, (_, rs, _, _) in enumerate(live) for j, r in enumerate(rs))
                    if not every:
                        continue
                    got = dp.get_data(BatchMeta(None, [r for r, _, _ in every], ["x"]))["x"]
                    assert np.array_equal(got, np.stack([live[i][2][j] for _, i, j in every]))
                elif op == "get":
                    names = ["x", "ids"] if ids is not None else ["x"]
                    got = dp.get_data(BatchMeta(part, rows, names))
                    assert np.array_equal(got["x"], x)
                    if ids is not None:
                        assert all(np.array_equal(g, i) for g, i in zip(got["ids"], ids))
                elif flag:
                    dp.clear(part)
                    live.pop(k % len(live))
                else:  # clear the first half of the rows; the rest must stay readable
                    half = len(rows) // 2
                    dp.clear_rows(rows[:half])
                    live[k % len(live)] = (part, rows[half:], x[half:], None if ids is None else ids[half:])
        assert files(prefixes, "x") == []
    finally:
        for part, *_ in live:
            dp.clear(part)
        dp.disconnect()
    assert settled(prefixes, "", 0)  # every segment freed at its last row, none exported left
