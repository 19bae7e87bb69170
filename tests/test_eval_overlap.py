"""Evaluation beside training (``train.eval_overlap``): the evaluator measures exactly the
weight version it names, one at a time (a due one is skipped), with deadlines and one-line
failures; a run's trace shows the trainer's steps during an evaluation, and its metrics and
summary attribute every result to the version measured."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from asyncflow.config import load_config

METRICS = '''
import threading, time, zlib

def digest(prompt, response, answer):  # differs with the answers, so with the weights
    return float(zlib.crc32(response.encode()) % 1000)

def slow(prompt, response, answer):
    time.sleep(0.02)
    return 0.25

def where(prompt, response, answer):  # this thread's nice x 100 + its cores as a bit mask
    import os
    nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    return float(nice * 100 + sum(1 << c for c in os.sched_getaffinity(0)))

def fails_beside(prompt, response, answer):
    if threading.current_thread().name == "evaluator":
        raise ValueError("metric broke")
    return 0.5
'''
TINY = ["warmstart.enabled=false", "progress=false", "train.prompts_per_step=2", "train.micro_prompts=1",
        "rollout.group_size=2", "rollout.max_batch=4", "rollout.max_new_tokens=3"]


def _metric(tmp_path: Path, name: str) -> str:
    (tmp_path / "metrics.py").write_text(METRICS)
    return f"eval.metric={tmp_path}/metrics.py:{name}"


def _weights(seed: int) -> dict:
    """Weights of the ``model_dir`` fixture's shape; an even ``seed`` flips the final norm's sign
    (an untrained model answers ``=`` whatever its seed: the flip makes it answer otherwise)."""
    from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model
    from asyncflow.weights.store import seal

    model = build_tiny_model(build_char_tokenizer(), seed=seed, hidden_size=32, num_layers=1, num_heads=2,
                             num_kv_heads=1, intermediate_size=64)
    w = {k: p.detach().numpy().copy() for k, p in model.named_parameters()}
    w["model.norm.weight"] *= -1 if seed % 2 == 0 else 1
    return seal(w)


def _direct(cfg, model_dir: Path, weights: dict) -> float:
    """The metric of ``weights`` computed here, in the plain blocking way."""
    from asyncflow.engines.inference import load_named_weights
    from asyncflow.tasks.models import load_model
    from asyncflow.tasks.registry import build_task, heldout_metric
    from asyncflow.tasks.warmstart import evaluate
    from asyncflow.weights.store import verify

    model, tok = load_model(str(model_dir))
    load_named_weights(model, verify(weights))
    task = build_task(cfg)
    return evaluate(model, tok, task.heldout[: cfg.task.eval_n], 512, task.greedy_eval_tokens,
                    heldout_metric(cfg, task)[1])


def _wait(ev, timeout: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while ev.busy():
        assert time.monotonic() < deadline, "the evaluation did not finish"
        time.sleep(0.02)
    got = ev.poll()
    assert not got["busy"]
    return got["done"]


def test_an_evaluation_measures_the_version_it_names(model_dir, tmp_path):
    from asyncflow.weights.store import WeightStore
    from asyncflow.workflow.evaluator import Evaluator

    cfg = load_config(None, ["task.eval_n=8", _metric(tmp_path, "digest")])
    a, b = _weights(1), _weights(2)
    want_a, want_b = _direct(cfg, model_dir, a), _direct(cfg, model_dir, b)
    assert want_a != want_b  # (else the versions could not be told apart)
    store = WeightStore()
    ev = Evaluator(cfg, str(model_dir), store, timeout_s=10)
    ev.health()
    store.publish(3, a)
    assert ev.request(3)
    [r] = _wait(ev)
    assert (r["requested"], r["version"], r["heldout_acc"]) == (3, 3, want_a) and "error" not in r
    store.publish(5, b)
    assert ev.request(5)
    assert [(r["version"], r["heldout_acc"]) for r in _wait(ev)] == [(5, want_b)]
    store.publish(6, a)  # version 7 was due, but only 6 exists: it waits for 7, then measures it
    assert ev.request(7)
    time.sleep(0.2)
    assert ev.busy()
    store.publish(7, b)
    assert [(r["version"], r["heldout_acc"]) for r in _wait(ev)] == [(7, want_b)]
    store.publish(9, a)  # 8 was due but 9 came first: the result names 9, the version measured
    assert ev.request(8)
    assert [(r["requested"], r["version"], r["heldout_acc"]) for r in _wait(ev)] == [(8, 9, want_a)]
    assert ev.counts() == {"requested": 4, "skipped": 0, "late": 1}
    assert len(ev.spans()["evaluator"]) == 4


def test_one_evaluation_at_a_time_a_due_one_is_skipped(model_dir, tmp_path):
    from asyncflow.weights.store import WeightStore
    from asyncflow.workflow.evaluator import Evaluator

    cfg = load_config(None, ["task.eval_n=10", _metric(tmp_path, "slow")])  # 10 x 20 ms: 0.2 s or more
    store = WeightStore()
    store.publish(1, _weights(1))
    ev = Evaluator(cfg, str(model_dir), store, timeout_s=10)
    assert ev.request(1)
    assert not ev.request(2)  # the first still runs
    assert [(r["version"], r["heldout_acc"]) for r in _wait(ev)] == [(1, 0.25)]
    assert ev.counts() == {"requested": 1, "skipped": 1, "late": 0}
    ev.stop()
    assert not ev.request(3) and not ev.busy()


def test_a_version_that_never_comes_is_one_line_within_the_deadline(model_dir, tmp_path):
    from asyncflow.weights.store import WeightStore
    from asyncflow.workflow.evaluator import Evaluator

    cfg = load_config(None, ["task.eval_n=4"])
    ev = Evaluator(cfg, str(model_dir), WeightStore(), timeout_s=0.3)
    t = time.monotonic()
    assert ev.request(4)
    [r] = _wait(ev, timeout=10)
    assert time.monotonic() - t < 5
    assert "weight version 4 was not published within 0.3 s" in r["error"] and "\n" not in r["error"]


def _run(tmp_path: Path, launcher: str, *overrides: str) -> tuple[dict, list[dict], dict]:
    from asyncflow.api import train

    run = tmp_path / "run"
    cfg = load_config(None, [*TINY, f"launcher={launcher}", "mode=async", f"run_dir={run}", *overrides])
    summary = train(cfg, run_dir=run)
    metrics = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    trace = json.loads((run / "trace.json").read_text())
    spans: dict = {}
    for e in trace["traceEvents"] if isinstance(trace, dict) else trace:
        if e.get("ph") == "X":
            spans.setdefault(e["cat"], []).append((e["ts"], e["ts"] + e["dur"]))
    return summary, metrics, spans


@pytest.mark.parametrize("launcher", ["local", pytest.param("ray", marks=[pytest.mark.ray, pytest.mark.slow])])
def test_training_goes_on_during_an_evaluation_and_the_result_names_its_version(launcher, tmp_path, monkeypatch):
    from asyncflow.workflow.job import Job

    ready = Job.evaluator_ready  # (built in the background: here a due step waits for it; Ray: seconds)
    monkeypatch.setattr(Job, "evaluator_ready", lambda self: self._eval_built.wait(120) and ready(self))
    steps, every = 40, 4  # (tiny steps: enough that evaluations finish within the run on a busy machine)
    summary, metrics, spans = _run(tmp_path, launcher, f"train.steps={steps}", f"train.eval_every={every}",
                                   "task.eval_n=8",
                                   _metric(tmp_path, "slow"))  # 8 x 20 ms asleep: >= 0.16 s an evaluation
    inside = [a for a in spans["actor"] for e in spans["evaluator"] if e[0] <= a[0] and a[1] <= e[1]]
    assert inside, (spans["evaluator"], spans["actor"])  # training steps computed during an evaluation
    lines = [m for m in metrics if "heldout_acc" in m]
    evals = summary["heldout_evals"]
    assert lines and evals["done"] == len(lines) and evals["failed"] == evals["paused"] == evals["off"] == 0
    due = steps // every - 1  # after steps every, 2 every, ... (the last one is the final evaluation)
    assert evals["due"] == due == sum(evals[k] for k in ("requested", "skipped", "superseded"))
    assert evals["not_ready"] == 0
    assert evals["requested"] == evals["done"] + evals["abandoned"] and evals["abandoned"] <= 1
    for m in lines:  # measured no later than the line it is on
        assert m["heldout_version"] < m["step"], m
        assert m["heldout_acc"] == 0.25 and m["heldout_metric"] == "slow"
    assert sum(m["heldout_version"] % every > 0 for m in lines) <= evals["late"]  # (a later one came first)
    assert evals["versions"] == [[m["heldout_version"], 0.25, round(m["heldout_eval_s"], 3)] for m in lines]
    assert summary["heldout_acc_before"] == summary["heldout_acc_after"] == 0.25  # the blocking ones, as before
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    from asyncflow.observe.report import format_summary

    assert f"evaluations        {len(lines)} beside training ({evals['skipped']} skipped" in format_summary(summary)


def test_the_evaluator_is_built_while_the_first_steps_run(tmp_path, monkeypatch):
    """Its build waits (up to 20 s) until the driver has logged step 3: a driver that waited for
    the build before the first step would never get there, and the build would fail."""
    import threading

    from asyncflow.workflow import driver, evaluator

    logged, load = threading.Event(), evaluator.load_model

    def log_step(m, *args):
        log(m, *args)
        if m["step"] >= 3:
            logged.set()

    def late_load(model_dir):
        assert logged.wait(20), "no step was logged while the evaluator was being built"
        return load(model_dir)

    log = driver._log_step
    monkeypatch.setattr(driver, "_log_step", log_step)
    monkeypatch.setattr(evaluator, "load_model", late_load)
    summary, metrics, _ = _run(tmp_path, "local", "train.steps=16", "train.eval_every=2", "task.eval_n=4")
    evals = summary["heldout_evals"]
    assert evals["beside_training"] and evals["not_ready"] >= 1 and evals["paused"] == 0, evals  # (step 2 was due)
    assert evals["due"] == 7 == sum(evals[k] for k in ("requested", "skipped", "not_ready", "superseded"))
    assert [m["step"] for m in metrics] == list(range(1, 17))


def test_with_overlap_off_training_pauses_for_each_evaluation(tmp_path):
    summary, metrics, spans = _run(tmp_path, "local", "train.steps=4", "train.eval_every=2", "task.eval_n=4",
                                   "train.eval_overlap=false", _metric(tmp_path, "slow"))
    assert "evaluator" not in spans and summary["heldout_evals"] is None
    assert [m["step"] for m in metrics if "heldout_acc" in m] == [2]
    assert "heldout_version" not in metrics[1]


def test_an_evaluator_failure_is_one_line_and_training_goes_on(tmp_path, capsys, monkeypatch):
    from asyncflow.workflow.job import Job

    ready = Job.evaluator_ready  # (a due step waits for the background build: beside a CPU hog no evaluation ran)
    monkeypatch.setattr(Job, "evaluator_ready", lambda self: self._eval_built.wait(120) and ready(self))
    summary, metrics, _ = _run(tmp_path, "local", "train.steps=16", "train.eval_every=2", "task.eval_n=4",
                               _metric(tmp_path, "fails_beside"))
    err = [ln for ln in capsys.readouterr().err.splitlines() if "held-out evaluation failed" in ln]
    assert len(err) == 1 and "ValueError: metric broke" in err[0], err
    evals = summary["heldout_evals"]
    assert evals["failed"] == 1 and evals["done"] == 0
    # due after steps 2, 4, ..., 14: one evaluation ran; a due step sees a finished failure before it
    # requests (a request while it is still in flight is skipped); none after the failure
    assert evals["requested"] == 1 and evals["due"] == 7
    assert evals["off"] == 7 - 1 - evals["skipped"] - evals["not_ready"] and evals["off"] >= 1
    assert summary["heldout_acc_before"] == summary["heldout_acc_after"] == 0.5
    assert len(metrics) == 16 and not any("heldout_acc" in m for m in metrics)


class _Evaluator:
    """A job's evaluator verbs, scripted: ``polls`` answered in turn (the last one forever)."""

    def __init__(self, *polls: dict | Exception, ready: bool | Exception = True):
        self.polls, self.requested, self.ready = list(polls), [], ready

    def evaluator_ready(self) -> bool:
        if isinstance(self.ready, Exception):
            raise self.ready
        return self.ready

    def eval_request(self, version: int) -> bool:
        self.requested.append(version)
        return True

    def eval_poll(self) -> dict:
        got = self.polls.pop(0) if len(self.polls) > 1 else self.polls[0]
        if isinstance(got, Exception):
            raise got
        return got

    def eval_counts(self) -> dict:
        return {"requested": len(self.requested), "skipped": 0, "late": 0}


