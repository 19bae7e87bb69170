"""A storage unit of the distributed data plane (see :mod:`asyncflow.queue.zmq_server`).

It holds the values of the rows of its shard (``shard_of(row) == unit``) by
``(row, field)`` in a :class:`~asyncflow.queue.storage.Storage`, knows nothing of tasks or
readiness, keeps received buffers as read-only views (no copy), and refuses a second
write of a ``(row, field)`` (fields are write-once). Same one-thread non-blocking ROUTER
loop, token check and error replies as the controller.

Zero-copy reads: for a fixed field it also remembers which received block (and index)
each row came in. A gather of rows that are consecutive rows of one block, the common
case of reading back what one put wrote, is sent as a view of that block instead of
being stacked into a new array (one full copy of the payload fewer per get); any other
set of rows is stacked as before. Blocks are immutable (read-only frames), so a view is
as good as a copy; it keeps its block alive only until ZeroMQ has sent it.
"""

from __future__ import annotations

import os

import numpy as np

from asyncflow.queue.persist import data_files, save_arrays
from asyncflow.queue.protocol import ProtocolError, decode_columns, encode_columns, shard_of
from asyncflow.queue.schema import Schema
from asyncflow.queue.storage import Storage, assemble
from asyncflow.queue.zmq_server import _args, _Server

__all__ = ["StorageServer"]


class StorageServer(_Server):
    """One storage unit: values of the rows of its shard, by ``(row, field)``."""

    def __init__(self, schema: Schema, bind: str = "tcp://127.0.0.1:0", token: str | None = None) -> None:
        super().__init__(bind, token)
        self.schema, self.storage = schema, Storage(schema)
        self.blocks: dict[str, dict[int, tuple[np.ndarray, int]]] = {}  # field -> row -> (block, index)
        self.ops.update(write=self.write, gather=self.gather, drop=self.drop, save=self.save, load=self.load,
                        nbytes=lambda h, f: self.storage.nbytes())

    def write(self, header: dict, frames: list) -> None:
        rows, spec = _args(header, "rows", "cols")
        rows = [int(r) for r in rows]
        columns = decode_columns(spec, frames, self.schema)
        stored = self.storage._columns
        for name, values in columns.items():
            if len(values) != len(rows):
                raise ProtocolError(f"field {name!r}: {len(values)} values for {len(rows)} rows")
            for row in rows:
                if row in stored[name]:
                    raise ValueError(f"row {row} field {name!r} is already stored; fields are write-once")
        self.storage.write(rows, columns)
        for name, values in columns.items():
            if isinstance(values, np.ndarray) and len(rows) > 1:
                refs = self.blocks.setdefault(name, {})
                for k, row in enumerate(rows):
                    refs[row] = (values, k)

    def gather(self, header: dict, frames: list) -> tuple[list, list]:
        rows, names = _args(header, "rows", "fields")
        names = self.schema.check_names(names)
        stored = self.storage._columns
        for name in names:
            for row in rows:
                if row not in stored[name]:
                    raise ValueError(f"row {row} field {name!r} is not stored (never written, or cleared)")
        views = {name: self._block_view(name, rows) for name in names}
        rest = [name for name in names if views[name] is None]
        stacked = assemble(self.schema, self.storage.gather(rows, rest))
        return encode_columns({name: stacked[name] if views[name] is None else views[name] for name in names})

    def _block_view(self, name: str, rows: list) -> np.ndarray | None:
        """``rows`` as one slice of the block they arrived in, or ``None`` if they are not
        consecutive rows of one block."""
        refs = self.blocks.get(name)
        first = refs.get(rows[0]) if refs and rows else None
        if first is None:
            return None
        block, k0 = first
        for offset, row in enumerate(rows):
            ref = refs.get(row)
            if ref is None or ref[0] is not block or ref[1] != k0 + offset:
                return None
        return block[k0:k0 + len(rows)]

    def drop(self, header: dict, frames: list) -> None:
        rows = [int(r) for r in _args(header, "rows")[0]]
        self.storage.drop(rows)
        for refs in self.blocks.values():
            for row in rows:
                refs.pop(row, None)

    def save(self, header: dict, frames: list) -> None:
        path, unit, n_units = _args(header, "path", "unit", "n_units")
        save_arrays(os.path.join(path, f"data-{unit}-of-{n_units}.npz"), self.storage.to_arrays())

    def load(self, header: dict, frames: list) -> None:
        path, unit, n_units = _args(header, "path", "unit", "n_units")
        storage = Storage(self.schema)
        for name in data_files(path):
            with np.load(name, allow_pickle=False) as arrays:
                storage.load_arrays(arrays, keep=lambda r: shard_of(r, n_units) == unit)
        self.storage, self.blocks = storage, {}
