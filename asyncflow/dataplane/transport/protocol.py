"""The wire format of the distributed data plane: msgpack headers + raw numpy buffers.

Every message is one ZeroMQ multipart message::

    [header (msgpack map), buffer 0, buffer 1, ...]

* The header carries the operation, its plain arguments (ints, strs, lists, maps) and,
  for data, a column spec ``[[name, kind, dtype, shape], ...]``: kind ``"f"`` (fixed,
  one buffer ``[n, *shape]``) or ``"r"`` (ragged, a flat buffer + an int64 lengths
  buffer, as in :mod:`asyncflow.dataplane.transport.wire`).
* Buffers are the raw bytes of C-contiguous arrays; the receiver wraps them with
  ``np.frombuffer`` (no copy, read-only) after checking the byte count against the spec.

There is no pickle anywhere: samplers travel as small maps (:func:`sampler_to_msg`),
errors as ``{"type", "msg"}`` and are re-raised as the same exception class when it is
one of the data plane's (:data:`ERRORS`). Partition names must be ``int``, ``str`` or
``None`` (what msgpack round-trips unchanged). A malformed message raises
:class:`ProtocolError` (a ``ValueError``) naming what is wrong, never anything else, so a
server can answer it and go on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

from asyncflow.dataplane.core.rules import BatchMeta, DataPlaneUnavailable, HandoutExpired, QueueClosed, QueueTimeout
from asyncflow.dataplane.core.samplers import (
    GroupSampler,
    Sampler,
    SequentialSampler,
    ShardSampler,
    StalenessSampler,
    TokenBalancedSampler,
)
from asyncflow.dataplane.core.schema import Schema, SchemaError

__all__ = [
    "ERRORS",
    "ProtocolError",
    "decode_columns",
    "encode_columns",
    "error_from_msg",
    "error_to_msg",
    "meta_from_msg",
    "meta_to_msg",
    "pack_header",
    "sampler_from_msg",
    "runs",
    "sampler_to_msg",
    "shard_of",
    "unpack_header",
]


class ProtocolError(ValueError):
    """A message that does not follow this module's format."""


ERRORS: dict[str, type[Exception]] = {
    c.__name__: c
    for c in (QueueTimeout, QueueClosed, DataPlaneUnavailable, HandoutExpired, SchemaError, ProtocolError, ValueError,
              TypeError, KeyError, PermissionError, FileNotFoundError)
}


_MAX_DIM = 1 << 40  # any dimension of a column spec: more is no real array (and could overflow)
SHARD_BLOCK = 64  # rows per block; block b lives on storage unit b % N


