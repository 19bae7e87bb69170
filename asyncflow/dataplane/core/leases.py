"""Pins on rows handed out by ``get_batch`` in the distributed deployment.

The controller answers a pinned ``get_meta`` with a *lease* on its rows; the client
fetches their bytes from the storage units, then releases the lease. While a row is
held by a live lease, a ``clear`` that forgets it must not free its bytes: the drop is
*deferred* until the last lease on the row is released (or expires: a client that died
mid-read). Pure bookkeeping, no I/O: the controller asks what to drop and sends it.

Invariants (property-tested): a row is returned for dropping exactly once per
``forget``; never while a live lease holds it; and every forgotten row is returned once
all leases on it are gone. Row ids are never reused, so a deferred drop cannot free a
newer sample's bytes.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable

__all__ = ["Leases"]


class Leases:
    """Row pins by lease id, and the drops they hold back."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._ids = itertools.count(1)
        self._leases: dict[int, tuple[list[int], float]] = {}  # lease -> (rows, expiry)
        self._pins: Counter[int] = Counter()  # row -> live leases holding it
        self._deferred: set[int] = set()  # forgotten rows whose drop waits for the last release

    @property
    def pinned(self) -> int:
        """Rows held by at least one live lease."""
        return len(self._pins)

    @property
    def deferred(self) -> int:
        """Forgotten rows whose bytes are kept for a live lease."""
        return len(self._deferred)

    def pin(self, rows: Iterable[int], now: float) -> int:
        """A new lease on ``rows`` (expires ``ttl`` seconds after ``now``)."""
        lease = next(self._ids)
        rows = list(rows)
        self._leases[lease] = (rows, now + self.ttl)
        self._pins.update(rows)
        return lease

    def forget(self, rows: Iterable[int]) -> list[int]:
        """Rows the index just forgot -> those whose bytes can be dropped now; the others
        are dropped by the :meth:`release` or :meth:`expire` of their last lease."""
        if not self._pins:
            return list(rows)
        now = []
        for row in rows:
            if row in self._pins:
                self._deferred.add(row)
            else:
                now.append(row)
        return now

    def release(self, lease: object) -> list[int]:
        """End ``lease``; return the deferred rows it was the last to hold. An unknown
        lease (already released or expired) releases nothing."""
        # (lease comes off the wire: any object; an unknown one finds nothing, so no int check)
        rows, _ = self._leases.pop(lease, ((), 0.0))  # type: ignore[call-overload]
        free = []
        for row in rows:
            self._pins[row] -= 1
            if self._pins[row] <= 0:
                del self._pins[row]
                if row in self._deferred:
                    self._deferred.discard(row)
                    free.append(row)
        return free

    def expire(self, now: float) -> list[int]:
        """Release every lease past its expiry; return the rows to drop."""
        free: list[int] = []
        if self._leases:
            for lease in [k for k, (_, expiry) in self._leases.items() if expiry <= now]:
                free.extend(self.release(lease))
        return free
