"""How a client splits one read into requests to the storage units (the frames path).

Rows live on unit ``shard_of(row)`` in blocks of 64 consecutive ids, so ``meta.rows`` of a
batch written by one put is a few *spans*: maximal runs of consecutive ids on one unit.
A storage unit answers a request whose rows are consecutive rows of one received block
with a view of that block (no copy, :mod:`asyncflow.dataplane.transport.storage_server`);
any other row set it stacks into a new array first (one full copy of the payload, in the
unit's single thread). :func:`plan_requests` therefore gives every big span its own
``gather`` request, all sent at once (pipelined on the one socket per unit, so the unit
sends span k while the client receives span k-1), and batches the small spans of a unit
into one request (one round trip instead of many tiny ones).

Invariants: the requests of a unit cover its spans exactly once, in ``rows`` order;
:func:`place` writes each answer's values into the output rows its spans name, so the
assembled batch is in ``meta.rows`` order whatever the split.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from asyncflow.dataplane.transport.protocol import runs

__all__ = ["SPLIT_BYTES", "place", "plan_requests"]

SPLIT_BYTES = 256 * 1024  # a span at least this big is one request (its answer a zero-copy view)


def plan_requests(rows: Sequence[int], row_bytes: Sequence[int]) -> list[tuple[int, list[tuple[int, int]]]]:
    """``(unit, spans)`` per request: each span of at least :data:`SPLIT_BYTES` (at
    ``row_bytes[unit]`` per row; 0: never split, e.g. a unit that answers with
    shared-memory refs) alone, the other spans of a unit together. Spans are
    ``(start, stop)`` slices of ``rows``."""
    small: dict[int, list[tuple[int, int]]] = {}
    out: list[tuple[int, list[tuple[int, int]]]] = []
    for unit, i, j in runs(rows, len(row_bytes)) if rows else []:
        if row_bytes[unit] and (j - i) * row_bytes[unit] >= SPLIT_BYTES:
            out.append((unit, [(i, j)]))
        else:
            small.setdefault(unit, []).append((i, j))
    return out + list(small.items())


def place(out: dict[str, Any], spans: Sequence[tuple[int, int]], values_of: Mapping[str, Any],
          whole: bool) -> None:
    """Put one answer's columns (its rows: ``spans`` one after another) into ``out``.
    ``whole``: this answer is the entire batch, so a fixed column is taken as it is."""
    for name, values in values_of.items():
        if whole and not isinstance(out[name], list):
            out[name] = values  # the whole answer: no copy
            continue
        k = 0
        for i, j in spans:  # this answer's rows, in request order, back into place
            out[name][i:j] = values[k:k + j - i]
            k += j - i
