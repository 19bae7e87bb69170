"""Rollout's mutable state, in one typed record: what its loop changes and a checkpoint saves.

:class:`RolloutState` holds every field the rollout loop mutates between two decode steps:
the prompt groups at each stage of their life (fetched, running, finished, being scored,
placed, waiting to start again), the outbox of rows not yet sent, the prompt cursor and the
counters the summary reports. :class:`~asyncflow.workflow.rollout.role.RolloutRole` owns one;
:class:`~asyncflow.workflow.rollout.collect.Collector` (finished answers -> steps) and
:mod:`asyncflow.workflow.rollout.inflight` (checkpoint capture and resume) read and write it.
Nothing else does: the engine batch, the placer's arithmetic and the scorer keep their own.

A group's life (``gid``: its prompt id), each stage one field:

``waiting`` (fetched, not started) -> ``groups`` (running; its requests, kept for restarts)
-> ``finished`` (answers done so far) -> ``scoring``/``opened`` (rewards in flight) ->
``outbox`` (placed in a step, not sent) -> the data plane, and ``placed`` (kept until trained,
for a checkpoint). Off the main path: ``restarts`` (on_swap=discard) and ``stale``
(over-provisioning's stalled stragglers) wait to start again from their prompts.

Invariant: a running group id is in ``groups`` until it is placed or dropped; its answers are
in exactly one of the batch (live), ``finished``, ``scoring`` (with its submission id) or
nowhere yet.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

from asyncflow.engines.types import Completion, Request
from asyncflow.workflow.placement import GroupPlacer

# a placed group: (its step, its answers, their raw rewards when rollout scored them)
Placed = tuple[int, list[Completion], "list[float] | None"]


@dataclass
class RolloutState:
    """Everything rollout's loop mutates (see the module doc for each group's stages)."""

    placer: GroupPlacer  # admission control and step placement (its own arithmetic)
    groups: dict[int, list[Request]] = field(default_factory=dict)  # running group id -> its requests
    waiting: deque[list[Request]] = field(default_factory=deque)  # fetched prompt groups not started yet
    restarts: deque[int] = field(default_factory=deque)  # discarded groups waiting to start again
    stale: deque[int] = field(default_factory=deque)  # stalled stragglers (over-provisioning), to start again
    finished: defaultdict[int, list[Completion]] = field(default_factory=lambda: defaultdict(list))
    scoring: dict[int, tuple[int, list[Completion]]] = field(default_factory=dict)  # gid -> (submission, answers)
    opened: dict[int, int] = field(default_factory=dict)  # gid -> submission id, answers still finishing
    sid: int = 0  # last submission id given to the scorer
    outbox: defaultdict[int, list[Completion]] = field(default_factory=lambda: defaultdict(list))  # step -> rows
    rewards: defaultdict[int, list[float]] = field(default_factory=lambda: defaultdict(list))  # step -> outbox's
    outbox_since: float | None = None  # when the outbox's oldest row was placed (perf_counter)
    placed: dict[int, Placed] = field(default_factory=dict)  # placed, maybe not trained (stream/async)
    produced: defaultdict[int, int] = field(default_factory=lambda: defaultdict(int))  # sample rows sent per step
    partition: int = 0  # the prompt partition prompts are taken from now
    taken: int = 0  # prompts taken from it so far
    discarded: int = 0  # answers (finished or not) thrown away at swaps (discard) and stalls
    groups_scored: int = 0
    groups_dropped: int = 0
    slot_steps: int = 0  # sum over decode steps of live rows (slot utilisation)
    steps: int = 0  # decode steps

    def counters(self) -> dict[str, int]:
        """The counters a checkpoint saves and the summary reports (JSON ``counters``)."""
        return {"discarded": self.discarded, "carried": self.placer.carried, "stalls": self.placer.stalls,
                "scored": self.groups_scored, "dropped": self.groups_dropped, "decode_steps": self.steps}

    def set_counters(self, c: dict[str, int]) -> None:
        """Continue the counters of a checkpoint (:meth:`counters`; a missing one starts at 0)."""
        self.discarded, self.groups_scored, self.groups_dropped = c.get("discarded", 0), c.get("scored", 0), \
            c.get("dropped", 0)
        self.placer.carried, self.placer.stalls, self.steps = c.get("carried", 0), c.get("stalls", 0), \
            c.get("decode_steps", 0)
