"""The in-process data plane: controller + storage behind one thread-safe API.

Tasks stream samples through a table of rows (samples) x fields (columns). Producers
``put`` columns; consumers ask the controller for up to ``n`` rows whose required fields
are all produced (``get_meta``), then fetch those columns (``get_data``)::

    >>> from asyncflow.dataplane import DataPlane, Field, Schema
    >>> plane = DataPlane(Schema([Field("ids", "int64", ragged=True), Field("reward", "float32")]))
    >>> plane.put({"ids": [[1, 2, 3], [4]]}, partition="step0")
    [0, 1]
    >>> plane.get_meta("reward_fn", ["ids"], n=2)
    BatchMeta(partition='step0', rows=[0, 1], fields=['ids'], dropped=[])
    >>> plane.put({"reward": [1.0, 0.0]}, partition="step0", rows=[0, 1])
    [0, 1]
    >>> meta, batch = plane.get_batch("trainer", ["ids", "reward"], n=2)
    >>> [len(x) for x in batch["ids"]], batch["reward"].tolist()
    ([3, 1], [1.0, 0.0])

Wiring: :class:`DataPlane` owns a :class:`~asyncflow.dataplane.core.index.RowIndex` (control plane)
and a :class:`~asyncflow.dataplane.core.storage.Storage` (data plane); neither knows the other. A
distributed deployment keeps these method signatures, hence plain picklable data only.

Invariants (tested, including under random thread interleavings):

* a row is consumed at most once per task (consumed = acknowledged + dropped): rows
  handed out by ``get_meta`` are consumed when ``get_data`` (or ``ack``) acknowledges
  them; unacknowledged after ``handout_ttl`` seconds (or ``nack``) they go back to the
  task (:mod:`~asyncflow.dataplane.core.handouts`); ``get_batch`` acknowledges at once;
* a row is never handed out before every required field is produced;
* a put is all-or-nothing: the whole write is validated (schema, tags, target rows,
  write-once fields) before anything is stored;
* back-pressure never drops: a put that would exceed ``capacity`` waits until ``clear``
  frees room, or raises :class:`QueueTimeout`, and stores nothing in that case.

Concurrency: one ``threading.Condition`` guards index and storage; validating/copying puts
and stacking fetched columns run outside it, and blocked callers wait on it, so they never
hold up others. Every change notifies all waiters; no fairness between blocked putters.
"""

from __future__ import annotations

import operator
import threading
import time
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from asyncflow.dataplane.core.consumption import Consumption
from asyncflow.dataplane.core.handouts import HANDOUT_TTL_S, Handouts
from asyncflow.dataplane.core.index import RowIndex
from asyncflow.dataplane.core.rules import (
    BatchMeta,
    Data,
    QueueClosed,
    QueueTimeout,
    check_request,
    try_sample,
)
from asyncflow.dataplane.core.samplers import Sampler, SequentialSampler
from asyncflow.dataplane.core.schema import Schema, prepare_write
from asyncflow.dataplane.core.storage import Storage, assemble

__all__ = ["BatchMeta", "DataPlane", "QueueClosed", "QueueTimeout", "check_request", "try_sample"]


