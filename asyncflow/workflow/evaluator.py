"""Evaluation beside training: the :class:`Evaluator` measures the held-out metric on a
snapshot of the policy's weights while rollout and training go on (``train.eval_overlap``).

Design: the evaluator is an object of the driver's process (with either launcher) with its own
copy of the model; it asks for no CPU of the launcher. ``request(v)`` starts one evaluation of
version ``v`` (the weights after ``v`` steps) on a fresh daemon thread and returns at once. That
thread first takes the weights from the weight store, as rollout does
(:class:`~asyncflow.weights.store.WeightSource`: the trainer publishes every version there),
and copies them into host memory at normal priority (the store keeps only the newest version,
so the copy is taken before the next step publishes); then it lowers its own priority to nice 19
(per thread on Linux, one torch thread) and verifies, loads and evaluates: it computes second to
the roles, so training is barely slowed, and an evaluation takes longer when the machine is
busy. The driver collects finished results with ``poll`` at each step.

Why the driver's process and not a worker of its own (as until 2026-11-27): the driver has
imported torch and transformers already, so building the evaluator costs one model load
(~0.1 s) instead of a process that starts and imports them (~5 s of CPU beside the workers'
builds on the default example) and stays resident; and nothing crosses a process to ask it.
Not ``SCHED_IDLE`` (which its own process had): here the thread shares the GIL with the driver's
threads (the feeder among them), and a thread that may wait indefinitely for a core while holding
the GIL would stall them; at nice 19 it waits at most a slice of the roles'. Measured on the
default example (``benchmarks/eval_overlap.py``, docs/benchmarks.md): the RL loop with an
evaluation every 10 steps 1.01 / 1.06 of its time without (1.10-1.14 with its own process); at
nice 0 instead of 19, 1.18.

Invariants:

* at most one evaluation in flight: a request while one runs is *skipped* (counted in
  ``skipped``; it is not queued), so evaluations never pile up behind a busy machine;
* every result carries the version it measured (``version``): the store's newest version
  ``>= v`` when the copy was taken, which is ``v`` unless the next step was published first
  (``late`` counts those);
* every wait has a deadline: the weights must come within ``timeout_s``; an error (a version
  that never came, a bad weight set, the metric raising) is a result with ``error`` (one
  line), never raised in a thread nor a hang; ``stop`` never waits for an evaluation (its
  thread is a daemon and its result is dropped);
* ``spans`` (wall-clock start, seconds) of each evaluation, for the run's ``trace.json``;
* the build (model, task, metric) runs on a thread of its own; the job starts it beside the
  workers' builds under Ray (:meth:`~asyncflow.workflow.job.Job.open_evaluator`), after them in
  the local launcher's process (whose workers load their models in it: a model load is not
  thread-safe);
* with pinned roles (``resources.pin_cores``) the evaluator's threads (its build, each evaluation)
  run on the cores of every role but the trainer (``cores``: rollout's), where idle cycles are; on
  the trainer's core even an idle-priority evaluation slowed the loop ~17% (its cache, its
  wake-ups). The driver's other threads stay where they were.

The model stays on the CPU whatever ``resources.device`` is (the evaluator asks for no GPU).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import numpy as np
import torch

from asyncflow.config import RunConfig
from asyncflow.engines.inference import load_named_weights
from asyncflow.engines.lora import LoraSpec, write_adapter_folder
from asyncflow.engines.lora_merge import AdapterMerger
from asyncflow.tasks.environments import heldout_episodes
from asyncflow.tasks.models import load_model
from asyncflow.tasks.registry import build_task, heldout_metric
from asyncflow.tasks.rewards import RewardFunction, load_reward_fn
from asyncflow.tasks.warmstart import evaluate
from asyncflow.weights.store import WeightSource, verify
from asyncflow.workflow.best import BestKeeper
from asyncflow.workflow.builders import lora_spec
from asyncflow.workflow.failure import one_line, tag

EVAL_BATCH = 512  # problems per greedy batch (as the trainer's own evaluation)
BUILD_TIMEOUT_S = 600.0  # the build's own deadline (the job gives up waiting for it sooner)


def lowest_nice() -> None:
    """The calling thread (and the threads it starts) at nice 19 (Linux: per thread; the driver's
    other threads keep theirs)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (OSError, AttributeError):  # (not Linux: the whole process would change; leave it)
        pass


def pin_thread(cores: tuple[int, ...]) -> None:
    """The calling thread (and the threads it starts) on ``cores`` only (none: where the OS puts
    it), with one torch thread: the cores of the roles that leave idle time (rollout's), never the
    trainer's, whose cache and wake-ups an evaluation on its core would disturb (measured: the RL
    loop ~17% slower unpinned)."""
    torch.set_num_threads(1)
    if cores:
        try:
            os.sched_setaffinity(0, cores)  # (0: the calling thread, on Linux)
        except (OSError, ValueError, AttributeError):  # (not Linux; a core gone)
            pass


