"""The ZeroMQ data plane across hosts: two network namespaces on this machine.

Namespaces ``afh-a-<pid>`` and ``afh-b-<pid>`` are joined by a veth pair on a private /30
(10.231.x.y, inside the two namespaces only; nothing is routed anywhere else). In B a
storage unit runs as started by hand on another host (``deploy storage --bind <B addr>
--keys FILE``), with a /dev/shm of its own (a private mount), so that, as between two
hosts, a segment the client writes is not the unit's to read. In A the controller
(``--bind <A addr> --storage <B endpoint>``) and a client (``tests/plane_hosts_client.py``):
rows put and read back equal, through ZeroMQ frames (the shared-memory probe fails
cleanly), on the unit's sealed bulk port (AES-256-GCM under a session handed out over
CURVE) and again on its CURVE socket, every byte authenticated and encrypted: a marker text in the data is
nowhere in the frames captured on the veth (a raw packet socket in A), and a client with
a stranger's keys is refused within its deadline by the controller and gets no answer
from the unit. Also: a non-loopback bind without keys, a wildcard, or an address not on
the host is refused with one line. Needs root, ``ip`` and ``unshare`` (else skipped); every step
is bounded and the namespaces are removed whatever happens.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import secrets
import shutil
import signal
import subprocess
import tempfile
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = [sys.executable, "-m", "asyncflow.dataplane.transport.deploy"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


class Pair:
    """Two namespaces joined by a veth pair: ``a``/``b`` names, ``addr_a``/``addr_b``."""

    def __init__(self) -> None:
        pid = os.getpid()
        self.a, self.b = f"afh-a-{pid}", f"afh-b-{pid}"
        net = 4 * (pid % 64)
        self.addr_a, self.addr_b = f"10.231.{pid // 64 % 256}.{net + 1}", f"10.231.{pid // 64 % 256}.{net + 2}"
        self.made: list[str] = []

    def up(self) -> None:
        for ns in (self.a, self.b):
            _ip("netns", "add", ns)
            self.made.append(ns)
        _ip("-n", self.a, "link", "add", "afh0", "type", "veth", "peer", "name", "afh1", "netns", self.b)
        for ns, dev, addr in ((self.a, "afh0", self.addr_a), (self.b, "afh1", self.addr_b)):
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def down(self) -> None:
        """Stop what runs in the two namespaces (only this test's processes are there), then
        delete them (which deletes the veth pair)."""
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
            pids = [int(p) for ns in self.made for p in _ip("netns", "pids", ns, check=False).stdout.split()]
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
            end = time.monotonic() + wait
            while pids and time.monotonic() < end and any(os.path.exists(f"/proc/{p}") for p in pids):
                time.sleep(0.1)
        for ns in self.made:
            _ip("netns", "del", ns, check=False)
        self.made = []


@pytest.fixture
def pair() -> Iterator[Pair]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("needs the 'ip' and 'unshare' commands")
    p = Pair()
    try:
        try:
            p.up()
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            pytest.skip(f"cannot make network namespaces here: {getattr(exc, 'stderr', '') or exc}")
        yield p
    finally:
        p.down()


def _first_line(proc: subprocess.Popen, timeout: float) -> str:
    """The first line a server prints (its endpoint), or fail with its stderr."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline().strip() if ready else ""
    if not line:
        proc.kill()
        raise AssertionError(f"server printed no endpoint in {timeout}s: {proc.communicate(timeout=10)[1][-2000:]}")
    return line


def _in_ns(ns: str, *cmd: str, private_shm: bool = False) -> list[str]:
    if private_shm:  # as on another host: this process's /dev/shm is not the client's
        inner = " ".join(cmd)
        cmd = ("unshare", "-m", "sh", "-c", f"mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec {inner}")
    return ["ip", "netns", "exec", ns, *cmd]


def _start(ns: str, *cmd: str, private_shm: bool = False) -> subprocess.Popen:
    return subprocess.Popen(_in_ns(ns, *cmd, private_shm=private_shm), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)


def test_a_unit_on_another_host_serves_frames_sealed_and_over_curve(pair, tmp_path):
    keys, schema = tmp_path / "job.keys", tmp_path / "schema.json"
    schema.write_text(json.dumps([["x", "float32", [4], False], ["wide", "float32", [128 * 1024], False]]))
    subprocess.run([*DEPLOY, "keys", str(keys)], check=True, env=ENV, timeout=60)
    common = ["--schema", str(schema), "--keys", str(keys)]
    procs: list[subprocess.Popen] = []
    try:
        procs.append(_start(pair.b, *DEPLOY, "storage", "--bind", pair.addr_b, *common, private_shm=True))
        unit = _first_line(procs[-1], 60)
        assert unit.startswith(f"tcp://{pair.addr_b}:"), unit
        procs.append(_start(pair.a, *DEPLOY, "controller", "--bind", pair.addr_a, *common, "--storage", unit))
        controller = _first_line(procs[-1], 60)
        assert controller.startswith(f"tcp://{pair.addr_a}:"), controller
        cfg = json.dumps({"controller": controller, "keys": str(keys), "deadline": 10, "dev": "afh0"})
        t0 = time.monotonic()
        out = subprocess.run(["ip", "netns", "exec", pair.a, sys.executable, str(ROOT / "tests" / "plane_hosts_client.py"),
                              cfg], capture_output=True, text=True, timeout=120, env=ENV, cwd=ROOT)
        assert out.returncode == 0, out.stderr[-3000:]
        report = json.loads(out.stdout.strip().splitlines()[-1])
        assert report["units"] == [unit] and report["rows"] == list(range(8))
        assert report["equal"] and report["transports"] == ["sealed"]  # frames (the probe failed, cleanly) on
        assert report["wire_bytes"] > 2 * 4 << 20 and report["marker_on_wire"] == 0, report  # the sealed port
        curve = report["curve"]  # the same over the unit's CURVE socket
        assert curve["equal"] and curve["transports"] == ["zmq"] and curve["rows"] == list(range(8, 16))
        assert curve["wire_bytes"] > 2 * 4 << 20 and curve["marker_on_wire"] == 0, curve
        assert report["bulk"] == {"session": True, "forged_key": False, "forged_session": False, "job": True,
                                  "forged_key_notice": False, "forged_session_notice": True, "job_notice": False}
        assert "authentication refused" in report["stranger"] and report["stranger_s"] < 10, report
        assert report["unit_answers_job"] is True and report["unit_answers_stranger"] is False
        assert time.monotonic() - t0 < 110
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


@pytest.mark.parametrize("bind,keys,why", [("B", False, "refusing to bind"), ("0.0.0.0", True, "refusing to bind"),
                                            ("10.231.255.254", True, "Cannot assign requested address")])
def test_an_unauthenticated_wildcard_or_foreign_bind_is_refused_in_one_line(pair, tmp_path, bind, keys, why):
    schema, key_file = tmp_path / "schema.json", tmp_path / "job.keys"
    schema.write_text(json.dumps([["x", "float32", [4], False]]))
    subprocess.run([*DEPLOY, "keys", str(key_file)], check=True, env=ENV, timeout=60)
    args = ["--schema", str(schema), "--bind", pair.addr_b if bind == "B" else bind]
    out = subprocess.run(["ip", "netns", "exec", pair.b, *DEPLOY, "storage", *args,
                          *(["--keys", str(key_file)] if keys else [])],
                         capture_output=True, text=True, timeout=60, env=ENV, cwd=ROOT)
    assert out.returncode != 0 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and why in out.stderr, out.stderr


def test_launch_refuses_a_non_loopback_host_without_keys_before_starting_anything():
    from asyncflow.dataplane import Field, Schema
    from asyncflow.dataplane.transport.deploy import launch
    from asyncflow.dataplane.transport.server_base import check_bind, tcp_bind

    t0 = time.monotonic()
    with pytest.raises(ValueError, match="without CURVE keys"):
        launch(Schema([Field("x", "float32", (4,))]), n_storage=1, host="10.231.0.1", secure=False)
    with pytest.raises(ValueError, match="not a wildcard"):
        launch(Schema([Field("x", "float32", (4,))]), n_storage=1, host="0.0.0.0")
    assert time.monotonic() - t0 < 5
    check_bind(tcp_bind("127.0.0.2"), None)  # loopback: allowed without keys (tests of the bare protocol)
    assert tcp_bind("fd00::1") == "tcp://[fd00::1]:0" and tcp_bind("tcp://h:5") == "tcp://h:5"


@pytest.mark.ray
def test_ray_across_two_nodes_runs_the_zeromq_plane_on_both(pair):
    """A Ray cluster whose head is namespace A and whose second node is namespace B (its own
    /dev/shm): ``data_plane=auto`` starts a unit on each node bound to its address, the
    controller on A's; the client in A reads B's unit through frames, A's through shm."""
    if shutil.which("ray") is None:
        pytest.skip("needs the 'ray' command")
    temp = tempfile.mkdtemp(prefix="afh-ray-", dir="/tmp")  # short: Ray's socket paths must fit
    env = {**ENV, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0"}
    head = f"{pair.addr_a}:6390"
    folders = set(Path(tempfile.gettempdir()).glob("asyncflow-unit-*"))
    common = ["--num-cpus=1", "--object-store-memory=100000000", "--disable-usage-stats"]
    try:
        for cmd in (_in_ns(pair.a, "ray", "start", "--head", f"--node-ip-address={pair.addr_a}", "--port=6390",
                           "--include-dashboard=false", f"--temp-dir={temp}/a", *common),
                    _in_ns(pair.b, "ray", "start", f"--address={head}", f"--node-ip-address={pair.addr_b}",
                           f"--temp-dir={temp}/b", *common, private_shm=True)):
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
            assert out.returncode == 0, out.stderr[-3000:]
        out = subprocess.run(_in_ns(pair.a, sys.executable, str(ROOT / "tests" / "plane_hosts_ray_driver.py")),
                             capture_output=True, text=True, timeout=180, env={**env, "RAY_ADDRESS": head}, cwd=ROOT)
        assert out.returncode == 0, out.stderr[-3000:]
        report = json.loads(out.stdout.strip().splitlines()[-1])
        assert report["nodes"] == sorted([pair.addr_a, pair.addr_b]) and not report["one_host"], report
        assert report["kind"] == "ZmqDataPlane" and report["equal"], report
        hosts = [u.split("//")[1].rsplit(":", 1)[0] for u in report["units"]]
        assert sorted(hosts) == sorted([pair.addr_a, pair.addr_b]), report
        assert {h: t for h, t in zip(hosts, report["transports"])} == {pair.addr_a: "shm", pair.addr_b: "sealed"}
        assert set(Path(tempfile.gettempdir()).glob("asyncflow-unit-*")) <= folders  # the units' folders removed
    finally:
        pair.down()  # the Ray processes live in the two namespaces: stopped by pid, nothing else
        shutil.rmtree(temp, ignore_errors=True)
