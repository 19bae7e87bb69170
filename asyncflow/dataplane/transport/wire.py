"""Columns on the wire: a few flat numpy buffers instead of many small objects.

A ragged column (a list of 1-D arrays, one per row) becomes one concatenated array plus
the row lengths; a fixed column is already one array. Serialisers (Ray's pickle-5 with
out-of-band buffers, ZeroMQ frames) then move each column as one contiguous buffer: on a
128-row batch of six fields this is a dozen buffers instead of ~800 pickled objects.

``unpack_columns(pack_columns(d))`` returns the same values (ragged rows as views of the
flat buffer). Values that are neither arrays nor lists of arrays pass through unchanged,
so the schema check on the receiving side still reports them precisely.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["pack_columns", "unpack_columns"]


def pack_columns(data: Mapping[str, Any]) -> dict[str, tuple]:
    out: dict[str, tuple] = {}
    for name, value in data.items():
        if isinstance(value, np.ndarray):
            out[name] = ("fixed", value)
        elif isinstance(value, (list, tuple)) and value and all(  # one dtype: else let the schema name the row
                isinstance(v, np.ndarray) and v.ndim == 1 and v.dtype == value[0].dtype for v in value):
            lengths = np.fromiter((len(v) for v in value), dtype=np.int64, count=len(value))
            out[name] = ("ragged", np.concatenate(value), lengths)
        else:
            out[name] = ("raw", value)
    return out


def unpack_columns(packed: Mapping[str, tuple]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, item in packed.items():
        kind = item[0]
        if kind == "ragged":
            flat, lengths = item[1], item[2]
            out[name] = np.split(flat, np.cumsum(lengths)[:-1]) if len(lengths) else []
        else:
            out[name] = item[1]
    return out