def test_the_last_step_does_not_wait_for_an_evaluation_in_flight():
    from asyncflow.workflow.driver import BesideEvals

    job = _Evaluator({"done": [], "busy": True})
    evals = BesideEvals(job)  # type: ignore[arg-type]
    evals.step({"step": 4}, 4, steps=5)
    t, m = time.monotonic(), {"step": 5}
    evals.step(m, None, steps=5)
    assert time.monotonic() - t < 0.5 and "heldout_acc" not in m  # (the final evaluation measures version 5)
    s = evals.summary()
    assert (s["abandoned"], s["requested"], s["due"], s["done"]) == (1, 1, 1, 0) and job.requested == [4]


def test_a_result_goes_on_the_line_it_arrives_at_with_its_version():
    from asyncflow.workflow.driver import BesideEvals

    r = {"requested": 2, "version": 2, "heldout_acc": 0.5, "eval_s": 1.25}
    job = _Evaluator({"done": [], "busy": True}, {"done": [r], "busy": False}, {"done": [], "busy": False})
    evals, lines = BesideEvals(job), [{"step": s} for s in (2, 3, 4)]  # type: ignore[arg-type]
    for m in lines:
        evals.step(m, 2 if m["step"] == 2 else None, steps=4)
    assert lines == [{"step": 2}, {"step": 3, "heldout_acc": 0.5, "heldout_version": 2, "heldout_eval_s": 1.25},
                     {"step": 4}]
    assert len(job.polls) == 1  # no call once nothing was in flight
    assert evals.summary() == {"beside_training": True, "requested": 1, "skipped": 0, "late": 0,
                               "due": 1, "not_ready": 0, "superseded": 0, "paused": 0, "off": 0, "failed": 0,
                               "abandoned": 0, "done": 1, "versions": [[2, 0.5, 1.25]]}


