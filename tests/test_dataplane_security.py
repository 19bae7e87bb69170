"""The distributed data plane as the Ray launcher starts it, against peers without the job's keys.

One deployment (``launch(schema, n_storage=2)``, secure by default) holds data of the job's
own client. From a separate process without the keys (``tests/plane_attacker.py``; the
same OS user, and user ``nobody`` when the tests run as root) every request (read,
consume, put, inject, clear, save, close, shutdown; plain and with a stranger's CURVE
keys) gets no answer, the real client fails fast with ``DataPlaneUnavailable``, and the
job's data and client are unaffected. Also: ``save``/``load`` stay in the state folder,
ipc sockets live in a 0700 folder, a token mismatch is refused both ways, and a client
pointed at a dead endpoint fails within its deadline. Each check is bounded (seconds).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from asyncflow.dataplane import DataPlaneUnavailable, Field, Schema
from asyncflow.dataplane.transport import shm
from asyncflow.dataplane.transport.client import ZmqDataPlane
from asyncflow.dataplane.transport.deploy import launch

SCHEMA = Schema([Field("x", "float32", (4,)), Field("wide", "float32", (1024,))])
ROOT = Path(__file__).resolve().parents[1]
NOBODY = 65534


@pytest.fixture(scope="module")
def dep():
    d = launch(SCHEMA, n_storage=2)  # as RayLauncher.data_plane does: no token, keys by default
    yield d
    d.shutdown()
    shutil.rmtree(d.folder, ignore_errors=True)  # with what was saved in its state folder


def _attack(dep, uid=None, units=True, deadline=3.0) -> dict:
    client = dep.client()
    cfg = {"controller": dep.endpoint, "units": client.storage_endpoints() if units else None,
           "server_public": dep.credentials.server_public, "uid": uid, "deadline": deadline}
    client.disconnect()
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "plane_attacker.py"), json.dumps(cfg)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _check_refused(report: dict, deadline: float) -> None:
    assert report["answered"] == []  # not one request of 22 got any reply
    for name in ("no_keys", "stranger_keys"):
        error, took = report[name]
        assert error.startswith("DataPlaneUnavailable") and "authentication refused" in error, error
        assert took < deadline, (name, took)  # refused at the handshake, not by the deadline


def test_a_process_without_the_keys_is_refused_and_the_job_unaffected(dep):
    plane = dep.client()
    rows = plane.put({"x": np.arange(8, dtype=np.float32).reshape(2, 4)}, partition="mine")
    before = plane.stats()
    report = _attack(dep)
    _check_refused(report, 3.0)
    after = plane.stats()
    assert after["refused"] > before["refused"]  # the controller counted (and logged) them
    assert after["live_rows"] == before["live_rows"] and after["gets"] == before["gets"]
    meta, data = plane.get_batch("mine", ["x"], n=2, partition="mine")
    assert meta.rows == rows and data["x"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert not os.path.exists("/tmp/asyncflow-evil")
    assert all(p.is_alive() for p in dep.processes)
    plane.disconnect()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run the attacker as user nobody")
def test_another_os_user_is_refused_and_cannot_open_segments_or_ipc_sockets(dep):
    plane = dep.client()
    rows = plane.put({"x": np.ones((1024, 4), np.float32), "wide": np.ones((1024, 1024), np.float32)},
                     partition="big")  # 4 MiB: in shared-memory segments
    report = _attack(dep, uid=NOBODY)
    assert report["uid"] == NOBODY
    _check_refused(report, 3.0)
    assert report["shm_opened"] == []  # segments: 0600 files of the job's user
    assert report["shm_seen"] > 0 or not shm.enabled()
    assert plane.get_meta("big-reader", ["x"], n=len(rows), partition="big").rows == rows
    ipc = launch(SCHEMA, n_storage=1, transport="ipc")
    try:
        assert stat.S_IMODE(os.stat(ipc.folder).st_mode) == 0o700
        t = time.monotonic()
        report = _attack(ipc, uid=NOBODY, units=False, deadline=2.0)
        for name in ("no_keys", "stranger_keys"):  # the folder cannot be entered: refused at once
            assert report[name][0].startswith("DataPlaneUnavailable") and "Permission denied" in report[name][0]
            assert report[name][1] < 1.0
        assert time.monotonic() - t < 30
        assert ipc.client().stats()["live_rows"] == 0
    finally:
        ipc.shutdown()
    assert not os.path.exists(ipc.folder)
    plane.disconnect()


def test_save_and_load_stay_inside_the_state_folder(dep, tmp_path):
    plane = dep.client()
    plane.put({"x": np.zeros((1, 4), np.float32)}, partition="sv")
    plane.save("snap/one")
    assert (Path(dep.state_dir) / "snap" / "one" / "index.msgpack").exists()
    plane.load("snap/one")
    outside = tmp_path / "outside"
    outside.mkdir()
    (Path(dep.state_dir) / "link").symlink_to(outside)
    for bad in ["../escape", "snap/../../escape", str(tmp_path / "abs"), "link/inside-a-symlink", "/etc"]:
        with pytest.raises(PermissionError, match="refused"):
            plane.save(bad)
    with pytest.raises(PermissionError, match="refused"):
        plane.load("/etc")
    assert list(outside.iterdir()) == [] and not (tmp_path / "abs").exists()
    plane.disconnect()


def test_a_token_must_match_both_ways():
    d = launch(SCHEMA, n_storage=1, token="right")
    try:
        assert d.client().stats()["live_rows"] == 0
        with pytest.raises(PermissionError, match="wrong token"):
            ZmqDataPlane(d.endpoint, token="wrong", credentials=d.credentials).stats()
    finally:
        d.shutdown()
    d = launch(SCHEMA, n_storage=1)  # no token: a request that carries one is refused, not accepted
    try:
        with pytest.raises(PermissionError, match="carries a token but this server has none"):
            ZmqDataPlane(d.endpoint, token="x", credentials=d.credentials).stats()
    finally:
        d.shutdown()


def test_a_client_at_a_dead_endpoint_fails_at_once_naming_it():
    """Nothing listens there: the refused connect fails the call (not its 30 s deadline)."""
    s = zmq.Context.instance().socket(zmq.ROUTER)  # a free port that nothing will answer on
    port = s.bind_to_random_port("tcp://127.0.0.1")
    s.close(0)
    t = time.monotonic()
    with pytest.raises(DataPlaneUnavailable, match=rf"controller tcp://127\.0\.0\.1:{port} refused the connection"):
        ZmqDataPlane(f"tcp://127.0.0.1:{port}").stats()
    assert time.monotonic() - t < 5


def test_a_server_that_stops_answering_fails_the_waiting_call(dep):
    """A ROUTER that accepts the connection but never replies: the deadline, not a hang."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.ROUTER)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    try:
        t = time.monotonic()
        with pytest.raises(DataPlaneUnavailable, match="within 0.5s"):
            ZmqDataPlane(f"tcp://127.0.0.1:{port}", deadline=0.5).stats()
        assert time.monotonic() - t < 3
        assert s.poll(1000)  # the request did arrive: the server just never answered
        assert msgpack.unpackb(s.recv_multipart()[1])["op"] == "hello"
    finally:
        s.close(0)