def shard_of(row: int, n_units: int) -> int:
    """The storage unit of ``row``: blocks of :data:`SHARD_BLOCK` consecutive global ids
    go round-robin over the units, so a put of new rows (consecutive ids) splits into a few
    contiguous slices (sent as views, no copy) while a large batch still spreads evenly."""
    return (row // SHARD_BLOCK) % n_units


def runs(rows: Sequence[int], n_units: int) -> list[tuple[int, int, int]]:
    """``(unit, start, stop)``: maximal slices of ``rows`` of consecutive ids on one unit."""
    out: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[i - 1] + 1 or shard_of(rows[i], n_units) != shard_of(rows[start], n_units):
            out.append((shard_of(rows[start], n_units), start, i))
            start = i
    return out


def pack_header(header: Mapping[str, Any]) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def unpack_header(frame: bytes | memoryview) -> dict[str, Any]:
    """Decode a header frame; :class:`ProtocolError` unless it is a msgpack map."""
    try:
        header = msgpack.unpackb(bytes(frame), raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several types on garbage
        raise ProtocolError(f"header is not msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a msgpack map, got {type(header).__name__}")
    return header


# -- columns ---------------------------------------------------------------------------
def encode_columns(data: Mapping[str, Any]) -> tuple[list[list], list[Any]]:
    """Validated columns (fixed arrays / lists of 1-D arrays) -> (spec, buffers).

    Buffers are the arrays themselves (C-contiguous; ZeroMQ sends them without a copy).
    """
    spec: list[list] = []
    buffers: list[Any] = []
    for name, value in data.items():
        if isinstance(value, np.ndarray):
            arr = np.ascontiguousarray(value)
            spec.append([name, "f", arr.dtype.str, list(arr.shape)])
            buffers.append(arr)
        else:
            rows = list(value)
            dtype = rows[0].dtype if rows else np.dtype(np.int64)
            flat = np.concatenate(rows).astype(dtype, copy=False) if rows else np.empty(0, dtype)
            lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
            spec.append([name, "r", flat.dtype.str, [len(rows)]])
            buffers.extend([np.ascontiguousarray(flat), lengths])
    return spec, buffers


def decode_columns(
    spec: Any, frames: Sequence[Any], schema: Schema | None = None
) -> dict[str, np.ndarray | list[np.ndarray]]:
    """(spec, buffers) -> columns, as read-only views of the received buffers.

    With ``schema``, every column must be a declared field of exactly its dtype and
    shape (the sender validated and cast already); :class:`SchemaError` names the field.
    Anything else malformed raises :class:`ProtocolError`.
    """
    if not isinstance(spec, list):
        raise ProtocolError(f"column spec must be a list, got {type(spec).__name__}")
    out: dict[str, np.ndarray | list[np.ndarray]] = {}
    i = 0
    for entry in spec:
        if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str)
                and entry[1] in ("f", "r") and isinstance(entry[3], list)):
            raise ProtocolError(f"bad column spec entry {entry!r}")
        name, kind, dtype_str, shape = entry
        try:
            dtype = np.dtype(dtype_str)
            shape = tuple(int(d) for d in shape)
        except Exception:
            raise SchemaError(f"field {name!r}: bad dtype {dtype_str!r} or shape {entry[3]!r}") from None
        if dtype.hasobject or any(not 0 <= d <= _MAX_DIM for d in shape) or not shape:
            raise SchemaError(f"field {name!r}: bad dtype {dtype_str!r} or shape {shape}")
        if schema is not None:
            f = schema[name]  # SchemaError for an unknown field
            if dtype != np.dtype(f.dtype) or (kind == "r") != f.ragged or (
                    kind == "f" and shape[1:] != f.shape):
                raise SchemaError(
                    f"field {name!r}: got {'ragged' if kind == 'r' else 'fixed'} {dtype} "
                    f"rows of shape {shape[1:]}, declared {f}"
                )
        need = 2 if kind == "r" else 1
        if i + need > len(frames):
            raise ProtocolError(f"field {name!r}: missing data frames")
        if kind == "f":
            out[name] = _view(name, frames[i], dtype, shape)
        else:
            lengths = _view(name, frames[i + 1], np.dtype(np.int64), (shape[0],))
            flat = _view(name, frames[i], dtype, (_total_length(name, lengths, frames[i], dtype),))
            out[name] = np.split(flat, np.cumsum(lengths)[:-1]) if len(lengths) else []
        i += need
    if i != len(frames):
        raise ProtocolError(f"{len(frames) - i} data frames more than the column spec names")
    return out


def _nbytes(frame: Any) -> int:
    return memoryview(frame.buffer if hasattr(frame, "buffer") else frame).nbytes


def _total_length(name: str, lengths: np.ndarray, flat: Any, dtype: np.dtype) -> int:
    """The sum of a ragged column's row lengths, checked without overflow: each length
    non-negative and at most the flat frame's element count E; with n lengths the sum is at
    most n * E <= (message bytes)**2 / 8, below 2**64 for any message under 8 GiB (the
    servers' limit is 1 GiB), so the unsigned sum cannot wrap; :func:`_view` then requires
    the sum to be exactly E."""
    if not len(lengths):
        return 0
    have = _nbytes(flat) // dtype.itemsize if dtype.itemsize else 0
    if int(lengths.min()) < 0 or int(lengths.max()) > have:
        raise ProtocolError(f"field {name!r}: row lengths must be in [0, {have}] (the flat frame's elements)")
    return int(lengths.sum(dtype=np.uint64))


