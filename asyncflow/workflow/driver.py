"""The driver loop of a training run (one screen; every mode goes through it).

``train(cfg)``: prepare the initial policy (warm-start), launch the job (data plane,
weight store, workers of the mode), then per step: feed prompts far enough ahead for the
staleness bound, train one version, log. Throughput and busy fractions are metered by
:class:`~asyncflow.observe.report.RunMeter` (whole run, and steady state after step 1). The
mode only changes what ``job.step`` does (colocated phases for ``sync``, a streamed
trainer step for ``stream``/``async``).
Evaluations: before the first step and after the last, on the trainer, blocking. Every
``train.eval_every`` steps, in ``stream``/``async`` with ``train.eval_overlap``, beside training
(:class:`BesideEvals`, :mod:`asyncflow.workflow.evaluator`): the driver only requests one and
the steps go on; results land on later metrics lines with ``heldout_version``. In ``sync`` (or
without ``eval_overlap``) the step after a due evaluation is queued only once it is done.
Mistakes found before any role starts (model folder, dataset rows, ``reward.fn``) are
``ConfigError`` errors; any failure writes ``<run_dir>/error.log`` (driver and worker
tracebacks, the watchdog's stack dumps: :mod:`asyncflow.workflow.failure`) and re-raises.

Survival: a failure of the machinery, not of the user's code (a lost worker, a dead data
plane process, a stalled step: :func:`~asyncflow.workflow.failure.recoverable`) shuts the job
down and runs it again from the run folder's latest complete checkpoint (from the start if
there is none), at most ``train.max_restarts`` times, with one line on stderr per restart;
past the limit the error's line ends with the ``--resume`` command that continues the run.
A resume (automatic or ``--resume``) feeds every prompt the checkpoint had not trained,
once (:mod:`asyncflow.workflow.feeder`): in ``stream``/``async`` the answers that were in
flight continue from their saved tokens where the staleness bound allows (the built-in engine;
:mod:`asyncflow.workflow.rollout.inflight`), the others and those generated but not trained restart
from their prompts (counted: ``in_flight_answers`` in the summary), the versions continue and ``metrics.jsonl`` keeps
each step once.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from asyncflow.agents.episode import KEEP_FAILURES
from asyncflow.config import ConfigError, RunConfig, dump_config
from asyncflow.observe.episodes import env_error_line, episode_stats
from asyncflow.observe.report import (
    Progress,
    RunMeter,
    reward_error_line,
    reward_failures,
    summarize,
)
from asyncflow.observe.trace import PlotUnavailable, write_gantt, write_trace
from asyncflow.observe.trackers import Trackers, open_trackers
from asyncflow.tasks.base import Task
from asyncflow.tasks.models import load_tokenizer, prepare_model
from asyncflow.tasks.registry import build_task, heldout_metric
from asyncflow.tasks.rewards import load_reward_fn
from asyncflow.workflow.best import BestKeeper
from asyncflow.workflow.checkpoint import CKPT_DIR, Checkpoints, Snapshot, complete, latest, read
from asyncflow.workflow.failure import (
    describe,
    mark_resumable,
    one_line,
    origin,
    recoverable,
    restart_cause,
    root_cause,
    write_error_log,
)
from asyncflow.workflow.feeder import PromptFeeder
from asyncflow.workflow.job import Job
from asyncflow.workflow.launcher import Launcher


def make_run_dir(cfg: RunConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    d = Path(cfg.run_dir).expanduser() / f"{stamp}-{cfg.mode}"
    n = 1
    while d.exists():
        d, n = d.with_name(f"{stamp}-{cfg.mode}-{n}"), n + 1
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(dump_config(cfg, absolute=True))  # its paths read the same from the run folder
    return d


def write_run_trace(spans: dict, path: Path) -> None:
    """Chrome trace (Perfetto) of the roles' computing spans, one track per role (an event is
    named after its role, or what it is where the role says: the actor's ``train`` / ``step``); and
    ``gantt.png`` beside it when matplotlib is installed."""
    t0 = min((s for v in spans.values() for s, *_ in v), default=0.0)
    write_trace([(role, what[0] if what else role, s - t0, d) for role, v in spans.items() for s, d, *what in v],
                path, "asyncflow run")
    try:  # the same timeline as a PNG, when the [plot] extra is installed
        write_gantt(path, path.with_name("gantt.png"))
    except PlotUnavailable:
        pass


def train(cfg: RunConfig, launcher: Launcher, run_dir: Path | None = None, evaluate: bool = True,
          resume: bool = False, annotate: Callable[[dict], dict] | None = None) -> dict:
    """Run one job on ``launcher``; return its summary (also written to ``<run_dir>/summary.json``).
    ``plan: auto`` must be resolved first (:func:`asyncflow.api.train` does, and picks the launcher).
    ``resume``: continue ``run_dir`` from its latest checkpoint (checked by :func:`asyncflow.api.train`).
    ``annotate(summary)``: more entries for the summary, asked once the run is done (the API's: the
    planner's prediction beside the measurement, :mod:`asyncflow.planner.check`)."""
    if cfg.plan == "auto":
        raise ConfigError("plan=auto is resolved before the driver runs: call asyncflow.api.train, or resolve it "
                          "with asyncflow.planner.auto.resolve")
    task = build_task(cfg)  # a user's mistakes (a bad dataset row, a missing module) fail before any role starts
    check_reward_fn(cfg)
    metric, _ = heldout_metric(cfg, task)
    if cfg.env.enabled and not cfg.env.tools:  # (an environment's or an agent's own reward: tasks.environments)
        metric = "mean episode reward"
    if resume and run_dir is not None:
        (run_dir / "config.yaml").write_text(dump_config(cfg, absolute=True))  # train.steps may have grown
    else:
        run_dir = run_dir or make_run_dir(cfg)
    history = {"restarts": 0, "restarted": 0, "continued": 0}  # restarts; in-flight answers restarted, continued
    while True:
        snap: Snapshot | None = read(latest(run_dir)) if resume else None
        try:
            return _run(cfg, launcher, run_dir, evaluate, task, metric, snap, history, annotate)
        except Exception as e:  # the whole story for the user's one line (asyncflow.cli)
            what = one_line(e)
            write_error_log(run_dir / "error.log", e)
            if not recoverable(e) or history["restarts"] >= cfg.train.max_restarts:
                if recoverable(e):
                    mark_resumable(e, run_dir)
                raise
            history["restarts"] += 1
            found = complete(run_dir / CKPT_DIR)
            resume = bool(found)
            print(f"asyncflow: restart {history['restarts']}/{cfg.train.max_restarts} from "
                  f"{f'checkpoint {found[-1].name}' if found else 'the start (no checkpoint yet)'} after "
                  f"{restart_cause(e)}: {what}", file=sys.stderr, flush=True)


def check_reward_fn(cfg: RunConfig) -> None:
    """Import ``reward.fn`` once here, before any role starts: a mistake in it is the user's
    (``ConfigError``), found in one line instead of in every worker that loads it."""
    if not cfg.reward.fn:
        return
    try:
        load_reward_fn(cfg.reward.fn)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"reward.fn = '{cfg.reward.fn}': loading it raised {describe(e)} "
                          f"(at {origin(root_cause(e))})") from e


