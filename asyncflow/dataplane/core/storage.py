"""Data plane: a storage unit holding the sample x field table.

The storage unit knows nothing about tasks, partitions, readiness or capacity (that is the
control plane, :mod:`asyncflow.dataplane.core.index`); it stores and returns values by
``(row, field)``. Keeping it policy-free is what lets a later deployment shard rows over
several units and move the bytes point to point while the controller moves only row ids.

Layout: one dict per field, ``row -> value``. A fixed field's rows are read-only views
into the validated block they arrived in (one copy at validation, none here); a ragged
field's rows are read-only 1-D arrays of their own length, so nothing is padded.

Not thread-safe on its own: the in-process :class:`~asyncflow.dataplane.core.controller.DataPlane`
calls it under its lock. :meth:`Storage.gather` returns references only, and
:func:`assemble` (the copying/stacking) runs outside the lock; this is safe because stored
values are never mutated, only replaced by dropping rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from asyncflow.dataplane.core.schema import Schema

__all__ = ["Storage", "assemble"]


class Storage:
    """``field -> row -> value`` for one schema."""

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self._columns: dict[str, dict[int, np.ndarray]] = {name: {} for name in schema.names}

    def write(
        self, rows: Sequence[int], columns: Mapping[str, np.ndarray | list[np.ndarray]]
    ) -> None:
        """Store validated ``columns`` (from :meth:`Schema.validate`) at ``rows``, in order."""
        for name, values in columns.items():
            column = self._columns[name]
            for row, value in zip(rows, values):
                column[row] = value

    def gather(self, rows: Sequence[int], fields: Iterable[str]) -> dict[str, list[np.ndarray]]:
        """Per-field lists of the stored values of ``rows`` (references, in ``rows`` order)."""
        return {name: [self._columns[name][row] for row in rows] for name in fields}

    def drop(self, rows: Iterable[int]) -> None:
        """Forget every field of ``rows`` (missing ones are ignored)."""
        rows = list(rows)
        for column in self._columns.values():
            for row in rows:
                column.pop(row, None)

    def to_arrays(self, keep: Callable[[int], bool] | None = None,
                  keep_fields: Mapping[str, Iterable[int]] | None = None) -> dict[str, np.ndarray]:
        """Every stored value as a few flat arrays (for ``np.savez``; no pickle).

        Keys per field: ``"<field>::rows"`` (row ids), ``"<field>::data"`` (fixed: stacked
        ``[n, *shape]``; ragged: the concatenated rows) and, for ragged fields,
        ``"<field>::lengths"``. ``keep(row)`` selects rows (default: all); ``keep_fields``
        (field -> rows) selects ``(row, field)`` pairs instead (a field it lacks: none).
        """
        out: dict[str, np.ndarray] = {}
        for name, column in self._columns.items():
            f = self.schema[name]
            if keep_fields is not None:
                rows = sorted(r for r in set(keep_fields.get(name, ())) if r in column)
            else:
                rows = [r for r in column if keep is None or keep(r)]
            values = [column[r] for r in rows]
            out[f"{name}::rows"] = np.asarray(rows, dtype=np.int64)
            if f.ragged:
                out[f"{name}::lengths"] = np.asarray([len(v) for v in values], dtype=np.int64)
                flat = np.concatenate(values) if values else np.empty(0, f.dtype)
                out[f"{name}::data"] = flat.astype(f.dtype, copy=False)
            else:
                out[f"{name}::data"] = (
                    np.stack(values) if values else np.empty((0, *f.shape), f.dtype)
                ).astype(f.dtype, copy=False)
        return out

    def load_arrays(
        self, arrays: Mapping[str, np.ndarray], keep: Callable[[int], bool] | None = None
    ) -> None:
        """Add the values of :meth:`to_arrays` output (rows selected by ``keep``)."""
        for name, column in self._columns.items():
            if f"{name}::rows" not in arrays:
                continue
            f = self.schema[name]
            rows = arrays[f"{name}::rows"].tolist()
            data = np.array(arrays[f"{name}::data"], dtype=f.dtype)  # one owned copy
            data.flags.writeable = False
            if f.ragged:
                lengths = arrays[f"{name}::lengths"]
                values = np.split(data, np.cumsum(lengths)[:-1]) if len(rows) else []
            else:
                values = list(data)
            for row, value in zip(rows, values):
                if keep is None or keep(row):
                    column[row] = value

    def nbytes(self) -> int:
        """Bytes of stored values (views count their own extent)."""
        return sum(np.asarray(v).nbytes for col in self._columns.values() for v in col.values())


def assemble(
    schema: Schema, gathered: Mapping[str, list[np.ndarray]]
) -> dict[str, np.ndarray | list[np.ndarray]]:
    """Turn :meth:`Storage.gather` output into what consumers get.

    Fixed fields become one new array ``[n_rows, *shape]``; ragged fields stay a list of
    read-only 1-D arrays (views of the store: copy before modifying).
    """
    out: dict[str, np.ndarray | list[np.ndarray]] = {}
    for name, values in gathered.items():
        f = schema[name]
        if f.ragged:
            out[name] = list(values)
        elif values:
            out[name] = np.stack(values).astype(f.dtype, copy=False)
        else:
            out[name] = np.empty((0, *f.shape), dtype=f.dtype)
    return out
