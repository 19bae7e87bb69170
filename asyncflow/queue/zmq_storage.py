"""A storage unit of the distributed data plane (see :mod:`asyncflow.queue.zmq_server`).

It holds the values of the rows of its shard (``shard_of(row) == unit``) by
``(row, field)`` in a :class:`~asyncflow.queue.storage.Storage`, knows nothing of tasks or
readiness, keeps received buffers as read-only views (no copy), and refuses a second
write of a ``(row, field)`` (fields are write-once). Same one-thread non-blocking ROUTER
loop, token check and error replies as the controller.
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

    def gather(self, header: dict, frames: list) -> tuple[list, list]:
        rows, names = _args(header, "rows", "fields")
        names = self.schema.check_names(names)
        stored = self.storage._columns
        for name in names:
            for row in rows:
                if row not in stored[name]:
                    raise ValueError(f"row {row} field {name!r} is not stored (never written, or cleared)")
        spec, buffers = encode_columns(assemble(self.schema, self.storage.gather(rows, names)))
        return spec, buffers

    def drop(self, header: dict, frames: list) -> None:
        self.storage.drop(int(r) for r in _args(header, "rows")[0])

    def save(self, header: dict, frames: list) -> None:
        path, unit, n_units = _args(header, "path", "unit", "n_units")
        save_arrays(os.path.join(path, f"data-{unit}-of-{n_units}.npz"), self.storage.to_arrays())

    def load(self, header: dict, frames: list) -> None:
        path, unit, n_units = _args(header, "path", "unit", "n_units")
        storage = Storage(self.schema)
        for name in data_files(path):
            with np.load(name, allow_pickle=False) as arrays:
                storage.load_arrays(arrays, keep=lambda r: shard_of(r, n_units) == unit)
        self.storage = storage
