"""The data-plane client interface: :class:`DataPlaneClient`, what every role and feeder uses.

Three deployments implement it with the same semantics (one contract test,
``tests/test_contracts_dataplane.py``, runs against each): the in-process
:class:`~asyncflow.dataplane.core.controller.DataPlane`, the ZeroMQ client
:class:`~asyncflow.dataplane.transport.client.ZmqDataPlane`, and the Ray actor client
``asyncflow.launch.ray_services.RayDataPlane``.

Invariants every implementation keeps: a put is all-or-nothing and fields are write-once;
a row is delivered to a task at most once (until ``reset_consumption``) and never before
all the fields asked for are produced; rows handed out by ``get_meta`` are consumed when
acknowledged (``get_data``/``ack``; ``get_batch`` at once) and go back to the task after
the deployment's hand-out TTL or a ``nack`` (:mod:`asyncflow.dataplane.core.handouts`);
``put`` applies back-pressure and never drops; a
blocking call returns by its ``timeout`` (``QueueTimeout``) or when the plane closes
(``QueueClosed``); an error from a ``put_nowait`` is raised by a later call of the same
client or by ``flush``.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from asyncflow.dataplane.core.rules import BatchMeta, Data


@runtime_checkable
class DataPlaneClient(Protocol):
    def put(self, data: Mapping[str, Any], partition: Hashable = 0, rows: Sequence[int] | None = None,
            tags: Mapping[str, Sequence[int]] | None = None, timeout: float | None = None) -> list[int]:
        """Write columns as new rows (``rows=None``) or into existing rows; the row ids."""

    def put_nowait(self, data: Mapping[str, Any], partition: Hashable = 0, rows: Sequence[int] | None = None,
                   tags: Mapping[str, Sequence[int]] | None = None) -> None:
        """``put`` without waiting for the reply (errors surface on a later call or ``flush``)."""

    def flush(self) -> None:
        """Wait for every ``put_nowait`` of this client; raise the first error among them."""

    def get_meta(self, task: str, fields: Sequence[str], n: int, partition: Hashable | None = None,
                 sampler: Any = None, min_n: int | None = None, block: bool = True,
                 timeout: float | None = None) -> BatchMeta:
        """Choose up to ``n`` ready rows for ``task`` and hand them out (consumed once acknowledged)."""

    def get_data(self, meta: BatchMeta, fields: Sequence[str] | None = None) -> Data:
        """The columns of ``meta``'s rows, in ``meta``'s order; acknowledges ``meta``'s hand-out
        (``HandoutExpired`` and no data if it expired)."""

    def ack(self, meta: BatchMeta) -> None:
        """Acknowledge ``meta``'s rows without reading them (they become consumed)."""

    def nack(self, meta: BatchMeta) -> None:
        """Give ``meta``'s unacknowledged rows back to its task now."""

    def get_batch(self, task: str, fields: Sequence[str], n: int, **kwargs: Any) -> tuple[BatchMeta, Data]:
        """``get_meta`` then ``get_data`` in one call."""

    def seal(self, partition: Hashable) -> None:
        """No more rows will be added to ``partition`` (a short last batch may be handed out)."""

    def clear(self, partition: Hashable) -> None:
        """Forget ``partition``'s rows and free their storage."""

    def clear_rows(self, rows: Sequence[int]) -> None:
        """Forget single rows (all-or-nothing)."""

    def reset_consumption(self, task: str) -> None:
        """Let ``task`` read every live row again."""

    def tags(self, rows: Sequence[int]) -> dict[str, list[int]]:
        """The per-row tags of ``rows``."""

    def stats(self) -> dict[str, Any]:
        """Counters: live rows, partitions, consumed and dropped per task, waiting calls, ..."""

    def save(self, path: str | os.PathLike) -> None:
        """Persist the whole state (msgpack + npz, no pickle) under ``path`` (the distributed
        plane: a path inside its deployment's state folder; nothing from the wire escapes it)."""

    def load(self, path: str | os.PathLike) -> None:
        """Replace the state with one saved by any deployment (same folder rule as ``save``)."""

    def close(self) -> None:
        """Stop: waiting calls raise ``QueueClosed``; stored data stays readable."""
