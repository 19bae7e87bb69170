"""The simulated rollout worker's loop (:class:`asyncflow.planner.sim._Job`'s ``rollout``).

One iteration is one poll of the real :class:`~asyncflow.workflow.rollout.RolloutRole`:
swap a newer version in (stream/async), fetch admitted prompts when none wait (one
data-plane round trip), start waiting groups in free slots (a ``prefill`` span), decode one
round for every live answer (a ``decode`` span, with the rewards of the answers it finishes
when rollout scores them), then send the outbox when the real ``_emit`` would: a step is
complete, its oldest group has waited ``FLUSH_S``, or there is nothing to decode. The hook
of multi-turn episodes (``Workload.turns``) takes an answer out of the batch at each turn's
end for ``env_latency_s`` and extends it (a ``prefill`` of its context) when it comes back.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from asyncflow.planner.sim import _Answer, _Job

FLUSH_S = 0.02  # RolloutRole.flush_s: a placed group waits at most this long in rollout's outbox


class Outbox:
    """Placed groups not sent yet, and since when the oldest waits."""

    def __init__(self) -> None:
        self.groups: list[list[_Answer]] = []
        self.since: float | None = None

    def add(self, group: list[_Answer], now: float) -> None:
        self.groups.append(group)
        self.since = now if self.since is None else self.since


class _Loop:
    """The state of one rollout call (one worker; sync: one step of one rank)."""

    def __init__(self, job: _Job, only: int | None, rank: int, share: int | None):
        wl = job.wl
        self.sync = only is not None
        self.share = share or wl.prompts_per_step
        self.live: list[_Answer] = []
        self.waiting: deque[list[_Answer]] = deque()
        self.members: dict[int, list[_Answer]] = {}
        self.back: list[_Answer] = []  # hook: answers back from the environment
        self.away = 0  # ... and still there
        self.outbox = Outbox()
        self.version = only if only is not None else 0
        self.total = self.share * (1 if self.sync else wl.steps)
        self.fetched = self.taken = 0

    def turn_end(self, x: _Answer, turns: int) -> int:
        """Tokens at which the answer's current turn ends (its length at the last turn)."""
        if not x.turns_left:
            return x.length
        return math.ceil(x.length * (turns - x.turns_left) / turns)


def _ctx(wl: Any, rows: list[_Answer]) -> float:
    return wl.prompt_len + (float(np.mean([x.done for x in rows])) if rows else 0.0)


def _reward_s(job: _Job, rows: list[_Answer]) -> float:
    """Rollout's own CPU for the rewards of ``rows`` (local rewards, scored in its round)."""
    wl = job.wl
    return job.cost.reward_s(len(rows)) if wl.reward_in_rollout and not wl.reward_latency_s and rows else 0.0


def run(job: _Job, threads: int, only: int | None, rank: int, share: int | None) -> Iterator:
    wl, cost = job.wl, job.cost
    role = job.name("rollout", rank)
    s = _Loop(job, only, rank, share)
    while True:
        if not s.sync and job.version > s.version:
            secs = cost.swap_s(len(s.live), _ctx(wl, s.live), threads, wl.sync_fraction)
            yield from job.work(role, "swap", secs, threads)
            s.version = job.version
            job.counts["swap"] += 1
        n = min(s.total - s.fetched, s.share - s.taken, job.placer.admits(s.version) if not s.sync else s.share)
        if not s.waiting and n > 0:  # one fetch: up to the rest of the current prompt partition
            if not s.sync:  # a data-plane round trip in rollout's process (sync: in its step overhead)
                yield job.overheads[0]
            groups = job.fetch(n, only if only is not None else -1, rank)
            job.counts["prompt_fetch"] += 1
            s.members.update((g[0].group, g) for g in groups)
            s.waiting.extend(groups)
            s.fetched, s.taken = s.fetched + n, (s.taken + n) % s.share
        yield from _admit(job, s, role, threads)
        if not s.live:
            _maybe_send(job, s, idle=True)
            if s.fetched >= s.total and not s.waiting and not s.back and not s.away \
                    and not job.scoring and not s.outbox.groups and (s.sync or s.version >= wl.steps):
                return  # (stream/async: it still swaps in every version, the last one too, as the real one)
            yield job.changed  # idle at the staleness bound (new weights), or rewards / turns in flight
            continue
        yield from _decode(job, s, role, threads)
        _maybe_send(job, s, idle=False)


