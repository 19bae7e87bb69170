"""Request semantics shared by every deployment of the data plane.

What a consumer gets back (:class:`BatchMeta`), the two errors every blocking call may
raise, the validation of ``get_meta`` arguments and the one sampling step
(:func:`try_sample`). The in-process :class:`~asyncflow.dataplane.core.controller.DataPlane` and
the distributed controller (:mod:`asyncflow.dataplane.transport.controller_server`) both call these, so they
hand out rows by exactly the same rules.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from asyncflow.dataplane.core.index import RowIndex
from asyncflow.dataplane.core.samplers import Sampler, check_sample
from asyncflow.dataplane.core.schema import Schema

__all__ = ["BatchMeta", "Data", "DataPlaneUnavailable", "HandoutExpired", "QueueClosed", "QueueTimeout",
           "check_request", "try_sample"]


class QueueClosed(RuntimeError):
    """The data plane was closed; raised in every blocked or later put/get_meta."""


class QueueTimeout(TimeoutError):
    """A blocking call ran out of time; the message says what it waited for."""


class DataPlaneUnavailable(ConnectionError):
    """A data-plane server did not answer (not running, unreachable, or it refused this
    client's credentials); the message names the endpoint and the request."""


class HandoutExpired(RuntimeError):
    """The rows of a ``get_meta`` were not acknowledged within the hand-out TTL (or were
    given back): they went back to the task and may be another consumer's now, so this
    consumer must not use them (see :mod:`asyncflow.dataplane.core.handouts`)."""


@dataclass
class BatchMeta:
    """What ``get_meta`` hands a consumer: row ids to fetch, not data.

    Attributes:
        partition: the partition the rows come from (``None`` for an empty answer to a
            ``partition=None`` request).
        rows: row ids, in the order the sampler chose (e.g. token-balanced order).
        fields: the fields that were required (and are produced for every row).
        dropped: rows consumed for the task without being handed out (e.g. too stale).
        handout: id of the hand-out of ``rows`` (``None``: nothing to acknowledge); the
            first successful ``get_data`` (or ``ack``) acknowledges it and sets it to ``None``.
    """

    partition: Hashable
    rows: list[int]
    fields: list[str]
    dropped: list[int] = field(default_factory=list)
    handout: int | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.rows)


Data = dict[str, np.ndarray | list[np.ndarray]]  # fixed: stacked array; ragged: list of 1-D


def check_request(
    schema: Schema, task: str, fields: Sequence[str], n: int, min_n: int | None
) -> tuple[list[str], int]:
    """Validate get_meta arguments; return ``(fields as a list, min_n)``."""
    fields = schema.check_names(fields)
    if not isinstance(task, str) or not task:
        raise ValueError(f"task must be a non-empty str, got {task!r}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be >= 1 (an int, not a bool), got {n!r}")
    min_n = n if min_n is None else min_n
    if not isinstance(min_n, int) or isinstance(min_n, bool) or not 0 <= min_n <= n:
        raise ValueError(f"min_n must be in [0, n={n}], got {min_n!r}")
    return fields, min_n


def try_sample(
    index: RowIndex, task: str, fields: list[str], n: int, partition: Hashable | None,
    sampler: Sampler, min_n: int,
) -> BatchMeta | None:
    """Sample and commit if the request can be answered now; else ``None`` (nothing changes).

    Shared by the in-process :class:`DataPlane` and the distributed controller, so both
    hand out rows by exactly the same rules.
    """
    candidates = index.partitions() if partition is None else [partition]
    for p in candidates:
        ready = index.ready(p, task, fields)
        if ready:
            chosen, consumed = sampler.sample(ready, n, index.tags(p))
            chosen, consumed = check_sample(sampler, ready, n, chosen, consumed,
                                            functools.partial(index.is_ready, p, task, fields))
        else:
            chosen, consumed = [], []
        done = len(chosen) >= min_n or index.exhausted(p, task, len(ready))
        if partition is None and not (chosen or consumed):
            done = False  # nothing here: look at the next partition
        if done:
            picked = set(chosen)
            dropped = [r for r in consumed if r not in picked]
            if consumed:
                index.consume(p, task, consumed, len(dropped))
            return BatchMeta(p, chosen, fields, dropped)
    if min_n == 0:
        return BatchMeta(partition, [], fields)
    return None
