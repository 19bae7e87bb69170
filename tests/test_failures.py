"""A failed run is one line: ``asyncflow: error: <where>: <root cause> (at file:line)``.

``asyncflow.cli.main`` is run in-process (local launcher; the Ray variants are marked
``ray``): a user mistake found before the roles start (``reward.fn`` that does not import)
exits 2; a role's crash, a stalled step (``train.step_timeout_s``) and a killed or stopped worker
process exit 1. Each prints exactly one line to stderr and leaves the tracebacks (the
worker's, and for a stall every worker's thread stacks) in ``<run_dir>/error.log``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from asyncflow.cli import main
from asyncflow.workflow.job import Job
from asyncflow.workflow.rollout import RolloutRole

TINY = ["warmstart.enabled=false", "progress=false", "train.steps=3", "train.prompts_per_step=2",
        "rollout.group_size=2", "train.micro_prompts=1", "task.eval_n=2", "train.eval_every=0"]


def run_cli(tmp_path: Path, capsys, *overrides: str) -> tuple[int, list[str], Path | None]:
    """Exit code, stderr lines, and the run folder's error.log (None if there is none)."""
    rc = main(["train", *TINY, f"run_dir={tmp_path / 'runs'}", *overrides])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    logs = sorted((tmp_path / "runs").glob("*/error.log"))
    return rc, err, logs[0] if logs else None


def one_error_line(err: list[str]) -> str:
    lines = [line for line in err if line.startswith("asyncflow: error:")]
    assert len(lines) == 1, err
    return lines[0]


SLOW_BUILD = "asyncflow: building the workers takes longer than"  # (a loaded machine: information, not an error)


def only_ray_startup_besides(err: list[str], line: str) -> None:
    """Nothing but the line on stderr, save Ray's own start-up warnings and the slow-build note."""
    others = [x for x in err if x != line and not x.startswith(SLOW_BUILD)]
    assert all("WARNING" in x and "Traceback" not in x for x in others), err
    assert not any(word in x for x in err for word in ("ActorDiedError", "RayTaskError", "RayActorError")), err


def test_a_reward_fn_that_does_not_import_is_a_user_error_found_by_the_driver(tmp_path, capsys):
    bad = tmp_path / "bad_reward.py"
    bad.write_text("import no_such_package_for_asyncflow_tests\n\ndef score(p, r, s):\n    return 0.0\n")
    rc, err, log = run_cli(tmp_path, capsys, "launcher=local", f"reward.fn={bad}:score")
    assert rc == 2
    assert err == [one_error_line(err)]
    assert "reward.fn" in err[0] and "no_such_package_for_asyncflow_tests" in err[0]
    # found before the run begins (as every config mistake): no run folder, so no error.log
    assert log is None and not (tmp_path / "runs").exists()


def test_a_crashing_role_is_one_line_naming_it_and_where_it_raised(tmp_path, capsys, monkeypatch):
    def poll(self, timeout):
        raise ZeroDivisionError("boom in rollout")

    monkeypatch.setattr(RolloutRole, "poll", poll)
    rc, err, log = run_cli(tmp_path, capsys, "launcher=local", "mode=async")
    line = one_error_line(err)
    assert rc == 1 and err == [line]
    assert "role 'rollout' on worker 'rollout'" in line and "ZeroDivisionError: boom in rollout" in line
    assert f"{__file__}:" in line  # the file:line that raised it
    text = log.read_text()
    assert "Traceback" in text and "boom in rollout" in text and "def poll" not in line


