"""A storage unit of the distributed data plane (see :mod:`asyncflow.dataplane.transport.controller_server`).

It holds the values of the rows of its shard (``shard_of(row) == unit``) by
``(row, field)`` in a :class:`~asyncflow.dataplane.core.storage.Storage`, knows nothing of tasks or
readiness, keeps received buffers as read-only views (no copy), and refuses a second
write of a ``(row, field)`` (fields are write-once). Same one-thread non-blocking ROUTER
loop (:mod:`asyncflow.dataplane.transport.server_base`: CURVE, token check, error replies)
as the controller; ``save``/``load`` only inside its ``state_dir``.

Bulk port (:mod:`asyncflow.dataplane.transport.bulk`, with CURVE keys only): ``write`` and
``gather`` also arrive on a second socket where every message is sealed with AES-256-GCM
under a session key this unit handed out over CURVE (``bulk_session``;
:mod:`asyncflow.dataplane.transport.sealed`): the frames path of a client on another host,
several times faster than CURVE's cipher. Same handlers; the buffers are opened in place.

Zero-copy reads: for a fixed field it also remembers which received block (and index)
each row came in. A gather of rows that are consecutive rows of one block, the common
case of reading back what one put wrote, is sent as a view of that block instead of
being stacked into a new array (one full copy of the payload fewer per get); any other
set of rows is stacked as before. Blocks are immutable (read-only frames), so a view is
as good as a copy; it keeps its block alive only until ZeroMQ has sent it.

Shared memory (:mod:`asyncflow.dataplane.transport.shm`, same host only): a ``write`` whose header
carries ``shm`` refs adopts the client's segment as the storage of those rows (counted per
stored ``(row, field)``, recycled or unlinked when the last is dropped; ``shm_lease``
hands a recycled one to a client's next big put). A ``gather`` from a client that asks for
``shm`` answers a block slice that lives in a segment as a ref (no byte moves; the
client's pid, sent with the request, is remembered so that the segment is not recycled
while that process maps it), and writes any other rows into one export segment when they
are at least the client's threshold (sent with the request), else frames. ``save`` writes
only the ``(row, field)`` pairs the controller's snapshot names as produced (``keep``;
rows cleared while leased keep their bytes until ``unpin`` but are not part of the state,
and a field written after the snapshot is not in it either).

Receipts (:mod:`asyncflow.dataplane.transport.receipts`): a successful ``write`` answers
``{"receipt": MAC}`` over this unit's random id, the written fields and rows, under the job's
receipt key (which clients never hold); the controller accepts a commit only with receipts
covering it. ``unit_info`` tells the controller this unit's id and how many values it holds
(a controller that starts without state refuses to serve a unit that holds some).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from asyncflow.dataplane.core.persist import contained_path, data_files, save_arrays
from asyncflow.dataplane.core.schema import Schema
from asyncflow.dataplane.core.storage import Storage, assemble
from asyncflow.dataplane.transport import shm
from asyncflow.dataplane.transport.auth import Credentials
from asyncflow.dataplane.transport.bulk import MAX_SESSIONS, BulkPort
from asyncflow.dataplane.transport.protocol import ProtocolError, decode_columns, encode_columns, shard_of
from asyncflow.dataplane.transport.receipts import receipt_key, sign
from asyncflow.dataplane.transport.server_base import MAX_MSG_BYTES, _args, _Server

__all__ = ["StorageServer"]


class StorageServer(_Server):
    """One storage unit: values of the rows of its shard, by ``(row, field)``."""

    def __init__(self, schema: Schema, bind: str = "tcp://127.0.0.1:0", token: str | None = None,
                 use_shm: bool = True, creds: Credentials | None = None, state_dir: str | None = None,
                 max_msg_bytes: int = MAX_MSG_BYTES, max_sessions: int = MAX_SESSIONS,
                 receipts: bytes | None = None) -> None:
        super().__init__(bind, token, creds, max_msg_bytes)
        self.state_dir = state_dir
        self.unit_id = os.urandom(16)  # names this unit in its receipts (the controller asks it: unit_info)
        self.receipts = receipts if receipts is not None else receipt_key(creds)  # None: writes get no receipt
        self.schema, self.storage = schema, Storage(schema)
        # field -> row -> (block, index in block, (segment, byte offset of the block) or None)
        self.blocks: dict[str, dict[int, tuple[np.ndarray, int, tuple | None]]] = {}
        self.shm = shm.ShmUnit() if shm.enabled(use_shm) else None
        self.seg_of: dict[int, dict[str, str]] = {}  # row -> field -> owned segment
        self.ops.update(write=self.write, gather=self.gather, drop=self.drop, save=self.save, load=self.load,
                        nbytes=lambda h, f: self.storage.nbytes(),
                        shm_hello=lambda h, f: None if self.shm is None else self.shm.hello(),
                        shm_probe=lambda h, f: self._shm().probe(_args(h, "shm")[0]),
                        shm_lease=lambda h, f: self._shm().lease(*_args(h, "n", "pid")),
                        unit_info=lambda h, f: {"id": self.unit_id, "held": self.held()})
        self.bulk: BulkPort | None = None  # the sealed bulk socket (sealed.py), with CURVE keys only
        if creds is not None:
            self.bulk = BulkPort(self.ctx, bind, max_msg_bytes, self.ops, self.check_token, max_sessions)
            self.add_side(self.bulk.sock, self.bulk.drain)
            self.ops["bulk_session"] = self.bulk.new_session

    def _shm(self) -> shm.ShmUnit:
        if self.shm is None:
            raise PermissionError("shared memory is disabled on this storage unit")
        return self.shm

    def held(self) -> int:
        """How many ``(row, field)`` values this unit stores."""
        return sum(len(column) for column in self.storage._columns.values())

    def write(self, header: dict, frames: list) -> dict:
        rows, spec = _args(header, "rows", "cols")
        if not (isinstance(rows, list) and all(isinstance(r, int) and 0 <= r < 1 << 62 for r in rows)):
            raise ProtocolError("write: rows must be a list of row ids (ints >= 0)")
        refs, seg = header["a"].get("shm"), None
        if refs is not None:
            frames, seg = self._shm().adopt(refs, frames)
        try:
            columns = decode_columns(spec, frames, self.schema)
            stored = self.storage._columns
            for name, values in columns.items():
                if len(values) != len(rows):
                    raise ProtocolError(f"field {name!r}: {len(values)} values for {len(rows)} rows")
                for row in rows:
                    if row in stored[name]:
                        raise ValueError(f"row {row} field {name!r} is already stored; fields are write-once")
            offsets = _buffer_offsets(spec, refs) if seg is not None else {}
        except BaseException:
            if seg is not None:
                self._shm().release(seg, 0)
            raise
        self.storage.write(rows, columns)
        for name, values in columns.items():
            if isinstance(values, np.ndarray) and len(rows) > 1:
                refs_of = self.blocks.setdefault(name, {})
                loc = (seg, offsets[name]) if name in offsets else None
                for k, row in enumerate(rows):
                    refs_of[row] = (values, k, loc)
        if seg is not None:
            self._shm().hold(seg, len(rows) * len(columns))
            self._shm().release(seg, 0)  # unlinks at once if nothing was stored from it
            for row in rows:
                mine = self.seg_of.setdefault(row, {})
                for name in columns:
                    mine[name] = seg
        return {"receipt": None if self.receipts is None else sign(self.receipts, self.unit_id, list(columns), rows)}

    def gather(self, header: dict, frames: list) -> tuple[Any, list]:
        rows, names = _args(header, "rows", "fields")
        names = self.schema.check_names(names)
        stored = self.storage._columns
        for name in names:
            for row in rows:
                if row not in stored[name]:
                    raise ValueError(f"row {row} field {name!r} is not stored (never written, or cleared)")
        views = {name: self._block_view(name, rows) for name in names}
        limit = header["a"].get("shm")  # the client's threshold; None: it cannot map our segments
        if limit is None or limit is False or self.shm is None:
            rest = [name for name in names if views[name] is None]
            stacked = assemble(self.schema, self.storage.gather(rows, rest))
            return encode_columns({n: stacked[n] if (v := views[n]) is None else v[0] for n in names})
        return self._gather_shm(rows, names, views, int(limit), header["a"].get("pid"))

    def _gather_shm(self, rows: list, names: list[str], views: dict, limit: int, pid: Any) -> tuple[dict, list]:
        """Reply with refs: block slices in place, other rows exported (or framed if small)."""
        spec, items = [], []  # item: ("ref", ref) | ("frame", array) | ("rows", [row arrays])
        for name in names:
            f, dtype = self.schema[name], np.dtype(self.schema[name].dtype)
            if views[name] is not None:
                view, loc = views[name]
                spec.append([name, "f", view.dtype.str, list(view.shape)])
                items.append(("ref", [loc[0], loc[1], view.nbytes]) if loc else ("frame", view))
                if loc:
                    self._shm().read_by(loc[0], pid)  # never recycled while that process maps it
                continue
            values = self.storage.gather(rows, [name])[name]
            if f.ragged:
                spec.append([name, "r", dtype.str, [len(rows)]])
                items += [("rows", values), ("frame", np.array([len(v) for v in values], np.int64))]
            else:
                spec.append([name, "f", dtype.str, [len(rows), *f.shape]])
                items.append(("rows", values))
        big = sum(sum(v.nbytes for v in x) for k, x in items if k == "rows") >= limit
        exported = iter(self._shm().export([x for k, x in items if k == "rows"]) if big else ())
        refs, buffers = [], []
        for (kind, x), entry in zip(items, [e for e in spec for _ in range(2 if e[1] == "r" else 1)]):
            if kind == "ref" or (kind == "rows" and big):
                refs.append(x if kind == "ref" else next(exported))
                continue
            if kind == "rows":
                shape = (0, *self.schema[entry[0]].shape) if entry[1] == "f" else (0,)
                x = (np.stack(x) if entry[1] == "f" else np.concatenate(x)) if x else np.empty(shape, entry[2])
            refs.append(None)
            buffers.append(np.ascontiguousarray(x))
        return {"cols": spec, "shm": refs}, buffers

    def _block_view(self, name: str, rows: list) -> tuple[np.ndarray, tuple | None] | None:
        """``rows`` as one slice of the block they arrived in (and its place in shared
        memory, if any), or ``None`` if they are not consecutive rows of one block."""
        refs = self.blocks.get(name)
        first = refs.get(rows[0]) if refs and rows else None
        if first is None or refs is None:
            return None
        block, k0, loc = first
        for offset, row in enumerate(rows):
            ref = refs.get(row)
            if ref is None or ref[0] is not block or ref[1] != k0 + offset:
                return None
        return block[k0:k0 + len(rows)], (loc and (loc[0], loc[1] + k0 * block.strides[0]))

    def drop(self, header: dict, frames: list) -> None:
        rows = [int(r) for r in _args(header, "rows")[0]]
        self.storage.drop(rows)
        for refs in self.blocks.values():
            for row in rows:
                refs.pop(row, None)
        for row in rows:
            for seg in self.seg_of.pop(row, {}).values():
                self._shm().release(seg)

    def save(self, header: dict, frames: list) -> None:
        path, unit, n_units = _args(header, "path", "unit", "n_units")
        path = self._path(path)
        live, fields = header["a"].get("live"), header["a"].get("keep")  # keep: field -> rows (the snapshot's)
        keep = None if live is None else set(live).__contains__
        if fields is not None and not (isinstance(fields, dict) and all(isinstance(v, list) for v in fields.values())):
            raise ProtocolError("save: keep must map field names to lists of rows")
        save_arrays(os.path.join(path, f"data-{unit}-of-{n_units}.npz"), self.storage.to_arrays(keep, fields))

    def load(self, header: dict, frames: list) -> None:
        path, unit, n_units = _args(header, "path", "unit", "n_units")
        path = self._path(path)
        storage = Storage(self.schema)
        for name in data_files(path):
            with np.load(name, allow_pickle=False) as arrays:
                storage.load_arrays(arrays, keep=lambda r: shard_of(r, n_units) == unit)
        self.storage, self.blocks = storage, {}
        for segs in self.seg_of.values():
            for seg in segs.values():
                self._shm().release(seg)
        self.seg_of = {}

    def _path(self, path: Any) -> str:
        if self.state_dir is None:
            raise PermissionError("save/load refused: this storage unit was started without a state folder")
        return contained_path(self.state_dir, path)

    def on_idle(self) -> None:
        if self.shm is not None:
            self.shm.sweep(time.monotonic())

    def close(self) -> None:
        """Release the sockets and every shared-memory segment of this unit."""
        if self.shm is not None:
            self.shm.close()
        self.ctx.destroy(linger=0)

    def serve_forever(self) -> None:
        try:
            super().serve_forever()
        finally:
            if self.shm is not None:
                self.shm.close()


def _buffer_offsets(spec: list, refs: list) -> dict[str, int]:
    """Field -> byte offset in the segment, for fixed columns whose buffer is a ref."""
    out, i = {}, 0
    for name, kind, *_ in spec:
        if kind == "f" and refs[i] is not None:
            out[name] = refs[i][1]
        i += 2 if kind == "r" else 1
    return out