class DataPlane(Consumption):
    """Thread-safe in-process data plane (controller + one storage unit).

    Args:
        schema: the declared fields; every write is validated against it.
        capacity: maximum live rows over all partitions (``None``: unbounded). New rows
            wait for room; only :meth:`clear` frees it (consumption does not, since other
            tasks may still need the row).
        handout_ttl: seconds a ``get_meta`` hand-out may stay unacknowledged before its
            rows go back to the task (:mod:`~asyncflow.dataplane.core.handouts`).
    """

    def __init__(self, schema: Schema, capacity: int | None = None, handout_ttl: float = HANDOUT_TTL_S) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be >= 1 or None, got {capacity}")
        self.schema = schema
        self.capacity = capacity
        self._index = RowIndex()
        self._storage = Storage(schema)
        self._handouts = Handouts(handout_ttl)
        self._cond = threading.Condition()
        self._closed = False
        self._puts = 0
        self._gets = 0

    # -- writes ------------------------------------------------------------------------
    def put(
        self,
        data: Mapping[str, Any],
        partition: Hashable = 0,
        rows: Sequence[int] | None = None,
        tags: Mapping[str, Sequence[int]] | None = None,
        timeout: float | None = None,
    ) -> list[int]:
        """Write columns, either as new rows or into existing rows; return the row ids.

        Args:
            data: field -> per-row values (see :meth:`Schema.validate`).
            partition: partition of the rows (e.g. the training step).
            rows: ``None`` to create new rows (global ids, increasing, never reused);
                otherwise existing rows of ``partition`` to add fields to.
            tags: small per-row integers for samplers (``group``, ``version``,
                ``tokens``, ...), one per row; merged with earlier tags (last write wins).
            timeout: seconds to wait for capacity (``None``: forever).

        Raises:
            SchemaError: invalid data or tags. ValueError: unknown row, row of another
            partition, field already written, new rows into a sealed partition, more new
            rows than ``capacity``. QueueTimeout: no room in time. QueueClosed: closed.
            In every case nothing is written.

        >>> from asyncflow.dataplane import Field
        >>> plane = DataPlane(Schema([Field("x", "int64")]))
        >>> plane.put({"x": [5, 6]}, tags={"group": [0, 0]})
        [0, 1]
        """
        rows, columns, n_rows, tag_lists = prepare_write(self.schema, data, rows, tags)
        if rows == []:
            return []
        if rows is None and self.capacity is not None and n_rows > self.capacity:
            raise ValueError(f"put of {n_rows} new rows can never fit capacity {self.capacity}")
        deadline = _deadline(timeout)
        with self._cond:
            if rows is None:
                while True:
                    self._check_open(f"put of {n_rows} rows into partition {partition!r}")
                    self._index.check_new(partition)
                    if self.capacity is None or self._index.live_rows + n_rows <= self.capacity:
                        break
                    if not self._wait(deadline):
                        live = self._index.live_rows
                        raise QueueTimeout(
                            f"put timed out after {timeout}s waiting for room for {n_rows} new "
                            f"rows in partition {partition!r} (live rows {live}, capacity "
                            f"{self.capacity}); clear() a consumed partition to free room"
                        )
                rows = self._index.allocate(partition, n_rows)
            else:
                self._check_open(f"put into rows of partition {partition!r}")
                self._index.check_write(partition, rows, columns)
            self._storage.write(rows, columns)
            self._index.mark_produced(partition, rows, columns, tag_lists)
            self._puts += 1
            self._cond.notify_all()
        return list(rows)

    def put_nowait(
        self,
        data: Mapping[str, Any],
        partition: Hashable = 0,
        rows: Sequence[int] | None = None,
        tags: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        """:meth:`put` for producers that do not need the row ids back.

        In process it is :meth:`put` (errors raise here). A remote client sends it without
        waiting for the answer (no round trip on the producer's hot path) and raises an
        error of a failed put at its next call; ``flush()`` waits for all of them.
        """
        self.put(data, partition=partition, rows=rows, tags=tags)

    def flush(self) -> None:
        """Wait until every ``put_nowait`` of this client is applied (in process: a no-op)."""

    def seal(self, partition: Hashable) -> None:
        """Declare that no new rows will be added to ``partition``.

        Consumers of a sealed partition get a final, possibly short (even empty), batch
        once every remaining row is ready instead of waiting for ``min_n`` rows. An unknown
        (or already cleared) partition is created empty and sealed.
        """
        with self._cond:
            self._index.seal(partition)
            self._cond.notify_all()

    def clear(self, partition: Hashable) -> None:
        """Drop every row of ``partition`` and free its capacity (unknown: no-op).

        Wakes putters blocked on capacity. The partition is forgotten: a later put with the
        same name starts a new, unsealed partition.
        """
        with self._cond:
            self._storage.drop(self._index.drop(partition))
            self._cond.notify_all()

    def close(self) -> None:
        """Refuse further puts and gets; every blocked caller raises :class:`QueueClosed`.

        Data stays readable: ``get_data`` on metas already handed out still works.
        """
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    # -- reads -------------------------------------------------------------------------
    def get_meta(
        self,
        task: str,
        fields: Sequence[str],
        n: int,
        partition: Hashable | None = None,
        sampler: Sampler | None = None,
        min_n: int | None = None,
        block: bool = True,
        timeout: float | None = None,
    ) -> BatchMeta:
        """Choose up to ``n`` rows for ``task`` and hand them out (consumed once acknowledged).

        Ready rows are those of ``partition`` with all ``fields`` produced and not yet
        consumed by ``task``; ``sampler`` (default :class:`SequentialSampler`) picks among
        them. The call returns once the sampler chooses at least ``min_n`` rows (default
        ``n``), or, for a sealed partition whose remaining rows are all ready, whatever
        the sampler gives (possibly fewer, even none). ``partition=None`` looks at every
        live partition, oldest first, and answers from the first one that yields rows.

        Args:
            task: consumer name; each row is consumed at most once per task.
            fields: fields that must be produced (and that ``get_data`` will read).
            n: batch size asked of the sampler.
            partition: one partition, or ``None`` for any.
            sampler: selection policy (picklable).
            min_n: fewest chosen rows worth returning, ``0 <= min_n <= n``.
            block: wait for ``min_n`` rows; ``False`` answers at once (an empty meta,
                nothing consumed, if fewer than ``min_n``).
            timeout: seconds to wait (``None``: forever).

        Raises:
            QueueTimeout, QueueClosed, SchemaError (unknown field), ValueError (bad
            arguments, or a sampler that breaks its contract or lacks its tags).

        >>> from asyncflow.dataplane import Field
        >>> plane = DataPlane(Schema([Field("x", "int64")]))
        >>> _ = plane.put({"x": [1, 2, 3]}, partition=0)
        >>> plane.seal(0)
        >>> plane.get_meta("t", ["x"], n=2)
        BatchMeta(partition=0, rows=[0, 1], fields=['x'], dropped=[])
        >>> plane.get_meta("t", ["x"], n=2, partition=0)  # sealed: the short last batch
        BatchMeta(partition=0, rows=[2], fields=['x'], dropped=[])
        """
        with self._cond:
            return self._get_meta_locked(task, fields, n, partition, sampler, min_n, block, timeout, True)

    def get_data(self, meta: BatchMeta, fields: Sequence[str] | None = None) -> Data:
        """Fetch columns of ``meta.rows`` (default ``meta.fields``), in ``meta.rows`` order.

        Fixed fields come as one array ``[len(meta), *shape]``; ragged fields as a list of
        1-D read-only arrays (views of the store; copy before modifying). The first
        successful call acknowledges ``meta``'s hand-out (its rows become consumed).

        Raises:
            SchemaError: unknown field. ValueError: a row no longer exists (partition
            cleared) or a field is not produced for some row. HandoutExpired: the
            hand-out was not acknowledged in time (its rows went back to the task).
        """
        names = self.schema.check_names(meta.fields if fields is None else fields)
        with self._cond:
            gathered = self._gather_locked(meta.rows, names)
            self._ack_locked(meta)
        return assemble(self.schema, gathered)

    def get_batch(
        self, task: str, fields: Sequence[str], n: int, **kwargs: Any
    ) -> tuple[BatchMeta, Data]:
        """``get_meta`` then ``get_data`` of ``fields`` in one call (one round trip remotely).

        Takes the keyword arguments of :meth:`get_meta`. Atomic with respect to ``clear``.
        """
        with self._cond:
            meta = self._get_meta_locked(task, fields, n, **kwargs)  # acknowledged at once
            gathered = self._gather_locked(meta.rows, meta.fields)
        return meta, assemble(self.schema, gathered)

    def tags(self, rows: Sequence[int]) -> dict[str, list[int]]:
        """Tags defined on every one of ``rows``: ``name -> [value per row]``."""
        with self._cond:
            return self._index.row_tags([operator.index(r) for r in rows])

    def stats(self) -> dict[str, Any]:
        """Counters, as plain ints.

        Keys: ``live_rows``; ``partitions`` (live partition -> row count); ``consumed``
        (task -> rows handed out, all time); ``dropped`` (task -> rows dropped by the
        sampler, all time); ``puts`` (successful put calls); ``gets`` (get_meta/get_batch
        answers, empty ones included); ``rows_allocated`` (new rows, all time); ``in_flight``
        (task -> rows handed out, not acknowledged; counted in ``consumed`` meanwhile).
        """
        with self._cond:
            self._expire_locked()
            return {
                "in_flight": self._handouts.in_flight(),
                "live_rows": self._index.live_rows,
                "partitions": self._index.row_counts(),
                "consumed": dict(self._index.consumed_total),
                "dropped": dict(self._index.dropped_total),
                "puts": self._puts,
                "gets": self._gets,
                "rows_allocated": self._index.rows_allocated,
            }

    def _get_meta_locked(  # the arguments of get_meta
        self, task: str, fields: Sequence[str], n: int, partition: Hashable | None = None,
        sampler: Sampler | None = None, min_n: int | None = None, block: bool = True,
        timeout: float | None = None, hand_out: bool = False,
    ) -> BatchMeta:
        fields, min_n = check_request(self.schema, task, fields, n, min_n)
        sampler = SequentialSampler() if sampler is None else sampler
        deadline = _deadline(timeout)
        what = (
            f"task {task!r} waiting for {min_n}..{n} rows with fields {fields} "
            f"in partition {partition!r}"
        )
        while True:
            self._check_open(what)
            self._expire_locked()
            meta = try_sample(self._index, task, fields, n, partition, sampler, min_n)
            if meta is None and not block:
                meta = BatchMeta(partition, [], fields)
            if meta is not None:
                self._gets += 1
                if hand_out and meta.rows:
                    meta.handout = self._handouts.give(meta.partition, task, meta.rows, time.monotonic())
                return meta
            if not self._wait(deadline):
                raise QueueTimeout(f"get_meta timed out after {timeout}s: {what}")

    def _gather_locked(self, rows: Sequence[int], fields: Sequence[str]) -> dict[str, list]:
        self._index.check_readable(rows, fields)
        return self._storage.gather(rows, fields)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise QueueClosed(f"data plane closed ({what})")

def _deadline(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0 or None, got {timeout}")
    return time.monotonic() + timeout