class Evaluator:
    """Held-out evaluations of published weight versions, one at a time, at nice 19."""

    def __init__(self, cfg: RunConfig, model_dir: str, weights: WeightSource, timeout_s: float = 60.0,
                 cores: tuple[int, ...] = (), keeper: BestKeeper | None = None):
        self.cfg, self.weights, self.timeout_s, self.cores = cfg, weights, timeout_s, cores
        self.keeper = keeper  # train.keep_best: a new best figure is saved from this thread
        self._lock = threading.Lock()
        self._running = False
        self._closed = False
        self._done: list[dict] = []
        self._spans: list[tuple[float, float]] = []
        self.requested = self.skipped = self.late = 0
        self._since: float | None = None  # when the one computing now started
        self._init_error: BaseException | None = None
        self._load: Callable[[Mapping[str, np.ndarray]], None]  # published weights into self.model (_build)
        self._lora: LoraSpec | None = None  # model.lora (_build): adapters are published, merged here
        self._adapters: Mapping[str, np.ndarray] = {}  # the adapters of the last evaluation (model.lora)
        build = threading.Thread(target=self._build, args=(model_dir,), name="evaluator-build", daemon=True)
        build.start()
        build.join(BUILD_TIMEOUT_S)
        if build.is_alive() and self._init_error is None:
            self._init_error = TimeoutError(f"worker 'evaluator' was not built within {BUILD_TIMEOUT_S:g} s")

    def _build(self, model_dir: str) -> None:
        pin_thread(self.cores)
        try:
            self.model, self.tokenizer = load_model(model_dir)
            self._lora, self._model_dir = lora_spec(self.cfg), model_dir
            self._load = partial(load_named_weights, self.model) if self._lora is None else self._merge
            if self._lora is not None:
                self._merger = AdapterMerger(self.model, self._lora.scale)
            self.task = build_task(self.cfg)
            self.metric, self.score = heldout_metric(self.cfg, self.task, self._reward)
            self.episodes = heldout_episodes(self.cfg, self.task, self._reward)[1] if self.cfg.env.enabled else None
        except Exception as e:  # raised by health(), as a worker's
            self._init_error = tag(e, "worker 'evaluator' (building)")

    def _reward(self) -> Callable:
        """``reward.fn`` with its timeout and error score (a "mean reward" metric), else the task's."""
        r = self.cfg.reward
        if not r.fn:
            return self.task.reward
        return RewardFunction(load_reward_fn(r.fn), r.timeout_s, r.on_error, r.key, batched=r.batched)

    def health(self) -> dict:
        if self._init_error is not None:
            raise self._init_error
        return {}

    def request(self, version: int) -> bool:
        """Start evaluating ``version`` unless one is running (then skip it); True if started."""
        with self._lock:
            if self._running or self._closed:
                self.skipped += 1
                return False
            self._running = True
            self.requested += 1
        threading.Thread(target=self._run, args=(version,), name="evaluator", daemon=True).start()
        return True

    def _run(self, version: int) -> None:
        out: dict[str, Any] = {"requested": version, "version": None}
        t0 = time.time()
        try:
            got = self.weights.wait_newer(version - 1, self.timeout_s)  # the newest, once >= version
            if got is None:
                raise TimeoutError(f"weight version {version} was not published within {self.timeout_s:g} s")
            out["version"], buffers = got[0], {k: np.array(b, copy=True) for k, b in got[1].items()}
            pin_thread(self.cores)
            lowest_nice()  # from here on: second to the roles
            t0 = self._since = time.time()
            self._load(verify(buffers))
            problems = self.task.heldout[: self.cfg.task.eval_n]
            if self.episodes is not None:  # (multi-turn: greedy episodes)
                out["heldout_acc"] = self.episodes(self.model, self.tokenizer, problems)
            else:
                out["heldout_acc"] = evaluate(self.model, self.tokenizer, problems, EVAL_BATCH,
                                              self.task.greedy_eval_tokens, self.score, self.cfg.task.chat_template)
            if self.keeper is not None:
                self.keeper.offer(out["version"], out["heldout_acc"], self._save)
        except Exception as e:
            out["error"] = one_line(tag(e, f"evaluating weight version {out['version'] or version}"))
        out["eval_s"] = time.time() - t0
        with self._lock:
            self._spans.append((t0, out["eval_s"]))
            self._since = None
            self.late += int((out["version"] or version) > version)
            self._done.append(out)
            self._running = False

    def _merge(self, adapters: Mapping[str, np.ndarray]) -> None:
        self._merger.apply(adapters)
        self._adapters = adapters  # (what _save writes as a PEFT adapter folder)

    def _save(self, path: str) -> None:
        """The weights just evaluated, as a model folder (``train.keep_best``); with ``model.lora`` as
        the trainer saves its own: a PEFT adapter folder (and the merged model in ``merged/``)."""
        if self._lora is None:
            self.model.save_pretrained(path)
        else:
            write_adapter_folder(path, self._adapters, self._lora, self._model_dir)
            if self.cfg.model.lora.merged:
                self.model.save_pretrained(os.path.join(path, "merged"))
                self.tokenizer.save_pretrained(os.path.join(path, "merged"))
        self.tokenizer.save_pretrained(path)

    def poll(self) -> dict:
        """``done``: the evaluations finished since the last poll (``requested`` and ``version``
        (measured), ``heldout_acc``, ``eval_s``; or ``error``, one line); ``busy``: one runs now."""
        with self._lock:
            done, self._done = self._done, []
            return {"done": done, "busy": self._running}

    def busy(self) -> bool:
        with self._lock:
            return self._running

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"requested": self.requested, "skipped": self.skipped, "late": self.late}

    def spans(self) -> dict[str, list[tuple[float, float]]]:
        """The evaluations' spans, the one computing now until now."""
        with self._lock:
            now = [(self._since, time.time() - self._since)] if self._since is not None else []
            return {"evaluator": [*self._spans, *now]}

    def stop(self) -> None:
        """Take no more requests; an evaluation in flight is left to its daemon thread."""
        with self._lock:
            self._closed = True
