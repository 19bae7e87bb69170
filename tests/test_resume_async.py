"""Runs that survive in ``stream``/``async``: resume after ``kill -9`` of the driver, and the
automatic restart (``train.max_restarts``) after a lost worker.

The invariant checked: every prompt group of steps ``0..N-1`` is trained exactly once (each
step's ``groups`` in ``metrics.jsonl``: the prompt ids the actor trained), every step appears
once, and the staleness bound holds (the actor raises ``StalenessViolation`` otherwise, and
the run would fail). Answers are long-tailed so groups finish out of order and a step may
train prompts of a later partition (completion order) while a straggler of an earlier one is
still running when the checkpoint is taken.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from asyncflow.cli import main
from asyncflow.config import load_config
from asyncflow.engines.tiny import build_char_tokenizer
from asyncflow.tasks.registry import build_task
from asyncflow.workflow import checkpoint as C
from asyncflow.workflow.failure import WorkerLost
from asyncflow.workflow.feeder import PromptFeeder
from asyncflow.workflow.job import Job
from asyncflow.workflow.worker import Worker

N, P, K = 10, 2, 2
LONG = 40  # steps of the Ray kill test: the kill after the first checkpoint must find the run going
TINY = ["mode=async", "launcher=local", "warmstart.enabled=false", "progress=false", f"train.steps={N}",
        f"train.prompts_per_step={P}", "rollout.group_size=2", "train.micro_prompts=1", "task.eval_n=2",
        "train.eval_every=0", "rollout.max_new_tokens=24", "rollout.gen_len=longtail", "rollout.longtail_short=2",
        "rollout.longtail_long=24", "rollout.longtail_frac=0.3", "train.save_every=2", f"staleness={K}"]


def check_every_group_once(run: Path, steps: int = N) -> list[dict]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    trained = [g for m in lines for g in m["groups"]]
    assert all(len(m["groups"]) == P for m in lines), [m["groups"] for m in lines]
    assert sorted(trained) == list(range(steps * P)), trained  # each prompt group exactly once
    assert all(0 <= m["max_staleness"] <= K for m in lines)
    return lines


class Puts:
    """A data plane that keeps what the feeder puts."""

    def __init__(self) -> None:
        self.parts: dict[int, dict] = {}

    def put(self, data: dict, partition: int, tags: dict | None = None) -> None:
        self.parts[partition] = data


def test_the_feeder_of_a_resumed_run_feeds_every_untrained_prompt_once_in_id_order():
    cfg = load_config(None, [f"train.steps={N}", f"train.prompts_per_step={P}", "train.micro_prompts=1", "seed=3"])
    tok, task = build_char_tokenizer(), build_task(cfg)
    whole, again = Puts(), Puts()
    PromptFeeder(cfg, tok, task, whole).fill(N)
    assert [list(whole.parts[p]["prompt_id"]) for p in range(N)] == [[2 * p, 2 * p + 1] for p in range(N)]
    trained = {0, 1, 2, 3, 5, 8}  # 3 steps: step 2 trained prompt 8 (a later partition) while 4 straggled
    feeder = PromptFeeder(cfg, tok, task, again)
    feeder.resume(3, trained)
    feeder.fill(N)
    assert sorted(again.parts) == list(range(3, N))
    fed = [int(q) for p in sorted(again.parts) for q in again.parts[p]["prompt_id"]]
    assert fed == [q for q in range(N * P) if q not in trained][: (N - 3) * P]
    by_id = {int(q): (whole.parts[p], i) for p in whole.parts for i, q in enumerate(whole.parts[p]["prompt_id"])}
    for d in again.parts.values():  # each prompt is the same prompt it was in the uninterrupted run
        for i, q in enumerate(d["prompt_id"]):
            src, j = by_id[int(q)]
            assert np.array_equal(d["query_ids"][i], src["query_ids"][j])
            assert np.array_equal(d["answer"][i], src["answer"][j]) and d["gen_len"][i] == src["gen_len"][j]
    assert C.unpack(C.pack(trained)) == trained and C.pack(trained) == {"below": 4, "more": [5, 8]}


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "asyncflow.cli", "train", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def kill_after_checkpoint(proc: subprocess.Popen, run: Path, after: int, delay: float) -> bool:
    """Wait for a checkpoint beyond step ``after``, then ``kill -9`` the driver ``delay`` seconds
    later (True), unless the run ended first (False)."""
    t = time.time()
    try:
        while not any(int(p.name[5:]) > after for p in C.complete(run / C.CKPT_DIR)):
            if proc.poll() is not None:
                return False
            assert time.time() - t < 300, "no checkpoint appeared"
            time.sleep(0.01)
        time.sleep(delay)
        if proc.poll() is not None:
            return False
        os.kill(proc.pid, signal.SIGKILL)
        return True
    finally:
        proc.wait()


def test_an_async_run_killed_twice_and_resumed_trains_every_group_once(tmp_path):
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    runs = tmp_path / "runs"
    proc = _start([*TINY, f"run_dir={runs}"])
    t = time.time()
    while not runs.exists() or not any(runs.iterdir()):
        assert proc.poll() is None and time.time() - t < 120, f"seed {seed}"
        time.sleep(0.01)
    run = next(runs.iterdir())
    # first soon after step 2's checkpoint (with this seed, step 1 trained prompt 4 while prompt 1 was
    # still running: a resume that fed partitions 2.. again would train 4 twice and 1 never), then anywhere
    assert kill_after_checkpoint(proc, run, 0, 0.0), f"seed {seed}: the run ended first"
    first = C.read(C.latest(run))[1]["driver"]
    kill_after_checkpoint(_start(["--resume", str(run)]), run, first["step"], rng.uniform(0, 1.0))  # (False: it
    # finished first)
    if not (run / "summary.json").exists():
        assert main(["train", "--resume", str(run)]) == 0, f"seed {seed}"
    check_every_group_once(run)
    print(f"seed {seed}: first resume from {first}")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"] >= 2 and summary["in_flight_answers"]["continued"] >= 0
    assert summary["in_flight_answers"]["restarted"] >= 0
    last = C.read(C.latest(run))[1]
    assert last["version"] == last["driver"]["step"] == N  # versions continued, never reset


def test_a_lost_worker_restarts_the_run_from_its_checkpoint_or_ends_it_with_the_resume_command(
        tmp_path, capsys, monkeypatch):
    """(The local launcher's workers are threads: the loss is raised by the trainer's step call,
    as the launcher reports a dead process; tests/test_failures.py kills real Ray processes.)"""
    train_step, die_at, died = Worker.train_step, random.randrange(3, N - 1), []

    def lost_once(self, v, prefetch_next=False, snapshot=False):
        out = train_step(self, v, prefetch_next, snapshot)
        if v == die_at and not died:  # (after the step: the worker's next call runs, then sees the plane closed)
            died.append(v)
            raise WorkerLost("the process died (test)")
        return out

    monkeypatch.setattr(Worker, "train_step", lost_once)
    assert main(["train", *TINY, f"run_dir={tmp_path / 'a'}"]) == 0, f"die_at {die_at}"
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and err[0].startswith("asyncflow: restart 1/2 from "), err
    assert " after a fault: " in err[0], err  # (a dead process, not a missed deadline)
    assert f"worker 'actor' was lost (step {die_at}): the process died (test)" in err[0], err
    run = next((tmp_path / "a").iterdir())
    check_every_group_once(run)
    assert json.loads((run / "summary.json").read_text())["restarts"] == 1

    died.clear()
    assert main(["train", *TINY, "train.max_restarts=0", f"run_dir={tmp_path / 'b'}"]) == 1
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    run = next((tmp_path / "b").iterdir())
    assert len(err) == 1 and err[0].startswith("asyncflow: error: worker 'actor' was lost"), err
    assert err[0].endswith(f"to continue: asyncflow train --resume {run}") or err[0].endswith("run it again"), err


@pytest.mark.ray
@pytest.mark.parametrize("target", ["rollout", pytest.param("storage unit", marks=pytest.mark.acceptance)])  # (controller: passes, slower)
def test_a_process_killed_under_ray_restarts_the_run_from_the_checkpoint(tmp_path, capfd, monkeypatch, target):
    """``kill -9`` of the rollout worker's process or of a data-plane storage unit (its
    controller: ``procs[-1]``), once a checkpoint exists: the run restarts from it (one line)
    and finishes, every step and every prompt group once. Nothing else on stderr: no Ray
    token-authentication warning, no warning from the workers' restore (capfd: Ray's own
    logging and the workers' forwarded output included)."""
    start, killed = Job.start, []

    def start_then_kill(self):
        procs = [] if target == "rollout" else self.launcher._deployments[-1].processes  # (units, then controller)
        pid = (self.watch.ask("rollout", "stats")["rollout"]["pid"] if target == "rollout"
               else procs[0 if target == "storage unit" else -1].pid)
        start(self)
        if killed:  # (the restarted job is left alone)
            return
        killed.append(pid)
        run = next((tmp_path / "runs").iterdir())

        def kill():
            t = time.time()
            while not C.complete(run / C.CKPT_DIR) and time.time() - t < 120:
                time.sleep(0.01)
            time.sleep(random.uniform(0, 0.2))  # (a long run after it: the kill lands mid-run)
            os.kill(pid, signal.SIGKILL)

        threading.Thread(target=kill, daemon=True).start()

    monkeypatch.setattr(Job, "start", start_then_kill)
    args = [a for a in TINY if a != "launcher=local"]
    assert main(["train", *args, "launcher=ray", "train.step_timeout_s=30", f"run_dir={tmp_path / 'runs'}",
                 f"train.steps={LONG}"]) == 0
    everything = capfd.readouterr().err
    assert "Token authentication" not in everything and "Warning:" not in everything, everything[-3000:]
    err = [x for x in everything.splitlines() if x.startswith("asyncflow:") and "building the workers takes" not in x]
    assert len(err) == 1 and err[0].startswith("asyncflow: restart 1/2 from checkpoint step-"), err
    assert " after a fault: " in err[0], err
    assert ("worker 'rollout'" if target == "rollout" else "DataPlaneUnavailable") in err[0], err
    run = next((tmp_path / "runs").iterdir())
    check_every_group_once(run, LONG)
    assert json.loads((run / "summary.json").read_text())["restarts"] == 1
