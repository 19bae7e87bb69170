"""A driver that started a local Ray instance and is killed with ``kill -9`` leaves no Ray
process behind (:mod:`asyncflow.launch.reaper`); without the reaper Ray's dashboard and
runtime-env agents outlive it for good."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncflow.launch.reaper import leftovers

pytestmark = pytest.mark.ray

DRIVER = """
import json, time
import ray
from asyncflow.launch.ray_launcher import RayLauncher
launcher = RayLauncher(num_cpus=1)
launcher.cpus  # starts the local instance (and its reaper)
print(json.dumps({"session": ray._private.worker._global_node.get_session_dir_path(),
                  "reaper": launcher._reaper.pid}), flush=True)
time.sleep(600)
"""


def test_a_driver_killed_with_kill_9_leaves_no_ray_process_behind():
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[1], env={**os.environ, "RAY_ADDRESS": ""})
    try:
        got = json.loads(driver.stdout.readline())
        session, reaper = got["session"], got["reaper"]
        t = time.monotonic()
        # Ray's agents come up a moment after ray.init returns: wait for them (they are what leaks)
        while not any(Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"ray::DashboardAgent")
                      for p in leftovers(session) if Path(f"/proc/{p}").exists()):
            assert time.monotonic() - t < 60, "Ray's dashboard agent never started"
            time.sleep(0.1)
        assert Path(f"/proc/{reaper}").exists() and len(leftovers(session)) >= 3
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    t = time.monotonic()
    while leftovers(session) and time.monotonic() - t < 30:
        time.sleep(0.2)
    left = {p: Path(f"/proc/{p}/cmdline").read_bytes()[:60] for p in leftovers(session) if Path(f"/proc/{p}").exists()}
    for pid in left:  # (the test leaves nothing either way)
        os.kill(pid, signal.SIGKILL)
    assert left == {}, f"Ray processes outlived their killed driver: {left}"
    print(f"every Ray process of the killed driver gone {time.monotonic() - t:.1f} s after its kill -9")
