"""The same-host shared-memory path of the distributed data plane (asyncflow.dataplane.transport.shm).

Checked: big puts/gets go through /dev/shm segments and return exactly the data; a put's
part on each unit is one segment owned by the unit until the last of its rows is dropped
(counted here by hand); nothing is left in /dev/shm after clear, shutdown, a killed unit or
a client that died before sending; a foreign name or ref cannot make a unit read another
file; save during a deferred clear writes only live rows. Recycling: a cleared segment is
reused by a later put only once no process maps it (the unit's own views, a reader's get),
is cut to size, expires, and respects its size floor and budget. A hypothesis test mixes
sizes across the threshold with clears, frame-only puts, out-of-order (exported) gets and
recycling, and checks that no array a get returned ever changes.
"""

from __future__ import annotations

import gc
import itertools
import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncflow.dataplane import BatchMeta, DataPlane, Field, Schema
from asyncflow.dataplane.transport import shm
from asyncflow.dataplane.transport.protocol import encode_columns
from asyncflow.dataplane.transport.deploy import launch
from asyncflow.dataplane.transport.storage_server import StorageServer

SCHEMA = Schema([Field("x", "float32", (64,)), Field("ids", "int64", ragged=True)])  # x: 256 bytes a row
MIN = 4096  # the clients' threshold here: 16 rows of x

pytestmark = pytest.mark.skipif(not shm.enabled(), reason="no /dev/shm")


def files(prefixes, kind: str = "") -> list[str]:
    return sorted(n for n in os.listdir(shm.SHM_DIR) for p in prefixes if n.startswith(p + kind))


def ours(dep) -> list[str]:
    """Every segment of ``dep``'s storage units (each name starts ``afdp-<unit pid>-``), left or
    not. Only these: a check of every ``afdp-*`` name in /dev/shm also saw the segments of other
    deployments on the machine (another job, or another test run beside this one), created while
    this test ran, and failed with their ``afdp-<other pid>-...-s1`` (reproduced with a second
    deployment putting in a loop beside the test)."""
    return sorted(n for n in os.listdir(shm.SHM_DIR) for p in dep.processes if n.startswith(f"afdp-{p.pid}-"))


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
def recycling():
    """Units that recycle segments from MIN bytes on (the client is told in the test)."""
    old = os.environ.get("ASYNCFLOW_PLANE_SHM_RECYCLE_MIN")
    os.environ["ASYNCFLOW_PLANE_SHM_RECYCLE_MIN"] = str(MIN)
    try:
        d = launch(SCHEMA, n_storage=2, token="tok")
    finally:
        if old is None:
            del os.environ["ASYNCFLOW_PLANE_SHM_RECYCLE_MIN"]
        else:
            os.environ["ASYNCFLOW_PLANE_SHM_RECYCLE_MIN"] = old
    yield d
    d.shutdown()


@pytest.fixture(scope="module")
def dep():
    d = launch(SCHEMA, n_storage=2, token="tok")
    yield d
    d.shutdown()
    shutil.rmtree(d.folder, ignore_errors=True)  # with what was saved in its state folder


