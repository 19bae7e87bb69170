"""A running job: the data plane, the weight store and the workers of one mode.

The launcher supplies *where* things run (``data_plane``, ``weight_store``, ``spawn``,
``submit``/``result``/``call``, ``dp_rendezvous``); the job decides *what* runs
(``plan_workers``) and offers the driver its verbs: ``start``, ``submit``/``result`` (or
``step``, both at once), ``evaluate``, ``stats``.

A data-parallel trainer (``train.dp = N``) is N actor workers, ranks ``0 .. N-1``: the job
joins them once (``launcher.dp_rendezvous`` on rank 0, then ``join_dp`` on every rank,
concurrently), and ``submit(v)`` queues ``train_step(v)`` on every rank at once; ``result``
returns rank 0's metrics (data-parallel ``sync``, where each rank trains its own rows: their sums,
:func:`merge_shares`). Rank 0 is *the* trainer for everything else (it evaluates, saves the
checkpoint and publishes weights): the driver's per-step protocol does not change. In
``sync`` the ranks are colocated workers (``colocated``, ``colocated.1``, ...) and ``submit(v)``
queues ``sync_step(v)`` on each. With
``train.strategy=fsdp`` or ``train.tp > 1`` each rank holds a shard, so ``evaluate`` and ``save`` first have
every rank gather the whole weights into rank 0's full copy (``gather_full``). With ``train.tp = T`` the
trainer is ``dp x T`` ranks (:mod:`asyncflow.engines.tensor_parallel`); everything above holds for them.

Evaluation beside training (``Job(..., evaluator=True)``, outside ``sync``): an
:class:`~asyncflow.workflow.evaluator.Evaluator`, an object of the driver's process with either launcher
(it asks for no CPU), takes published weight versions from the weight store. It is built in the
background by a thread of the driver (under Ray beside the workers' builds; in the local launcher's
process after them) within the step timeout; with pinned roles its threads run on every core but the
trainer's (``_evaluator_cores``). Nothing waits for it; ``evaluator_ready`` says whether it is built
yet (and raises its build error, or that it was not built in time). The job's ``eval_request`` /
``eval_poll`` (only once it is ready) answer at once. It is not one of ``workers``: the watchdog's
heartbeat does not ask it, so a failed evaluator ends the evaluations (the driver's one line), not the
run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from asyncflow.config import RunConfig
from asyncflow.workflow.best import BestKeeper
from asyncflow.workflow.checkpoint import Snapshot, merge_ranks, rank_part
from asyncflow.workflow.cores import pinnable_cores
from asyncflow.workflow.evaluator import Evaluator
from asyncflow.workflow.failure import WorkerLost
from asyncflow.workflow.fields import SCHEMA
from asyncflow.workflow.launcher import Launcher
from asyncflow.workflow.plan import plan_workers
from asyncflow.workflow.role_state import split_critic
from asyncflow.workflow.watchdog import HEALTH_TIMEOUT_S, Watchdog
from asyncflow.workflow.worker import Worker

RESUME_TIMEOUT_S = 60.0  # rollout waits this long for the weights the restored trainer republished


class Job:
    def __init__(self, cfg: RunConfig, launcher: Launcher, model_dir: str, evaluator: bool = False,
                 keeper: BestKeeper | None = None):
        self.cfg, self.launcher, self.keeper = cfg, launcher, keeper  # keeper: train.keep_best
        if cfg.resources.device != "cpu":
            launcher.check_device(cfg.resources.device)
        r = cfg.resources
        self.plane = launcher.data_plane(SCHEMA, r.data_plane, r.storage_units, handout_ttl=r.handout_ttl_s,
                                         unit_deadline=r.unit_deadline_s)
        self.weights = launcher.weight_store()
        self.specs = plan_workers(cfg, launcher.cpus, pinnable_cores(cfg, launcher), launcher.gpus)
        self.workers: dict = {}
        self.evaluator: Any = None  # open_evaluator (set once it is built)
        self._eval_lock = threading.Lock()
        self._eval_built = threading.Event()
        self._eval_error: Exception | None = None
        self._eval_deadline = 0.0
        self._closed = False
        self._eval_thread: threading.Thread | None = None
        self.watch = Watchdog(launcher, self.workers, cfg.train.step_timeout_s)  # every wait has a deadline
        try:
            self._launch(model_dir, evaluator)
        except BaseException:
            self.shutdown()  # the workers already built go too
            raise

    def _launch(self, model_dir: str, evaluator: bool) -> None:
        cfg, launcher = self.cfg, self.launcher
        # the evaluator (never waited for): built beside the workers' builds, not in the RL loop; in the
        # local launcher's process after them (its workers load their models here: not thread-safe)
        early = evaluator and not getattr(launcher, "in_process", False)
        if early:
            self.open_evaluator(model_dir)
        for s in self.specs:
            self.workers[s.name] = launcher.spawn(s, Worker, cfg, s.roles, model_dir, self.plane, self.weights,
                                                  s.threads, s.rank, s.cores)
        self.trainer = "colocated" if cfg.mode == "sync" else "actor"
        # the trainer's workers, rank 0 first (sync: the colocated workers, every one an actor rank)
        self.ranks = [s.name for s in sorted(self.specs, key=lambda s: s.rank) if "actor" in s.roles]
        self.watch.waiting("building the workers")
        self.watch.wait_built(self.cfg.train.build_timeout_s)  # (errors surface here)
        if len(self.ranks) > 1:
            rdv = launcher.dp_rendezvous(self.workers[self.ranks[0]], len(self.ranks))
            self._all([launcher.submit(self.workers[n], "join_dp", rdv) for n in self.ranks],
                      "joining the trainer's ranks")
        if evaluator and not early:
            self.open_evaluator(model_dir)

    def start(self) -> None:
        if self.cfg.mode != "sync":
            for name in self.workers:
                if name != self.trainer:
                    self.watch.ask(name, "start")

    def submit(self, v: int, snapshot: bool = False) -> list[Any]:
        """Queue training of version ``v`` on the trainer (it runs after any step queued
        before it: the trainer's one compute thread takes calls in order); a future.
        ``snapshot``: the trainer starts a checkpoint's snapshot right after the step (:meth:`snapshot`)."""
        if self.cfg.mode == "sync":  # every rank generates its share, then all train together
            return [self.launcher.submit(self.workers[n], "sync_step", v, snapshot) for n in self.ranks]
        # the trainer starts fetching step v + 1 as soon as v's rows are in hand
        return [self.launcher.submit(self.workers[n], "train_step", v, v + 1 < self.cfg.train.steps, snapshot)
                for n in self.ranks]

    def result(self, futs: list, v: int) -> dict:
        """Step ``v``'s metrics (rank 0's; PPO: with the critic's); while waiting, check that
        the other workers are alive."""
        every = self._all(futs, f"step {v}")
        out = merge_shares(every) if every[0].pop("dp_share", False) else every[0]
        if "critic" in self.workers:  # PPO: the critic's update on step v runs beside the actor's
            while (m := self.watch.ask("critic", "critic_metrics", v, timeout=HEALTH_TIMEOUT_S)) is None:
                self.watch.beat()
            out.update(m)
        return out

    def step(self, v: int) -> dict:
        return self.result(self.submit(v), v)

    def _all(self, futs: list, what: str = "the trainer's ranks") -> list:
        """Results of ``futs`` (one per trainer rank), raising the first error of any, and
        checking the other workers while waiting (a failed rank must not leave us blocked
        on one that waits for it in a collective). ``what`` they do, for the watchdog's line
        (:mod:`asyncflow.workflow.watchdog`: a dead worker or a stalled step ends the wait)."""
        out, pending = [None] * len(futs), dict(enumerate(futs))
        self.watch.waiting(what)
        while pending:
            for i, fut in list(pending.items()):
                try:
                    out[i] = self.launcher.result(fut, timeout=2.0 if len(pending) == 1 else 0.5)
                    del pending[i]
                except TimeoutError:
                    pass
                except Exception as e:  # named after the rank it came from (a dead process too)
                    raise self._lost_peer(i, e) or self.watch.blame(self.ranks[i], e) from None
            if pending:
                self.watch.beat()
        return out

    def _lost_peer(self, i: int, e: Exception) -> WorkerLost | None:
        """The other rank that is lost, if any, when rank ``i`` raised ``e`` (not a ``WorkerLost``
        itself): a peer killed mid-collective makes the ranks still alive raise (gloo: "Connection
        reset by peer"), and the run must restart from its checkpoint (``WorkerLost`` is
        recoverable), not end with that error. Each peer answers a heartbeat within ``HEALTH_TIMEOUT_S``."""
        if isinstance(e, WorkerLost) or len(self.ranks) == 1:
            return None
        for j, name in enumerate(self.ranks):
            if j != i:
                try:
                    self.watch.ask(name, "health", timeout=HEALTH_TIMEOUT_S)
                except WorkerLost as lost:
                    return lost
                except Exception:  # (a peer's own error: rank i's is the one reported)
                    pass
        return None

    def evaluate(self, n: int | None = None) -> float:
        self._gather()
        self.watch.waiting("evaluating")
        return self.watch.ask(self.trainer, "evaluate", n)

    def open_evaluator(self, model_dir: str) -> None:
        """Start building the evaluator (in this process, no CPU asked) in the background; returns at once."""
        self._eval_deadline = time.monotonic() + self.cfg.train.step_timeout_s
        self._eval_thread = threading.Thread(target=self._build_evaluator, args=(model_dir,), name="evaluator-spawn",
                                             daemon=True)
        self._eval_thread.start()

    def _build_evaluator(self, model_dir: str) -> None:
        handle: Evaluator | None = None
        try:  # (an object of this process, with either launcher: asyncflow.workflow.evaluator says why)
            handle = Evaluator(self.cfg, model_dir, self.weights, HEALTH_TIMEOUT_S * 6, self._evaluator_cores(),
                               self.keeper)
            handle.health()
        except Exception as e:
            self._eval_error = self.watch.blame("evaluator", e, "health")
        with self._eval_lock:  # (a job shut down meanwhile, or a failed build: stop it here)
            keep = self._eval_error is None and not self._closed
            if keep:
                self.evaluator = handle
        if handle is not None and not keep:
            handle.stop()
        self._eval_built.set()

    def _evaluator_cores(self) -> tuple[int, ...]:
        """Where the evaluator computes when roles are pinned: the cores of every pinned worker but
        the trainer's ranks (rollout's, which waits for weights part of each step); () if none."""
        return tuple(sorted({c for s in self.specs if "actor" not in s.roles for c in s.cores}))

    def evaluator_ready(self) -> bool:
        """Whether the evaluator is built (False while it is being built); raises why it cannot be
        (its build's error, or that it was not built within ``train.step_timeout_s``)."""
        if not self._eval_built.is_set():
            if time.monotonic() < self._eval_deadline:
                return False
            self._eval_error = self._eval_error or TimeoutError(
                f"worker 'evaluator' was not built within train.step_timeout_s = {self.cfg.train.step_timeout_s:g} s")
        if self._eval_error is not None:
            raise self._eval_error
        return True

    def _ask_evaluator(self, method: str, *args: Any) -> Any:
        """A call of the evaluator (in this process: it answers at once, under its lock)."""
        try:
            return getattr(self.evaluator, method)(*args)
        except Exception as e:
            raise self.watch.blame("evaluator", e, method) from None

    def eval_request(self, version: int) -> bool:
        """Have the evaluator measure weight ``version`` beside training; False if one was running (skipped)."""
        return bool(self._ask_evaluator("request", version))

    def eval_poll(self) -> dict:
        """The evaluator's results finished since the last poll, and whether one runs (``Evaluator.poll``)."""
        return self._ask_evaluator("poll")

    def eval_counts(self) -> dict[str, int]:
        return self._ask_evaluator("counts")

    def save(self, path: str) -> str:
        self._gather()
        self.watch.waiting("saving")
        return self.watch.ask(self.trainer, "save", path)

    def snapshot(self, done: int) -> Callable[[], Snapshot]:
        """Ask for the checkpoint of ``done`` steps (step ``done - 1`` was submitted with ``snapshot``
        and returned); a call that returns it (:mod:`asyncflow.workflow.checkpoint`), for the
        checkpoint writer's thread: the trainer's state, rank 0's whole and the other ranks' RNGs
        and versions (FSDP: and their shards), copied to host memory beside the next step
        (:mod:`asyncflow.workflow.hostcopy`); not ``sync``: also rollout's groups not trained once ``done`` steps are
        (:mod:`asyncflow.workflow.rollout.inflight`: tensors ``rollout/...``, JSON ``rollout``), asked now
        and taken by rollout's loop meanwhile (any time before step ``done`` is trained is
        consistent with the trainer's state); and PPO's critic worker's, which it took itself right
        after its update of step ``done - 1`` (before that step's metrics, which :meth:`result` waited
        for), copied beside its next step (tensors and JSON ``critic``:
        :func:`~asyncflow.workflow.role_state.critic_parts`). Nothing here waits: the next step runs meanwhile."""
        asked = {n: self.launcher.submit(self.workers[n], "rollout_snapshot", RESUME_TIMEOUT_S, done)
                 for n in (self._rollouts() if self.cfg.mode != "sync" else [])}
        copy_wait = self.cfg.train.step_timeout_s
        copies = {n: self.launcher.submit(self.workers[n], "taken_snapshot", done, copy_wait) for n in self.ranks}
        critic = {n: self.launcher.submit(self.workers[n], "taken_snapshot", done, copy_wait)
                  for n in (["critic"] if "critic" in self.workers else [])}  # (stream/async PPO)
        wait = RESUME_TIMEOUT_S + 15  # (after rollout's own deadline: its error, not our timeout, names a cause)

        def collect() -> Snapshot:
            snaps = [self._answer(n, fut, "taken_snapshot", copy_wait + 15) for n, fut in copies.items()]
            tensors, meta = merge_ranks(snaps)
            for n, fut in critic.items():
                ct, cm = self._answer(n, fut, "taken_snapshot", copy_wait + 15)
                tensors.update(ct)
                meta.update(cm)
            for n, fut in asked.items():
                rt, meta["rollout"] = self._answer(n, fut, "rollout_snapshot", wait)
                tensors.update(rt)
            return tensors, meta

        return collect

    def _answer(self, name: str, fut: Any, method: str, wait: float) -> Any:
        """A snapshot's answer within ``wait`` s; waits in short slices so that a job shutting down
        (a failed run) ends the writer's wait at once instead of holding the exit for ``wait``."""
        until = time.monotonic() + wait
        while True:
            try:
                return self.launcher.result(fut, min(1.0, max(until - time.monotonic(), 0.0)))
            except TimeoutError as e:
                if self._closed:
                    raise WorkerLost(f"the job shut down before worker '{name}' answered {method}()") from None
                if time.monotonic() >= until:
                    raise self.watch.blame(name, e, method, wait) from None
            except Exception as e:
                raise self.watch.blame(name, e, method, wait) from None

    def restore(self, snap: Snapshot, step: int) -> list[int]:
        """Put the trainer's snapshot back (``stream``/``async``: it republishes its weights; PPO's
        critic worker's first), then (not ``sync``) have rollout take them, continue the groups in
        flight that may, and go on from partition ``step``; the continued groups' prompt ids (``sync``:
        rollout's stalled and waiting groups, put back as they were: they keep their prompt slots)."""
        self.watch.waiting("restoring the checkpoint")
        if "critic" in self.workers:  # stream/async PPO: the critic's worker (first: the actor's RNGs last)
            critic, snap = split_critic(snap)
            self.watch.ask("critic", "restore", critic, step)
        # every rank at once (FSDP: the restored trainer's export is an all-gather of them all)
        kept = self._all([self.launcher.submit(self.workers[n], "restore", rank_part(snap, i), step)
                          for i, n in enumerate(self.ranks)], "restoring the checkpoint")
        continued: list[int] = [g for ids in kept for g in ids or ()]
        if self.cfg.mode != "sync":
            tensors, meta = snap
            saved = ({k: v for k, v in tensors.items() if k.startswith("rollout/")}, meta["rollout"]) \
                if "rollout" in meta else None
            for n in self._rollouts():
                continued += self.watch.ask(n, "resume_rollout", step, meta["version"], RESUME_TIMEOUT_S, saved)
        return continued

    def _rollouts(self) -> list[str]:
        return [s.name for s in self.specs if "rollout" in s.roles]

    def in_flight(self, done: int, meta: dict | None = None) -> int:
        """Answers started beyond the groups of ``done`` steps (started, not trained: a resume from
        a checkpoint taken now continues or restarts them), as of the snapshot ``meta`` (else now); 0 in ``sync``."""
        if self.cfg.mode == "sync":
            return 0
        started = meta["rollout"]["started"] if meta and "rollout" in meta else \
            sum(self.watch.ask(n, "groups_started") for n in self._rollouts())
        return max(0, started - done * self.cfg.train.prompts_per_step) * self.cfg.rollout.group_size

    def _gather(self) -> None:
        """FSDP, TP: rank 0's parameters are a shard; gather whole ones (every rank at once) first."""
        if len(self.ranks) > 1 and (self.cfg.train.strategy == "fsdp" or self.cfg.train.tp > 1):
            self._all([self.launcher.submit(self.workers[n], "gather_full") for n in self.ranks])

    def stats(self) -> dict:
        out: dict = {}
        for name in self.workers:
            out.update(self.watch.ask(name, "stats"))
        return out

    def pinned(self) -> dict[str, list[int]]:
        """The cores each pinned worker's compute thread may run on (asked of the worker)."""
        return {s.name: self.watch.ask(s.name, "affinity") for s in self.specs if s.cores}

    def spans(self) -> dict:
        out: dict = {}
        for name in self.workers:
            out.update(self.watch.ask(name, "spans"))
        if self.evaluator is not None:
            try:
                out.update(self._ask_evaluator("spans"))
            except Exception:  # (a lost evaluator was told in one line already; its track is left out)
                pass
        return out

    def shutdown(self) -> None:
        with self._eval_lock:  # (an evaluator still being built is released by its builder)
            self._closed = True
        if self._eval_thread is not None:
            self._eval_thread.join(5.0)
        stops = {}  # every worker stops at once, within one deadline (one stuck on a dead server does not add up)
        for name, w in self.workers.items():
            try:
                stops[name] = self.launcher.submit(w, "stop")
            except Exception:
                pass
        until = time.monotonic() + HEALTH_TIMEOUT_S
        for fut in stops.values():
            try:
                self.launcher.result(fut, max(until - time.monotonic(), 0.1))
            except Exception:
                pass
        if self.evaluator is not None:  # (it never waits for an evaluation in flight)
            try:
                self._ask_evaluator("stop")
            except Exception:
                pass
        lost = getattr(self.launcher, "plane_lost", None)
        if lost is None or lost() is None:  # (a dead controller would hold close() for the client's deadline)
            try:
                self.plane.close()
            except Exception:
                pass
        for obj in [*self.workers.values(), self.plane, self.weights]:
            self.launcher.release(obj)


def merge_shares(ranks: list[dict]) -> dict:
    """One step's metrics from every data-parallel rank's own rows (``dp_share``): samples and
    tokens summed, reward and response length weighted by samples, the groups' union, the
    worst staleness; the rest (loss, optimizer) rank 0's."""
    out = dict(ranks[0])
    n = sum(m["samples"] for m in ranks)
    out.update(samples=n, tokens=sum(m["tokens"] for m in ranks),
               reward=sum(m["reward"] * m["samples"] for m in ranks) / max(n, 1),
               response_len=sum(m["response_len"] * m["samples"] for m in ranks) / max(n, 1),
               max_staleness=max(m["max_staleness"] for m in ranks),
               groups=sorted(g for m in ranks for g in m["groups"]))
    for m in ranks[1:]:
        m.pop("dp_share", None)
    return out
