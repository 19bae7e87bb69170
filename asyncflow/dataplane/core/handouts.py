"""Rows handed out by ``get_meta`` and not yet acknowledged: ack-based consumption.

Semantics (every deployment, the same): ``get_meta`` takes the chosen rows out of the
task's ready set at once (no other consumer of the task can get them) and records a
*hand-out* ``(partition, task, rows, expiry)`` whose id travels in ``BatchMeta.handout``.
The rows are *consumed* only when the hand-out is acknowledged: explicitly (``ack(meta)``)
or by the consumer's first successful ``get_data(meta)`` (``get_batch`` acknowledges in the
same call, so existing callers need nothing new). A hand-out not acknowledged within its
TTL (:data:`HANDOUT_TTL_S`, configurable per deployment; a consumer that died or hung)
expires, and so does one its consumer gives back (``nack(meta)``) or whose reply never
reached a live client: its rows that still exist become ready again for that task, in
row order, and the next consumer of the task gets them.

Exactly once per task: an acknowledgement of an expired hand-out is refused
(:class:`~asyncflow.dataplane.core.rules.HandoutExpired`, and ``get_data`` then returns
no data), so a returned row is delivered to at most one successful consumer. An ack of an
unknown id (already acknowledged, or from before a ``load``/``reset_consumption``) is a
no-op. Rows dropped by a sampler are consumed at once (they are never delivered). A
``save`` writes in-flight rows as *not consumed*: the state of a restart is the one in
which their consumer never got them.

Pure bookkeeping, no I/O, not thread-safe (the owner serialises calls). Hand-outs are
kept in the order given, which is their expiry order (one TTL, a monotonic clock), so
checking for expired ones costs O(expired), not O(live).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["HANDOUT_TTL_S", "Handout", "Handouts"]

HANDOUT_TTL_S = 60.0  # default: a hand-out not acknowledged by then returns its rows
_EXPIRED_KEPT = 1 << 16  # ids of expired hand-outs remembered (to refuse their late acks)


@dataclass
class Handout:
    partition: Hashable
    task: str
    rows: list[int]
    expiry: float


class Handouts:
    """Live hand-outs by id, and the ids of recently expired ones."""

    def __init__(self, ttl: float = HANDOUT_TTL_S) -> None:
        if not (isinstance(ttl, (int, float)) and ttl > 0):
            raise ValueError(f"handout_ttl must be a number of seconds > 0, got {ttl!r}")
        self.ttl = float(ttl)
        self._ids = itertools.count(1)
        self._live: dict[int, Handout] = {}
        self._expired: OrderedDict[int, None] = OrderedDict()

    def give(self, partition: Hashable, task: str, rows: list[int], now: float) -> int:
        """Record a hand-out of ``rows`` (already taken out of ``task``'s ready set)."""
        hid = next(self._ids)
        self._live[hid] = Handout(partition, task, list(rows), now + self.ttl)
        return hid

    def ack(self, hid: object) -> Handout | None:
        """Acknowledge: the hand-out (its rows now consumed), or ``None`` if unknown.
        Raises ``KeyError`` if it expired (its rows were returned)."""
        got = self._live.pop(hid, None) if isinstance(hid, int) else None
        if got is None and hid in self._expired:
            raise KeyError(hid)
        return got

    def take_back(self, hid: object) -> Handout | None:
        """End a hand-out early (given back, or its client is gone); ``None`` if unknown."""
        if not isinstance(hid, int):
            return None
        got = self._live.pop(hid, None)
        if got is not None:
            self._remember(hid)
        return got

    def expire(self, now: float) -> list[Handout]:
        """End every hand-out past its expiry; return them (their rows go back)."""
        due = []
        for hid, x in self._live.items():  # in expiry order (same TTL, given in time order)
            if x.expiry > now:
                break
            due.append(hid)
        out = []
        for hid in due:
            out.append(self._live.pop(hid))
            self._remember(hid)
        return out

    def next_expiry(self) -> float | None:
        return next(iter(self._live.values())).expiry if self._live else None

    def forget_task(self, task: str) -> None:
        """``reset_consumption(task)``: its hand-outs end without returning anything."""
        for hid in [h for h, x in self._live.items() if x.task == task]:
            del self._live[hid]

    def live(self) -> list[Handout]:
        return list(self._live.values())

    def in_flight(self) -> dict[str, int]:
        """Task -> rows handed out and not acknowledged."""
        out: dict[str, int] = {}
        for x in self._live.values():
            out[x.task] = out.get(x.task, 0) + len(x.rows)
        return out

    def _remember(self, hid: int) -> None:
        self._expired[hid] = None
        while len(self._expired) > _EXPIRED_KEPT:
            self._expired.popitem(last=False)
