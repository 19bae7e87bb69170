"""Discrete-event simulation of one training job's dataflow (sync, stream, async).

The simulated job mirrors the real roles (``asyncflow/workflow``); each term is named after
the span or the gap it is in a real run's ``trace.json`` (:mod:`asyncflow.planner.terms`
compares the two):

* **rollout** (:meth:`_Job.rollout`): one worker with ``slots`` continuous-batching slots.
  Prompts are fetched a step's worth at a time (stream/async: one data-plane round trip,
  ``fetch`` = the first of ``cost.pipeline_overheads_s()``) and admitted a whole group at a
  time into free slots while fewer than ``(version + staleness + 1) * prompts_per_step``
  groups have started (admission control, the real
  :class:`~asyncflow.workflow.placement.GroupPlacer`); every decode round costs
  ``cost.decode_s(live rows, mean context)``. With ``Workload.prefill_token`` (the real
  engines sample an answer's first token in its prefill) an answer of ``L`` tokens takes
  ``L - 1`` decode rounds. **Rewards in rollout** (``reward_in_rollout``: the default
  ``reward.placement=rollout``): each answer is scored as it finishes, its reward's CPU in
  the same decode round, a remote latency in flight meanwhile; a group is placed (completion
  order, within the bound) once its rewards are in and goes to the outbox, which is sent
  (``put_nowait``) when a step is complete, when its oldest group has waited ``FLUSH_S``, or
  when rollout idles, as ``RolloutRole._emit`` does; it reaches the trainer ``data`` later
  (the put -> get hop). ``sync`` does not place: step ``v``'s groups land in ``v``, and with
  rewards in rollout the rows are handed over in memory (no hop). A newer published version
  is swapped in at the next decode boundary (``cost.swap_s``: load + rebuild the KV cache of
  the live rows: the delayed update);
* **reward** (``reward.placement=separate``): a FIFO consumer, ``cost.reward_s`` per sample
  plus an optional remote latency served by ``concurrency`` calls in flight; its rows take
  two hops (rollout -> reward -> trainer);
* **actor** (:meth:`_Job.train`): a lone trainer's fetches are *greedy* (each takes every
  ready whole group of the step, at least a micro-batch's, and the next fetch is in flight
  while it computes; the first of step ``v + 1`` once ``v``'s rows are all in hand), and its
  engine trains one fetch's rows in length-sorted passes of ``micro_prompts`` groups' rows
  (one ``train`` span per fetch, as the real actor's); data-parallel ranks fetch
  ``ranks x micro_prompts`` groups and train ``1 / ranks`` of them each. Then the ``step``
  span: optimizer step + weight export (+ the gradient all-reduce of ``ranks``), after which
  ``v + 1`` is published (visible to rollout ``cost.transfer_s`` later). Before each step the
  actor pays the driver's round trip (``actor``, the last of the pipeline overheads);
* **tensor-parallel trainer** (``Allocation.tp``, ``train.tp``): each pass is split among the
  ranks and pays its all-reduces (:func:`~asyncflow.planner.costs.tp_pass_s`), the optimizer
  step is ``1 / tp`` of the parameters a rank, and the actor keeps ``tp x actor_res`` threads busy;
* **sync** (:meth:`_Job.colocated`): ``ranks`` colocated workers (``train.dp``), each
  generating and scoring its share of the step's prompts (``r, r + N, ...``) on its own
  threads, training its own rows in sorted passes, then all together the step (their
  gradient all-reduce); each pays ``cost.step_overhead_s`` (the driver, prompt fetch)
  before each step; ``stream`` is ``async`` with staleness 0;
* **evaluations** (:mod:`asyncflow.planner.extras`) every ``eval_every`` steps: beside
  training in stream/async (the driver's thread at nice 19: it computes only where no role
  does), else a pause of the trainer; **checkpoints** every ``save_every`` steps and after
  the last: the trainer's pause, the host copy beside the next step (whose optimizer step
  waits for it) and the writer, both on the shared cores;
* **shared cores**: work started while other roles are busy is stretched by
  ``max(1, busy threads / cores)`` (re-evaluated every ``QUANTUM_S`` of work), times
  ``cost.interference`` (shared caches and memory bandwidth: measured by ``asyncflow profile``).

Throughput is measured like the real driver: samples of steps ``1 .. N-1`` over the time
from the end of step 0 to the end of step ``N-1``. ``SimResult.counts`` has the structural
events (decode rounds, prefills, swaps, fetches, passes, steps, publishes, evaluations,
checkpoints) that :mod:`asyncflow.planner.terms` pins against a real run. The kernel
(:mod:`asyncflow.planner.des`) is a few lines of generator processes; a 40-step CPU-scale
run takes milliseconds.
"""