def test_big_puts_use_one_segment_per_unit_freed_at_the_last_drop():
    d = launch(SCHEMA, n_storage=2, token="tok")
    plane = client(d)
    try:
        assert plane.transports() == ["shm", "shm"]
        prefixes = plane._core._shm_prefix
        x = np.arange(200 * 64, dtype=np.float32).reshape(200, 64)
        rows = plane.put({"x": x}, partition="big")
        # unit 0 holds rows 0-63 and 128-191 (32 KB), unit 1 rows 64-127 and 192-199 (18 KB): one segment each
        assert rows == list(range(200)) and len(files(prefixes, "s")) == 2
        more = plane.put({"x": x[:20]}, partition="more")  # rows 200-219: 5 KB, on unit 1 after 192-199
        small = plane.put({"x": x[:10]}, partition="more")  # rows 220-229: 2.5 KB: frames
        assert len(files(prefixes, "s")) == 3 and more == list(range(200, 220))
        meta, got = plane.get_batch("t", ["x"], n=200, partition="big")
        assert meta.rows == rows and np.array_equal(got["x"], x)
        # rows 192-229: one slice on unit 1 over three blocks: stacked, 9.5 KB, exported
        span = plane.get_data(BatchMeta("big", list(range(192, 230)), ["x"]))["x"]
        assert np.array_equal(span, np.concatenate([x[192:], x[:20], x[:10]]))
        assert files(prefixes, "x") == []  # the client unlinked the export once mapped
        plane.clear_rows(rows[:64])  # unit 0's segment still holds rows 128-191
        plane.clear_rows(rows[130:140])
        time.sleep(0.3)  # the drops reached the units (see settled)
        assert len(files(prefixes, "s")) == 3
        got_back = plane.get_data(BatchMeta("big", [129, 140, 191], ["x"]))["x"]
        assert np.array_equal(got_back, x[[129, 140, 191]])
        plane.clear_rows(rows[128:130] + rows[140:192])
        assert settled(prefixes, "s", 2)
        kept = got["x"]  # a mapping outlives the unlink
        plane.clear("big")
        plane.clear("more")
        assert settled(prefixes, "", 0) and np.array_equal(kept, x) and small == list(range(220, 230))
    finally:
        plane.disconnect()
        d.shutdown()
    assert ours(d) == []


def test_shutdown_and_a_killed_unit_leave_nothing():
    d = launch(SCHEMA, n_storage=2)
    plane = client(d)
    plane.put({"x": np.ones((128, 64), np.float32)}, partition=0)
    prefixes = plane._core._shm_prefix
    assert len(files(prefixes, "s")) == 2
    # a client that died after writing its segment, before sending it
    shm.write_segment(prefixes[1], "c", [np.ones(1000, np.uint8)])
    assert len(files(prefixes)) == 3
    os.kill(d.processes[0].pid, signal.SIGKILL)  # unit 0 dies with its segment
    d.processes[0].join(5)
    plane.disconnect()
    d.shutdown(timeout=2)
    assert ours(d) == []
    assert not Path(d.folder).exists()


def test_a_deployment_with_its_own_state_folder_leaves_no_job_folder(tmp_path):
    """``state_dir`` elsewhere: the job folder holds only sockets and goes at shutdown (it stayed,
    empty, when the missing ``state`` inside it stopped the removal); the saved state stays."""
    d = launch(SCHEMA, n_storage=1, state_dir=str(tmp_path / "state"))
    plane = client(d)
    plane.put({"x": np.ones((4, 64), np.float32)}, partition=0)
    plane.save("snap")
    plane.disconnect()
    d.shutdown(timeout=2)
    assert not Path(d.folder).exists() and any((tmp_path / "state").rglob("*.npz"))


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


def test_save_during_a_deferred_clear_writes_only_live_rows(dep):
    plane = client(dep)
    try:
        a = plane.put({"x": np.zeros((20, 64), np.float32)}, partition="sa")
        b = plane.put({"x": np.ones((3, 64), np.float32)}, partition="sb")
        meta, lease = plane._run("_get_meta", "t", ["x"], 20, "sa", None, None, True, None, True)
        assert meta.rows == a and lease is not None
        plane.clear("sa")  # deferred: the lease holds a's bytes
        assert plane.stats()["deferred_drops"] == 20
        plane.save("deferred")  # a name in the servers' state folder
        tmp_path = Path(dep.state_dir) / "deferred"
        saved = []
        for name in sorted(tmp_path.glob("data-*.npz")):
            with np.load(name) as arrays:
                saved += arrays["x::rows"].tolist()
        assert sorted(saved) == b  # a's 20 rows are not part of the saved state
        local = DataPlane(SCHEMA)
        local.load(tmp_path)
        assert local.stats()["live_rows"] == 3 and local._storage.nbytes() == 3 * 256

        async def unpin():
            plane._core._ctrl.send("unpin", {"lease": lease}, noreply=True)

        plane._thread.run(unpin())
        assert plane.stats()["deferred_drops"] == 0 and settled(plane._core._shm_prefix, "", 0)
        _, got = local.get_batch("r", ["x"], n=3, partition="sb")
        assert got["x"].tolist() == [[1.0] * 64] * 3
    finally:
        plane.clear("sb")
        plane.disconnect()