def _view(name: str, frame: Any, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    buf = memoryview(frame.buffer if hasattr(frame, "buffer") else frame)
    want = math.prod(shape) * dtype.itemsize  # Python ints: a huge shape cannot wrap around
    if buf.nbytes != want:
        raise ProtocolError(
            f"field {name!r}: data frame has {buf.nbytes} bytes, spec {dtype}{list(shape)} needs {want}"
        )
    arr = np.frombuffer(buf, dtype=dtype).reshape(shape)
    arr.flags.writeable = False
    return arr


# -- samplers, metas, errors -----------------------------------------------------------
def sampler_to_msg(sampler: Sampler | None) -> dict | None:
    """The built-in samplers as small maps; a custom sampler cannot cross the network."""
    if sampler is None:
        return None
    if isinstance(sampler, SequentialSampler):
        return {"k": "seq"}
    if isinstance(sampler, GroupSampler):
        return {"k": "group", "group_size": sampler.group_size}
    if isinstance(sampler, StalenessSampler):
        return {"k": "stale", "min_version": sampler.min_version, "inner": sampler_to_msg(sampler.inner)}
    if isinstance(sampler, TokenBalancedSampler):
        return {"k": "tokens", "world_size": sampler.world_size, "inner": sampler_to_msg(sampler.inner)}
    if isinstance(sampler, ShardSampler):
        return {"k": "shard", "shard": sampler.shard, "tag": sampler.tag, "inner": sampler_to_msg(sampler.inner)}
    raise ValueError(
        f"sampler {sampler!r} cannot be sent to a remote controller (no pickle); use "
        "SequentialSampler, GroupSampler, StalenessSampler, TokenBalancedSampler or ShardSampler"
    )


def sampler_from_msg(msg: Any) -> Sampler:
    if msg is None:
        return SequentialSampler()
    try:
        kind = msg["k"]
        if kind == "seq":
            return SequentialSampler()
        if kind == "group":
            return GroupSampler(int(msg["group_size"]))
        if kind == "stale":
            return StalenessSampler(int(msg["min_version"]), sampler_from_msg(msg["inner"]))
        if kind == "tokens":
            return TokenBalancedSampler(int(msg["world_size"]), sampler_from_msg(msg["inner"]))
        if kind == "shard":
            return ShardSampler(int(msg["shard"]), str(msg["tag"]), sampler_from_msg(msg["inner"]))
    except (KeyError, TypeError) as exc:
        raise ProtocolError(f"malformed sampler {msg!r} ({exc})") from None
    raise ProtocolError(f"unknown sampler {msg!r}")


def meta_to_msg(meta: BatchMeta) -> list:
    return [meta.partition, meta.rows, meta.fields, meta.dropped]


def meta_from_msg(msg: Sequence[Any]) -> BatchMeta:
    return BatchMeta(msg[0], list(msg[1]), list(msg[2]), list(msg[3]), handout=msg[5] if len(msg) > 5 else None)


def error_to_msg(exc: BaseException) -> dict[str, str]:
    name = type(exc).__name__
    return {"type": name if name in ERRORS else "RuntimeError", "msg": str(exc)}


def error_from_msg(msg: Mapping[str, Any]) -> Exception:
    cls = ERRORS.get(str(msg.get("type")), RuntimeError)
    return cls(str(msg.get("msg")))


def concat_spec(columns: Mapping[str, Any], spans: list[tuple[int, int]]) -> tuple[list[list], list[Any]]:
    """As :func:`encode_columns` of the rows in ``spans`` one after another, without
    concatenating: each buffer is the list of its per-span parts (written back to back)."""
    parts = [encode_columns({k: v[i:j] for k, v in columns.items()}) for i, j in spans]
    spec = [[name, kind, dtype, [sum(p[0][c][3][0] for p in parts), *shape[1:]]]
            for c, (name, kind, dtype, shape) in enumerate(parts[0][0])]
    return spec, [[p[1][b] for p in parts] for b in range(len(parts[0][1]))]