from __future__ import annotations

import functools
from collections import Counter, defaultdict, deque
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncflow.planner import extras, sim_rollout
from asyncflow.planner.costs import tp_pass_s
from asyncflow.planner.des import Env, Signal
from asyncflow.planner.sim_rollout import FLUSH_S, Outbox
from asyncflow.planner.workload import Allocation, CostModel, Hooks, SimResult, Workload
from asyncflow.workflow.placement import GroupPlacer

__all__ = ["FLUSH_S", "Allocation", "CostModel", "Hooks", "SimResult", "Workload", "simulate", "sorted_passes"]

QUANTUM_S = 0.01  # shared cores: work is re-stretched every this many seconds of work (~ one decode round here)


@dataclass
class _Answer:
    partition: int  # training step (-1 until its group is placed)
    group: int  # global group id, in fetch order
    length: int
    version: int  # the version that started it
    rank: int = 0  # sync: the colocated worker that generates and trains it
    done: int = 0
    turns_left: int = 0  # hook: environment turns still to come (multi-turn episodes)


def sorted_passes(lengths: list[int], rows_per_pass: int) -> list[list[int]]:
    """Positions of ``lengths`` cut into passes of at most ``rows_per_pass``, longest first
    (the real engine's :func:`~asyncflow.engines.passes.length_sorted_split`)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[i:i + rows_per_pass] for i in range(0, len(order), max(1, rows_per_pass))]


class _Fetch:
    """One fetch of the trainer in flight: its groups once it returns (None before)."""

    def __init__(self) -> None:
        self.groups: list[list[_Answer]] | None = None


class _Job:
    def __init__(self, wl: Workload, alloc: Allocation, cost: CostModel, cores: float | None):
        self.wl, self.a, self.cost, self.cores = wl, alloc, cost, cores
        self.env = Env()
        self.rng = np.random.default_rng(wl.seed)
        self.changed = Signal(self.env)  # anything a waiting process may care about
        self.spans: list[tuple[str, str, float, float]] = []
        self.counts: Counter[str] = Counter()
        self.busy_threads: dict[str, int] = {}
        self.version = 0  # trainer's published version
        self.rewarded: dict[tuple[int, int], list[_Answer]] = defaultdict(list)
        self.group_left: dict[tuple[int, int], int] = {}
        self.ready: dict[tuple[int, int], deque] = defaultdict(deque)  # (step, rank) -> scored groups at the trainer
        self.step_end: list[float] = []
        self.reward_free = 0.0
        self.reward_servers = [0.0] * max(1, wl.reward_concurrency)
        self.max_staleness = 0
        self.placer = GroupPlacer(wl.prompts_per_step, alloc.k)
        self.fetched = 0  # groups fetched so far (gid of the next)
        self.unfinished: dict[int, int] = {}  # gid -> answers still generating
        self.scoring: dict[int, int] = {}  # gid -> remote reward calls still in flight (rewards in rollout)
        self.sent: Counter[int] = Counter()  # step -> groups rollout has sent to the trainer
        self.placement: dict[int, int] = {}
        self._drawn = 0
        # stream/async: (prompt fetch per partition, data-plane hop of a sent group, actor's step boundary)
        self.overheads = cost.pipeline_overheads_s()
        self.hops = 1 if wl.reward_in_rollout else 2  # rollout -> trainer, or rollout -> reward -> trainer
        self.arrived: Counter[int] = Counter()  # sync: ranks done training step v (their all-reduce barrier)
        self.extras = extras.Extras(self)

    # ---------------------------------------------------------------- helpers
    def work(self, role: str, what: str, seconds: float, threads: int, span: bool = True) -> Iterator:
        """Busy ``seconds`` of work (stretched by core sharing), recorded as one span. With
        shared cores it advances in quanta of ``QUANTUM_S`` of work, each stretched by the
        roles busy when it starts (judged once at its start, a span that began while another
        role was idle escaped all sharing, which favoured big micro-batches). ``span=False``:
        work the real run does outside its roles' spans (a paused evaluation)."""
        if seconds <= 0:  # (still a section of the role, as a real one that took no time: counted)
            if span:
                self.spans.append((role, what, self.env.now, 0.0))
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
        if span:
            self.spans.append((role, what, start, self.env.now - start))

    @staticmethod
    def name(role: str, rank: int) -> str:
        return f"{role}.{rank}" if rank else role  # as the real worker names a rank's role

    def fetch(self, n: int, partition: int, rank: int) -> list[list[_Answer]]:
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
            groups.append([_Answer(partition, gid, int(L[i * wl.group_size + j]), -1, rank, 0, wl.turns - 1)
                           for j in range(wl.group_size)])
        self.fetched += n
        return groups

    def generated(self, ans: _Answer, group: list[_Answer], outbox: Outbox) -> None:
        """An answer finished generating (its local reward, when rollout scores, is paid in its
        round); a remote reward call goes in flight at once, and its group waits for every call."""
        self.unfinished[ans.group] -= 1
        if self.wl.reward_in_rollout and self.wl.reward_latency_s:
            self.scoring[ans.group] = self.scoring.get(ans.group, len(group))
            self.env.at(self._remote(self.env.now), lambda: self._reward_back(ans.group, group, outbox))
        elif not self.unfinished[ans.group]:
            self._complete(group, outbox)

    def _reward_back(self, gid: int, group: list[_Answer], outbox: Outbox) -> None:
        self.scoring[gid] -= 1
        if not self.scoring[gid]:
            del self.scoring[gid]
            self._complete(group, outbox)
            self.changed.fire()  # (rollout may idle, waiting for rewards)

    def _complete(self, group: list[_Answer], outbox: Outbox) -> None:
        """A group is generated (and, in rollout, scored): place it, then send or score it."""
        gid = group[0].group
        self.unfinished.pop(gid, None)
        step = group[0].partition if group[0].partition >= 0 else self.placer.complete(gid)
        assert step is not None  # only soft (over-provisioned) groups go unplaced; the simulator has none
        self.placement[gid] = step
        for x in group:
            x.partition = step
        if self.wl.reward_in_rollout:
            outbox.add(group, self.env.now)
            return
        self.group_left[(step, gid)] = len(group)
        for x in group:
            self._reward_role(x)

    def _remote(self, start: float) -> float:
        """When a remote reward call started at ``start`` returns (``concurrency`` servers)."""
        lo, hi = self.wl.reward_latency_s or (0.0, 0.0)
        i = int(np.argmin(self.reward_servers))
        t = max(start, self.reward_servers[i]) + self.rng.uniform(lo, hi)
        self.reward_servers[i] = t
        return t

    def _reward_role(self, ans: _Answer) -> None:
        """reward.placement=separate: FIFO on the reward CPU, then the remote latency, the hops."""
        self.reward_free = max(self.env.now, self.reward_free) + self.cost.reward_s(1)
        t = self._remote(self.reward_free) if self.wl.reward_latency_s else self.reward_free
        if self.a.mode != "sync":  # data-plane hops to the trainer (sync: inside its step overhead)
            t += self.hops * self.overheads[1]
        self.env.at(t, lambda: self._scored(ans))

    def _scored(self, ans: _Answer) -> None:
        key = (ans.partition, ans.group)
        self.rewarded[key].append(ans)
        self.group_left[key] -= 1
        if self.group_left[key] == 0:
            self.ready[(ans.partition, 0)].append(self.rewarded.pop(key))
            self.changed.fire()

    def send(self, outbox: Outbox, sync: bool) -> None:
        """Rollout's put of its outbox: the groups reach the trainer one hop later (sync: in memory)."""
        groups, outbox.groups, outbox.since = outbox.groups, [], None
        delay = 0.0 if sync else self.overheads[1]
        self.counts["handoff" if sync else "put"] += 1

        def arrive() -> None:
            for g in groups:
                self.ready[(g[0].partition, g[0].rank if sync else 0)].append(g)
            self.changed.fire()

        self.env.at(self.env.now + delay, arrive)

    # ---------------------------------------------------------------- rollout
    def rollout(self, threads: int, only: int | None = None, rank: int = 0, share: int | None = None) -> Iterator:
        """Continuous batching. ``only``: generate just that partition (``share`` prompts of
        it, this rank's) and return (sync)."""
        yield from sim_rollout.run(self, threads, only, rank, share)

    # ---------------------------------------------------------------- actor
    def _fetcher(self, v: int, least: int, most: int, greedy: bool) -> _Fetch:
        """Start one fetch of the trainer: it returns once ``least`` whole groups of step ``v``
        are ready, with every ready one up to ``most`` (greedy) or exactly ``least``."""
        out = _Fetch()

        def proc() -> Iterator:
            while len(self.ready[(v, 0)]) < least:
                yield self.changed
            q = self.ready[(v, 0)]
            out.groups = [q.popleft() for _ in range(min(len(q), most) if greedy else least)]
            self.counts["fetch"] += 1
            self.changed.fire()

        self.env.process(proc())
        return out

    def pass_seconds(self, rows: list[_Answer], threads: int, ranks: int = 1) -> float:
        """A fetch's training on one rank: its rows (``1 / ranks`` of them) in passes."""
        wl, a = self.wl, self.a
        per = max(1, len(rows) // max(1, ranks)) if ranks > 1 else len(rows)
        mine = rows[:per]
        cut = sorted_passes([x.length for x in mine], a.micro_prompts * wl.group_size) if wl.sorted_passes \
            else [list(range(len(mine)))]
        total = 0.0
        for idx in cut:
            part = [mine[i] for i in idx]
            longest = (sum(x.length for x in part) / len(part)) if wl.packed else max(x.length for x in part)
            padded = int(wl.prompt_len + longest)
            total += tp_pass_s(self.cost, self.cost.train_s(len(part), padded, threads), len(part) * padded, a.tp, wl)
            self.counts["pass"] += 1
        return total

    def train(self, v: int, first: _Fetch | None) -> Generator[Any, Any, _Fetch | None]:
        """stream/async: train step ``v`` (see the module doc); returns the next step's first fetch."""
        wl, a = self.wl, self.a
        P, greedy = wl.prompts_per_step, wl.greedy and a.ranks == 1
        micro = a.micro_prompts * a.ranks
        seen, nxt = 0, first or self._fetcher(v, min(micro, P), P, greedy)
        prefetched = None
        while seen < P:
            while nxt.groups is None:
                yield self.changed
            groups, seen = nxt.groups, seen + len(nxt.groups)
            if seen < P:  # the next fetch travels while this one computes
                nxt = self._fetcher(v, min(micro, P - seen), P - seen, greedy)
            elif v + 1 < wl.steps:  # the step's rows are all here: the next step's first fetch
                prefetched = self._fetcher(v + 1, min(micro, P), P, greedy)
            rows = [x for g in groups for x in g]
            for x in rows:
                self.max_staleness = max(self.max_staleness, v - x.version)
            threads = a.actor_res * a.tp * a.ranks
            yield from self.work("actor", "train", self.pass_seconds(rows, a.actor_res, a.ranks), threads)
        yield from self.extras.wait_copy()
        yield from self.work("actor", "step", self.cost.step_s(a.actor_res) / a.tp + self.cost.grad_allreduce_s(a.ranks)
                             + self.cost.export_s(wl.sync_fraction), a.actor_res * a.tp * a.ranks)
        self.counts["step"] += 1
        return prefetched

    def actor(self) -> Iterator:
        first = None
        for v in range(self.wl.steps):
            yield self.overheads[2]  # the driver's round trip at the step boundary
            first = yield from self.train(v, first)
            self.counts["publish"] += 1
            self.env.at(self.env.now + self.cost.transfer_s(self.wl.sync_fraction),
                        functools.partial(self.publish, v + 1))
            yield from self.extras.after_step(v, "actor", self.a.actor_res)
            self.step_end.append(self.env.now)
            yield from self.extras.pause(v, "actor", self.a.actor_res)

    def publish(self, version: int) -> None:
        self.version = max(self.version, version)
        self.changed.fire()

    def colocated(self, rank: int) -> Iterator:
        """sync: this rank generates and scores its share, trains its rows; all ranks step together."""
        a, wl = self.a, self.wl
        t, share = a.rollout_res, len(range(rank, wl.prompts_per_step, a.ranks))
        actor = self.name("actor", rank)
        for v in range(wl.steps):
            yield self.cost.step_overhead_s()
            yield from self.rollout(t, only=v, rank=rank, share=share)
            while len(self.ready[(v, rank)]) < share:  # (a separate reward role: scoring)
                yield self.changed
            rows = [x for g in self.ready.pop((v, rank)) for x in g]
            yield from self.work(actor, "train", self.pass_seconds(rows, t), t * a.tp)
            self.arrived[v] += 1
            self.changed.fire()
            while self.arrived[v] < a.ranks:  # the gradient all-reduce: every rank's rows in
                yield self.changed
            yield from self.extras.wait_copy()
            step = self.cost.step_s(t) / a.tp + self.cost.grad_allreduce_s(a.ranks)
            yield from self.work(actor, "step", step, t * a.tp)
            if rank:
                while len(self.step_end) <= v:  # the driver queues the next step once every rank returned
                    yield self.changed
                continue
            self.counts["step"] += 1
            yield from self.extras.after_step(v, actor, t)
            self.step_end.append(self.env.now)
            self.changed.fire()
            yield from self.extras.pause(v, actor, t)

    def run(self) -> SimResult:
        if self.a.mode == "sync":
            for r in range(self.a.ranks):
                self.env.process(self.colocated(r))
        else:
            self.env.process(self.rollout(self.a.rollout_res))
            self.env.process(self.actor())
        self.env.run()
        return self.result()

    def result(self) -> SimResult:
        ends = self.step_end
        if len(ends) < self.wl.steps:
            raise RuntimeError(f"simulation stalled after {len(ends)} of {self.wl.steps} steps ({self.a.describe()})")
        t0, t1 = (ends[0], ends[-1]) if len(ends) > 1 else (0.0, ends[-1])
        n = (len(ends) - 1 if len(ends) > 1 else 1) * self.wl.batch
        busy: defaultdict[str, float] = defaultdict(float)
        for role, _, s, d in self.spans:
            busy[role] += max(0.0, min(s + d, t1) - max(s, t0))
        if not self.wl.reward_in_rollout:  # its own CPU, FIFO: busy = compute of the window's samples
            busy["reward"] = self.cost.reward_s(1) * n
        span = max(t1 - t0, 1e-12)
        roles = ["rollout", "reward", "actor"] + sorted(r for r in busy if r not in ("rollout", "reward", "actor"))
        return SimResult(n / span, ends, {r: min(1.0, busy[r] / span) for r in roles}, self.spans,
                         self.max_staleness, span, dict(self.placement), dict(self.counts))


def simulate(wl: Workload, alloc: Allocation, cost: CostModel, cores: float | None = None) -> SimResult:
    """Simulate ``wl.steps`` training steps of ``alloc`` under ``cost``.

    ``cores``: CPU cores the roles share (None = every role has its own hardware).
    """
    if alloc.slots < wl.group_size:
        raise ValueError(f"slots ({alloc.slots}) must hold at least one group ({wl.group_size})")
    if alloc.mode == "sync" and alloc.ranks > wl.prompts_per_step:
        raise ValueError(f"{alloc.ranks} sync ranks need at least as many prompts per step ({wl.prompts_per_step})")
    return _Job(wl, alloc, cost, cores).run()
