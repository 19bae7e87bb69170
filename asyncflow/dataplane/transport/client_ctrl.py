"""The distributed client's requests that the controller alone serves (a mixin of ``AsyncZmqDataPlane``).

Partition lifetime (``seal``, ``clear``, ``clear_rows``), consumption (``reset_consumption``),
``tags``, ``stats``, ``close`` and the state on the servers' disk (``save``/``load``). Each is
one request to the controller with the client's default deadline, but ``save``/``load``,
which wait for every storage unit (20 deadlines). Semantics: those of
:class:`~asyncflow.dataplane.core.controller.DataPlane`.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

from asyncflow.dataplane.core.index import check_partition_name

__all__ = ["ControllerCalls"]


class ControllerCalls:
    """The requests only the controller answers."""

    if TYPE_CHECKING:  # AsyncZmqDataPlane's
        deadline: float
        async def _ctrl_call(self, op: str, deadline: float | None | bool = True, **args: Any) -> Any: ...

    async def seal(self, partition: Hashable) -> None:
        check_partition_name(partition)
        await self._ctrl_call("seal", partition=partition)

    async def clear(self, partition: Hashable) -> None:
        await self._ctrl_call("clear", partition=partition)

    async def clear_rows(self, rows: Sequence[int]) -> None:
        await self._ctrl_call("clear_rows", rows=[int(r) for r in rows])

    async def reset_consumption(self, task: str) -> None:
        await self._ctrl_call("reset_consumption", task=task)

    async def close(self) -> None:
        """Close the data plane for every client (as :meth:`DataPlane.close`)."""
        await self._ctrl_call("close")

    async def save(self, path: str | os.PathLike) -> None:
        """Save the whole state on the servers' file system (``index.msgpack`` + one npz per
        unit) under ``path``: a name relative to the servers' state folder, fixed at launch
        (``Deployment.state_dir``); a path outside it is refused."""
        await self._ctrl_call("save", deadline=20 * self.deadline, path=os.fspath(path))  # waits for every unit

    async def load(self, path: str | os.PathLike) -> None:
        """Load a state saved by :meth:`save` (a name in the servers' state folder)."""
        await self._ctrl_call("load", deadline=20 * self.deadline, path=os.fspath(path))

    async def tags(self, rows: Sequence[int]) -> dict[str, list[int]]:
        return await self._ctrl_call("tags", rows=[int(r) for r in rows])

    async def stats(self) -> dict[str, Any]:
        """As :meth:`DataPlane.stats`, plus ``storage_units``, ``waiting`` (parked requests)
        and ``pinned`` (rows handed out by ``get_batch`` and not read yet)."""
        return await self._ctrl_call("stats")
