"""Discrete-event simulation of one training job's dataflow (sync, stream, async).

The simulated job mirrors the real roles (``asyncflow/workflow``):

* **rollout**: one worker with ``slots`` continuous-batching slots. Prompts are fetched a
  step's worth at a time and admitted a whole group at a time into free slots, while
  fewer than ``(version + staleness + 1) * prompts_per_step`` groups have started
  (admission control); every decode round costs ``cost.decode_s(live rows, mean context)``.
  With ``Workload.prefill_token`` (every profiled workload: the built-in engine's real batch,
  like vLLM, samples an answer's first token in its prefill) an answer of ``L`` tokens
  takes ``L - 1`` decode rounds after its prefill; without it (hand-set tests, the analytic
  what-if) ``L``. At the built-in example's 3-4 token answers the difference is a third of
  the decode rounds, which the rollout calibration factor used to absorb.
  When a group's last answer finishes it is **placed in completion order** by the real
  :class:`~asyncflow.workflow.placement.GroupPlacer` (the lowest training step that is not
  full and not later than its start version + staleness, with the same
  earliest-deadline-first check), and its answers stream to reward at once. ``sync`` does
  not place: every group of step ``v`` starts and lands in ``v``.
  A newer published version is swapped in at the next decode boundary
  (``cost.swap_s``: load + rebuild the KV cache of the live rows: the delayed update);
* **reward**: a FIFO consumer, ``cost.reward_s`` per sample on its own CPU, plus an
  optional remote latency served by ``concurrency`` calls in flight;
* **actor**: trains partition ``v`` as micro-batches of whole rewarded groups
  (``cost.train_s(rows, padded length)`` each), then one optimizer step + weight export
  (``cost.step_s``, ``cost.export_s``), then publishes ``v + 1`` (visible to rollout ``cost.transfer_s`` later).
  With ``Allocation.tp`` tensor-parallel ranks each pass is split among them and pays its
  all-reduces (:func:`~asyncflow.planner.costs.tp_pass_s`), the step is ``1 / tp`` of the
  parameters a rank, and the actor keeps ``tp x actor_res`` threads busy.

``sync`` runs the same pieces as whole-batch phases on one colocated worker (generate all,
score all, train, no weight transfer); ``stream`` is ``async`` with staleness 0.

``cost.step_overhead_s`` is the measured per-step latency the cost curves miss (data-plane
round trips between processes, the driver's round trip, prompt feeding). In ``sync`` one
worker makes every call, so it is paid whole, once per step. In ``stream``/``async`` each
role makes its own calls in its own process: ``cost.pipeline_overheads_s()`` gives what
rollout pays when it starts a partition, the latency of a scored group on its way to the
trainer (data-plane hops: it delays the group, not a role), and what the actor pays before
each step (the driver's round trip). The profiled model measures the last two in real runs
(:mod:`asyncflow.planner.calib`); models that know one overhead split it
(:func:`asyncflow.planner.costs.split_overhead`).

Roles that share cores slow each other down: a role's work taking ``threads`` while other
roles are busy is stretched by ``max(1, busy threads / cores)`` (a coarse time-sharing
model, re-evaluated every ``QUANTUM_S`` of work), times ``cost.interference`` (shared caches and
memory bandwidth, and other jobs' load: measured by ``asyncflow profile``). Throughput is
measured like the real driver: samples of steps ``1 .. N-1`` over the time from the end of
step 0 to the end of step ``N-1``.

The kernel (:mod:`asyncflow.planner.des`) is a few lines of generator processes, so the
whole simulation is plain Python with no dependency; a 40-step CPU-scale run takes
milliseconds.
"""

from __future__ import annotations

import functools
from collections import defaultdict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from asyncflow.planner.costs import tp_pass_s
from asyncflow.planner.des import Env, Signal
from asyncflow.workflow.placement import GroupPlacer

QUANTUM_S = 0.01  # shared cores: work is re-stretched every this many seconds of work (~ one decode round here)


