"""How a training engine cuts the rows of one call into forward/backward passes, and merges their metrics.

* :func:`token_budget_split`: chunks whose padded size ``rows x longest row`` stays within a
  token budget (``train.max_tokens_per_micro``);
* :func:`padding_split`: cuts only where a cut saves enough padded tokens (``train.split_padding``);
* :func:`take_rows` and :func:`merge_metrics`: a chunk's rows of per-row values, and the
  chunks' metrics combined.

Every split is exact for the engines' losses: they normalise by the step's totals, never by a
chunk's, so the chunks' summed gradient equals one pass over all rows
(:mod:`asyncflow.engines.training`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def token_budget_split(lengths: Sequence[int], max_tokens: int | None) -> list[list[int]]:
    """Row indices grouped so that ``len(chunk) * max(lengths in chunk) <= max_tokens``.

    Longest first, packed greedily; a row longer than the budget is a chunk of its own.
    ``None`` = one chunk of every row in the original order.

    >>> token_budget_split([3, 10, 4, 4, 9, 2], 20)
    [[1, 4], [2, 3, 0, 5]]
    """
    if max_tokens is None:
        return [list(range(len(lengths)))] if len(lengths) else []
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    chunks: list[list[int]] = []
    for i in order:
        # Descending order: the chunk's first row is its longest, so its width is fixed.
        if chunks and (len(chunks[-1]) + 1) * lengths[chunks[-1][0]] <= max_tokens:
            chunks[-1].append(i)
        else:
            chunks.append([i])
    return chunks


def padding_split(lengths: Sequence[int], min_saving: int) -> list[list[int]]:
    """Row indices (longest first) cut into passes wherever a cut saves at least
    ``min_saving`` padded tokens: a pass costs about ``rows x longest row`` tokens plus a
    fixed overhead, so a micro-batch of a few long rows and many short ones runs as two
    passes, and one of similar rows stays one pass. ``0`` = one pass, original order.

    >>> padding_split([10, 50, 10, 10, 50, 10], 60)  # 6 x 50 = 300 -> 2 x 50 + 4 x 10 = 140
    [[1, 4], [0, 2, 3, 5]]
    """
    if not min_saving or len(lengths) < 2:
        return [list(range(len(lengths)))] if len(lengths) else []
    rest = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    chunks: list[list[int]] = []
    while len(rest) > 1:
        widths = [lengths[i] for i in rest]
        n, full = len(rest), len(rest) * widths[0]
        cost, cut = min((j * widths[0] + (n - j) * widths[j], j) for j in range(1, n))
        if full - cost < min_saving:
            break
        chunks.append(rest[:cut])
        rest = rest[cut:]
    return chunks + [rest]


def take_rows(value: Any, idx: list[int]) -> Any:
    """Rows ``idx`` of a per-row value (numpy array, list or tuple); anything else as is."""
    if isinstance(value, np.ndarray):
        return value[idx]
    if isinstance(value, (list, tuple)):
        return [value[i] for i in idx]
    return value


def merge_metrics(parts: list[tuple[int, dict]]) -> dict:
    """Combine per-chunk metrics: ``*_max`` by max, ``*_min`` by min, the rest row-weighted."""
    if len(parts) == 1:
        return parts[0][1]
    rows = sum(n for n, _ in parts)
    out = {}
    for k in parts[0][1]:
        vals = [(n, m[k]) for n, m in parts if k in m]
        if k.endswith("_max"):
            out[k] = max(v for _, v in vals)
        elif k.endswith("_min"):
            out[k] = min(v for _, v in vals)
        else:
            out[k] = sum(n * v for n, v in vals) / max(rows, 1)
    return out


def length_sorted_split(lengths: Sequence[int], rows: int) -> list[list[int]]:
    """Row indices sorted longest first, cut into ``ceil(len / rows)`` passes of near-equal
    row counts (the first ``len % passes`` one row longer): each pass holds rows of similar
    length, so little of it is padding.

    >>> length_sorted_split([3, 9, 4, 8, 2], 2)  # 5 rows, at most 2 a pass: 3 passes of 2, 2, 1
    [[1, 3], [2, 0], [4]]
    """
    if not len(lengths):
        return []
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    k = -(-len(order) // max(rows, 1))
    sizes = [len(order) // k + (1 if i < len(order) % k else 0) for i in range(k)]
    out, at = [], 0
    for n in sizes:
        out.append(order[at: at + n])
        at += n
    return out
