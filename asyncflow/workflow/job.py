"""A running job: the data plane, the weight store and the workers of one mode.

The launcher supplies *where* things run (``data_plane``, ``weight_store``, ``spawn``,
``submit``/``result``/``call``); the job decides *what* runs (``plan_workers``) and offers
the driver its verbs: ``start``, ``submit``/``result`` (or ``step``, both at once),
``evaluate``, ``stats``.
"""

from __future__ import annotations

from asyncflow.config import RunConfig
from asyncflow.workflow.fields import SCHEMA
from asyncflow.workflow.worker import Worker, plan_workers


class Job:
    def __init__(self, cfg: RunConfig, launcher, model_dir: str):
        self.cfg, self.launcher = cfg, launcher
        self.dp = launcher.data_plane(SCHEMA, cfg.resources.data_plane, cfg.resources.storage_units)
        self.weights = launcher.weight_store()
        self.specs = plan_workers(cfg, launcher.cpus)
        self.workers = {s.name: launcher.spawn(s, Worker, cfg, s.roles, model_dir, self.dp, self.weights, s.threads)
                        for s in self.specs}
        self.trainer = "colocated" if cfg.mode == "sync" else "actor"
        for name in self.workers:  # wait for every worker to be built (errors surface here)
            launcher.call(self.workers[name], "health")

    def start(self) -> None:
        if self.cfg.mode != "sync":
            for name, w in self.workers.items():
                if name != self.trainer:
                    self.launcher.call(w, "start")

    def submit(self, v: int):
        """Queue training of version ``v`` on the trainer (it runs after any step queued
        before it: the trainer's one compute thread takes calls in order); a future."""
        if self.cfg.mode == "sync":
            return self.launcher.submit(self.workers[self.trainer], "sync_step", v)
        # the trainer starts fetching step v + 1 as soon as v's rows are in hand
        return self.launcher.submit(self.workers[self.trainer], "train_step", v, v + 1 < self.cfg.train.steps)

    def result(self, fut, v: int) -> dict:
        """Step ``v``'s metrics (PPO: with the critic's); while waiting, check that the other
        workers are alive."""
        while True:
            try:
                out = self.launcher.result(fut, timeout=2.0)
                break
            except TimeoutError:
                self._health()
        if "critic" in self.workers:  # PPO: the critic's update on step v runs beside the actor's
            while (m := self.launcher.call(self.workers["critic"], "critic_metrics", v)) is None:
                self._health()
            out.update(m)
        return out

    def step(self, v: int) -> dict:
        return self.result(self.submit(v), v)

    def _health(self) -> None:
        for name, w in self.workers.items():
            if name != self.trainer:
                self.launcher.call(w, "health")

    def evaluate(self, n: int | None = None) -> float:
        return self.launcher.call(self.workers[self.trainer], "evaluate", n)

    def save(self, path: str) -> str:
        return self.launcher.call(self.workers[self.trainer], "save", path)

    def stats(self) -> dict:
        out: dict = {}
        for w in self.workers.values():
            out.update(self.launcher.call(w, "stats"))
        return out

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
            self.dp.close()
        except Exception:
            pass
        for obj in [*self.workers.values(), self.dp, self.weights]:
            self.launcher.release(obj)
