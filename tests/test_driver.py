"""The driver loop queues step v + 1 on the trainer before step v returns (no idle trainer at
the step boundary), except where a held-out evaluation must run between the two steps."""

from __future__ import annotations

from asyncflow.api import train
from asyncflow.config import load_config
from asyncflow.launch.local import LocalLauncher


class OrderLauncher(LocalLauncher):
    """Records the trainer's calls in the order the driver makes them."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple] = []

    def submit(self, handle, method, *args):  # (the job's other calls, heartbeats..., are not recorded)
        fut = super().submit(handle, method, *args)
        if method == "evaluate":
            self.events.append(("evaluate",))
        elif method == "train_step":
            self.events.append(("submit", method, args[0]))
            fut.step = args[0]
        return fut

    def result(self, fut, timeout):
        out = super().result(fut, timeout)
        if hasattr(fut, "step"):
            self.events.append(("result", fut.step))
        return out

    def call(self, handle, method, *args):
        if method == "evaluate":
            self.events.append(("evaluate",))
        return super().call(handle, method, *args)


ORDER = ["launcher=local", "warmstart.enabled=false", "progress=false", "train.steps=5", "train.eval_every=2",
         "train.prompts_per_step=2", "train.micro_prompts=1", "rollout.group_size=2", "rollout.max_batch=4",
         "task.eval_n=4"]


def test_next_step_is_queued_early_except_before_an_evaluation(tmp_path):
    cfg = load_config(None, [*ORDER, "train.eval_overlap=false", f"run_dir={tmp_path}"])
    launcher = OrderLauncher()
    summary = train(cfg, launcher=launcher, run_dir=tmp_path)
    ev = [e for e in launcher.events if e[0] != "submit" or e[1] == "train_step"]
    assert ev == [
        ("evaluate",),  # before training
        ("submit", "train_step", 0), ("submit", "train_step", 1), ("result", 0),
        ("result", 1), ("evaluate",),  # after step 2 of 5: step index 2 is not queued before it
        ("submit", "train_step", 2), ("submit", "train_step", 3), ("result", 2),
        ("result", 3), ("evaluate",),  # after step 4
        ("submit", "train_step", 4), ("result", 4),
        ("evaluate",),  # the final held-out accuracy
    ]
    assert summary["steps"] == 5


def test_evaluations_beside_training_never_hold_the_next_step_back(tmp_path, monkeypatch):
    from asyncflow.workflow.evaluator import Evaluator
    from asyncflow.workflow.job import Job

    ready = Job.evaluator_ready  # (built in the background: here the driver waits for it, so step 2 requests)
    monkeypatch.setattr(Job, "evaluator_ready", lambda self: self._eval_built.wait(60) and ready(self))
    cfg = load_config(None, [*ORDER, f"run_dir={tmp_path}"])  # (train.eval_overlap: the default)
    launcher = OrderLauncher()
    request = Evaluator.request  # (an object of the driver's process: asked directly, not through the launcher)
    monkeypatch.setattr(Evaluator, "request", lambda ev, v: launcher.events.append(("request", v)) or request(ev, v))
    summary = train(cfg, launcher=launcher, run_dir=tmp_path)
    ev = [e for e in launcher.events if e[0] != "submit" or e[1] == "train_step"]
    assert ev == [
        ("evaluate",),  # before training, blocking
        ("submit", "train_step", 0), ("submit", "train_step", 1), ("result", 0),
        ("submit", "train_step", 2), ("result", 1), ("request", 2),  # version 2, once step index 1 returned
        ("submit", "train_step", 3), ("result", 2),
        ("submit", "train_step", 4), ("result", 3), *([("request", 4)] if ("request", 4) in ev else []),
        ("result", 4),
        ("evaluate",),  # the final held-out accuracy, blocking
    ]
    evals = summary["heldout_evals"]  # (version 4 is not asked for where version 2's evaluation took longer than
    assert summary["steps"] == 5 and evals["due"] == 2  # the one step left: superseded, on a busy machine)
    assert evals["requested"] + evals["skipped"] == (2 if ("request", 4) in ev else 1) == 2 - evals["superseded"]


def test_worker_runs_steps_in_order_whatever_order_the_calls_arrive_in():
    """A Ray actor serves calls on several threads without keeping their order: step v + 1
    (queued early by the driver) must still run after step v."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from asyncflow.workflow.worker import Worker

    w = Worker.__new__(Worker)  # only the ordering machinery
    w._compute, w._order, w._expect = ThreadPoolExecutor(1), threading.Condition(), 0
    ran: list[int] = []

    def step(v):
        ran.append(v)
        return v

    with ThreadPoolExecutor(3) as callers:
        late = [callers.submit(w._in_order, v, step, v) for v in (2, 1)]  # arrive first
        time.sleep(0.05)
        assert ran == []  # nothing runs before step 0
        first = callers.submit(w._in_order, 0, step, 0)
        assert [f.result(5) for f in [first, *late]] == [0, 2, 1]
    assert ran == [0, 1, 2]
    w._compute.shutdown()
