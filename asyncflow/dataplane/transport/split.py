"""How a client cuts a put's frames into messages the servers accept.

A server refuses a frame over its ``max_msg_bytes`` at the frame's header and a message over
it once received (:mod:`asyncflow.dataplane.transport.server_base`); the controller's
``hello`` tells each client that limit. A put sends each unit one message per span of
consecutive rows (:func:`~asyncflow.dataplane.transport.protocol.runs`); a span whose bytes
pass the limit (a whole put on one unit, or very long rows) is cut here into consecutive
row ranges whose messages stay under it, with :data:`SLACK` bytes left for the header
(spec, row ids) and the seals. Only a put bigger than the limit as a whole pays for this
(its row sizes summed once, numpy); any other put's path is unchanged.

Invariants: the pieces cover each span exactly once, in order; every piece holds at least
one row; a single row over the budget is refused by :func:`check_rows` before anything is
sent (it could never be written as frames).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["SLACK", "check_rows", "split_spans"]

SLACK = 1 << 16  # bytes of a message left for its header (row ids, spec) and seals
_ROW_ID_BYTES = 9  # a row id in the msgpack header: at most 9 bytes


def _row_bytes(columns: Mapping[str, Any], i: int, j: int) -> np.ndarray:
    """Bytes each row ``i..j`` adds to a message (its values, a ragged row's length, its id)."""
    out = np.full(j - i, _ROW_ID_BYTES, dtype=np.int64)
    for values in columns.values():
        if isinstance(values, np.ndarray):
            out += values.itemsize * math.prod(values.shape[1:])
        else:
            out += np.fromiter((v.nbytes + 8 for v in values[i:j]), dtype=np.int64, count=j - i)
    return out


def check_rows(columns: Mapping[str, Any], n_rows: int, limit: int) -> None:
    """Refuse a put with a row that alone passes the budget of a message (``limit - SLACK``)."""
    sizes = _row_bytes(columns, 0, n_rows)
    if len(sizes) and int(sizes.max()) > limit - SLACK:
        k = int(sizes.argmax())
        raise ValueError(f"row {k} of the put is {int(sizes[k])} bytes: more than a message may carry (the data "
                         f"plane's max_msg_bytes={limit}, less {SLACK} for the header); launch the data plane with "
                         "a larger max_msg_bytes")


def split_spans(columns: Mapping[str, Any], spans: Sequence[tuple[int, int]], limit: int) -> list[tuple[int, int]]:
    """``spans`` (row ranges of one unit) cut so that each piece's message stays under ``limit``."""
    budget, out = limit - SLACK, []
    for i, j in spans:
        ends = np.cumsum(_row_bytes(columns, i, j))
        start, base = i, 0
        while start < j:
            stop = i + int(np.searchsorted(ends, base + budget, side="right"))
            stop = max(stop, start + 1)  # (check_rows refused rows over the budget)
            out.append((start, stop))
            base, start = int(ends[stop - i - 1]), stop
    return out