def test_an_evaluation_that_would_end_after_the_last_step_is_not_requested(monkeypatch):
    """The last one took 1.1 s; at 0.1 s a step, 12 steps are left at version 8 (requested),
    10 at version 10 (1.0 s: superseded by the final evaluation)."""
    from asyncflow.workflow import driver

    clock = iter(i / 10 for i in range(100))
    monkeypatch.setattr(driver.time, "monotonic", lambda: next(clock))
    r = {"requested": 2, "version": 2, "heldout_acc": 0.5, "eval_s": 1.1}
    job = _Evaluator({"done": [r], "busy": False})
    evals = driver.BesideEvals(job)  # type: ignore[arg-type]
    for step in range(1, 21):
        evals.step({"step": step}, step if step in (2, 8, 10) else None, steps=20)
    assert job.requested == [2, 8]
    s = evals.summary()
    assert (s["due"], s["requested"], s["superseded"], s["abandoned"]) == (3, 2, 1, 0), s


def test_due_steps_before_the_evaluator_is_built_request_nothing():
    from asyncflow.workflow.driver import BesideEvals

    job = _Evaluator({"done": [], "busy": False}, ready=False)
    evals = BesideEvals(job)  # type: ignore[arg-type]
    evals.step({"step": 2}, 2, steps=6)
    job.ready = True
    evals.step({"step": 4}, 4, steps=6)
    assert job.requested == [4] and evals.beside()
    assert evals.summary()["not_ready"] == 1