def _admit(job: _Job, s: _Loop, role: str, threads: int) -> Iterator:
    """Answers back from the environment first, then waiting groups, into free slots."""
    wl, a, cost = job.wl, job.a, job.cost
    if s.back:
        rows, s.back = s.back[:max(0, a.slots - len(s.live))], s.back[max(0, a.slots - len(s.live)):]
        if rows:
            yield from job.work(role, "prefill", cost.prefill_s(len(rows), _ctx(wl, rows), threads), threads)
            job.counts["extend"] += 1
            s.live += rows
    free = (a.slots - len(s.live)) // wl.group_size
    start = [s.waiting.popleft() for _ in range(min(free, len(s.waiting)))]
    if not start:
        return
    rows = [x for g in start for x in g]
    for x in rows:
        x.version = s.version
    for g in start if not s.sync else ():
        job.placer.start(g[0].group, s.version)
    done = [x for x in rows if x.length <= 1] if wl.prefill_token else []
    secs = cost.prefill_s(len(rows), wl.prompt_len, threads) + _reward_s(job, done)
    yield from job.work(role, "prefill", secs, threads)
    job.counts["prefill"] += 1
    if wl.prefill_token:  # the first token comes with the prefill: length - 1 decode rounds
        for x in rows:
            x.done = 1
        for x in done:
            job.generated(x, s.members[x.group], s.outbox)
        rows = [x for x in rows if x.done < x.length]
    s.live += rows


def _decode(job: _Job, s: _Loop, role: str, threads: int) -> Iterator:
    """One decode round (``token_chunk`` tokens) of every live answer."""
    wl, cost = job.wl, job.cost
    step = min(max(1, wl.token_chunk), min(s.turn_end(x, wl.turns) - x.done for x in s.live))
    finishing = [x for x in s.live if x.done + step >= x.length]
    secs = step * cost.decode_s(len(s.live), _ctx(wl, s.live), threads) + _reward_s(job, finishing)
    yield from job.work(role, "decode", secs, threads)
    job.counts["decode"] += 1
    keep = []
    for x in s.live:
        x.done += step
        if x.done >= x.length:
            job.generated(x, s.members[x.group], s.outbox)
        elif x.turns_left and x.done >= s.turn_end(x, wl.turns):  # hook: a turn ends, the environment answers
            x.turns_left -= 1
            s.away += 1
            job.env.at(job.env.now + wl.env_latency_s, functools.partial(_returns, job, s, x))
        else:
            keep.append(x)
    s.live = keep


def _returns(job: _Job, s: _Loop, x: _Answer) -> None:
    s.away -= 1
    s.back.append(x)
    job.changed.fire()


def _maybe_send(job: _Job, s: _Loop, idle: bool) -> None:
    """Send the outbox when the real rollout would (module doc); sync hands rows over in memory."""
    box = s.outbox
    if not box.groups:
        return
    if s.sync:
        job.send(box, sync=True)
        return
    per: dict[int, int] = {}
    for g in box.groups:
        per[g[0].partition] = per.get(g[0].partition, 0) + 1
    complete = any(job.sent[p] + n >= job.wl.prompts_per_step for p, n in per.items())
    assert box.since is not None  # set with its first group
    if idle or complete or job.env.now - box.since >= FLUSH_S:
        for p, n in per.items():
            job.sent[p] += n
        job.send(box, sync=False)