class CostModel(Protocol):
    """Seconds of each unit of work; ``res`` is the role's resources (threads or devices)."""

    interference: float

    def decode_s(self, n: int, ctx: float, res: int) -> float: ...
    def prefill_s(self, n: int, prompt_len: float, res: int) -> float: ...
    def train_s(self, rows: int, padded_len: int, res: int) -> float: ...
    def step_s(self, res: int) -> float: ...
    def export_s(self) -> float: ...
    def swap_s(self, n_live: int, ctx: float, res: int) -> float: ...
    def transfer_s(self) -> float: ...
    def step_overhead_s(self) -> float: ...
    def pipeline_overheads_s(self) -> tuple[float, float, float]: ...  # stream/async: rollout, data, actor
    def reward_s(self, n: int) -> float: ...
    def allreduce_s(self, nbytes: float, ranks: int) -> float: ...  # train.tp: one all-reduce (costs.tp_pass_s)


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
    rollout_res: int = 1  # threads (CPU) or devices of rollout; sync: of the colocated worker
    actor_res: int = 1
    micro_prompts: int = 4
    staleness: int = 1
    slots: int = 64  # continuous-batching slots of the rollout worker (all instances together)
    tp: int = 1  # tensor-parallel ranks of the trainer, actor_res each (costs.tp_pass_s)

    @property
    def k(self) -> int:
        return self.staleness if self.mode == "async" else 0

    def describe(self) -> str:
        if self.mode == "sync":
            return f"sync: colocated worker on {self.rollout_res}, micro {self.micro_prompts} prompts"
        k = f", staleness {self.staleness}" if self.mode == "async" else ""
        tp = f" x tp {self.tp}" if self.tp > 1 else ""
        return (f"{self.mode}: rollout {self.rollout_res}, actor {self.actor_res}{tp}, "
                f"micro {self.micro_prompts} prompts{k}")


@dataclass
class SimResult:
    samples_per_s: float
    step_end: list[float]
    busy: dict[str, float]  # busy fraction over the steady window
    spans: list[tuple[str, str, float, float]]  # (role, what, start, seconds)
    max_staleness: int
    steady_s: float
    placement: dict[int, int] = field(default_factory=dict)  # group (in start order) -> training step

    @property
    def idle(self) -> dict[str, float]:
        return {r: 1.0 - b for r, b in self.busy.items()}


# ---------------------------------------------------------------------------- the job
@dataclass
class _Answer:
    partition: int  # training step (-1 until its group is placed)
    group: int  # global group id, in fetch order
    length: int
    version: int  # the version that started it
    done: int = 0


