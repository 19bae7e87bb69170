"""What the simulator is asked: the workload of a step, the allocation, the costs; what it answers.

* :class:`Workload`: what one training step processes and how the job around it behaves
  (where rewards are scored, periodic evaluations, checkpoints) plus the hooks of the
  features that are landing (multi-turn episodes, adapter-only weight syncs), each a
  parameter whose default leaves the dataflow as it is;
* :class:`Allocation`: one candidate configuration (mode, threads, micro-batch, staleness,
  data-parallel ranks, tensor-parallel ranks);
* :class:`CostModel`: seconds of each unit of work. Every term has a place in the dataflow
  of :mod:`asyncflow.planner.sim` and a source (a profile, an assumption, a test's hand-set
  number); :class:`Hooks` gives the terms that are zero until measured or landed;
* :class:`SimResult`: samples/s the way the driver measures it, busy fractions, every span.

Pure data, no torch, no numpy beyond drawing lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


class CostModel(Protocol):
    """Seconds of each unit of work; ``res`` is the role's resources (threads or devices).
    ``fraction``: the share of the weights' bytes a sync moves (1 = all; LoRA: the adapter's)."""

    interference: float

    def decode_s(self, n: int, ctx: float, res: int) -> float: ...
    def prefill_s(self, n: int, prompt_len: float, res: int) -> float: ...
    def train_s(self, rows: int, padded_len: int, res: int) -> float: ...
    def step_s(self, res: int) -> float: ...
    def export_s(self, fraction: float = 1.0) -> float: ...
    def swap_s(self, n_live: int, ctx: float, res: int, fraction: float = 1.0) -> float: ...
    def transfer_s(self, fraction: float = 1.0) -> float: ...
    def step_overhead_s(self) -> float: ...
    def pipeline_overheads_s(self) -> tuple[float, float, float]: ...  # stream/async: prompt fetch, data, actor
    def reward_s(self, n: int) -> float: ...
    def eval_s(self, res: int) -> float: ...
    def checkpoint_s(self) -> tuple[float, float, float]: ...
    def grad_allreduce_s(self, ranks: int) -> float: ...
    def allreduce_s(self, nbytes: float, ranks: int) -> float: ...  # train.tp: one all-reduce (costs.tp_pass_s)


class Hooks:
    """Cost terms that are zero until measured (``asyncflow profile`` measures the first three
    on the job's model) or until their feature lands; a cost model inherits these defaults.

    * ``eval_s(res)``: one held-out evaluation (``task.eval_n`` problems, greedy) on ``res`` threads;
    * ``checkpoint_s()``: ``(pause, copy, write)`` of one resumable checkpoint: the trainer's
      pause at the step boundary, the host copy of weights and AdamW's state beside the next
      step (whose optimizer step waits for it), the writer's serialisation to disk;
    * ``grad_allreduce_s(ranks)``: the gradient sum of one step across ``ranks`` data-parallel ranks.

    (``train.tp``'s all-reduces are every cost model's own ``allreduce_s(nbytes, ranks)``, one
    ring all-reduce, which :func:`~asyncflow.planner.costs.tp_pass_s` counts per pass.)
    """

    def eval_s(self, res: int) -> float:
        return 0.0

    def checkpoint_s(self) -> tuple[float, float, float]:
        return 0.0, 0.0, 0.0

    def grad_allreduce_s(self, ranks: int) -> float:
        return 0.0


@dataclass
class Workload:
    """What one training step processes. ``lengths`` is a discrete answer-length
    distribution ``{tokens: probability}`` (long tails included)."""

    prompts_per_step: int = 16
    group_size: int = 8
    prompt_len: float = 7.0
    lengths: dict[int, float] = field(default_factory=lambda: {5: 1.0})
    steps: int = 10
    reward_latency_s: tuple[float, float] | None = None
    reward_concurrency: int = 64
    token_chunk: int = 1  # tokens per simulated decode round (coarser = faster, for big runs)
    packed: bool = False  # trainer packs sequences (cost ~ mean length) instead of padding to the longest
    seed: int = 0
    length_seq: list[int] | None = None  # answer lengths in start order, cycled (tests, replays); None = draw
    # the prefill samples each answer's first token (the real engines); False: every token is a decode round
    prefill_token: bool = False
    # rollout scores each answer as it finishes (reward.placement=rollout, the default): the reward's CPU
    # is in rollout's decode round, a group is placed once its rewards are in, no reward role, one hop
    reward_in_rollout: bool = False
    # the trainer's engine cuts the rows of one fetch into length-sorted passes of micro_prompts groups'
    # rows (sync, and a lone trainer's greedy fetches in stream/async); False: one pass per micro-batch
    sorted_passes: bool = False
    # stream/async lone trainer: each fetch takes every ready whole group (at least a micro-batch's)
    greedy: bool = False
    eval_every: int = 0  # held-out evaluation every N steps (0 = none)
    eval_beside: bool = False  # beside training (stream/async, train.eval_overlap); else the trainer pauses
    save_every: int = 0  # resumable checkpoint every N steps (0 = none but the last)
    checkpoint_last: bool = False  # ... and one after the last step (a resumable run: the real default)
    # hooks (their defaults change nothing): issue 35's multi-turn episodes: an answer is `turns`
    # turns, between two it waits env_latency_s outside the batch (its slot freed), then its
    # context is extended (a prefill of its tokens so far); LoRA: the share of the weights a sync moves
    turns: int = 1
    env_latency_s: float = 0.0
    sync_fraction: float = 1.0
    layers: int = 0  # the model's decoder layers and hidden size: train.tp's all-reduces (0: not counted)
    hidden: int = 0

    @property
    def batch(self) -> int:
        return self.prompts_per_step * self.group_size

    def sample_lengths(self, rng: np.random.Generator, n: int) -> np.ndarray:
        L = np.array(list(self.lengths), dtype=np.int64)
        p = np.array(list(self.lengths.values()), dtype=float)
        return rng.choice(L, size=n, p=p / p.sum())

    def mean_length(self) -> float:
        p = sum(self.lengths.values())
        return sum(L * q for L, q in self.lengths.items()) / p


@dataclass
class Allocation:
    """One candidate configuration of the job."""

    mode: str = "async"  # sync | stream | async
    rollout_res: int = 1  # threads (CPU) or devices of rollout; sync: of each colocated worker
    actor_res: int = 1  # of each trainer rank
    micro_prompts: int = 4
    staleness: int = 1
    slots: int = 64  # continuous-batching slots of the rollout worker (all instances together)
    ranks: int = 1  # train.dp: sync: colocated workers, each generating its share; else the actor's ranks
    tp: int = 1  # train.tp: tensor-parallel ranks of each trainer rank, actor_res threads each (costs.tp_pass_s)

    @property
    def k(self) -> int:
        return self.staleness if self.mode == "async" else 0

    def describe(self) -> str:
        dp = f", {self.ranks} data-parallel ranks" if self.ranks > 1 else ""
        tp = f" x tp {self.tp}" if self.tp > 1 else ""
        if self.mode == "sync":  # (sync refuses train.tp)
            return f"sync: colocated worker on {self.rollout_res}, micro {self.micro_prompts} prompts{dp}"
        k = f", staleness {self.staleness}" if self.mode == "async" else ""
        return (f"{self.mode}: rollout {self.rollout_res}, actor {self.actor_res}{tp}, "
                f"micro {self.micro_prompts} prompts{k}{dp}")


@dataclass
class SimResult:
    samples_per_s: float
    step_end: list[float]
    busy: dict[str, float]  # busy fraction over the steady window
    spans: list[tuple[str, str, float, float]]  # (role, what, start, seconds)
    max_staleness: int
    steady_s: float
    placement: dict[int, int] = field(default_factory=dict)  # group (in start order) -> training step
    counts: dict[str, int] = field(default_factory=dict)  # structural events (asyncflow.planner.terms)

    @property
    def idle(self) -> dict[str, float]:
        return {r: 1.0 - b for r, b in self.busy.items()}
