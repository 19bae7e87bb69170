"""A running job: the data plane, the weight store and the workers of one mode.

The launcher supplies *where* things run (``data_plane``, ``weight_store``, ``spawn``,
``submit``/``result``/``call``, ``dp_rendezvous``); the job decides *what* runs
(``plan_workers``) and offers the driver its verbs: ``start``, ``submit``/``result`` (or
``step``, both at once), ``evaluate``, ``stats``.

A data-parallel trainer (``train.dp = N``) is N actor workers, ranks ``0 .. N-1``: the job
joins them once (``launcher.dp_rendezvous`` on rank 0, then ``join_dp`` on every rank,
concurrently), and ``submit(v)`` queues ``train_step(v)`` on every rank at once; ``result``
returns rank 0's metrics. Rank 0 is *the* trainer for everything else (it evaluates, saves the
checkpoint and publishes weights): the driver's per-step protocol does not change. In
``sync`` the ranks are colocated workers (``colocated``, ``colocated.1``, ...) and ``submit(v)``
queues ``sync_step(v)`` on each. With
``train.strategy=fsdp`` each rank holds a shard, so ``evaluate`` and ``save`` first have
every rank gather the whole weights into rank 0's full copy (``gather_full``).
"""

from __future__ import annotations

from typing import Any

from asyncflow.config import RunConfig
from asyncflow.workflow.cores import pinnable_cores
from asyncflow.workflow.fields import SCHEMA
from asyncflow.workflow.launcher import Launcher
from asyncflow.workflow.plan import plan_workers
from asyncflow.workflow.worker import Worker


class Job:
    def __init__(self, cfg: RunConfig, launcher: Launcher, model_dir: str):
        self.cfg, self.launcher = cfg, launcher
        if cfg.resources.device != "cpu":
            launcher.check_device(cfg.resources.device)
        self.plane = launcher.data_plane(SCHEMA, cfg.resources.data_plane, cfg.resources.storage_units)
        self.weights = launcher.weight_store()
        self.specs = plan_workers(cfg, launcher.cpus, pinnable_cores(cfg, launcher), launcher.gpus)
        self.workers = {s.name: launcher.spawn(s, Worker, cfg, s.roles, model_dir, self.plane, self.weights, s.threads,
                                               s.rank, s.cores) for s in self.specs}
        self.trainer = "colocated" if cfg.mode == "sync" else "actor"
        # the trainer's workers, rank 0 first (sync: the colocated workers, every one an actor rank)
        self.ranks = [s.name for s in sorted(self.specs, key=lambda s: s.rank) if "actor" in s.roles]
        for name in self.workers:  # wait for every worker to be built (errors surface here)
            launcher.call(self.workers[name], "health")
        if len(self.ranks) > 1:
            rdv = launcher.dp_rendezvous(self.workers[self.ranks[0]], len(self.ranks))
            self._all([launcher.submit(self.workers[n], "join_dp", rdv) for n in self.ranks])

    def start(self) -> None:
        if self.cfg.mode != "sync":
            for name, w in self.workers.items():
                if name != self.trainer:
                    self.launcher.call(w, "start")

    def submit(self, v: int) -> list[Any]:
        """Queue training of version ``v`` on the trainer (it runs after any step queued
        before it: the trainer's one compute thread takes calls in order); a future."""
        if self.cfg.mode == "sync":  # every rank generates its share, then all train together
            return [self.launcher.submit(self.workers[n], "sync_step", v) for n in self.ranks]
        # the trainer starts fetching step v + 1 as soon as v's rows are in hand
        return [self.launcher.submit(self.workers[n], "train_step", v, v + 1 < self.cfg.train.steps)
                for n in self.ranks]

    def result(self, futs: list, v: int) -> dict:
        """Step ``v``'s metrics (rank 0's; PPO: with the critic's); while waiting, check that
        the other workers are alive."""
        out = self._all(futs)[0]
        if "critic" in self.workers:  # PPO: the critic's update on step v runs beside the actor's
            while (m := self.launcher.call(self.workers["critic"], "critic_metrics", v)) is None:
                self._health()
            out.update(m)
        return out

    def step(self, v: int) -> dict:
        return self.result(self.submit(v), v)

    def _all(self, futs: list) -> list:
        """Results of ``futs`` (one per trainer rank), raising the first error of any, and
        checking the other workers while waiting (a failed rank must not leave us blocked
        on one that waits for it in a collective)."""
        out, pending = [None] * len(futs), dict(enumerate(futs))
        while pending:
            for i, fut in list(pending.items()):
                try:
                    out[i] = self.launcher.result(fut, timeout=2.0 if len(pending) == 1 else 0.5)
                    del pending[i]
                except TimeoutError:
                    pass
            if pending:
                self._health()
        return out

    def _health(self) -> None:
        for name, w in self.workers.items():
            if name not in self.ranks:
                self.launcher.call(w, "health")

    def evaluate(self, n: int | None = None) -> float:
        self._gather()
        return self.launcher.call(self.workers[self.trainer], "evaluate", n)

    def save(self, path: str) -> str:
        self._gather()
        return self.launcher.call(self.workers[self.trainer], "save", path)

    def _gather(self) -> None:
        """FSDP: rank 0's parameters are a shard; gather whole ones (every rank at once) first."""
        if len(self.ranks) > 1 and self.cfg.train.strategy == "fsdp":
            self._all([self.launcher.submit(self.workers[n], "gather_full") for n in self.ranks])

    def stats(self) -> dict:
        out: dict = {}
        for w in self.workers.values():
            out.update(self.launcher.call(w, "stats"))
        return out

    def pinned(self) -> dict[str, list[int]]:
        """The cores each pinned worker's compute thread may run on (asked of the worker)."""
        return {s.name: self.launcher.call(self.workers[s.name], "affinity") for s in self.specs if s.cores}

    def spans(self) -> dict:
        out: dict = {}
        for w in self.workers.values():
            out.update(self.launcher.call(w, "spans"))
        return out

    def shutdown(self) -> None:
        for w in self.workers.values():
            try:
                self.launcher.call(w, "stop")
            except Exception:
                pass
        try:
            self.plane.close()
        except Exception:
            pass
        for obj in [*self.workers.values(), self.plane, self.weights]:
            self.launcher.release(obj)