def _run(cfg: RunConfig, launcher: Launcher, run_dir: Path, evaluate: bool, task: Task, metric: str,
         snap: Snapshot | None, history: dict, annotate: Callable[[dict], dict] | None = None) -> dict:
    progress = Progress(cfg.train.steps, enabled=cfg.progress, metric=metric)
    model_dir, init = prepare_model(cfg, run_dir, progress.warmstart, progress.note)  # checks model.path's folder
    beside = evaluate and evaluates_beside(cfg)  # (its evaluator is built beside the before-evaluation)
    keeper = BestKeeper(run_dir) if cfg.train.keep_best and evaluate else None
    job, trackers = Job(cfg, launcher, model_dir, evaluator=beside, keeper=keeper), Trackers([])
    ckpt = Checkpoints(cfg, job, run_dir)
    try:
        evals = BesideEvals(job) if beside else None
        start, acc0 = ckpt.resume(snap, evaluate)
        trackers = open_trackers(cfg.log.backends, run_dir, cfg.log.project, cfg.log.mlflow_uri,
                                 append=snap is not None)
        trackers.log_config(cfg.model_dump(mode="json"))
        feeder = PromptFeeder(cfg, load_tokenizer(model_dir), task, job.plane)
        # every prompt not trained yet nor continued, once (asyncflow.workflow.feeder)
        feeder.resume(start, ckpt.trained | set(ckpt.continued), len(ckpt.continued))
        if snap is not None:
            history["restarted"] += ckpt.restarted
            history["continued"] += ckpt.continued_answers
            print(f"asyncflow: resumed at step {start}; in-flight answers: {ckpt.continued_answers} continued, "
                  f"{ckpt.restarted} restarted", flush=True)
        progress.start(acc0)
        job.start()
        meter = RunMeter(job.stats, drops=cfg.algorithm.dynamic_sampling, stragglers=cfg.rollout.overprovision > 0,
                         since=snap[1].get("rollout", {}).get("counters") if snap is not None else None,
                         votes=cfg.reward.mode == "majority" or cfg.rollout.etmr)
        meter.steps = start
        _rl_steps(cfg, job, feeder, meter, lambda m: _log_step(m, metric, progress, trackers), evaluate, ckpt, start,
                  evals)
        totals = {**meter.finish(), "pinned": job.pinned(), "heldout_metric": metric if evaluate else None,
                  "skipped_rows": getattr(task, "skipped", 0),  # task.on_bad_row=skip
                  "skipped_first": next(iter(getattr(task, "bad_rows", [])), None)}
        write_run_trace(job.spans(), run_dir / "trace.json")
        acc1 = job.evaluate() if evaluate else None
        saved = job.save(str(run_dir / "checkpoint"))
        kept = keeper.finish(run_dir, cfg.train.steps, acc1) if keeper is not None else None
        progress.close()
        ckpt.close()
        summary = {**summarize(cfg, init, acc0, acc1, totals, run_dir, saved), "resumed_from": start or None,
                   "checkpoint_pause_s": ckpt.pauses, "restarts": history["restarts"],
                   "in_flight_answers": {"continued": history["continued"], "restarted": history["restarted"]},
                   "heldout_evals": evals.summary() if evals is not None else None, "checkpoint_kept": kept}
        summary.update(annotate(summary) if annotate is not None else {})
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        trackers.log_summary(summary)
        _warn_reward_errors(summary, totals["stats"], run_dir)
        _warn_env_errors(summary, totals["stats"], run_dir)
        return summary
    finally:  # (after a failure: the job first, so a checkpoint write still waiting on a worker ends at once)
        trackers.close()
        job.shutdown()
        ckpt.close(quiet=True)


