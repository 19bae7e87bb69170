"""The asyncio core of the distributed data plane's client.

:class:`AsyncZmqDataPlane` holds every data-plane method as a coroutine; the synchronous
:class:`~asyncflow.dataplane.transport.client.ZmqDataPlane` that the roles use only runs these on a
private event-loop thread. Both are picklable (only ``(endpoint, token, credentials)`` travel;
sockets, the schema fetched with ``hello`` and the loop thread are created lazily in the
process that uses the copy, and again after a fork). There are no module-level clients.

Wire: the core talks to a :class:`~asyncflow.dataplane.transport.controller_server.ControllerServer`
(row ids) and, directly, to its storage units (bytes): rows live on unit ``shard_of(row)``
(blocks of 64 consecutive ids, round-robin), so a put sends each unit its contiguous slices
(views of the validated arrays) and a get asks every unit at once: one request per big
slice (answered with a view of the block the put wrote) plus one for a unit's small slices
(:mod:`~.fetch`), each answer placed in ``meta.rows`` order as it arrives. One DEALER
socket per server per core, shared by every coroutine: each request carries an id and the
loop's reader hands each reply to the coroutine waiting for it, so any number of calls
(e.g. parked ``get_meta``) wait at once. Blocking happens server-side, so timeouts and
``close`` behave as in process. On one host, a unit's part of a put of at least
``shm_min_bytes`` goes through one shared-memory segment (a recycled one when at least
``recycle_min_bytes``), and gets answer with segment refs (:mod:`~.shm`; probed per unit
at connect; ``use_shm=False`` or ``ASYNCFLOW_PLANE_SHM=0`` turns it off). Otherwise each
slice is one message of frames: with credentials, on the unit's sealed bulk port
(AES-256-GCM, :mod:`~.sealed`, :mod:`~.link_sealed`; ``sealed=False``: on its CURVE socket),
a put's slices three at a time, a get's fixed columns decrypted straight into place.

Invariants:

* ``put`` validates the whole write against the schema before anything is sent
  (all-or-nothing, errors name field and row); rows become ready only at ``commit``,
  after every storage unit acknowledged its slice, and the commit carries the units' write
  receipts (:mod:`~.receipts`: the controller refuses fields no unit acknowledged). A
  unit's slice goes as messages under the servers' ``max_msg_bytes`` (told by ``hello``;
  :mod:`~.split`); a row that alone passes it is refused before anything is sent.
* ``put_nowait`` validates and copies the data, starts the put and returns without any
  round trip; the first error among sent puts is raised by the client's next call
  (``flush`` waits for all and raises it too). Closing the core flushes first.
* ``get_batch`` pins its rows until read (a racing ``clear`` frees their bytes only
  after); rows are consumed on acknowledgement (:mod:`~.client_acks`).
* Every request has a deadline (``deadline``, default 30 s; a waiting ``get_meta`` or a
  ``put`` waiting for room gets its own ``timeout`` plus that margin, and none when it has
  no timeout: the connection monitor still fails it if its server goes away). A server
  that does not answer, refuses this client's credentials or drops the connection raises
  :class:`~asyncflow.dataplane.core.rules.DataPlaneUnavailable` naming the endpoint and the
  request, never a hang. ``credentials`` (a client copy of the job's
  :class:`~asyncflow.dataplane.transport.auth.Credentials`) make every socket a CURVE client.
* ``save``/``load`` paths are names inside the servers' state folder (fixed at launch).
* A core belongs to the event loop that first uses it (a clear error otherwise).
  A cancelled waiting ``get_meta`` stays on the server: rows it is then handed go back
  when their hand-out expires; pass ``timeout`` to bound a wait instead.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from asyncflow.dataplane.core.index import check_partition_name
from asyncflow.dataplane.core.rules import BatchMeta, Data, check_request
from asyncflow.dataplane.core.samplers import Sampler
from asyncflow.dataplane.core.schema import Schema, prepare_write, schema_from_msg
from asyncflow.dataplane.transport import shm
from asyncflow.dataplane.transport.auth import Credentials
from asyncflow.dataplane.transport.client_acks import ClientAcks
from asyncflow.dataplane.transport.client_ctrl import ControllerCalls
from asyncflow.dataplane.transport.fetch import place, plan_requests
from asyncflow.dataplane.transport.link import DEADLINE_S, gather_all
from asyncflow.dataplane.transport.link import Link as _Link
from asyncflow.dataplane.transport.link_sealed import SealedLink, connect_units, open_columns
from asyncflow.dataplane.transport.protocol import (
    concat_spec,
    decode_columns,
    encode_columns,
    meta_from_msg,
    runs,
    sampler_to_msg,
)
from asyncflow.dataplane.transport.sealed import Sealed
from asyncflow.dataplane.transport.server_base import MAX_MSG_BYTES
from asyncflow.dataplane.transport.split import SLACK, check_rows, split_spans

__all__ = ["AsyncZmqDataPlane"]


def _receipt(result: Any) -> bytes | None:
    """The receipt in a unit's answer to a write (receipts.py), ``None`` if it gives none."""
    return result.get("receipt") if isinstance(result, dict) else None


