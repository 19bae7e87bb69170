"""Ends what a local Ray instance leaves behind when its driver dies without shutting it down.

``kill -9`` of a driver that started a local Ray instance (the OOM killer, a scheduler's
preemption) takes down Ray's control store and raylet, but Ray's ``DashboardAgent`` and
``RuntimeEnvAgent`` processes live on, reparented to init, and hang in their own SIGTERM
handler once their raylet is gone: each such run would leak them for good. So a launcher that
starts a local instance (:class:`~asyncflow.launch.ray_launcher.RayLauncher`) also starts this
*reaper*, a small process of its own session holding the read end of a pipe whose write end
only the driver holds. When the driver exits in any way (or shuts Ray down and closes it),
the pipe ends; the reaper gives Ray :data:`GRACE_S` to stop by itself, then ends with SIGKILL
every process of this user still tied to that instance: its command line is Ray's
(``ray::...`` or under Ray's package) and it names the instance's session folder, or has a
file open in it. Nothing else is touched (a shell tailing a log there has no Ray command line).

The reaper never waits on anything but the pipe and ends after one sweep; it reads nothing
from anywhere but ``/proc`` and its own argument (the session folder, from its parent).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

__all__ = ["GRACE_S", "leftovers", "start_reaper"]

GRACE_S = 3.0  # for Ray's own shutdown to finish before the sweep


def start_reaper(session_dir: str) -> subprocess.Popen:
    """Start the reaper of the local Ray instance at ``session_dir``; the returned process's
    ``stdin`` is the pipe (close it after ``ray.shutdown()``; the driver's death closes it too)."""
    return subprocess.Popen([sys.executable, "-m", "asyncflow.launch.reaper", session_dir], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, start_new_session=True, close_fds=True)


def _is_ray(cmdline: bytes) -> bool:
    return cmdline.startswith(b"ray::") or b"/ray/" in cmdline


def leftovers(session_dir: str) -> list[int]:
    """Pids of this user's Ray processes tied to ``session_dir`` (named on their command line, or
    holding a file open under it); never this process."""
    me, uid, needle = os.getpid(), os.getuid(), os.fsencode(session_dir.rstrip("/"))
    out = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read()
            if not _is_ray(cmd):
                continue
            tied = needle in cmd
            if not tied:
                fd_dir = f"/proc/{name}/fd"
                tied = any(os.fsencode(os.readlink(os.path.join(fd_dir, fd))).startswith(needle + b"/")
                           for fd in os.listdir(fd_dir))
        except OSError:  # (gone meanwhile, or not ours to read)
            continue
        if tied:
            out.append(int(name))
    return out


def main(argv: list[str]) -> int:
    session_dir = argv[0]
    try:
        while sys.stdin.buffer.read(1 << 16):  # until the driver's end closes (its exit, or its shutdown)
            pass
    except OSError:
        pass
    time.sleep(GRACE_S)
    for pid in leftovers(session_dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
