"""The worker plan: which workers a mode runs, what each hosts and asks for.

* ``sync``: one colocated worker with every role, sharing one model between the rollout
  and training engines (weight sync is free), using all cores in every phase; with
  ``train.dp = N``, N such workers (``colocated``, ``colocated.1``, ...: ranks ``0 .. N-1``,
  ``resources.sync_threads`` or ``ncpu // N`` threads each), rank ``r`` generating and
  scoring prompts ``r, r + N, ...`` of each step (:func:`sync_share`; rewards always in
  rollout), all of them training the step's rows together (PPO's critic: rank 0 only);
* ``stream`` / ``async``: one worker per role, one torch thread each; the compute roles
  (rollout, the actor's ranks, and reference / critic when the algorithm needs them) share
  the CPUs: each requests ``min(1, ncpu / n_compute)``, so the requests never add up to more
  than ``ncpu``; rewards are computed inside rollout (``reward.placement=rollout``, the
  default), or by a reward worker of their own that requests no CPU (``separate``).

``train.dp = N`` gives the actor N workers (``actor``, ``actor.1``, ...: one rank each,
counted as N compute roles; more compute roles than CPUs is warned about, not refused);
``train.tp = T`` multiplies them: ``N x T`` ranks, rank ``r`` at ``(dp, tp) = (r // T, r % T)``
of the trainer's device mesh (:class:`~asyncflow.engines.tensor_parallel.MeshGroup`).
Pure data: no torch, nothing started here.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, replace

from asyncflow.config import RunConfig


@dataclass
class WorkerSpec:
    name: str
    roles: list[str]
    threads: int
    cpus: float  # resource request for the launcher (may be fractional)
    rank: int = 0  # the actor's rank among its train.dp x train.tp processes
    cores: tuple[int, ...] = ()  # pinned to these CPU cores (empty: not pinned)
    gpus: float = 0.0  # GPU request for the launcher (resources.device=cuda on Ray)


def rewards_in_rollout(cfg: RunConfig) -> bool:
    """Rollout scores its own groups (``reward.placement=rollout``; dynamic sampling and
    data-parallel ``sync``, where each rank scores its own answers, need it)."""
    return cfg.reward.placement == "rollout" or cfg.algorithm.dynamic_sampling or sync_ranks(cfg) > 1


def plan_workers(cfg: RunConfig, ncpu: int | None = None, cores: list[int] | None = None,
                 ngpu: int = 0) -> list[WorkerSpec]:
    """The workers of ``cfg``'s mode on ``ncpu`` CPUs; pinned to ``cores`` (:func:`assign_cores`) if given.
    With ``resources.device=cuda`` the compute workers share ``ngpu`` GPUs as they share the
    CPUs; a vLLM / SGLang rollout worker gets its share whatever the device."""
    specs = _plan(cfg, ncpu or os.cpu_count() or 1)
    on_gpu = [s for s in specs if s.cpus > 0 and (cfg.resources.device != "cpu" or
                                                  ("rollout" in s.roles and cfg.rollout.engine in ("vllm", "sglang")))]
    for s in on_gpu if ngpu else []:
        s.gpus = min(1.0, round(ngpu / len(on_gpu), 4))  # Ray's fractional GPUs: 4 decimals
    return assign_cores(specs, cores) if cores and cfg.mode != "sync" else specs


def trainer_ranks(cfg: RunConfig) -> int:
    """The trainer's processes: ``train.dp x train.tp``."""
    return cfg.train.dp * cfg.train.tp


def sync_ranks(cfg: RunConfig) -> int:
    """How many colocated ``sync`` workers share each step's prompts (1 outside ``sync``)."""
    return cfg.train.dp if cfg.mode == "sync" else 1


def sync_share(cfg: RunConfig, rank: int) -> int:
    """Prompts per step that ``sync`` rank ``rank`` generates: the step's prompts ``rank,
    rank + N, ...`` (prompt ``i`` of a step is tagged shard ``i % N`` by the feeder)."""
    return len(range(rank, cfg.train.prompts_per_step, sync_ranks(cfg)))


def _plan(cfg: RunConfig, ncpu: int) -> list[WorkerSpec]:
    extra = (["reference"] if cfg.algorithm.kl_coef > 0 else []) + (["critic"] if cfg.algorithm.name == "ppo" else [])
    reward = [] if rewards_in_rollout(cfg) else ["reward"]
    if cfg.mode == "sync":
        n = cfg.train.dp
        threads = cfg.resources.sync_threads or max(1, ncpu // n)
        return [WorkerSpec(f"colocated.{i}" if i else "colocated",
                           ["rollout"] + reward + [x for x in extra if i == 0 or x != "critic"] + ["actor"],
                           threads, round(ncpu / n, 4) if n > 1 else float(ncpu), rank=i) for i in range(n)]
    ranks = trainer_ranks(cfg)
    n_compute = 1 + ranks + len(extra)  # rollout, the actor's ranks and the extras
    share = min(1.0, ncpu / n_compute)
    t = cfg.resources.threads_per_role
    if n_compute * t > ncpu and ranks > 1:
        warnings.warn(f"train.dp={cfg.train.dp} x train.tp={cfg.train.tp}: {n_compute} compute roles x {t} thread(s) "
                      f"on {ncpu} CPUs oversubscribe them (each asks for {share:.2f} CPU); expect no speed-up",
                      stacklevel=2)
    specs = [WorkerSpec("rollout", ["rollout"], t, share)] + [WorkerSpec(n, [n], 1, 0.0) for n in reward]
    specs += [WorkerSpec(name, [name], t, share) for name in extra]
    specs += [WorkerSpec(f"actor.{i}" if i else "actor", ["actor"], t, share, rank=i) for i in range(ranks)]
    return specs


def assign_cores(specs: list[WorkerSpec], cores: list[int]) -> list[WorkerSpec]:
    """``specs`` with cores of their own for the compute workers (those requesting CPU):
    ``threads`` consecutive cores each, the trainer's ranks first (the usual bottleneck),
    then the others in plan order, rollout last. Unchanged when they do not all fit."""
    compute = [s for s in specs if s.cpus > 0]
    order = sorted(compute, key=lambda s: ("actor" not in s.roles, "rollout" in s.roles, s.rank))
    if sum(s.threads for s in order) > len(cores):
        return specs
    given, at = {}, 0
    for s in order:
        given[s.name], at = tuple(cores[at:at + s.threads]), at + s.threads
    return [replace(s, cores=given.get(s.name, ())) for s in specs]