class AsyncZmqDataPlane(ControllerCalls, ClientAcks):
    """Asyncio client of the distributed data plane; methods as in ``DataPlane``, awaited."""

    def __init__(self, endpoint: str, token: str | None = None, use_shm: bool = True,
                 shm_min_bytes: int = shm.MIN_BYTES, credentials: Credentials | None = None,
                 deadline: float = DEADLINE_S, sealed: bool = True) -> None:
        self.endpoint, self.token, self.sealed = endpoint, token, sealed  # sealed: frames on units' bulk ports
        self.credentials = None if credentials is None else credentials.for_client()
        if not (isinstance(deadline, (int, float)) and deadline > 0):
            raise ValueError(f"deadline must be a number of seconds > 0, got {deadline!r}")
        self.deadline = float(deadline)
        self.use_shm, self.shm_min_bytes = use_shm, shm_min_bytes
        self.recycle_min_bytes = shm.RECYCLE_MIN  # a write this big asks its unit for a recycled segment
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ctrl: _Link | None = None
        self._units: list[_Link] = []
        self._bulk: list[SealedLink | None] = []  # per unit: its sealed bulk link, for frames
        self._unit_endpoints: list[str] = []
        self._shm_prefix: list[str | None] = []  # per unit: its segment prefix, if shared memory works
        self._schema: Schema | None = None
        self._max_msg = MAX_MSG_BYTES  # the servers' limit per message (hello): puts are split below it
        self._hello: asyncio.Task | None = None
        self._sent: set[asyncio.Task] = set()
        self._errors: list[BaseException] = []

    def __getstate__(self) -> dict:
        return {"endpoint": self.endpoint, "token": self.token, "use_shm": self.use_shm,
                "shm_min_bytes": self.shm_min_bytes, "recycle_min_bytes": self.recycle_min_bytes,
                "keys": None if self.credentials is None else self.credentials.to_msg(),
                "deadline": self.deadline, "sealed": self.sealed}

    def __setstate__(self, state: dict) -> None:
        self.endpoint, self.token = state["endpoint"], state["token"]
        keys = state.get("keys")
        self.credentials = None if keys is None else Credentials.from_msg(keys)
        self.deadline, self.use_shm = state.get("deadline", DEADLINE_S), state.get("use_shm", True)
        self.shm_min_bytes, self.sealed = state.get("shm_min_bytes", shm.MIN_BYTES), state.get("sealed", True)
        self.recycle_min_bytes = state.get("recycle_min_bytes", shm.RECYCLE_MIN)
        self._reset()

    # -- connection --------------------------------------------------------------------
    async def _enter(self) -> None:
        """Connect on first use (in this process, on this loop); raise a failed ``put_nowait``."""
        if self._pid != os.getpid():  # a fork: the parent's sockets are not ours
            self._reset()
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("this AsyncZmqDataPlane is bound to another event loop; use a copy "
                               "(copy.copy or pickle) per loop")
        if self._schema is None:
            if self._hello is None:
                self._ctrl = self._link(self.endpoint, loop, f"the data plane's controller {self.endpoint}")
                self._hello = loop.create_task(self._connect(loop))
            try:
                await asyncio.shield(self._hello)
            except BaseException:
                if self._hello.done():
                    self._hello = None
                raise
        self._raise_sent()

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> None:
        """``hello`` to the controller, then connect every storage unit (and probe shared memory);
        every link names its server in its errors (``the data plane's controller <endpoint>``,
        ``storage unit <i> (<endpoint>)``), whichever process's call meets the failure."""
        assert self._ctrl is not None  # created with the hello task
        hello, _ = await self._ctrl.call("hello", {})
        units = [self._link(ep, loop, f"storage unit {i} ({ep})") for i, ep in enumerate(hello["storage"])]
        self._shm_prefix, self._bulk = await connect_units(
            units, shm.enabled(self.use_shm), self.sealed and self.credentials is not None, self.token or "", loop,
            self.deadline)
        for i, bulk in enumerate(self._bulk):
            if bulk is not None:
                bulk.who = f"storage unit {i} (bulk port {bulk.endpoint})"
        self._unit_endpoints, self._units = list(hello["storage"]), units
        self._max_msg = int(hello.get("max_msg_bytes", MAX_MSG_BYTES))
        self._schema = schema_from_msg(hello["schema"])  # last: marks the core connected

    def _link(self, endpoint: str, loop: asyncio.AbstractEventLoop, who: str | None = None) -> _Link:
        return _Link(endpoint, self.token or "", loop, self.credentials, self.deadline, who)

    def _wait_limit(self, timeout: float | None) -> float | None:
        """The deadline of a request that waits server-side for up to ``timeout``."""
        return None if timeout is None else float(timeout) + self.deadline

    async def _ctrl_call(self, op: str, deadline: float | None | bool = True, **args: Any) -> Any:
        await self._enter()
        assert self._ctrl is not None  # connected by _enter
        return (await self._ctrl.call(op, args, deadline=deadline))[0]

    async def get_schema(self) -> Schema:
        await self._enter()
        assert self._schema is not None  # connected by _enter
        return self._schema

    async def transports(self) -> list[str]:
        """Per unit: ``"shm"`` (shared memory), ``"sealed"`` (frames, bulk port) or ``"zmq"`` (frames)."""
        await self._enter()
        return ["shm" if p is not None else "sealed" if b is not None else "zmq"
                for p, b in zip(self._shm_prefix, self._bulk)]

    async def storage_endpoints(self) -> list[str]:
        """The storage units' endpoints, in shard order."""
        await self._enter()
        return list(self._unit_endpoints)

    # -- writes ------------------------------------------------------------------------
    async def put(self, data: Mapping[str, Any], partition: Hashable = 0, rows: Sequence[int] | None = None,
                  tags: Mapping[str, Sequence[int]] | None = None, timeout: float | None = None) -> list[int]:
        """As :meth:`DataPlane.put`: validated whole, then allocate, write shards, commit."""
        await self._enter()
        return await self._put(*self._prepare(data, partition, rows, tags, copy=False), timeout)

    def _prepare(self, data: Mapping[str, Any], partition: Hashable, rows: Sequence[int] | None,
                 tags: Mapping[str, Sequence[int]] | None,
                 copy: bool) -> tuple[Hashable, list[int] | None, dict, int, dict]:
        check_partition_name(partition)
        assert self._schema is not None  # connected by _enter
        rows, columns, n_rows, tag_lists = prepare_write(self._schema, data, rows, tags, copy=copy)
        return partition, rows, columns, n_rows, tag_lists

    async def _put(self, partition: Hashable, rows: list[int] | None, columns: dict, n_rows: int,
                   tag_lists: dict, timeout: float | None) -> list[int]:
        if rows == []:
            return []
        fields, ctrl = list(columns), self._ctrl
        assert ctrl is not None  # connected by _enter
        total = sum(v.nbytes if isinstance(v, np.ndarray) else sum(r.nbytes for r in v) for v in columns.values())
        frames = total < self.shm_min_bytes or None in self._shm_prefix  # (some unit gets frames)
        if frames and total > self._max_msg - SLACK:  # (frames are split below the servers' limit: split.py)
            check_rows(columns, n_rows, self._max_msg)
        if rows is None:
            rows = (await ctrl.call("alloc", {"partition": partition, "n": n_rows, "timeout": timeout},
                                    deadline=self._wait_limit(timeout)))[0]
        else:
            await ctrl.call("check_write", {"partition": partition, "rows": rows, "fields": fields})
        commit = {"partition": partition, "rows": rows, "fields": fields, "tags": tag_lists, "abort": False}
        by_unit: dict[int, list[tuple[int, int]]] = {}
        for unit, i, j in runs(rows, len(self._units)):
            by_unit.setdefault(unit, []).append((i, j))
        big = total >= self.shm_min_bytes  # else frames for every unit
        try:
            written = await gather_all([self._write(unit, rows, columns, spans, big, total)
                                        for unit, spans in by_unit.items()])
        except BaseException:
            await ctrl.call("commit", {**commit, "abort": True})
            raise
        commit["receipts"] = [r for per_unit in written for r in per_unit]  # what the units acknowledged
        await ctrl.call("commit", commit)
        return list(rows)

    async def _write(self, unit: int, rows: list[int], columns: dict, spans: list[tuple[int, int]],
                     big: bool, total: int) -> list[list]:
        """One unit's rows (``spans`` of ``rows``): on one host and big enough, one
        shared-memory segment written on a worker thread (the unit adopts it, else it is
        unlinked here); else frames, one message per span (cut below the servers' limit).
        Returns the unit's receipts: ``[unit, spans, receipt]`` per message."""
        link, prefix = self._units[unit], self._shm_prefix[unit]
        if prefix is not None and big:
            mine = [r for i, j in spans for r in rows[i:j]]
            spec, buffers = concat_spec(columns, spans)
            size = shm.segment_bytes(buffers)
            if size >= self.shm_min_bytes:
                leased = None
                if size >= self.recycle_min_bytes:  # pages that exist write ~2x faster than fresh ones
                    leased = (await link.call("shm_lease", {"n": size, "pid": os.getpid()}))[0]
                assert self._loop is not None  # connected by _enter
                name, refs = await self._loop.run_in_executor(None, shm.write_segment, prefix, "c", buffers, leased)
                try:
                    got = (await link.call("write", {"rows": mine, "cols": spec, "shm": refs}))[0]
                finally:
                    shm.unlink(name)  # a no-op once the unit adopted (renamed) it
                return [[unit, [list(s) for s in spans], _receipt(got)]]
        if total > self._max_msg - SLACK:
            spans = split_spans(columns, spans, self._max_msg)
        if (sealed := self._bulk[unit]) is not None:  # spans in flight: seal, carry, open overlap
            got = await sealed.pipeline(("write", {"rows": rows[i:j], "cols": s[0]}, s[1]) for i, j in spans
                                        for s in [encode_columns({k: v[i:j] for k, v in columns.items()})])
            return [[unit, [[i, j]], _receipt(r)] for (i, j), r in zip(spans, got)]
        out = []
        for i, j in spans:
            spec, buffers = encode_columns({k: v[i:j] for k, v in columns.items()})
            got = (await link.call("write", {"rows": rows[i:j], "cols": spec}, buffers))[0]
            out.append([unit, [[i, j]], _receipt(got)])
        return out

    async def put_nowait(self, data: Mapping[str, Any], partition: Hashable = 0, rows: Sequence[int] | None = None,
                         tags: Mapping[str, Sequence[int]] | None = None) -> None:
        """Validate and copy the write, start it and return at once (see the module docstring)."""
        await self._enter()
        prepared = self._prepare(data, partition, rows, tags, copy=True)  # the caller may reuse its arrays
        assert self._loop is not None  # connected by _enter
        task = self._loop.create_task(self._put(*prepared, None))
        self._sent.add(task)
        task.add_done_callback(self._put_done)

    def _put_done(self, task: asyncio.Task) -> None:
        self._sent.discard(task)
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            self._errors.append(exc)

    def _raise_sent(self) -> None:
        if self._errors:
            first, self._errors = self._errors[0], []
            raise first

    async def flush(self) -> None:
        """Wait until every ``put_nowait`` of this client is applied; raise the first error."""
        while self._sent:
            await asyncio.wait(list(self._sent))
        self._raise_sent()

    # -- reads -------------------------------------------------------------------------
    async def get_meta(self, task: str, fields: Sequence[str], n: int, partition: Hashable | None = None,
                       sampler: Sampler | None = None, min_n: int | None = None, block: bool = True,
                       timeout: float | None = None) -> BatchMeta:
        """As :meth:`DataPlane.get_meta`; waits server-side, so other calls go on."""
        return (await self._get_meta(task, fields, n, partition, sampler, min_n, block, timeout, False))[0]

    async def _get_meta(self, task: str, fields: Sequence[str], n: int, partition: Hashable | None,
                        sampler: Sampler | None, min_n: int | None, block: bool, timeout: float | None,
                        pin: bool) -> tuple[BatchMeta, int | None]:
        await self._enter()
        assert self._schema is not None  # connected by _enter
        fields, _ = check_request(self._schema, task, fields, n, min_n)
        msg = await self._ctrl_call("get_meta", task=task, fields=fields, n=n, partition=partition,
                                    sampler=sampler_to_msg(sampler), min_n=min_n, block=block,
                                    timeout=timeout, pin=pin,
                                    deadline=self._wait_limit(timeout) if block else True)
        return meta_from_msg(msg), (msg[4] if len(msg) > 4 else None)  # meta.handout: acked by get_data

    async def get_data(self, meta: BatchMeta, fields: Sequence[str] | None = None) -> Data:
        """Fetch ``meta.rows`` from the units (in order), then acknowledge ``meta`` (client_acks)."""
        await self._enter()
        assert self._schema is not None  # connected by _enter
        names = self._schema.check_names(meta.fields if fields is None else fields)
        rows = [int(r) for r in meta.rows]
        out: dict[str, Any] = {}
        for name in names:
            f = self._schema[name]
            out[name] = [None] * len(rows) if f.ragged else np.empty((len(rows), *f.shape), f.dtype)
        fixed = sum(np.dtype(self._schema[n].dtype).itemsize * math.prod(self._schema[n].shape)
                    for n in names if not self._schema[n].ragged)
        plan = plan_requests(rows, [fixed if p is None else 0 for p in self._shm_prefix])
        whole = len(plan) == 1 and len(plan[0][1]) == 1

        async def fetch(u: int, spans: list[tuple[int, int]]) -> None:  # placed as it arrives: copy k, receive k+1
            spec, frames = await (self._bulk[u] or self._units[u]).call("gather", {
                "rows": [r for i, j in spans for r in rows[i:j]], "fields": names, "pid": os.getpid(),
                "shm": None if self._shm_prefix[u] is None else self.shm_min_bytes})
            if isinstance(frames, Sealed):  # the bulk port: fixed columns decrypted straight into place
                spec, frames = open_columns(spec, frames, out, spans)
            elif isinstance(spec, dict):  # shared-memory refs (and frames for the small rest)
                spec, frames = spec["cols"], shm.map_refs(spec["shm"], frames, self._shm_prefix[u] or "?")
            place(out, spans, decode_columns(spec, frames), whole)

        await gather_all([fetch(u, spans) for u, spans in plan])
        await self._acknowledge(meta)
        return out

    async def get_batch(self, task: str, fields: Sequence[str], n: int, partition: Hashable | None = None,
                        sampler: Sampler | None = None, min_n: int | None = None, block: bool = True,
                        timeout: float | None = None) -> tuple[BatchMeta, Data]:
        """``get_meta`` then ``get_data``, atomic with respect to ``clear``: the rows stay
        pinned (their bytes kept) until read (``get_data`` acknowledges, then ``unpin``)."""
        meta, lease = await self._get_meta(task, fields, n, partition, sampler, min_n, block, timeout, True)
        try:
            return meta, await self.get_data(meta, meta.fields)
        except BaseException:
            self._give_back(meta)  # the caller never sees this meta: its rows go back now
            raise
        finally:
            if lease is not None:
                assert self._ctrl is not None  # connected by _get_meta
                self._ctrl.send("unpin", {"lease": lease}, noreply=True)

    # -- administration ----------------------------------------------------------------
    async def shutdown_servers(self) -> None:
        """Stop the controller and every storage unit (their processes exit)."""
        await self._enter()
        for link in self._units:
            await link.call("shutdown", {})
        assert self._ctrl is not None  # connected by _enter
        await self._ctrl.call("shutdown", {})

    async def aclose(self) -> None:
        """Wait for sent puts (errors dropped: nobody is left to raise them to), then close
        this core's sockets; the servers keep running. A later call reconnects."""
        if self._loop is not None and self._loop is asyncio.get_running_loop():
            while self._sent:
                await asyncio.wait(list(self._sent))
        for link in [self._ctrl, *self._units, *self._bulk]:
            if link is not None:
                link.close()
        self._reset()