def _rl_steps(cfg: RunConfig, job: Job, feeder: PromptFeeder, meter: RunMeter, log: Callable[[dict], None],
              evaluate: bool, ckpt: Checkpoints, start: int = 0, evals: BesideEvals | None = None) -> None:
    """The RL steps from ``start``: feed prompts far enough ahead for the staleness bound, train,
    evaluate every ``train.eval_every`` steps, ``log`` each step's metrics, snapshot a checkpoint
    every ``train.save_every`` (the next step is not queued behind an evaluation; a snapshot is
    copied beside it: :mod:`asyncflow.workflow.hostcopy`).
    With ``evals`` an evaluation is only requested (it runs beside the next steps) and the
    results finished by then go on each step's line."""
    steps, every = cfg.train.steps, cfg.train.eval_every if evaluate else 0
    ahead = cfg.effective_staleness + 2 + -(-cfg.rollout.overprovision // cfg.train.prompts_per_step)

    def submit(v: int) -> list | None:  # feed prompts for every admissible step, then queue step v on the trainer
        if not cfg.algorithm.dynamic_sampling:  # (with it, rollout feeds itself)
            feeder.fill(v + ahead)  # (over-provisioned groups reach further ahead)
        return job.submit(v, ckpt.due(v + 1)) if v < steps else None  # (the trainer snapshots after a due step)

    fut = submit(start)
    for v in range(start, steps):
        eval_now = every and (v + 1) % every == 0 and v + 1 < steps
        beside = evals is not None and evals.beside()  # (False once its evaluator failed to build)
        pause = eval_now and not beside
        # step v + 1 queues behind v (no idle trainer between steps) unless an evaluation comes between
        nxt = submit(v + 1) if not pause else None
        assert fut is not None  # v < steps: submitted
        m = meter.step(job.result(fut, v))
        ckpt.saw(m)  # (the prompt groups step v trained; its wait for the last checkpoint's host copy)
        if evals is not None and beside:  # (weights v + 1 are published: step v returned)
            evals.step(m, v + 1 if eval_now else None, steps)
        elif eval_now:
            m["heldout_acc"] = job.evaluate()  # counted in the wall time: nothing is hidden
            if job.keeper is not None:  # (train.keep_best; beside training, the evaluator offers its own)
                job.keeper.offer(v + 1, m["heldout_acc"], job.save)
            if evals is not None:
                evals.paused()
        log(m)  # (before the checkpoint: a checkpoint of step n means n metrics lines)
        if ckpt.due(v + 1):
            ckpt.save(v + 1, feeder.fed)
        fut = submit(v + 1) if pause else nxt


def evaluates_beside(cfg: RunConfig) -> bool:
    """Whether periodic evaluations run beside training (``train.eval_overlap``, not ``sync``: its one
    worker computes on every core in every phase, so it pauses for each)."""
    return cfg.train.eval_overlap and cfg.mode != "sync" and 0 < cfg.train.eval_every < cfg.train.steps


class BesideEvals:
    """The driver's side of evaluations beside training (:mod:`asyncflow.workflow.evaluator`).

    The evaluator is built in the background while the run starts: a due step before it is
    built requests nothing (``not_ready``); one that cannot be built is one line on stderr and
    the later evaluations pause training instead (``beside`` turns False; ``paused`` counts them).
    Each step: see what finished (a due step only), request the due version (skipped by the
    evaluator while one runs; none after a failure; none, ``superseded``, where the last evaluation
    took longer than the steps left: the final evaluation, after the last step, measures a later
    version), then put the newest result finished by now on the step's line (``heldout_acc``,
    ``heldout_version``: the weights after that many steps, ``heldout_eval_s``). The last step
    does not wait: an evaluation still in flight is ``abandoned`` (the final one measures the
    last version). An evaluator failure is one line on stderr and ends the periodic evaluations
    (``failed``); training goes on. Every due step is counted once: ``due`` = ``requested`` +
    ``skipped`` + ``not_ready`` + ``superseded`` + ``paused`` + ``off`` (after a failure)."""

    def __init__(self, job: Job):
        self.job = job
        self.on, self.build_error = True, ""
        self.n = dict.fromkeys(("due", "not_ready", "superseded", "paused", "off", "failed", "abandoned"), 0)
        self.pending = False  # one was started and its result not seen yet (else no call at all: a step
        self.done: list[dict] = []  # of the tiny example is ~0.2 s, a Ray call ~1 ms)
        self._times: list[float] = []  # when each step was seen (the step time, for ``superseded``)

    def beside(self) -> bool:
        """Whether due evaluations go beside training (True while the evaluator is being built)."""
        if not self.build_error:
            try:
                self.job.evaluator_ready()
            except Exception as e:
                self.build_error = one_line(e)
                print(f"asyncflow: the evaluator could not be built ({self.build_error}); evaluations pause "
                      "training instead", file=sys.stderr, flush=True)
        return not self.build_error

    def paused(self) -> None:
        """A due evaluation ran on the trainer (the evaluator could not be built)."""
        self.n["due"] += 1
        self.n["paused"] += 1

    def step(self, m: dict, due: int | None, steps: int) -> None:
        """After step ``m["step"]`` of ``steps``: ``due`` the version to evaluate now (else None)."""
        self._times = [*self._times[-10:], time.monotonic()]
        results: list[dict] = []
        try:
            if self.pending and due is not None:  # first what finished since: a failure ends the requests
                got = self.job.eval_poll()
                results, self.pending = got["done"], got["busy"]
                self.on = self.on and not any(r.get("error") for r in results)
            if due is not None:
                self._request(due, steps)
            if self.pending:
                got = self.job.eval_poll()
                results, self.pending = results + got["done"], got["busy"]
            if m["step"] == steps and self.pending:  # (no wait: the final evaluation measures a later version)
                self.n["abandoned"], self.pending = self.n["abandoned"] + 1, False
        except Exception as e:  # (the evaluator's process is gone, or does not answer)
            results = [{"error": one_line(e)}]
        for r in results:
            if r.get("error"):
                self.n["failed"], self.on, self.pending = self.n["failed"] + 1, False, False
                print(f"asyncflow: held-out evaluation failed: {r['error']}; no more periodic evaluations this run",
                      file=sys.stderr, flush=True)
            else:
                self.done.append(r)
                m.update(heldout_acc=r["heldout_acc"], heldout_version=r["version"], heldout_eval_s=r["eval_s"])

    def _request(self, due: int, steps: int) -> None:
        self.n["due"] += 1
        t = self._times
        step_s = (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0
        try:
            ready = self.job.evaluator_ready()
        except Exception:  # (it could not be built: beside() says so in one line at the next step)
            ready = False
        if not self.on:
            self.n["off"] += 1
        elif not ready:
            self.n["not_ready"] += 1
        elif self.done and step_s and self.done[-1]["eval_s"] > (steps - due) * step_s:
            self.n["superseded"] += 1  # (it would finish after the last step)
        else:
            self.pending = self.job.eval_request(due) or self.pending

    def summary(self) -> dict:
        try:
            counts = self.job.eval_counts() if not self.build_error and self.job.evaluator_ready() else {}
        except Exception:
            counts = {}
        return {"beside_training": not self.build_error, "requested": 0, "skipped": 0, "late": 0, **counts,
                **self.n, "done": len(self.done),
                "versions": [[r["version"], r["heldout_acc"], round(r["eval_s"], 3)] for r in self.done]}


def _log_step(m: dict, metric: str, progress: Progress, trackers: Trackers) -> None:
    if "heldout_acc" in m:
        m["heldout_metric"] = metric  # what heldout_acc measures (exact match, accuracy, mean reward, ...)
    trackers.log_metrics(m["step"], m)
    progress.update(m)


def _warn_reward_errors(summary: dict, stats: dict, run_dir: Path) -> None:
    """Rewards that failed: the first few tracebacks to ``reward_errors.log``, one line to stderr."""
    failures = reward_failures(stats)
    log = run_dir / "reward_errors.log" if failures else None
    if log is not None:
        log.write_text("".join(f"--- failure {i + 1} of the first {len(failures)}\n{f}\n"
                               for i, f in enumerate(failures)))
    line = reward_error_line(summary, log)
    if line:
        print(line, file=sys.stderr, flush=True)


def _warn_env_errors(summary: dict, stats: dict, run_dir: Path) -> None:
    """Episodes an environment error ended: the first tracebacks to ``env_errors.log``, one line to stderr."""
    failures = episode_stats(stats).get("env_failures", [])[:KEEP_FAILURES]
    log = run_dir / "env_errors.log" if failures else None
    if log is not None:
        log.write_text("".join(f"--- failure {i + 1} of the first {len(failures)}\n{f}\n"
                               for i, f in enumerate(failures)))
    line = env_error_line(summary, log)
    if line:
        print(line, file=sys.stderr, flush=True)