def test_a_lost_evaluator_is_one_line_and_no_more_requests(capsys):
    from asyncflow.workflow.driver import BesideEvals
    from asyncflow.workflow.failure import WorkerLost

    job = _Evaluator(WorkerLost("worker 'evaluator' was lost (poll(), step 2): its process died"))
    evals = BesideEvals(job)  # type: ignore[arg-type]
    for step in (2, 3, 4, 5, 6):
        evals.step({"step": step}, step if step in (2, 4) else None, steps=6)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "held-out evaluation failed" in err[0] and "its process died" in err[0], err
    s = evals.summary()
    assert job.requested == [2] and s["failed"] == 1 and (s["due"], s["off"]) == (2, 1)


def test_an_evaluator_that_cannot_be_built_is_one_line_and_evaluations_pause_instead(tmp_path, capsys, monkeypatch):
    from asyncflow.workflow.evaluator import Evaluator

    def broken(self):
        raise RuntimeError("no evaluator here")

    monkeypatch.setattr(Evaluator, "health", broken)
    summary, metrics, spans = _run(tmp_path, "local", "train.steps=8", "train.eval_every=2", "task.eval_n=4")
    err = [ln for ln in capsys.readouterr().err.splitlines() if "evaluator could not be built" in ln]
    assert len(err) == 1 and "no evaluator here" in err[0], err
    evals = summary["heldout_evals"]
    assert not evals["beside_training"] and "evaluator" not in spans
    # built in the background: the due steps before its failure was known requested nothing, the
    # later ones paused for an evaluation on the trainer, as without the evaluator
    paused = [m["step"] for m in metrics if "heldout_acc" in m]
    assert paused and paused == [2, 4, 6][-len(paused):] and not any("heldout_version" in m for m in metrics)
    assert (evals["due"], evals["paused"], evals["not_ready"], evals["done"]) == (3, len(paused), 3 - len(paused), 0)


