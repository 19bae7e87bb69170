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
  drop only removes a running group, so every remaining deadline stays feasible;
* **over-provisioning** (``extra = E > 0``, ``rollout.overprovision``): admission lets ``E``
  more live groups run, ``started - dropped < (v + k + 1) * P + E``, so a step fills with
  its *fastest* groups and the stragglers keep running into the next step (APRIL). Those
  ``E`` groups break Hall's condition, so guarantees become per group:

  - a fresh group starts **soft**: it takes the lowest step ``<= its deadline`` with room
    that keeps every *firm* group feasible (EDF over the firm groups only) and, among
    those, loses the fewest other running groups (the most running groups that can still
    be placed; EDF greedy, exact because every group's window starts at ``lowest``);
  - a soft group that can no longer be placed (every step ``<= deadline`` is full, or its
    last free slots are owed to firm groups) is **stalled** (:meth:`expire`,
    ``complete`` returns None): it will not be trained as it is. :meth:`retry` restarts it
    from its prompt at version ``v`` (deadline ``v + k``; its tokens are thrown away) as a
    **firm** group, only when the firm groups plus it are EDF-feasible (else it waits for a
    newer version): a prompt is thrown away at most once, then trained by its deadline.
    Firm groups never miss a deadline;
  - a fresh group starts only while the firm and stalled groups leave a free slot up to
    its deadline (a soft group with no room could only be thrown away);
  - with ``k = 0`` no group can outlive its step (it started at ``v``, so it may only be
    trained at ``v``): every straggler is stalled and restarted at ``v + 1``. That cuts a
    step's tail only when lengths vary per *sample* (a fresh draw), and then biases the
    trained answers toward the short ones (each prompt's first draw is kept only if it is
    among the fastest); with ``k >= 1`` a straggler that finishes within ``k`` more steps
    carries over with nothing thrown away. With ``E = 0`` every group is firm and the
    rules above reduce exactly to the ones before (the property tests of both hold);
* **resume** (a checkpoint's groups, :mod:`asyncflow.workflow.rollout.inflight`): the placed groups go
  back into their steps (:meth:`refill`), the running ones rejoin with their deadlines, soft
  ones soft and firm ones only where the firm groups stay feasible (:meth:`adopt`), the
  stalled ones stalled (:meth:`adopt_stalled`: a prompt is still thrown away at most once);
  ``started`` counts them all, so admission continues where it was (``started - dropped``: a
  dropped group was given back before the checkpoint, so neither counts it).

Plain logic, no I/O: :class:`~asyncflow.workflow.rollout.RolloutRole` drives it, and a
property test drives it with random completion orders.
"""

from __future__ import annotations

from collections import defaultdict


class GroupPlacer:
    def __init__(self, groups_per_step: int, staleness: int, extra: int = 0):
        if extra < 0:
            raise ValueError(f"extra = {extra}: over-provisioned groups must be >= 0")
        self.P, self.k, self.extra = groups_per_step, staleness, extra
        self.started = 0
        self.dropped = 0  # finished groups never placed (dynamic sampling)
        self.running: dict[int, int] = {}  # group id -> deadline (start version + k)
        self.soft: set[int] = set()  # running groups without a guaranteed slot (fresh, over-provisioning)
        self.stalled: set[int] = set()  # soft groups that missed their deadline; wait for retry (still admitted)
        self.filled: dict[int, int] = defaultdict(int)  # step -> groups placed
        self.lowest = 0  # lowest step that is not full
        self.crossed: set[int] = set()  # running groups that were running when a step filled
        self.carried = 0  # groups placed after running across a step boundary
        self.stalls = 0  # groups stalled (thrown away and restarted)

    def admits(self, version: int, extra: int = 0) -> int:
        """How many more groups may start now (``extra`` already promised, e.g. fetched)."""
        n = (version + self.k + 1) * self.P + self.extra - (self.started - self.dropped) - extra
        if self.extra:  # and only while firm and stalled groups leave room up to the deadline
            d = version + self.k
            firm = sum(1 for g, e in self.running.items() if g not in self.soft and e <= d)
            n = n if self._free(d, None) - firm - len(self.stalled) > 0 else 0
        return max(0, n)

    def start(self, gid: int, version: int) -> None:
        if not self.admits(version):
            raise RuntimeError(f"group {gid} started at version {version} beyond the admission limit")
        self.started += 1
        self.running[gid] = version + self.k
        if self.extra:
            self.soft.add(gid)

    def restart(self, gid: int, version: int) -> None:
        """A running group starts again from its prompt at ``version`` (``on_swap=discard``):
        it keeps its admission slot and its deadline moves to ``version + k``. Moving a
        deadline later only relaxes Hall's condition, and ``started`` is unchanged, so every
        guarantee above still holds."""
        if gid not in self.running:
            raise RuntimeError(f"group {gid} restarted but it is not running")
        self.running[gid] = max(self.running[gid], version + self.k)

    def adopt(self, gid: int, version: int, soft: bool = False, crossed: bool = False) -> bool:
        """A group started at ``version`` before a restart joins as running (it continues, its
        deadline still ``version + k``), counted as started, if every firm group stays feasible
        with it; False (nothing changes) if not: restart it from its prompt instead. A ``soft``
        group (over-provisioning) joins soft, with no check: it had no guaranteed slot before
        either, and is stalled as before if it finds none; ``crossed``: it was running when a
        step filled (placed, it counts as carried)."""
        if gid in self.running or not (soft or self._feasible(None, add=version + self.k)):
            return False
        self.started += 1
        self.running[gid] = version + self.k
        if soft:
            self.soft.add(gid)
        if crossed:
            self.crossed.add(gid)
        return True

    def adopt_stalled(self, gid: int) -> None:
        """A group stalled before a restart (waiting for :meth:`retry`) is stalled again,
        counted as started (it held its admission), not counted as a new stall."""
        if gid in self.running or gid in self.stalled:
            raise RuntimeError(f"group {gid} adopted as stalled but it is already running or stalled")
        self.started += 1
        self.stalled.add(gid)

    def refill(self, step: int) -> None:
        """A group placed in ``step`` before a restart, not trained, is placed there again (counted
        as started): the placement the original run made, so every guarantee still holds."""
        self.started += 1
        self.filled[step] += 1
        while self.filled[self.lowest] >= self.P:
            del self.filled[self.lowest]
            self.lowest += 1

    def drop(self, gid: int) -> None:
        """The finished group ``gid`` will not be trained: forget it, free its admission."""
        self._forget(gid)
        self.dropped += 1

    def complete(self, gid: int) -> int | None:
        """Place the finished group ``gid``; return its step, or None if it is a soft group
        with no step left (it is stalled: restart it with :meth:`retry`)."""
        deadline = self.running[gid]
        firm = gid not in self.soft
        del self.running[gid]
        self.soft.discard(gid)
        best, best_kept = None, -1
        for p in range(self.lowest, deadline + 1):
            if self.filled[p] < self.P and self._feasible(p):
                if not self.soft:  # every running group is firm, so feasible keeps them all:
                    best = p  # the rule without over-provisioning, the lowest feasible step
                    break
                kept = self._kept(p)
                if kept > best_kept:
                    best, best_kept = p, kept
        if best is None:
            if firm:
                raise RuntimeError(f"group {gid} (deadline step {deadline}) has no step left: admission was broken")
            self.running[gid] = deadline  # back as it was, then stalled
            self.soft.add(gid)
            self._stall(gid)
            return None
        self.carried += gid in self.crossed
        self._forget(gid)
        self.filled[best] += 1
        while self.filled[self.lowest] >= self.P:
            del self.filled[self.lowest]
            self.lowest += 1
            self.crossed |= set(self.running)
        return best

    def expire(self) -> list[int]:
        """Stall every soft group whose deadline has passed (every step ``<= deadline`` is
        full); return them, oldest deadline first."""
        gone = sorted((d, g) for g, d in self.running.items() if g in self.soft and d < self.lowest)
        for _, g in gone:
            self._stall(g)
        return [g for _, g in gone]

    def retry(self, gid: int, version: int) -> bool:
        """Restart the stalled group ``gid`` from its prompt at ``version`` as a firm group;
        False (nothing changes) if the firm groups plus it would not be feasible: wait for a
        newer version (retry the oldest stall first)."""
        if gid not in self.stalled:
            raise RuntimeError(f"group {gid} retried but it is not stalled")
        if not self._feasible(None, add=version + self.k):
            return False
        self.stalled.discard(gid)
        self.running[gid] = version + self.k
        return True

    # ------------------------------------------------------------------ internals
    def _stall(self, gid: int) -> None:
        del self.running[gid]
        self.soft.discard(gid)
        self.crossed.discard(gid)
        self.stalled.add(gid)
        self.stalls += 1

    def _forget(self, gid: int) -> None:
        self.running.pop(gid, None)
        self.soft.discard(gid)
        self.crossed.discard(gid)

    def _free(self, d: int, taken: int | None) -> int:
        """Free slots in steps ``lowest..d`` once one more group is placed in ``taken``."""
        return (d - self.lowest + 1) * self.P - (1 if taken is not None and taken <= d else 0) \
            - sum(n for q, n in self.filled.items() if q <= d)

    def _feasible(self, taken: int | None, add: int | None = None) -> bool:
        """After placing one group in step ``taken`` (None: none), can every running *firm*
        group (and one more with deadline ``add``) still be placed by its deadline? (EDF:
        the i-th earliest deadline d needs i slots in steps ``lowest..d``.)"""
        need = 0
        firm = [d for g, d in self.running.items() if g not in self.soft] + ([] if add is None else [add])
        for d in sorted(firm):
            need += 1
            if need > self._free(d, taken):
                return False
        return True

    def _kept(self, taken: int) -> int:
        """How many running groups (firm or soft) can still be placed by their deadlines
        after placing one group in ``taken``: EDF greedy, optimal since all windows start at
        ``lowest``."""
        kept = 0
        for d in sorted(self.running.values()):
            if kept < self._free(d, taken):
                kept += 1
        return kept
