"""Client of the distributed data plane, with the in-process ``DataPlane`` API.

``ZmqDataPlane(endpoint)`` talks to a :class:`~asyncflow.queue.zmq_server.ControllerServer`
(row ids) and, directly, to its storage units (bytes): rows live on unit ``shard_of(row)``
(blocks of 64 consecutive ids, round-robin), so a put sends each unit contiguous slices of
its rows (views of the validated arrays: no copy) and a get asks for them, all requests in
flight at once, then places each slice in ``meta.rows`` order. The controller never
touches sample data.

Design: a synchronous client over ZeroMQ DEALER sockets (one set per thread, so threads
of one process never share a socket and a blocked ``get_meta`` in one thread does not
hold up a put in another). Blocking happens on the server side (the request is parked),
so timeouts and ``close`` behave exactly as in process; the client only waits for the
reply. Replies carry the request id; a stray one is ignored.

Picklable: only ``(endpoint, token)`` is pickled; sockets (and the schema, fetched with
``hello``) are created lazily in the process that uses the copy, so a launcher can pass a
client to Ray actors or ``multiprocessing`` workers. ``put`` validates the whole write
against the schema before anything is sent (all-or-nothing, errors name field and row);
``put_nowait`` is ``put`` without returning the ids (so ``flush`` is a no-op).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import zmq

from asyncflow.queue.rules import BatchMeta, Data, check_request
from asyncflow.queue.index import check_partition_name
from asyncflow.queue.protocol import (
    decode_columns,
    encode_columns,
    error_from_msg,
    meta_from_msg,
    pack_header,
    runs,
    sampler_to_msg,
    unpack_header,
)
from asyncflow.queue.samplers import Sampler
from asyncflow.queue.schema import Schema, prepare_write, schema_from_msg

__all__ = ["ZmqDataPlane"]

_ZERO_COPY_BYTES = 65536  # below this, copying into the message is cheaper than tracking


class _Conn:
    """The sockets of one thread of one process."""

    def __init__(self, ctx: zmq.Context, controller: str, units: Sequence[str]) -> None:
        self.ctrl = self._dealer(ctx, controller)
        self.units = [self._dealer(ctx, ep) for ep in units]
        self.ids = itertools.count(1)

    @staticmethod
    def _dealer(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        return s

    def close(self) -> None:
        for s in [self.ctrl, *self.units]:
            s.close(0)


class ZmqDataPlane:
    """Remote data plane client; see the module docstring. Methods as in ``DataPlane``."""

    def __init__(self, endpoint: str, token: str | None = None) -> None:
        self.endpoint, self.token = endpoint, token
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._schema: Schema | None = None
        self._units: list[str] | None = None
        self._ctx: zmq.Context | None = None

    def __getstate__(self) -> dict:
        return {"endpoint": self.endpoint, "token": self.token}

    def __setstate__(self, state: dict) -> None:
        self.endpoint, self.token = state["endpoint"], state["token"]
        self._reset()

    # -- connection --------------------------------------------------------------------
    def _conn(self) -> _Conn:
        if self._pid != os.getpid():  # a fork: the parent's sockets are not ours
            self._reset()
        conn = getattr(self._local, "conn", None)
        if conn is None:
            with self._lock:
                if self._ctx is None:
                    # The process-wide context: never garbage-collected mid-run (a collected
                    # context with a socket still open in some thread would hang in term()).
                    self._ctx = zmq.Context.instance()
                if self._schema is None:
                    boot = _Conn(self._ctx, self.endpoint, [])
                    hello = self._call(boot, boot.ctrl, "hello", {})
                    boot.close()
                    self._schema, self._units = schema_from_msg(hello["schema"]), list(hello["storage"])
            conn = self._local.conn = _Conn(self._ctx, self.endpoint, self._units)
        return conn

    @property
    def schema(self) -> Schema:
        self._conn()
        return self._schema

    def _send(self, conn: _Conn, sock: zmq.Socket, op: str, args: dict, buffers: Sequence[Any] = ()) -> int:
        rid = next(conn.ids)
        header = pack_header({"op": op, "id": rid, "a": args, "tok": self.token or ""})
        big = any(np.asarray(b).nbytes >= _ZERO_COPY_BYTES for b in buffers)
        sock.send_multipart([header, *buffers], copy=not big)
        return rid

    def _recv(self, sock: zmq.Socket, rid: int) -> tuple[Any, list]:
        while True:
            frames = sock.recv_multipart(copy=False)
            header = unpack_header(frames[0].buffer)
            if header.get("id") == rid:
                break
        if not header.get("ok"):
            raise error_from_msg(header.get("err", {}))
        return header.get("r"), frames[1:]

    def _call(self, conn: _Conn, sock: zmq.Socket, op: str, args: dict, buffers: Sequence[Any] = ()) -> Any:
        return self._recv(sock, self._send(conn, sock, op, args, buffers))[0]

    def _ctrl(self, op: str, **args: Any) -> Any:
        conn = self._conn()
        return self._call(conn, conn.ctrl, op, args)

    # -- writes ------------------------------------------------------------------------
    def put(self, data: Mapping[str, Any], partition: Hashable = 0, rows: Sequence[int] | None = None,
            tags: Mapping[str, Sequence[int]] | None = None, timeout: float | None = None) -> list[int]:
        """As :meth:`DataPlane.put`: validated whole, then allocate, write shards, commit."""
        conn = self._conn()
        check_partition_name(partition)
        rows, columns, n_rows, tag_lists = prepare_write(self._schema, data, rows, tags, copy=False)
        if rows == []:
            return []
        fields = list(columns)
        if rows is None:
            rows = self._call(conn, conn.ctrl, "alloc", {"partition": partition, "n": n_rows, "timeout": timeout})
        else:
            self._call(conn, conn.ctrl, "check_write", {"partition": partition, "rows": rows, "fields": fields})
        commit = {"partition": partition, "rows": rows, "fields": fields, "tags": tag_lists, "abort": False}
        try:
            self._write_shards(conn, rows, columns)
        except BaseException:
            self._call(conn, conn.ctrl, "commit", {**commit, "abort": True})
            raise
        self._call(conn, conn.ctrl, "commit", commit)
        return list(rows)

    def _write_shards(self, conn: _Conn, rows: list[int], columns: Mapping[str, Any]) -> None:
        sent = []
        for unit, i, j in runs(rows, len(self._units)):
            spec, buffers = encode_columns({k: v[i:j] for k, v in columns.items()})
            sock = conn.units[unit]
            sent.append((sock, self._send(conn, sock, "write", {"rows": rows[i:j], "cols": spec}, buffers)))
        errors = []
        for sock, rid in sent:  # collect every reply, so no stray one is left in a socket
            try:
                self._recv(sock, rid)
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def put_nowait(self, data: Mapping[str, Any], partition: Hashable = 0, rows: Sequence[int] | None = None,
                   tags: Mapping[str, Sequence[int]] | None = None) -> None:
        """:meth:`put` without the ids (errors raise here; nothing is left in flight)."""
        self.put(data, partition=partition, rows=rows, tags=tags)

    def flush(self) -> None:
        """No-op: ``put_nowait`` has completed when it returns."""

    def seal(self, partition: Hashable) -> None:
        check_partition_name(partition)
        self._ctrl("seal", partition=partition)

    def clear(self, partition: Hashable) -> None:
        self._ctrl("clear", partition=partition)

    def clear_rows(self, rows: Sequence[int]) -> None:
        self._ctrl("clear_rows", rows=[int(r) for r in rows])

    def reset_consumption(self, task: str) -> None:
        self._ctrl("reset_consumption", task=task)

    def close(self) -> None:
        """Close the data plane for every client (as :meth:`DataPlane.close`)."""
        self._ctrl("close")

    def save(self, path: str | os.PathLike) -> None:
        """Save the whole state on the servers' file system (``index.msgpack`` + one npz per unit)."""
        self._ctrl("save", path=os.path.abspath(path))

    def load(self, path: str | os.PathLike) -> None:
        self._ctrl("load", path=os.path.abspath(path))

    # -- reads -------------------------------------------------------------------------
    def get_meta(self, task: str, fields: Sequence[str], n: int, partition: Hashable | None = None,
                 sampler: Sampler | None = None, min_n: int | None = None, block: bool = True,
                 timeout: float | None = None) -> BatchMeta:
        """As :meth:`DataPlane.get_meta`; waits server-side, so other clients go on."""
        fields, _ = check_request(self.schema, task, fields, n, min_n)
        msg = self._ctrl("get_meta", task=task, fields=fields, n=n, partition=partition,
                         sampler=sampler_to_msg(sampler), min_n=min_n, block=block, timeout=timeout)
        return meta_from_msg(msg)

    def get_data(self, meta: BatchMeta, fields: Sequence[str] | None = None) -> Data:
        """Fetch columns of ``meta.rows`` from the storage units, in ``meta.rows`` order."""
        conn = self._conn()
        names = self._schema.check_names(meta.fields if fields is None else fields)
        rows = [int(r) for r in meta.rows]
        out: dict[str, Any] = {}
        for name in names:
            f = self._schema[name]
            out[name] = [None] * len(rows) if f.ragged else np.empty((len(rows), *f.shape), f.dtype)
        slices = runs(rows, len(self._units)) if rows else []
        sent = [(i, j, conn.units[u], self._send(conn, conn.units[u], "gather", {"rows": rows[i:j], "fields": names}))
                for u, i, j in slices]
        errors = []
        for i, j, sock, rid in sent:
            try:
                spec, frames = self._recv(sock, rid)
            except Exception as exc:
                errors.append(exc)
                continue
            for name, values in decode_columns(spec, frames).items():
                if len(slices) == 1 and not isinstance(out[name], list):
                    out[name] = values  # the whole answer: no copy
                else:
                    out[name][i:j] = values
        if errors:
            raise errors[0]
        return out

    def get_batch(self, task: str, fields: Sequence[str], n: int, **kwargs: Any) -> tuple[BatchMeta, Data]:
        """``get_meta`` then ``get_data`` (not atomic with respect to ``clear``)."""
        meta = self.get_meta(task, fields, n, **kwargs)
        return meta, self.get_data(meta, meta.fields)

    def tags(self, rows: Sequence[int]) -> dict[str, list[int]]:
        return self._ctrl("tags", rows=[int(r) for r in rows])

    def stats(self) -> dict[str, Any]:
        """As :meth:`DataPlane.stats`, plus ``storage_units`` and ``waiting`` (parked requests)."""
        return self._ctrl("stats")

    # -- administration ----------------------------------------------------------------
    def shutdown_servers(self) -> None:
        """Stop the controller and every storage unit (their processes exit)."""
        conn = self._conn()
        for sock in conn.units:
            self._call(conn, sock, "shutdown", {})
        self._call(conn, conn.ctrl, "shutdown", {})

    def disconnect(self) -> None:
        """Close this thread's sockets (the servers keep running)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