_part = itertools.count()


@settings(deadline=None, max_examples=15, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(ops=st.lists(st.one_of(
    st.tuples(st.just("put"), st.integers(1, 150), st.booleans()),  # rows, also a ragged field
    st.tuples(st.just("clear"), st.integers(0, 3), st.booleans()),  # which live put; whole partition?
    st.tuples(st.just("get"), st.integers(0, 3), st.booleans()),  # which live put; or every live row?
), min_size=1, max_size=12))
def test_random_sizes_across_the_threshold_with_clears(recycling, ops):
    plane = client(recycling)
    plane._core.recycle_min_bytes = MIN
    held: list[tuple[np.ndarray, np.ndarray]] = []  # (array a get returned, its values): never rewritten
    live: list[tuple[str, list[int], np.ndarray, list]] = []
    try:
        for op, k, flag in ops:
            if op == "put":
                part = f"h{next(_part)}"
                x = np.random.default_rng(k).standard_normal((k, 64)).astype(np.float32)
                ids = [np.arange(r % 7 + 40 * flag, dtype=np.int64) for r in range(k)]
                rows = plane.put({"x": x, "ids": ids} if flag else {"x": x}, partition=part)
                live.append((part, rows, x, ids if flag else None))
            elif live:
                part, rows, x, ids = live[k % len(live)]
                if op == "get" and flag:  # every live row, ascending: slices span puts (exports)
                    every = sorted((r, i, j) for i, (_, rs, _, _) in enumerate(live) for j, r in enumerate(rs))
                    if not every:
                        continue
                    got = plane.get_data(BatchMeta(None, [r for r, _, _ in every], ["x"]))["x"]
                    assert np.array_equal(got, np.stack([live[i][2][j] for _, i, j in every]))
                elif op == "get":
                    names = ["x", "ids"] if ids is not None else ["x"]
                    got = plane.get_data(BatchMeta(part, rows, names))
                    assert np.array_equal(got["x"], x)
                    held.append((got["x"], x.copy()))
                    if ids is not None:
                        assert all(np.array_equal(g, i) for g, i in zip(got["ids"], ids))
                elif flag:
                    plane.clear(part)
                    live.pop(k % len(live))
                else:  # clear the first half of the rows; the rest must stay readable
                    half = len(rows) // 2
                    plane.clear_rows(rows[:half])
                    live[k % len(live)] = (part, rows[half:], x[half:], None if ids is None else ids[half:])
            assert all(np.array_equal(a, v) for a, v in held)
        prefixes = plane._core._shm_prefix
        assert files(prefixes, "x") == []
    finally:
        for part, *_ in live:
            plane.clear(part)
        plane.disconnect()
    assert prefixes == [] or settled(prefixes, "s", 0)  # every segment freed (or recycled) at its last row
    assert prefixes == [] or files(prefixes, "c") + files(prefixes, "x") == []  # none left behind


def test_unit_recycles_a_cleared_segment_only_when_no_process_maps_it():
    unit = shm.ShmUnit(recycle_bytes=64 << 20)
    try:
        big = np.arange(shm.RECYCLE_MIN // 8 + 8, dtype=np.int64)  # just over RECYCLE_MIN bytes
        _, refs = shm.write_segment(unit.prefix, "c", [big])
        views, owned = unit.adopt(refs, [])
        unit.hold(owned, 1)
        unit.read_by(owned, os.getpid())  # a get sent this process refs into it
        held = shm.map_refs([[owned, 0, big.nbytes]], [], unit.prefix)[0]
        unit.release(owned)
        assert files([unit.prefix], "s") == [] and len(files([unit.prefix], "r")) == 1
        assert unit.lease(big.nbytes, os.getpid()) is None  # the unit's own views still map it
        del views
        gc.collect()
        assert unit.lease(big.nbytes, os.getpid()) is None  # this process (a reader) still maps it
        assert np.frombuffer(held, np.int64)[-1] == big[-1]
        del held
        gc.collect()
        assert unit.lease(big.nbytes + 1, os.getpid()) is None  # none big enough
        assert unit.lease("x", os.getpid()) is None and unit.lease(big.nbytes, -3) is None
        name = unit.lease(big.nbytes - 32, 4321)
        assert name.startswith(f"{unit.prefix}c4321-") and files([unit.prefix], "r") == []
        assert time.time() - os.stat(os.path.join(shm.SHM_DIR, name)).st_mtime < 30  # not stale for the sweep
        small = np.arange(shm.RECYCLE_MIN // 8, dtype=np.int64)[::-1].copy()
        name2, refs2 = shm.write_segment(unit.prefix, "c", [small], leased=name)
        assert name2 == name and os.stat(os.path.join(shm.SHM_DIR, name)).st_size == small.nbytes  # cut to size
        views, owned = unit.adopt(refs2, [])
        assert np.array_equal(np.frombuffer(views[0], np.int64), small)
        unit.hold(owned, 1)
        del views
        unit.release(owned)
        assert len(files([unit.prefix], "r")) == 1
        unit.sweep(time.monotonic() + shm.RECYCLE_IDLE_S + 1)  # kept too long unleased: unlinked
        assert files([unit.prefix]) == []
        # below RECYCLE_MIN, or over the budget: unlinked at once
        for seg, budget in ((np.zeros(1000, np.int64), 64 << 20), (big, big.nbytes - 1)):
            unit.recycler.budget = budget
            _, refs = shm.write_segment(unit.prefix, "c", [seg])
            views, owned = unit.adopt(refs, [])
            unit.hold(owned, 1)
            unit.release(owned)
            assert files([unit.prefix]) == []
    finally:
        unit.close()


def test_puts_reuse_cleared_segments_and_a_held_get_never_sees_its_rows_rewritten():
    schema = Schema([Field("y", "float32", (1 << 15,))])  # 128 KiB a row: 160 rows, 20 MiB
    d = launch(schema, n_storage=1)
    plane = d.client()
    try:
        inodes = lambda kind: {os.stat(os.path.join(shm.SHM_DIR, n)).st_ino for n in files(prefixes, kind)}
        y = np.random.default_rng(0).standard_normal((160, 1 << 15), dtype=np.float32)
        plane.put({"y": y}, partition="a")
        prefixes = plane._core._shm_prefix
        first = inodes("s")
        kept = plane.get_data(BatchMeta("a", list(range(64)), ["y"]))["y"]  # a view of the segment
        assert not kept.flags.owndata
        plane.clear("a")
        assert settled(prefixes, "r", 1) and files(prefixes, "s") == []
        plane.put({"y": -y}, partition="b")  # the cleared segment is still mapped here: a new one
        assert np.array_equal(kept, y[:64]) and inodes("r") == first and not inodes("s") & first
        second = inodes("s")
        del kept
        gc.collect()
        plane.clear("b")
        assert settled(prefixes, "r", 2)
        plane.put({"y": 2 * y}, partition="c")  # now either can be reused
        assert len(files(prefixes, "r")) == 1 and inodes("s") <= first | second
        _, got = plane.get_batch("t", ["y"], n=160, partition="c")
        assert np.array_equal(got["y"], 2 * y)
    finally:
        plane.disconnect()
        d.shutdown()
    assert ours(d) == []


def test_a_get_refuses_a_segment_recycled_while_it_was_being_mapped(monkeypatch):
    unit = shm.ShmUnit()
    try:
        _, refs = shm.write_segment(unit.prefix, "c", [np.arange(16, dtype=np.int64)])
        views, owned = unit.adopt(refs, [])
        mapped = shm._map

        def then_recycled(name):  # the rows are cleared between the client's open and its check
            out = mapped(name)
            os.rename(os.path.join(shm.SHM_DIR, name), os.path.join(shm.SHM_DIR, f"{unit.prefix}r99"))
            return out

        monkeypatch.setattr(shm, "_map", then_recycled)
        with pytest.raises(ValueError, match="cleared while being read"):
            shm.map_refs([[owned, 0, 128]], [], unit.prefix)
    finally:
        unit.close()


OWNER = """
import json, sys, time
import numpy as np
from asyncflow.dataplane import Field, Schema
from asyncflow.dataplane.transport.deploy import launch
d = launch(Schema([Field("x", "float32", (64,))]), n_storage=2)
plane = d.client()
plane._core.shm_min_bytes = 1024
plane.put({"x": np.ones((128, 64), np.float32)}, partition=0)  # a shared-memory segment in each unit
print(json.dumps({"pids": [p.pid for p in d.processes], "prefixes": plane._core._shm_prefix, "folder": d.folder}),
      flush=True)
time.sleep(600)
"""


def test_servers_of_an_owner_killed_with_kill_9_stop_and_free_their_memory():
    """``kill -9`` of the process that launched a deployment (a driver killed by the OOM killer):
    its controller and storage units stop within seconds and unlink their segments, instead of
    serving nobody forever with the memory held (``_Server.watch_owner``); the controller removes
    the job's 0700 folder as a shutdown would."""
    import json
    import subprocess
    import sys

    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[1])
    try:
        got = json.loads(owner.stdout.readline())
        pids, prefixes, folder = got["pids"], got["prefixes"], Path(got["folder"])
        assert len(pids) == 3 and len(files(prefixes, "s")) == 2 and folder.is_dir()
        for pid in pids:
            assert Path(f"/proc/{pid}").exists()
    finally:
        owner.kill()
        owner.wait()
    t = time.monotonic()

    def alive() -> list[int]:  # (not exited, or exited and not yet reaped: a zombie)
        return [pid for pid in pids if Path(f"/proc/{pid}").exists()
                and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"]

    while alive() and time.monotonic() - t < 10:
        time.sleep(0.05)
    assert alive() == [], "a data-plane server outlived the process that launched it"
    assert files(prefixes) == []  # its segments unlinked
    assert not folder.exists(), list(folder.rglob("*"))  # the job folder (its sockets) gone
    print(f"servers gone {time.monotonic() - t:.2f} s after the owner's kill -9")


def test_a_process_that_exits_without_shutdown_leaves_no_folder_and_no_segment(tmp_path):
    """A script that launches a deployment and exits without ``shutdown``: before, Python's
    exit terminated the servers (multiprocessing's SIGTERM, none of their clean-up runs) and
    the job folder stayed in the temp dir, every unit's segments in /dev/shm. Now
    ``launch`` registers the shutdown at exit."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "TMPDIR": str(tmp_path)}  # (the job folder goes there)
    out = subprocess.run([sys.executable, "-c", OWNER.replace("time.sleep(600)", "")], capture_output=True,
                         text=True, timeout=120, env=env, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert files(got["prefixes"]) == []
    assert not Path(got["folder"]).exists() and Path(got["folder"]).parent == tmp_path
    assert list(tmp_path.iterdir()) == []


def test_the_next_launch_clears_the_folders_of_jobs_killed_whole(tmp_path):
    """A job killed with its servers at once (``kill -9`` of its process group) leaves its job
    folder (nobody is left to remove it): the next launch removes such folders, by the launching
    pid in their name, only when that process is gone, only this user's, keeping a saved state."""
    from asyncflow.dataplane.transport.deploy import sweep_job_folders

    gone = subprocess_pid()
    dead, alive, kept = (tmp_path / f"asyncflow-plane-{gone}-abc", tmp_path / f"asyncflow-plane-{os.getpid()}-abc",
                         tmp_path / f"asyncflow-plane-{gone}-def")
    for folder in (dead, alive, kept):
        (folder / "sock").mkdir(parents=True)
        (folder / "state").mkdir()
    (kept / "state" / "index.msgpack").write_bytes(b"saved")
    (tmp_path / "asyncflow-plane-notapid").mkdir()
    sweep_job_folders(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [alive.name, kept.name, "asyncflow-plane-notapid"])
    assert sorted(p.name for p in kept.iterdir()) == ["state"]  # its sockets gone, the saved state kept


def subprocess_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid
