"""Consumption bookkeeping of the in-process :class:`~asyncflow.dataplane.core.controller.DataPlane`.

A mixin holding the methods that change what tasks consumed or replace the whole state:
``ack``/``nack`` of hand-outs (:mod:`~asyncflow.dataplane.core.handouts`: rows handed out
by ``get_meta`` are consumed when acknowledged, and go back to their task when the
hand-out expires or is given back), ``reset_consumption``, ``clear_rows``, ``save`` and
``load``, and the lock-held helpers the reads share (acknowledge, expire, wait). Every
method takes the plane's one ``threading.Condition``; every change notifies all waiters.
A wait never sleeps past the next hand-out expiry, so a waiter sees returned rows at once.
"""

from __future__ import annotations

import operator
import os
import threading
import time
from collections.abc import Sequence

import numpy as np

from asyncflow.dataplane.core.handouts import Handouts
from asyncflow.dataplane.core.index import RowIndex
from asyncflow.dataplane.core.persist import data_files, load_state, save_arrays, save_state
from asyncflow.dataplane.core.rules import BatchMeta, HandoutExpired
from asyncflow.dataplane.core.schema import Schema
from asyncflow.dataplane.core.storage import Storage

__all__ = ["Consumption"]


class Consumption:
    """Acknowledgements, consumption resets and persistence of a :class:`DataPlane`."""

    schema: Schema
    _cond: threading.Condition
    _index: RowIndex
    _storage: Storage
    _handouts: Handouts

    def ack(self, meta: BatchMeta) -> None:
        """Acknowledge ``meta``'s rows without reading them (they become consumed).

        Raises :class:`HandoutExpired` if its hand-out expired; a no-op if already acknowledged."""
        with self._cond:
            self._ack_locked(meta)

    def nack(self, meta: BatchMeta) -> None:
        """Give ``meta``'s unacknowledged rows back to its task now (they are ready again;
        a later ``get_data``/``ack`` of ``meta`` raises :class:`HandoutExpired`)."""
        with self._cond:
            got = self._handouts.take_back(meta.handout)
            if got is not None:
                self._index.unconsume(got.partition, got.task, got.rows)
                self._cond.notify_all()

    def reset_consumption(self, task: str) -> None:
        """Forget what ``task`` consumed: every live row can be handed to it again.

        For re-reading data (another epoch, a restarted consumer). Wakes waiters.
        """
        with self._cond:
            self._index.reset_consumption(task)
            self._handouts.forget_task(task)
            self._cond.notify_all()

    def clear_rows(self, rows: Sequence[int]) -> None:
        """Drop single rows (every field, tag and consumption mark) and free their capacity.

        Raises ``ValueError`` naming the first row that does not exist; then nothing is
        dropped. Their partitions stay (possibly empty). Wakes putters blocked on capacity.
        """
        rows = [operator.index(r) for r in rows]
        with self._cond:
            self._storage.drop(self._index.drop_rows(rows))
            self._cond.notify_all()

    def save(self, path: str | os.PathLike) -> None:
        """Write the whole state to directory ``path``: ``index.msgpack`` + ``data.npz``.

        Unconsumed rows, consumption marks, tags, seals and counters are all kept; no
        pickle is used (msgpack + ``np.savez``). Readers and writers wait while it runs.
        Rows handed out and not acknowledged are saved as not consumed.
        """
        with self._cond:
            in_flight = [(h.partition, h.task, h.rows) for h in self._handouts.live()]
            state, arrays = self._index.state(in_flight), self._storage.to_arrays()
            save_state(path, self.schema, state)
            save_arrays(os.path.join(path, "data.npz"), arrays)

    def load(self, path: str | os.PathLike) -> None:
        """Replace the whole state by what :meth:`save` (or a distributed save) wrote.

        The saved schema must equal this one. Wakes every waiter.
        """
        state = load_state(path, self.schema)
        storage = Storage(self.schema)
        for name in data_files(path):
            with np.load(name, allow_pickle=False) as arrays:
                storage.load_arrays(arrays)
        with self._cond:
            self._index, self._storage = RowIndex.from_state(state), storage
            self._handouts = Handouts(self._handouts.ttl)
            self._cond.notify_all()

    # -- internals (called with the lock held) ----------------------------------------
    def _ack_locked(self, meta: BatchMeta) -> None:
        if meta.handout is None:
            return
        self._expire_locked()  # past its TTL is expired, whether or not a waiter noticed yet
        try:
            self._handouts.ack(meta.handout)
        except KeyError:
            raise HandoutExpired(
                f"rows {meta.rows[:8]} of partition {meta.partition!r} went back to the task (given "
                f"back, or not acknowledged within handout_ttl={self._handouts.ttl:g}s); call get_data "
                f"sooner or raise handout_ttl") from None
        meta.handout = None

    def _expire_locked(self) -> None:
        """Rows of hand-outs past their TTL go back to their task (waiters are woken)."""
        expired = self._handouts.expire(time.monotonic())
        for h in expired:
            self._index.unconsume(h.partition, h.task, h.rows)
        if expired:
            self._cond.notify_all()

    def _wait(self, deadline: float | None) -> bool:
        """Wait for a notification (or the next hand-out expiry); ``False`` if the deadline
        has already passed."""
        expiry = self._handouts.next_expiry()
        if deadline is None and expiry is None:
            self._cond.wait()
            return True
        now = time.monotonic()
        if deadline is not None and deadline <= now:
            return False
        wake = min(t for t in (deadline, expiry) if t is not None)
        self._cond.wait(max(wake - now, 0.001))
        return True


