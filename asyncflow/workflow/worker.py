"""Worker: hosts one or more roles in one process (a thread, or a Ray actor via the launcher).

A worker is built from picklable inputs only (config, role names, model folder, data-plane
and weight-store clients), so the Ray launcher can construct it inside a fresh process:
``ray.remote(Worker)`` is applied there, never here.

Which workers a mode runs and what each hosts: :mod:`asyncflow.workflow.plan`. How each
role is built from the worker's model, tokenizer and task: :mod:`asyncflow.workflow.builders`.
A data-parallel trainer (``train.dp = N``) is joined by the job (``dp_address`` on rank 0,
then ``join_dp`` on every rank) before the first step; the actor is built on the group then
(in ``sync`` every rank is a whole colocated worker: ``sync_step`` runs on all at once).
Core pinning (``resources.pin_cores``): :mod:`asyncflow.workflow.cores`.
"""

from __future__ import annotations

import copy
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch
from transformers import PreTrainedModel

from asyncflow.config import RunConfig
from asyncflow.dataplane.api import DataPlaneClient
from asyncflow.engines.allocator import keep_heap
from asyncflow.engines.collective import Collective, ThreadRendezvous, TorchGroup, free_address, full_buckets, join
from asyncflow.engines.device import resolve_device
from asyncflow.engines.lora import attach, save_adapter, save_merged
from asyncflow.tasks.environments import heldout_episodes
from asyncflow.tasks.models import load_model
from asyncflow.tasks.registry import build_task, heldout_metric
from asyncflow.tasks.warmstart import evaluate
from asyncflow.weights.store import WeightSource
from asyncflow.workflow.builders import BUILD_ORDER, BUILDERS, RoleContext, link_local, lora_spec
from asyncflow.workflow.checkpoint import Snapshot, checkpoint_due
from asyncflow.workflow.cores import pin_thread, run_pinned
from asyncflow.workflow.failure import tag
from asyncflow.workflow.hostcopy import HostCopy
from asyncflow.workflow.plan import trainer_ranks
from asyncflow.workflow.role_state import critic_parts, restore_roles, snapshot_parts, snapshot_roles

_T = TypeVar("_T")


