"""Distributed data plane servers: one controller + N storage units over ZeroMQ.

Wiring (each box its own process; clients in any process)::

    client --DEALER--> controller (ROUTER)   row ids, fields, tags: alloc/commit/get_meta/...
    client --DEALER--> storage unit i (ROUTER)   raw column buffers of its rows (shard_of(row) == i)
    controller --DEALER--> storage units     drops of cleared rows, save/load (never blocking:
                                             :mod:`asyncflow.dataplane.transport.unit_links`)

* The controller owns the control plane (a :class:`~asyncflow.dataplane.core.index.RowIndex`) and
  never sees sample data; it hands out rows with the same
  :func:`~asyncflow.dataplane.core.controller.try_sample` as the in-process ``DataPlane``.
* A storage unit (:mod:`asyncflow.dataplane.transport.storage_server`) owns a
  :class:`~asyncflow.dataplane.core.storage.Storage` of its shard and knows nothing of tasks; it
  keeps received buffers as read-only views (no copy).
* A put is ``alloc`` (new rows) or ``check_write`` (existing rows; reserves the
  ``(row, field)`` pairs so two writers cannot both pass), then the writes to the units,
  then ``commit``: rows become ready only after their data is stored, so a consumer can
  never be handed a row whose bytes are not there.

Concurrency: each server is one thread running a non-blocking ROUTER loop. A request
that must wait (``get_meta`` for rows not ready yet, ``alloc`` without capacity) is
*parked* with its deadline and retried after every state change, so a waiting client
never holds up another; ``close`` answers every parked request with ``QueueClosed`` and
an expired one gets ``QueueTimeout`` (checked at least every 50 ms).

Safety: bind to 127.0.0.1 by default; with ``creds`` (what :func:`launch` always gives)
every connection is CURVE-authenticated and encrypted and only the job's clients get in
(:mod:`asyncflow.dataplane.transport.server_base`, :mod:`asyncflow.dataplane.transport.auth`);
the controller's own links to the units are CURVE clients too. With ``token`` set, a
request without the same token is refused (``PermissionError``). ``save``/``load`` touch
only paths inside ``state_dir`` (fixed at start; a wire path is a name relative to it,
``..``, absolute paths outside it and escaping symlinks are refused; no ``state_dir``: both
refused). A put allocates at most ``max_rows`` rows per request; a blocked request whose
client disconnected is dropped (its reply bounces, and every second the controller pings
the clients it holds waiters for). Every malformed
request (garbage bytes, unknown op or field, bad dtype, wrong byte count) gets an error
reply and changes nothing; the server goes on. No pickle on any socket. Shared-memory refs
(same host) name only files under the storage unit's own prefix (:mod:`asyncflow.dataplane.transport.shm`).

Ack-based consumption (:mod:`asyncflow.dataplane.core.handouts`): a non-empty ``get_meta``
answer carries a hand-out id; the rows are consumed when the client acknowledges it
(``ack``, sent by its ``get_data`` after the units answered, or by ``get_batch``), and go
back to the task when it expires (``handout_ttl``, checked every idle turn), is given back
(``nack``) or its parked answer bounces off a client that is gone.

``save``/``load``: a consistent snapshot, the units awaited without blocking the loop
(:mod:`asyncflow.dataplane.transport.controller_persist`). Start: the controller asks every
unit its id and what it holds before it serves, and refuses to serve (until a ``load``)
when it starts without state while units hold rows: a controller restarted on its port
(:mod:`asyncflow.dataplane.transport.controller_start`). Commits: accepted only with the
units' write receipts covering every committed ``(row, field)``
(:mod:`asyncflow.dataplane.transport.receipts`), so a client cannot commit what it did not
write.

Atomic ``get_batch`` across processes: the client's ``get_batch`` is ``get_meta`` then
fetches from the units, so a ``clear`` in between would free bytes it is about to read.
It therefore asks with ``pin``: the answer carries a lease, and until the client sends
``unpin`` (after its fetches were answered) the controller *defers* the storage drop of
those rows. The index forgets cleared rows at once (ids are never reused, so deferring
cannot alias newer data) and capacity counts them as free. A lease not released within
:data:`LEASE_TTL_S` (a client that died mid-read) expires and its deferred drops happen.
Plain ``get_meta`` + ``get_data`` stays unpinned: a clear in between fails the fetch with
"not stored", never returns other data. A client that dies between ``check_write`` and
``commit`` leaves its reservation (those fields of those rows stay unwritable until the
rows are cleared).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from asyncflow.dataplane.core.handouts import HANDOUT_TTL_S, Handouts
from asyncflow.dataplane.core.index import RowIndex, check_partition_name
from asyncflow.dataplane.core.leases import Leases
from asyncflow.dataplane.core.rules import (
    BatchMeta,
    HandoutExpired,
    QueueClosed,
    QueueTimeout,
    check_request,
    try_sample,
)
from asyncflow.dataplane.core.schema import Schema, schema_to_msg, validate_tags
from asyncflow.dataplane.transport.auth import Credentials
from asyncflow.dataplane.transport.controller_persist import LEASE_TTL_S, ControllerPersistence
from asyncflow.dataplane.transport.controller_start import ControllerStart
from asyncflow.dataplane.transport.protocol import meta_to_msg, sampler_from_msg
from asyncflow.dataplane.transport.receipts import check_receipts, receipt_key
from asyncflow.dataplane.transport.server_base import _PARKED, MAX_MSG_BYTES, _args, _Server
from asyncflow.dataplane.transport.unit_links import AdminOp, UnitLinks

__all__ = ["MAX_ROWS", "ControllerServer"]  # StorageServer: asyncflow.dataplane.transport.storage_server

MAX_ROWS = 1 << 16  # rows per put (alloc / check_write): a bigger request is refused at once
UNIT_DEADLINE_S = 120.0  # a storage unit that does not answer save/load by then fails it (DataPlaneUnavailable)
_PING_S = 1.0  # how often the clients of parked requests are checked for being gone


@dataclass
class _Parked:
    ident: bytes
    header: dict
    retry: Callable[[], Any]  # returns the answer, or None to keep waiting
    deadline: float | None
    timeout_msg: str = field(default="")


class ControllerServer(ControllerStart, ControllerPersistence, _Server):
    """The control plane: row ids, produced/consumed state, parked waiters."""

    def __init__(self, schema: Schema, storage: Sequence[str], bind: str = "tcp://127.0.0.1:0",
                 token: str | None = None, capacity: int | None = None, creds: Credentials | None = None,
                 state_dir: str | None = None, max_rows: int = MAX_ROWS,
                 max_msg_bytes: int = MAX_MSG_BYTES, handout_ttl: float = HANDOUT_TTL_S,
                 unit_deadline: float = UNIT_DEADLINE_S, receipts: bytes | None = None) -> None:
        super().__init__(bind, token, creds, max_msg_bytes)
        self.receipts = receipts if receipts is not None else receipt_key(creds)  # None: commits unchecked
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be >= 1 or None, got {capacity}")
        self.schema, self.storage_endpoints, self.capacity = schema, list(storage), capacity
        self.state_dir, self.max_rows, self._pinged = state_dir, max_rows, time.monotonic()
        self.index = RowIndex()
        self.closed = False
        self.puts = self.gets = 0
        self.reserved: set[tuple[int, str]] = set()
        self.parked: list[_Parked] = []
        self.units = UnitLinks(self.ctx, self.storage_endpoints, creds, self._tok())
        for s in self.units.socks:
            self.poller.register(s, zmq.POLLIN)  # a unit's reply wakes the loop
        self.admin: AdminOp | None = None  # the save/load waiting for the units
        self.unit_deadline = unit_deadline
        self.leases = Leases(LEASE_TTL_S)
        self.handouts = Handouts(handout_ttl)
        self.parking_ops = frozenset({"alloc", "get_meta", "save", "load"})
        self.ops.update(
            hello=lambda h, f: {"schema": schema_to_msg(self.schema), "storage": self.storage_endpoints,
                                "max_msg_bytes": self.max_msg_bytes},
            alloc=self.alloc, check_write=self.check_write, commit=self.commit, get_meta=self.get_meta,
            seal=self.seal, clear=self.clear, clear_rows=self.clear_rows, close=self.close,
            reset_consumption=self.reset_consumption, tags=self.tags, stats=self.stats,
            save=self.save, load=self.load, unpin=self.unpin, ack=self.ack, nack=self.nack,
        )
        self.start_probe()  # (requests wait for the units' answers: controller_start)

    def handle(self, frames: list) -> None:
        if self.gated and self.held_back(frames):  # (starting, or refusing to serve)
            return
        super().handle(frames)

    # -- writes ------------------------------------------------------------------------
    def alloc(self, header: dict, frames: list, ident: bytes) -> Any:
        partition, n, timeout = _args(header, "partition", "n", "timeout")
        check_partition_name(partition)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"put of new rows needs n >= 1 rows, got {n!r}")
        if n > self.max_rows:
            raise ValueError(f"put of {n} new rows refused: at most {self.max_rows} per put; split the put")
        if self.capacity is not None and n > self.capacity:
            raise ValueError(f"put of {n} new rows can never fit capacity {self.capacity}")

        def retry() -> list[int] | None:
            self._check_open(f"put of {n} rows into partition {partition!r}")
            self.index.check_new(partition)
            if self.capacity is None or self.index.live_rows + n <= self.capacity:
                return self.index.allocate(partition, n)
            return None

        msg = (f"put timed out after {timeout}s waiting for room for {n} new rows in partition "
               f"{partition!r} (capacity {self.capacity}); clear() a consumed partition to free room")
        return self._answer_or_park(ident, header, retry, timeout, msg)

    def check_write(self, header: dict, frames: list) -> None:
        partition, rows, fields = _args(header, "partition", "rows", "fields")
        self._check_open(f"put into rows of partition {partition!r}")
        if not isinstance(rows, list) or len(rows) > self.max_rows:
            raise ValueError(f"put into existing rows needs a list of at most {self.max_rows} rows; split the put")
        fields = self.schema.check_names(fields)
        self.index.check_write(partition, rows, fields)
        for name in fields:
            for row in rows:
                if (row, name) in self.reserved:
                    raise ValueError(f"row {row} field {name!r} is being written by another put; fields are write-once")
        self.reserved.update((row, name) for name in fields for row in rows)

    def commit(self, header: dict, frames: list) -> None:
        partition, rows, fields, tags, abort = _args(header, "partition", "rows", "fields", "tags", "abort")
        if not isinstance(rows, list) or len(rows) > self.max_rows:
            raise ValueError(f"commit needs a list of at most {self.max_rows} rows")
        fields = self.schema.check_names(fields)
        self.reserved.difference_update((row, name) for name in fields for row in rows)
        if abort:
            return
        tag_lists = validate_tags(tags, len(rows))
        if self.receipts is not None:  # only what the units acknowledged storing (receipts.py)
            check_receipts(self.receipts, self.unit_ids, rows, fields, header["a"].get("receipts"))
        try:
            self.index.check_write(partition, rows, fields)
        except ValueError:
            dead = [r for r in rows if not self.index.has_row(r)]
            self._drop_on_units(dead)  # written after their partition was cleared
            raise
        self.index.mark_produced(partition, rows, fields, tag_lists)
        self.puts += 1
        self._wake()

    def seal(self, header: dict, frames: list) -> None:
        (partition,) = _args(header, "partition")
        check_partition_name(partition)
        self.index.seal(partition)
        self._wake()

    def clear(self, header: dict, frames: list) -> None:
        (partition,) = _args(header, "partition")
        self._drop_on_units(self.index.drop(partition))
        self._wake()

    def clear_rows(self, header: dict, frames: list) -> None:
        (rows,) = _args(header, "rows")
        self._drop_on_units(self.index.drop_rows([int(r) for r in rows]))
        self._wake()

    def reset_consumption(self, header: dict, frames: list) -> None:
        (task,) = _args(header, "task")
        self.index.reset_consumption(str(task))
        self.handouts.forget_task(str(task))
        self._wake()

    def close(self, header: dict, frames: list) -> None:
        self.closed = True
        self._wake()

    # -- reads -------------------------------------------------------------------------
    def get_meta(self, header: dict, frames: list, ident: bytes) -> Any:
        task, fields, n, partition, sampler, min_n, block, timeout = _args(
            header, "task", "fields", "n", "partition", "sampler", "min_n", "block", "timeout")
        pin = bool(header["a"].get("pin", False))
        fields, min_n = check_request(self.schema, task, fields, n, min_n)
        sampler = sampler_from_msg(sampler)
        what = f"task {task!r} waiting for {min_n}..{n} rows with fields {fields} in partition {partition!r}"

        def retry() -> list | None:
            self._check_open(what)
            meta = try_sample(self.index, task, fields, n, partition, sampler, min_n)
            if meta is None and not block:
                meta = BatchMeta(partition, [], fields)
            if meta is None:
                return None
            self.gets += 1
            if not meta.rows:
                return meta_to_msg(meta)
            now = time.monotonic()
            lease = self.leases.pin(meta.rows, now) if pin else None
            return [*meta_to_msg(meta), lease, self.handouts.give(meta.partition, task, meta.rows, now)]

        return self._answer_or_park(ident, header, retry, timeout, f"get_meta timed out after {timeout}s: {what}")

    def unpin(self, header: dict, frames: list) -> None:
        """Release a ``get_batch`` lease; drop its rows' bytes if they were cleared meanwhile.
        An unknown lease (expired, or from before a ``load``) is ignored."""
        (lease,) = _args(header, "lease")
        self._send_drops(self.leases.release(lease))

    def ack(self, header: dict, frames: list) -> None:
        """Acknowledge a hand-out (its rows become consumed) and release its lease, if any.
        A hand-out that expired is refused (:class:`HandoutExpired`): its rows went back."""
        handout, lease = _args(header, "handout", "lease")
        if lease is not None:
            self._send_drops(self.leases.release(lease))
        try:
            self.handouts.ack(handout)
        except KeyError:
            raise HandoutExpired(f"hand-out {handout} went back to the task (given back, or not acknowledged "
                                 f"within handout_ttl={self.handouts.ttl:g}s); read sooner, or launch with a "
                                 "longer handout_ttl") from None

    def nack(self, header: dict, frames: list) -> None:
        """Give a hand-out's rows back to its task now (and release its lease, if any)."""
        handout, lease = _args(header, "handout", "lease")
        if lease is not None:
            self._send_drops(self.leases.release(lease))
        self._take_back(handout)

    def _take_back(self, handout: Any) -> None:
        got = self.handouts.take_back(handout)
        if got is not None:
            self.index.unconsume(got.partition, got.task, got.rows)
            self._wake()

    def tags(self, header: dict, frames: list) -> dict:
        return self.index.row_tags([int(r) for r in _args(header, "rows")[0]])

    def stats(self, header: dict, frames: list) -> dict:
        return {
            "live_rows": self.index.live_rows, "partitions": self.index.row_counts(),
            "consumed": dict(self.index.consumed_total), "dropped": dict(self.index.dropped_total),
            "puts": self.puts, "gets": self.gets, "rows_allocated": self.index.rows_allocated,
            "storage_units": len(self.units), "waiting": len(self.parked), "in_flight": self.handouts.in_flight(),
            "pinned": self.leases.pinned, "deferred_drops": self.leases.deferred, "refused": self.refused,
            "not_serving": self.refusal or "",
        }

    # -- internals ---------------------------------------------------------------------
    def _tok(self) -> str:
        return self.token.decode() if self.token else ""

    def _drop_on_units(self, rows: Sequence[int]) -> None:
        """Free the bytes of forgotten rows now, or at their last ``unpin`` if pinned."""
        self._send_drops(self.leases.forget(rows))

    def _send_drops(self, rows: Sequence[int]) -> None:
        if rows and len(self.units):
            self.units.drop(rows)

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise QueueClosed(f"data plane closed ({what})")

    def _answer_or_park(self, ident: bytes, header: dict, retry: Callable[[], Any],
                        timeout: float | None, timeout_msg: str) -> Any:
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 or None, got {timeout}")
        answer = retry()
        if answer is not None:
            return answer
        deadline = None if timeout is None else time.monotonic() + timeout
        self.parked.append(_Parked(ident, header, retry, deadline, timeout_msg))
        return _PARKED

    def _wake(self) -> None:
        """Retry every parked request in arrival order; answer those that can be."""
        still = []
        for p in self.parked:
            try:
                answer = p.retry()
            except Exception as exc:
                self.reply(p.ident, p.header.get("id"), error=exc)
                continue
            if answer is None:
                still.append(p)
            elif not self.reply(p.ident, p.header.get("id"), answer) and isinstance(answer, list) and len(answer) > 5:
                self._take_back(answer[5])  # its client is gone: the rows go back at once
        self.parked = still

    def gone(self, ident: bytes) -> None:
        """Forget the parked requests of a client that disconnected."""
        self.parked = [p for p in self.parked if p.ident != ident]

    def _ping_waiters(self, now: float) -> None:
        """Probe each client with parked requests (a reply it ignores); a bounced probe
        means its connection is gone, and :meth:`gone` drops its waiters."""
        self._pinged = now
        for ident in {p.ident for p in self.parked}:
            self.reply(ident, None, "ping")

    def on_idle(self) -> None:
        now = time.monotonic()
        self.units.flush()
        self._poll_units(now)
        self.check_start(now)
        self._send_drops(self.leases.expire(now))
        returned = self.handouts.expire(now)
        for h in returned:
            self.index.unconsume(h.partition, h.task, h.rows)
        if returned:
            self._wake()
        if not self.parked:
            return
        if now - self._pinged >= _PING_S:
            self._ping_waiters(now)
        expired = [p for p in self.parked if p.deadline is not None and p.deadline <= now]
        if expired:
            self.parked = [p for p in self.parked if p not in expired]
            for p in expired:
                self.reply(p.ident, p.header.get("id"), error=QueueTimeout(p.timeout_msg))