def test_the_keys_never_reach_argv_or_environment(dep):
    secret = dep.credentials.server_secret
    for p in dep.processes:
        for name in ("cmdline", "environ"):
            with open(f"/proc/{p.pid}/{name}", "rb") as fh:
                assert secret.encode() not in fh.read()
    assert secret not in repr(dep.credentials)


def test_servers_started_by_hand_use_a_0600_key_file(tmp_path):
    from asyncflow.dataplane.transport.deploy import read_keys

    keys, schema = tmp_path / "job.keys", tmp_path / "schema.json"
    schema.write_text(json.dumps([["x", "float32", [4], False]]))
    cmd = [sys.executable, "-m", "asyncflow.dataplane.transport.deploy"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([*cmd, "keys", str(keys)], check=True, env=env, timeout=30)
    assert stat.S_IMODE(keys.stat().st_mode) == 0o600
    common = ["--schema", str(schema), "--keys", str(keys), "--state-dir", str(tmp_path)]
    procs = [subprocess.Popen([*cmd, "storage", *common], stdout=subprocess.PIPE, text=True, env=env)]
    try:
        unit = procs[0].stdout.readline().strip()
        procs.append(subprocess.Popen([*cmd, "controller", *common, "--storage", unit], stdout=subprocess.PIPE,
                                      text=True, env=env))
        endpoint = procs[1].stdout.readline().strip()
        plane = ZmqDataPlane(endpoint, credentials=read_keys(keys), deadline=10)
        assert plane.put({"x": np.zeros((2, 4), np.float32)}) == [0, 1]
        plane.save("s")
        assert (tmp_path / "s" / "index.msgpack").exists()
        with pytest.raises(DataPlaneUnavailable, match="authentication refused"):
            ZmqDataPlane(endpoint, deadline=5).stats()
        keys.chmod(0o644)
        with pytest.raises(PermissionError, match="mode 0600"):
            read_keys(keys)
        plane.shutdown_servers()
        plane.disconnect()
    finally:
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