def test_the_evaluator_runs_on_every_pinned_core_but_the_trainers(model_dir, tmp_path):
    """Pinned roles (rollout on core 1, the trainer on core 0): the evaluator goes where rollout is,
    never on the trainer's core; unpinned, nowhere in particular. Its evaluations run at nice 19 on
    those cores, in this process, and the thread that asked keeps its own priority and cores."""
    import os
    import threading
    from types import SimpleNamespace

    from asyncflow.weights.store import WeightStore
    from asyncflow.workflow.evaluator import Evaluator
    from asyncflow.workflow.job import Job
    from asyncflow.workflow.plan import plan_workers

    cfg = load_config(None, ["mode=async", "staleness=1"])
    job = SimpleNamespace(specs=plan_workers(cfg, 2, cores=[0, 1]))
    assert {s.name: s.cores for s in job.specs} == {"rollout": (1,), "actor": (0,)}
    assert Job._evaluator_cores(job) == (1,)
    job.specs = plan_workers(cfg, 2)
    assert Job._evaluator_cores(job) == ()
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs Linux and two cores to pin")
    me = threading.get_native_id()
    nice, cores = os.getpriority(os.PRIO_PROCESS, me), os.sched_getaffinity(0)
    store = WeightStore()
    store.publish(1, _weights(1))
    ev = Evaluator(load_config(None, ["task.eval_n=2", _metric(tmp_path, "where")]), str(model_dir), store,
                   timeout_s=10, cores=(1,))
    assert ev.request(1)
    [r] = _wait(ev)
    assert r["heldout_acc"] == 19 * 100 + 0b10, r  # nice 19, on core 1 only
    assert (os.getpriority(os.PRIO_PROCESS, me), os.sched_getaffinity(0)) == (nice, cores)  # (the asker's own)
    ev.stop()