class Worker:
    """Roles of one process; the launcher calls its methods (directly or as a Ray actor)."""

    def __init__(self, cfg: RunConfig, roles: list[str], model_dir: str, plane: DataPlaneClient,
                 weights: WeightSource | None, threads: int, rank: int = 0, cores: tuple[int, ...] = ()):
        base = "colocated" if len(roles) > 1 else roles[0]
        self.name = f"{base}.{rank}" if rank else base  # as in plan.py
        self.cores = tuple(cores)  # the compute thread and the role loops run here (see pin_thread)
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="compute", initializer=pin_thread,
                                           initargs=(self.cores,))
        self._order = threading.Condition()  # steps enter the compute queue in order (see _in_order)
        self._expect = 0
        self.cfg, self.plane, self.rank = cfg, plane, rank
        # Role subclasses by name (builders.BUILDERS): the worker calls each kind's own methods
        self.roles: dict[str, Any] = {}
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._full: PreTrainedModel | None = None  # FSDP, TP: rank 0's gathered copy of the whole weights
        self.ctx: RoleContext | None = None
        self.started = time.perf_counter()
        self._copies: dict[int, HostCopy] = {}  # checkpoint snapshots by steps done (see train_step)
        self._episodes: Callable | None = None  # multi-turn: the held-out episodes (tasks.environments)
        # an error while building is kept and raised by health(): under Ray a constructor's
        # error would kill the actor and reach the driver as an ActorDiedError without its cause
        self._init_error: BaseException | None = None
        try:
            self._build(list(roles), model_dir, weights, threads)
        except Exception as e:
            self._init_error = tag(e, f"worker '{self.name}' (building {', '.join(roles)})")

    def _context(self) -> RoleContext:
        """What the role builders got (raises the building error if the worker could not be built)."""
        if self.ctx is None:
            raise self._init_error or RuntimeError(f"worker '{self.name}' is not built")
        return self.ctx

    def _build(self, roles: list[str], model_dir: str, weights: WeightSource | None, threads: int) -> None:
        cfg = self.cfg
        torch.set_num_threads(threads)
        keep_heap()  # no page faults per step (they were ~10% of a solo trainer step)
        torch.manual_seed(cfg.seed)
        self.model, self.tokenizer = load_model(model_dir)
        # every engine below computes where its model is (transformers' functools.wraps on
        # PreTrainedModel.to loses the self binding in its type)
        self.model.to(resolve_device(cfg.resources.device))  # type: ignore[arg-type]
        self.task = build_task(cfg)
        lora = lora_spec(cfg) if "actor" in roles else None  # (the policy's adapters live with its trainer)
        self.ctx = RoleContext(cfg, self.plane, weights, self.model, self.tokenizer, self.task, model_dir, roles,
                               self.rank, peft=attach(self.model, lora) if lora is not None else None)
        for name in BUILD_ORDER:
            if name in roles and not (name == "actor" and trainer_ranks(cfg) > 1):  # several ranks: built by join_dp
                self.roles[name] = BUILDERS[name](self.ctx)
        link_local(cfg, self.roles)
        if roles == ["critic"]:  # stream/async PPO: the critic snapshots itself at each due step's update
            self.roles["critic"].on_update = self._critic_updated

    @property
    def group(self) -> Collective | None:
        return self.ctx.group if self.ctx is not None else None

    def _build_actor(self) -> None:
        """The actor role on the joined group (FSDP, TP: rank 0 also keeps a whole copy)."""
        t = self.cfg.train
        if t.tp > 1 or (t.dp > 1 and t.strategy == "fsdp"):
            if not isinstance(self.group, TorchGroup):
                raise ValueError(f"train.{'tp' if t.tp > 1 else 'strategy=fsdp'} needs the trainer's ranks as "
                                 "processes (torch.distributed): set launcher=ray")
            if self.rank == 0:  # rank 0 evaluates and saves this gathered copy (gather_full)
                self._full = copy.deepcopy(self.model)
        self.roles["actor"] = BUILDERS["actor"](self._context())
        link_local(self.cfg, self.roles)

    # ------------------------------------------------------------------ data-parallel trainer
    def dp_address(self) -> str:
        """Rank 0: a ``tcp://`` rendezvous address with a free port on this machine."""
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = "127.0.0.1"
        return free_address(host)

    def join_dp(self, rendezvous: str | ThreadRendezvous) -> None:
        """Join the trainer's ``train.dp x train.tp`` ranks (blocks until every rank joins), then build
        the actor role on the group. ``rendezvous``: a ``tcp://`` address (processes) or a
        :class:`~asyncflow.engines.collective.ThreadRendezvous` (threads of this process)."""
        def build() -> None:
            self._context().group = join(rendezvous, self.rank, trainer_ranks(self.cfg))
            self._build_actor()

        self._on_compute(build)

    def _whole(self) -> PreTrainedModel:
        """The model with whole weights: the trainer's own, or (FSDP) the gathered copy."""
        return self._full if self._full is not None else self.model

    def gather_full(self) -> None:
        """``train.strategy=fsdp``, ``train.tp > 1``: every rank calls this at once; rank 0's ``_full``
        copy then holds the whole current weights (what ``evaluate`` and ``save`` use), gathered
        bucket by bucket."""
        @torch.no_grad()
        def gather() -> None:
            whole = dict(self._full.named_parameters()) if self._full is not None else {}  # (rank 0)
            for bucket in full_buckets(self.roles["actor"].engine.model):  # all-gathers: every rank joins
                for name, w in bucket.items() if whole else ():
                    whole[name].copy_(torch.from_numpy(w))

        self._on_compute(gather)

    # ------------------------------------------------------------------ stream / async
    def start(self) -> None:
        """Run every non-actor role's poll loop in its own thread."""
        self.started = time.perf_counter()
        for name, role in self.roles.items():
            if name == "actor":
                continue
            th = threading.Thread(target=run_pinned, args=(self.cores, role.run, self._stop), name=name, daemon=True)
            th.start()
            self._threads.append(th)

    def affinity(self) -> list[int]:
        """The cores this worker's compute thread may run on."""
        return self._on_compute(lambda: sorted(os.sched_getaffinity(0)))

    def _on_compute(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn`` on this worker's one compute thread.

        Callers arrive on any thread (a Ray actor serves calls from a thread pool; the local
        launcher from its own pool). Each thread that runs multi-threaded torch ops gets its
        own OpenMP team, and idle teams spinning beside the busy one cost a measured ~60%
        of a colocated step on 2 cores; one compute thread keeps one team.
        """
        try:
            return self._compute.submit(fn, *args).result()
        except Exception as e:
            tag(e, f"worker '{self.name}' in {getattr(fn, '__name__', 'a call')}")
            raise

    def _in_order(self, v: int, fn: Callable[..., _T], *args: Any) -> _T:
        """Run step ``v`` on the compute thread after step ``v - 1``, whatever order the calls
        arrive in: the driver queues step ``v + 1`` before ``v`` returns, and a Ray actor that
        serves calls on several threads does not keep their order."""
        with self._order:
            if not self._order.wait_for(lambda: self._expect == v, timeout=600):
                raise RuntimeError(f"step {v} called but step {self._expect} never came: steps must be consecutive")
            fut = self._compute.submit(fn, *args)
            self._expect = v + 1
            self._order.notify_all()
        try:
            return fut.result()
        except Exception as e:
            tag(e, f"worker '{self.name}' at step {v}")
            raise

    def train_step(self, v: int, prefetch_next: bool = False, snapshot: bool = False) -> dict:
        """Train version ``v``; ``snapshot``: then start the checkpoint's snapshot of the state after
        it (:meth:`taken_snapshot`), copied beside the next step (:mod:`asyncflow.workflow.hostcopy`)."""
        return self._in_order(v, self._then_snapshot, snapshot, self.roles["actor"].train_step, v, prefetch_next)

    def _then_snapshot(self, snapshot: bool, fn: Callable[..., dict], v: int, *args: Any) -> dict:
        out = fn(v, *args)
        if snapshot:  # (the compute thread, at the boundary: nothing runs between the step and this)
            # (rank 0 saves the weights and AdamW's state; FSDP: every rank its own shards)
            full = self.rank == 0 or getattr(self.roles["actor"].engine, "gathers", False)
            live, snap, engines = snapshot_parts(self.model, self.roles, full)
            self._copies[v + 1] = HostCopy(live, snap, engines, self.cfg.train.step_timeout_s)
        return out

    def _critic_updated(self, v: int) -> None:
        """(The critic's thread, right after its update of step ``v``.) The snapshot of the critic after
        ``v + 1`` steps when a checkpoint is due then, copied beside its next step (:meth:`taken_snapshot`)."""
        if checkpoint_due(self.cfg, v + 1):
            live, snap, engines = critic_parts(self.roles["critic"])
            self._copies[v + 1] = HostCopy(live, snap, engines, self.cfg.train.step_timeout_s)

    def taken_snapshot(self, done: int, timeout: float) -> Snapshot:
        """The snapshot started once step ``done - 1`` was trained (``train_step``/``sync_step`` with
        ``snapshot``; PPO's critic worker: by its update of that step), once copied (within ``timeout``;
        not the compute thread: the next step runs)."""
        copy = self._copies.pop(done, None)
        if copy is None:
            raise RuntimeError(f"worker '{self.name}' took no checkpoint snapshot after {done} steps")
        return copy.result(timeout)

    def critic_metrics(self, v: int, timeout: float = 2.0) -> dict | None:
        """The critic's metrics of step ``v`` once its update is done (None if not within ``timeout``)."""
        return self.roles["critic"].wait_step(v, timeout)

    # ------------------------------------------------------------------ sync (colocated)
    def sync_step(self, v: int, snapshot: bool = False) -> dict:
        """One colocated step: generate all, score all, reference all, value all and update the
        critic (PPO), train, sync weights (``snapshot``: as in :meth:`train_step`)."""
        return self._in_order(v, self._then_snapshot, snapshot, self._sync_step, v)

    def _sync_step(self, v: int) -> dict:
        """(Data-parallel: this rank generates, scores and references its share of the step's
        rows, PPO's critic on rank 0 values all of them; then every rank trains together.)"""
        roles = self.roles
        mine = roles["rollout"].batch_rows  # this rank's rows of a step (all of them when it is alone)
        while roles["rollout"].state.produced[v] < mine:
            roles["rollout"].poll(0.05)
        for name in ("reward", "reference", "critic"):
            share = self.cfg.batch_size if name == "critic" else mine
            if name in roles:
                while roles[name].items < (v + 1) * share:  # rows the role has produced once step v is done
                    roles[name].poll(0.05)
        out = roles["actor"].train_step(v)
        if "critic" in roles:  # valued by critic version v, updated on step v before the actor's step
            out.update(roles["critic"].wait_step(v, 0))
        roles["rollout"].set_version(v + 1)
        return out

    # ------------------------------------------------------------------ common
    def evaluate(self, n: int | None = None) -> float:
        problems = self.task.heldout[: n or self.cfg.task.eval_n]
        if self.cfg.env.enabled:  # (multi-turn: greedy episodes)
            if self._episodes is None:
                self._episodes = heldout_episodes(self.cfg, self.task, self.reward_fn)[1]
            return self._on_compute(self._episodes, self._whole(), self.tokenizer, problems)
        _, score = heldout_metric(self.cfg, self.task, self.reward_fn)  # (None: exact match)
        return self._on_compute(evaluate, self._whole(), self.tokenizer, problems, 512, self.task.greedy_eval_tokens,
                                score, self.cfg.task.chat_template)

    def reward_fn(self) -> Callable:
        """The task's reward, or ``reward.fn`` wrapped with its timeout, error score and counters."""
        return self._context().reward_fn()

    def save(self, path: str) -> str:
        """The model folder at ``path`` with the tokenizer; with ``model.lora`` a PEFT adapter folder
        there (and with ``model.lora.merged`` the merged model in ``path/merged``)."""
        def save() -> str:
            peft = self._context().peft
            if peft is None:
                self._whole().save_pretrained(path)
            else:
                save_adapter(peft, path)
                if self.cfg.model.lora.merged:
                    save_merged(peft, os.path.join(path, "merged"))
                    self.tokenizer.save_pretrained(os.path.join(path, "merged"))
            self.tokenizer.save_pretrained(path)
            return path

        return self._on_compute(save)

    def snapshot(self, full: bool = True) -> Snapshot:
        """A host copy of the trainer's state at a step boundary (mode=sync; :mod:`asyncflow.workflow.checkpoint`;
        not ``full``: a data-parallel rank's RNGs and versions only)."""
        return self._on_compute(snapshot_roles, self.model, self.roles, full)

    def restore(self, snap: Snapshot, step: int) -> list[int]:
        """Put a :meth:`snapshot` taken after ``step`` steps back; the next call is ``sync_step(step)``.
        ``sync``: the prompt ids of the groups rollout put back (stalled or waiting; :func:`restore_roles`)."""
        kept = self._on_compute(restore_roles, self.model, self.roles, snap, step)
        self._expect = step
        return kept

    def resume_rollout(self, step: int, version: int, timeout: float, saved: Snapshot | None = None) -> list[int]:
        """``stream``/``async`` resume: rollout takes the restored weights, continues the ``saved``
        groups in flight that may, then goes on from partition ``step``; the continued group ids
        (:meth:`RolloutRole.resume <asyncflow.workflow.rollout.RolloutRole.resume>`)."""
        return self.roles["rollout"].resume(step, version, timeout, saved)

    def rollout_snapshot(self, timeout: float, done: int) -> Snapshot:
        """Rollout's groups not trained once ``done`` steps are (:mod:`asyncflow.workflow.rollout.inflight`)."""
        try:
            return self.roles["rollout"].snapshot_in_flight(timeout, done)
        except Exception as e:
            tag(e, f"role 'rollout' on worker '{self.name}'")
            raise

    def groups_started(self) -> int:
        """Prompt groups rollout has started and not dropped (admitted; the in-flight count of a checkpoint)."""
        placer = self.roles["rollout"].placer
        return placer.started - placer.dropped

    def health(self) -> dict[str, dict]:
        """Raise the error of building this worker, or the first of a background role, if any
        (tagged with where it happened: :mod:`asyncflow.workflow.failure`). Else a heartbeat:
        per role, its progress (``items``: rows done, and rollout's decode steps) and the
        seconds it has been in its current call (``stuck_s``)."""
        if self._init_error is not None:
            raise self._init_error
        roles = list(self.roles.items())  # (join_dp may add the actor meanwhile, on the compute thread)
        for name, role in roles:
            if role.error is not None:
                where = f"role '{name}' on worker '{self.name}'"
                err = RuntimeError(f"{where} failed: {role.error!r}")
                err.__cause__ = role.error  # (before tagging: the tag names the root cause)
                raise tag(err, where)
        return {self._key(name): {"items": role.items + getattr(role, "steps", 0),  # (rollout: + decode steps)
                                  "stuck_s": role.stuck_s()} for name, role in roles}

    def stacks(self) -> str:
        """Every thread's stack in this process, now (the watchdog writes it to ``error.log``)."""
        names = {t.ident: t.name for t in threading.enumerate()}
        threads = (f"thread '{names.get(ident, ident)}':\n" + "".join(traceback.format_stack(frame))
                   for ident, frame in sys._current_frames().items())
        return f"pid {os.getpid()}\n" + "\n".join(threads)

    def stats(self) -> dict:
        wall, cpu = time.perf_counter() - self.started, time.process_time()  # cpu: this whole process
        return {self._key(name): {**role.stats(), "wall_s": wall, "cpu_s": cpu, "pid": os.getpid()}
                for name, role in self.roles.items()}

    def _key(self, role: str) -> str:
        """A role's name in stats and traces: ``actor.1`` for the actor of trainer rank 1."""
        return f"{role}.{self.rank}" if self.rank else role

    def spans(self) -> dict[str, list[tuple[float, float]]]:
        """Each role's computing spans (wall-clock start, seconds), for the timeline trace."""
        return {self._key(name): list(role.spans) for name, role in self.roles.items()}

    def stop(self) -> None:
        self._stop.set()
        if self._init_error is not None:  # nothing was started
            self._compute.shutdown(wait=False)
            return
        if self.group is not None:  # a rank still waiting in a collective gives up
            self.group.abort()
        for th in self._threads:
            th.join(timeout=5)
        subscriber = getattr(self.roles.get("rollout"), "weights", None)
        if subscriber is not None:
            subscriber.close()
        self._compute.shutdown(wait=False)
        if "reward" in self.roles:
            self.roles["reward"].close()
        scorer = getattr(self.roles.get("rollout"), "scorer", None)
        if scorer is not None:
            scorer.close()
