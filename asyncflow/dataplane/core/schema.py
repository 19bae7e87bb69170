"""Declared columns of the data plane and the validation of everything written to it.

Every value that crosses the queue belongs to a declared :class:`Field`. A put is validated
*as a whole* before any byte is stored (all-or-nothing), and every error names the field and,
where one row is at fault, the row, so the producer knows what to change::

    >>> schema = Schema([Field("prompt_ids", "int64", ragged=True), Field("reward", "float32")])
    >>> cols = schema.validate({"prompt_ids": [[1, 2, 3], [4]], "reward": [1.0, 0.0]})
    >>> [len(r) for r in cols["prompt_ids"]], cols["reward"].dtype.name
    ([3, 1], 'float32')
    >>> schema.validate({"reward": [[1.0], [2.0]]})
    Traceback (most recent call last):
    ...
    asyncflow.dataplane.core.schema.SchemaError: field 'reward' row 0: expected shape (), got (1,)

Two kinds of column:

* **fixed**: every row has the same shape ``Field.shape`` (``()`` is a scalar per row);
  normalised to one array ``[n_rows, *shape]``.
* **ragged**: every row is a 1-D array of its own length, stored without padding;
  normalised to a list of 1-D arrays.

Casting follows ``np.can_cast(given, declared, "same_kind")``: ints into a float field are
fine, floats into an int field are refused (they would be truncated silently). Empty ragged
rows are accepted whatever dtype numpy guessed for them (``np.asarray([])`` is float64).

Validated values are copies owned by the caller of :meth:`Schema.validate` and are marked
read-only, so that the store can hand out views without the producer or a consumer being
able to change stored data behind its back.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Field", "Schema", "SchemaError", "prepare_write", "schema_from_msg", "schema_to_msg", "validate_tags"]


class SchemaError(ValueError):
    """A value does not match the declared schema; the message names the field and row."""


@dataclass(frozen=True)
class Field:
    """One column of the table.

    Args:
        name: column name, unique within a schema.
        dtype: numpy dtype name (normalised, e.g. ``"float"`` becomes ``"float64"``).
        shape: per-row shape of a fixed field; ``()`` is one scalar per row.
        ragged: rows are 1-D arrays of varying length (``shape`` must then be ``()``).
    """

    name: str
    dtype: str
    shape: tuple[int, ...] = ()
    ragged: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Field name must be a non-empty str, got {self.name!r}")
        try:
            dtype = np.dtype(self.dtype)
        except TypeError as exc:
            raise ValueError(f"field {self.name!r}: unknown dtype {self.dtype!r}") from exc
        shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"field {self.name!r}: negative dimension in shape {shape}")
        if self.ragged and shape:
            raise ValueError(
                f"field {self.name!r}: ragged fields are 1-D per row, so shape must be (), "
                f"got {shape}"
            )
        object.__setattr__(self, "dtype", dtype.name)
        object.__setattr__(self, "shape", shape)


class Schema:
    """An ordered set of :class:`Field` s, and the validator for writes.

    Picklable plain data, so it can be sent to a remote controller/storage unit.
    """

    def __init__(self, fields: Iterable[Field]) -> None:
        self._fields: dict[str, Field] = {}
        for f in fields:
            if not isinstance(f, Field):
                raise TypeError(f"Schema takes Field objects, got {f!r}")
            if f.name in self._fields:
                raise ValueError(f"duplicate field {f.name!r} in schema")
            self._fields[f.name] = f

    @property
    def names(self) -> list[str]:
        """Field names in declaration order."""
        return list(self._fields)

    @property
    def fields(self) -> list[Field]:
        """Fields in declaration order."""
        return list(self._fields.values())

    def __contains__(self, name: object) -> bool:
        return name in self._fields

    def __getitem__(self, name: str) -> Field:
        try:
            return self._fields[name]
        except KeyError:
            raise SchemaError(f"unknown field {name!r}; schema has {self.names}") from None

    def __repr__(self) -> str:
        return f"Schema({self.fields!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schema) and self.fields == other.fields

    def check_names(self, names: Iterable[str]) -> list[str]:
        """Return ``names`` as a list, raising :class:`SchemaError` on an unknown one (or a
        bare str, which would otherwise read as its letters)."""
        if isinstance(names, (str, bytes)):
            raise SchemaError(f"fields must be a list of field names, got the str {names!r}; pass [{names!r}]")
        out = list(names)
        for name in out:
            self[name]
        return out

    def validate(
        self, data: Mapping[str, Any], n_rows: int | None = None, copy: bool = True
    ) -> dict[str, np.ndarray | list[np.ndarray]]:
        """Check and normalise a column-wise write.

        Args:
            data: field name -> per-row values (an array with a leading row axis, or a
                sequence with one entry per row).
            n_rows: expected number of rows; ``None`` takes it from the first column.
            copy: ``False`` skips the copy of arrays that already have the declared dtype
                (read-only *views* of the caller's arrays come back): for a sender that
                serialises them before returning, like the distributed client.

        Returns:
            field name -> array ``[n_rows, *shape]`` (fixed) or list of 1-D arrays (ragged),
            all freshly copied and read-only.

        Raises:
            SchemaError: unknown field, wrong dtype kind, wrong shape, ragged row not 1-D,
                or columns with different row counts. Nothing is returned partially.
        """
        out: dict[str, np.ndarray | list[np.ndarray]] = {}
        first: str | None = None
        for name, value in data.items():
            f = self[name]
            rows = _fixed_column(f, value, copy) if not f.ragged else _ragged_column(f, value, copy)
            if n_rows is None:
                n_rows, first = len(rows), name
            elif len(rows) != n_rows:
                against = f"field {first!r} has" if first else "expected"
                raise SchemaError(f"field {name!r}: got {len(rows)} rows, {against} {n_rows}")
            out[name] = rows
        return out


def _rows_of(f: Field, value: Any) -> Sequence[Any] | np.ndarray:
    """Reject values that have no row axis (scalars, strings, mappings, iterators)."""
    if isinstance(value, np.ndarray) and value.ndim >= 1:
        return value
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return value
    raise SchemaError(
        f"field {f.name!r}: expected one value per row (a sequence or an array with a "
        f"leading row axis), got {type(value).__name__}"
    )


def _as_row(f: Field, i: int, item: Any) -> np.ndarray:
    try:
        return np.asarray(item)
    except ValueError as exc:  # e.g. nested lists of unequal lengths
        raise SchemaError(f"field {f.name!r} row {i}: not an array ({exc})") from None


def _check_kind(f: Field, given: np.dtype, row: int | None) -> None:
    if not np.can_cast(given, f.dtype, "same_kind"):
        where = f"row {row}" if row is not None else "(all rows)"
        raise SchemaError(
            f"field {f.name!r} {where}: expected {f.dtype} values, got {given} "
            f"(casting {given} -> {f.dtype} is not 'same_kind')"
        )


def _fixed_column(f: Field, value: Any, copy: bool = True) -> np.ndarray:
    value = _rows_of(f, value)
    if isinstance(value, np.ndarray):
        # One array for all rows: a wrong dtype or shape is wrong for every row, so the
        # first offending row is row 0.
        if value.shape[1:] != f.shape:
            raise SchemaError(
                f"field {f.name!r} row 0: expected shape {f.shape}, got {value.shape[1:]} "
                f"(column of shape {value.shape})"
            )
        if len(value):
            _check_kind(f, value.dtype, 0)
        arr = value.astype(f.dtype, copy=True) if copy else value.astype(f.dtype, copy=False).view()
    else:
        items = [_as_row(f, i, item) for i, item in enumerate(value)]
        for i, a in enumerate(items):
            if a.shape != f.shape:
                raise SchemaError(
                    f"field {f.name!r} row {i}: expected shape {f.shape}, got {a.shape}"
                )
            _check_kind(f, a.dtype, i)
        arr = np.empty((len(items), *f.shape), dtype=f.dtype)
        for i, a in enumerate(items):
            arr[i] = a
    arr.flags.writeable = False
    return arr


def _ragged_column(f: Field, value: Any, copy: bool = True) -> list[np.ndarray]:
    value = _rows_of(f, value)
    out: list[np.ndarray] = []
    for i, item in enumerate(value):
        a = _as_row(f, i, item)
        if a.ndim != 1:
            raise SchemaError(
                f"field {f.name!r} row {i}: expected 1-D {f.dtype} array, got shape {a.shape}"
            )
        if a.size:
            _check_kind(f, a.dtype, i)
        a = a.astype(f.dtype, copy=True) if copy else a.astype(f.dtype, copy=False).view()
        a.flags.writeable = False
        out.append(a)
    return out


def prepare_write(
    schema: Schema, data: Mapping[str, Any], rows: Sequence[int] | None,
    tags: Mapping[str, Sequence[int]] | None, copy: bool = True,
) -> tuple[list[int] | None, dict, int, dict[str, list[int]]]:
    """Validate a whole put before anything is stored, for every deployment.

    Returns ``(rows, columns, n_rows, tags)``: ``rows`` as plain ints (``None`` = new rows),
    the validated columns, the row count and the checked tags. ``rows == []`` is an empty
    write: returned as is, nothing else checked. Raises :class:`SchemaError` or
    ``ValueError`` (a write of new rows without any field).
    """
    if rows is not None:
        rows = [operator.index(r) for r in rows]
        if not rows:
            return rows, {}, 0, {}
    columns = schema.validate(data, None if rows is None else len(rows), copy=copy)
    if rows is None and not columns:
        raise ValueError("put of new rows needs at least one field")
    n_rows = len(rows) if rows is not None else len(next(iter(columns.values())))
    return rows, columns, n_rows, validate_tags(tags, n_rows)


def validate_tags(tags: Mapping[str, Sequence[int]] | None, n_rows: int) -> dict[str, list[int]]:
    """Check per-row integer tags (``name -> one int per row``); return them as lists.

    Raises :class:`SchemaError` naming the tag and row of a non-integer value.
    """
    out: dict[str, list[int]] = {}
    for name, values in (tags or {}).items():
        if not isinstance(name, str):
            raise SchemaError(f"tag names must be str, got {name!r}")
        values = list(values)
        if len(values) != n_rows:
            raise SchemaError(f"tag {name!r}: got {len(values)} values for {n_rows} rows")
        ints = []
        for row, v in enumerate(values):
            try:
                ints.append(operator.index(v))
            except TypeError:
                raise SchemaError(f"tag {name!r} row {row}: expected an int, got {v!r}") from None
        out[name] = ints
    return out


def schema_to_msg(schema: Schema) -> list[list]:
    """The schema as plain lists (msgpack/JSON): ``[[name, dtype, shape, ragged], ...]``."""
    return [[f.name, f.dtype, list(f.shape), f.ragged] for f in schema.fields]


def schema_from_msg(msg: Sequence[Sequence[Any]]) -> Schema:
    """Inverse of :func:`schema_to_msg`; raises ``ValueError`` on a malformed entry."""
    try:
        return Schema(Field(str(n), str(d), tuple(s), bool(r)) for n, d, s, r in msg)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"malformed schema message: {exc}") from None