def test_a_stalled_role_is_reported_within_the_step_timeout(tmp_path, capsys, monkeypatch):
    release, started = threading.Event(), []

    def poll(self, timeout):
        release.wait(120)  # stuck (released at the end of the test)

    start = Job.start

    def timed_start(self):
        started.append(time.monotonic())
        start(self)

    monkeypatch.setattr(RolloutRole, "poll", poll)
    monkeypatch.setattr(Job, "start", timed_start)
    try:
        rc, err, log = run_cli(tmp_path, capsys, "launcher=local", "mode=async", "train.step_timeout_s=3",
                               "train.max_restarts=0")
        took = time.monotonic() - started[0]
    finally:
        release.set()
    line = one_error_line(err)
    assert rc == 1 and err == [line]
    assert "step 0 made no progress" in line and "role 'rollout' on worker 'rollout'" in line, line
    assert took < 3 + 20, took  # (20 s: the heartbeat period, stopping the workers, a loaded machine)
    text = log.read_text()
    assert "threads of worker 'rollout'" in text and "in poll" in text


CRASH_MODULE = '''
import os

from asyncflow.tasks.registry import FACTORIES


def make(cfg):
    if os.getpid() != int(os.environ["ASYNCFLOW_TEST_DRIVER_PID"]):  # only inside the role processes
        from asyncflow.workflow.rollout import RolloutRole

        def poll(self, timeout):
            raise ZeroDivisionError("boom in a Ray worker")

        RolloutRole.poll = poll
    return FACTORIES["addition"](cfg)
'''


@pytest.mark.ray
def test_a_crashing_role_under_ray_is_one_line_with_the_workers_traceback_in_the_log(tmp_path, capsys,
                                                                                      monkeypatch):
    (tmp_path / "crash_task_for_tests.py").write_text(CRASH_MODULE)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("ASYNCFLOW_TEST_DRIVER_PID", str(os.getpid()))
    monkeypatch.syspath_prepend(str(tmp_path))
    rc, err, log = run_cli(tmp_path, capsys, "launcher=ray", "mode=async", "task.name=crash_task_for_tests:make")
    line = one_error_line(err)
    assert rc == 1
    only_ray_startup_besides(err, line)
    assert "role 'rollout' on worker 'rollout'" in line and "ZeroDivisionError: boom in a Ray worker" in line
    assert "crash_task_for_tests.py:" in line
    text = log.read_text()
    assert "traceback in the worker" in text and "boom in a Ray worker" in text


@pytest.mark.ray
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_a_killed_or_stopped_worker_process_ends_the_run_with_one_line_naming_it(tmp_path, capsys, monkeypatch,
                                                                                  sig):
    """kill -9: the launcher reports the dead process; SIGSTOP: the process no longer answers its
    heartbeat (within train.step_timeout_s + 30 s, here well within). train.max_restarts=0: no restart.
    A checkpoint every step: the stopped rollout always leaves one waiting for its snapshot, which
    must not hold the exit (it once did, for the snapshot's 75 s)."""
    killed: list[float] = []
    pids: list[int] = []
    start = Job.start

    def start_then_kill(self):
        pids.append(self.watch.ask("rollout", "stats")["rollout"]["pid"])
        start(self)

        def kill():
            time.sleep(2)
            os.kill(pids[0], sig)
            killed.append(time.monotonic())

        threading.Thread(target=kill, daemon=True).start()

    monkeypatch.setattr(Job, "start", start_then_kill)
    try:
        rc, err, log = run_cli(tmp_path, capsys, "launcher=ray", "mode=async", "train.steps=1000",
                               "train.max_restarts=0", "train.step_timeout_s=20", "train.save_every=1")
    finally:
        if sig == signal.SIGSTOP:
            try:
                os.kill(pids[0], signal.SIGKILL)  # (the test stopped it; Ray may have killed it already)
            except ProcessLookupError:
                pass
    took = time.monotonic() - killed[0]
    line = one_error_line(err)
    assert rc == 1
    only_ray_startup_besides(err, line)
    assert "worker 'rollout'" in line, line
    assert took < (60 if sig == signal.SIGKILL else 20 + 30), took
    assert line.endswith("no checkpoint yet: run it again") or "to continue: asyncflow train --resume" in line, line
    assert log is not None
