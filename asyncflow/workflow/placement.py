"""Which training step a finished answer group goes to: completion order within the bound.

Rollout answers finish out of order (long tails). Binding every prompt to a fixed step
makes that step wait for its slowest answer; instead a finished group fills the lowest
step that is not full yet, so fast groups fill the current step and slow ones land in a
later one. The staleness bound stays exact, per sample:

* a group started under policy version ``w`` has the *deadline* ``w + k``: it must be
  trained by the trainer at a version ``<= w + k``, i.e. placed in a step ``<= w + k``
  (step ``p`` is trained at version ``p``);
* **admission** (:meth:`GroupPlacer.admits`): a group may start at version ``v`` only while
  ``started < (v + k + 1) * P`` (P groups per step). Then, for every deadline ``D``, the
  groups with deadline ``<= D`` number at most ``(D + 1) * P`` = the slots of steps
  ``0..D`` (Hall's condition), so a placement exists;
* **placement** (:meth:`GroupPlacer.complete`): the lowest step that is not full, unless
  taking it would leave some running group without a slot before its deadline (an
  earliest-deadline-first check); then the next such step. With ``k = 0`` this is the
  on-policy schedule: every group of step ``v`` starts at ``v`` and lands in ``v``;
* **drop** (:meth:`GroupPlacer.drop`, DAPO dynamic sampling): a finished group that will
  not be trained (all rewards equal) is never placed and gives its admission back
  (``live = started - dropped`` is what admission counts). Hall's condition still holds:
  the live groups with deadline ``<= D`` all started while ``live < (D + 1) * P``, and a
  drop only removes a running group, so every remaining deadline stays feasible.

Plain logic, no I/O: :class:`~asyncflow.workflow.rollout.RolloutRole` drives it, and a
property test drives it with random completion orders.
"""

from __future__ import annotations

from collections import defaultdict


class GroupPlacer:
    def __init__(self, groups_per_step: int, staleness: int):
        self.P, self.k = groups_per_step, staleness
        self.started = 0
        self.dropped = 0  # finished groups never placed (dynamic sampling)
        self.running: dict[int, int] = {}  # group id -> deadline (start version + k)
        self.filled: dict[int, int] = defaultdict(int)  # step -> groups placed
        self.lowest = 0  # lowest step that is not full

    def admits(self, version: int, extra: int = 0) -> int:
        """How many more groups may start now (``extra`` already promised, e.g. fetched)."""
        return max(0, (version + self.k + 1) * self.P - (self.started - self.dropped) - extra)

    def start(self, gid: int, version: int) -> None:
        if not self.admits(version):
            raise RuntimeError(f"group {gid} started at version {version} beyond the admission limit")
        self.started += 1
        self.running[gid] = version + self.k

    def restart(self, gid: int, version: int) -> None:
        """A running group starts again from its prompt at ``version`` (``on_swap=discard``):
        it keeps its admission slot and its deadline moves to ``version + k``. Moving a
        deadline later only relaxes Hall's condition, and ``started`` is unchanged, so every
        guarantee above still holds."""
        if gid not in self.running:
            raise RuntimeError(f"group {gid} restarted but it is not running")
        self.running[gid] = max(self.running[gid], version + self.k)

    def drop(self, gid: int) -> None:
        """The finished group ``gid`` will not be trained: forget it, free its admission."""
        del self.running[gid]
        self.dropped += 1

    def complete(self, gid: int) -> int:
        """Place the finished group ``gid``; return its step."""
        deadline = self.running.pop(gid)
        p = self.lowest
        while p <= deadline:
            if self.filled[p] < self.P and self._feasible(p):
                self.filled[p] += 1
                while self.filled[self.lowest] >= self.P:
                    del self.filled[self.lowest]
                    self.lowest += 1
                return p
            p += 1
        raise RuntimeError(f"group {gid} (deadline step {deadline}) has no step left: admission was broken")

    def _feasible(self, taken: int) -> bool:
        """After placing one group in step ``taken``, can every running group still be
        placed by its deadline? (EDF: the i-th earliest deadline d needs i slots in
        steps ``lowest..d``.)"""
        need = 0
        for d in sorted(self.running.values()):
            need += 1
            free = (d - self.lowest + 1) * self.P - (1 if taken <= d else 0) \
                - sum(n for q, n in self.filled.items() if q <= d)
            if need > free:
                return False
        return True