class _Job:
    def __init__(self, wl: Workload, alloc: Allocation, cost: CostModel, cores: float | None):
        self.wl, self.a, self.cost, self.cores = wl, alloc, cost, cores
        self.env = Env()
        self.rng = np.random.default_rng(wl.seed)
        self.changed = Signal(self.env)  # anything a waiting process may care about
        self.spans: list[tuple[str, str, float, float]] = []
        self.busy_threads: dict[str, int] = {}
        self.version = 0  # trainer's published version
        self.staged_at: dict[int, float] = {}
        self.rewarded: dict[tuple[int, int], list[_Answer]] = defaultdict(list)
        self.group_left: dict[tuple[int, int], int] = {}
        self.ready_groups: dict[int, deque] = defaultdict(deque)
        self.step_end: list[float] = []
        self.reward_free = 0.0
        self.reward_servers = [0.0] * max(1, wl.reward_concurrency)
        self.max_staleness = 0
        self.placer = GroupPlacer(wl.prompts_per_step, alloc.k)
        self.fetched = 0  # groups fetched so far (gid of the next)
        self.unfinished: dict[int, int] = {}  # gid -> answers still generating
        self.placement: dict[int, int] = {}
        self._drawn = 0
        self.overheads = cost.pipeline_overheads_s()  # stream/async: (rollout per partition, data, actor per step)

    # ---------------------------------------------------------------- helpers
    def work(self, role: str, what: str, seconds: float, threads: int) -> Iterator:
        """Busy ``seconds`` of work (stretched by core sharing), recorded as one span. With
        shared cores it advances in quanta of ``QUANTUM_S`` of work, each stretched by the
        roles busy when it starts: a long span beside another role's short bursts is slowed
        for the part they overlap (judged once at its start, a span that began while the
        other role was idle escaped all sharing, which favoured big micro-batches)."""
        if seconds <= 0:
            return
        start, left = self.env.now, seconds
        self.busy_threads[role] = threads
        while left > 1e-12:
            piece = min(left, QUANTUM_S) if self.cores else left
            left -= piece
            if self.cores:
                others = sum(t for r, t in self.busy_threads.items() if r != role)
                piece *= max(1.0, (others + threads) / self.cores) * (self.cost.interference if others else 1.0)
            yield piece
        self.busy_threads.pop(role, None)
        self.spans.append((role, what, start, self.env.now - start))

    def fetch(self, n: int, partition: int = -1) -> list[list[_Answer]]:
        """The next ``n`` prompt groups (``partition`` fixed for sync; -1 = placed at completion)."""
        wl = self.wl
        seq = wl.length_seq
        L = [seq[(self._drawn + i) % len(seq)] for i in range(n * wl.group_size)] if seq \
            else wl.sample_lengths(self.rng, n * wl.group_size)
        self._drawn += n * wl.group_size
        groups = []
        for i in range(n):
            gid = self.fetched + i
            self.unfinished[gid] = wl.group_size
            groups.append([_Answer(partition, gid, int(L[i * wl.group_size + j]), -1) for j in range(wl.group_size)])
        self.fetched += n
        return groups

    def generated(self, ans: _Answer, group: list[_Answer]) -> None:
        """An answer finished generating; when its group is complete, place it and score it."""
        self.unfinished[ans.group] -= 1
        if self.unfinished[ans.group]:
            return
        del self.unfinished[ans.group]
        step = ans.partition if ans.partition >= 0 else self.placer.complete(ans.group)
        assert step is not None  # only soft (over-provisioned) groups go unplaced; the simulator has none
        self.placement[ans.group] = step
        self.group_left[(step, ans.group)] = len(group)
        for x in group:
            x.partition = step
            self.finished(x)

    def finished(self, ans: _Answer) -> None:
        """An answer left rollout: score it (FIFO on the reward CPU, then remote latency)."""
        wl, now = self.wl, self.env.now
        self.reward_free = max(now, self.reward_free) + self.cost.reward_s(1)
        t = self.reward_free
        if wl.reward_latency_s:
            lo, hi = wl.reward_latency_s
            i = int(np.argmin(self.reward_servers))
            t = max(t, self.reward_servers[i]) + self.rng.uniform(lo, hi)
            self.reward_servers[i] = t
        if self.a.mode != "sync":  # data-plane hops to the trainer (sync: inside its step overhead)
            t += self.overheads[1]
        self.env.at(t, lambda: self.scored(ans))

    def scored(self, ans: _Answer) -> None:
        key = (ans.partition, ans.group)
        self.rewarded[key].append(ans)
        self.group_left[key] -= 1
        if self.group_left[key] == 0:
            self.ready_groups[ans.partition].append(self.rewarded.pop(key))
            self.changed.fire()

    # ---------------------------------------------------------------- rollout
    def rollout(self, threads: int, only: int | None = None) -> Iterator:
        """Continuous batching. ``only``: generate just that partition and return (sync)."""
        wl, a, cost = self.wl, self.a, self.cost
        live: list[_Answer] = []
        waiting: deque = deque()
        members: dict[int, list[_Answer]] = {}
        version = only if only is not None else 0
        total = wl.prompts_per_step * (1 if only is not None else wl.steps)
        fetched, taken = 0, 0  # groups fetched by this call; of the current prompt partition
        chunk = max(1, wl.token_chunk)
        while True:
            if only is None and self.version > version:
                ctx = wl.prompt_len + (float(np.mean([x.done for x in live])) if live else 0.0)
                yield from self.work("rollout", f"swap v{self.version}", cost.swap_s(len(live), ctx, threads), threads)
                version = self.version
            n = min(total - fetched, wl.prompts_per_step - taken,
                    self.placer.admits(version) if only is None else wl.prompts_per_step)
            if not waiting and n > 0:  # one fetch: up to the rest of the current prompt partition
                if only is None and taken == 0:  # its share of the per-step data-plane overhead, in its own process
                    yield self.overheads[0]
                groups = self.fetch(n, only if only is not None else -1)
                members.update((g[0].group, g) for g in groups)
                waiting.extend(groups)
                fetched, taken = fetched + n, (taken + n) % wl.prompts_per_step
            free = (a.slots - len(live)) // wl.group_size
            start = [waiting.popleft() for _ in range(min(free, len(waiting)))]
            if start:
                rows = [x for g in start for x in g]
                for x in rows:
                    x.version = version
                for g in start if only is None else ():
                    self.placer.start(g[0].group, version)
                yield from self.work("rollout", "prefill", cost.prefill_s(len(rows), wl.prompt_len, threads), threads)
                if wl.prefill_token:  # the first token comes with the prefill: length - 1 decode rounds
                    for x in rows:
                        x.done = 1
                    for x in [x for x in rows if x.done >= x.length]:
                        self.generated(x, members[x.group])
                    rows = [x for x in rows if x.done < x.length]
                live += rows
            if not live:
                if fetched >= total and not waiting:
                    return
                yield self.changed  # idle at the staleness bound until new weights arrive
                continue
            ctx = wl.prompt_len + float(np.mean([x.done for x in live]))
            step = min(chunk, min(x.length - x.done for x in live))
            yield from self.work("rollout", "decode", step * cost.decode_s(len(live), ctx, threads), threads)
            keep = []
            for x in live:
                x.done += step
                if x.done >= x.length:
                    self.generated(x, members[x.group])
                else:
                    keep.append(x)
            live = keep

    # ---------------------------------------------------------------- actor
    def train(self, v: int, threads: int) -> Iterator:
        wl, a = self.wl, self.a
        seen = 0
        while seen < wl.batch:
            want = min(a.micro_prompts, wl.prompts_per_step - seen // wl.group_size)
            while len(self.ready_groups[v]) < want:
                yield self.changed
            rows = [x for _ in range(want) for x in self.ready_groups[v].popleft()]
            for x in rows:
                self.max_staleness = max(self.max_staleness, v - x.version)
            longest = (sum(x.length for x in rows) / len(rows)) if wl.packed else max(x.length for x in rows)
            padded = int(wl.prompt_len + longest)
            secs = tp_pass_s(self.cost, self.cost.train_s(len(rows), padded, threads), len(rows) * padded, a.tp, wl)
            yield from self.work("actor", "train", secs, threads * a.tp)  # (tp ranks of `threads` each)
            seen += len(rows)
        yield from self.work("actor", "optimizer step", self.cost.step_s(threads) / a.tp, threads * a.tp)

    def actor(self) -> Iterator:
        for v in range(self.wl.steps):
            yield self.overheads[2]  # driver round trip, its own gets, clear
            yield from self.train(v, self.a.actor_res)
            yield from self.work("actor", "export weights", self.cost.export_s(), self.a.actor_res * self.a.tp)
            self.step_end.append(self.env.now)
            self.env.at(self.env.now + self.cost.transfer_s(), functools.partial(self.publish, v + 1))

    def publish(self, version: int) -> None:
        self.version = max(self.version, version)
        self.changed.fire()

    def colocated(self) -> Iterator:
        """sync: generate all, score all, train all, on one worker (weights shared)."""
        t = self.a.rollout_res
        for v in range(self.wl.steps):
            yield self.cost.step_overhead_s()
            yield from self.rollout(t, only=v)
            while len(self.ready_groups[v]) < self.wl.prompts_per_step:  # reward runs alone
                yield self.changed
            yield from self.train(v, t)
            self.step_end.append(self.env.now)

    def run(self) -> SimResult:
        if self.a.mode == "sync":
            self.env.process(self.colocated())
        else:
            self.env.process(self.rollout(self.a.rollout_res))
            self.env.process(self.actor())
        self.env.run()
        ends = self.step_end
        if len(ends) < self.wl.steps:
            raise RuntimeError(f"simulation stalled after {len(ends)} of {self.wl.steps} steps ({self.a.describe()})")
        t0, t1 = (ends[0], ends[-1]) if len(ends) > 1 else (0.0, ends[-1])
        n = (len(ends) - 1 if len(ends) > 1 else 1) * self.wl.batch
        busy: defaultdict[str, float] = defaultdict(float)
        for role, _, s, d in self.spans:
            busy[role] += max(0.0, min(s + d, t1) - max(s, t0))
        busy["reward"] = self.cost.reward_s(1) * n  # its own CPU, FIFO: busy = compute of the window's samples
        span = max(t1 - t0, 1e-12)
        roles = ["rollout", "reward", "actor"]
        return SimResult(n / span, ends, {r: min(1.0, busy[r] / span) for r in roles}, self.spans,
                         self.max_staleness, span, dict(self.placement))


def simulate(wl: Workload, alloc: Allocation, cost: CostModel, cores: float | None = None) -> SimResult:
    """Simulate ``wl.steps`` training steps of ``alloc`` under ``cost``.

    ``cores``: CPU cores the roles share (None = every role has its own hardware).
    """
    if alloc.slots < wl.group_size:
        raise ValueError(f"slots ({alloc.slots}) must hold at least one group ({wl.group_size})")
    return _Job(wl, alloc, cost, cores).run()
