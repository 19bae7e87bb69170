"""``save``/``load`` of the distributed controller: a consistent snapshot, never blocking its loop.

A mixin of :class:`~asyncflow.dataplane.transport.controller_server.ControllerServer`.
``save`` snapshots the index when the request arrives (rows handed out and not
acknowledged are written as not consumed) and tells each storage unit, per field,
exactly the rows that snapshot has produced: a unit never saves a field written after
the snapshot (a put not yet committed then), so every restored row is complete, or lacks
fields that can be put again, never "not produced but already stored". The units answer
through :class:`~asyncflow.dataplane.transport.unit_links.UnitLinks` while the controller
goes on serving (one save/load at a time; a unit that does not answer within
``unit_deadline`` fails it with ``DataPlaneUnavailable`` naming the unit). ``index.msgpack``
is removed first and written last, so a save that fails leaves no loadable mix of old
and new files. ``load`` replaces the index once every unit loaded (for a plane nobody
else uses yet).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from asyncflow.dataplane.core.handouts import Handouts
from asyncflow.dataplane.core.index import RowIndex
from asyncflow.dataplane.core.leases import Leases
from asyncflow.dataplane.core.persist import contained_path, load_state, save_state
from asyncflow.dataplane.core.schema import Schema
from asyncflow.dataplane.transport.protocol import shard_of
from asyncflow.dataplane.transport.server_base import _PARKED, _args
from asyncflow.dataplane.transport.unit_links import AdminOp, UnitLinks

__all__ = ["LEASE_TTL_S", "ControllerPersistence"]

LEASE_TTL_S = 600.0  # a get_batch lease not released by then is dropped (its client died)


class ControllerPersistence:
    """``save``, ``load`` and the wait for the units' answers."""

    schema: Schema
    state_dir: str | None
    index: RowIndex
    reserved: set[tuple[int, str]]
    leases: Leases
    handouts: Handouts
    units: UnitLinks
    admin: AdminOp | None
    unit_deadline: float

    if TYPE_CHECKING:  # the server's and the controller's
        def reply(self, ident: bytes, rid: Any, result: Any = None, buffers: Any = (),
                  error: BaseException | None = None) -> bool: ...
        def _wake(self) -> None: ...
        def loaded(self) -> None: ...

    # -- persistence (waits for the units without blocking the loop) -----------------
    def save(self, header: dict, frames: list, ident: bytes) -> Any:
        """Snapshot the index now; each unit saves exactly the ``(row, field)`` pairs the
        snapshot has produced; ``index.msgpack`` is written once every unit answered."""
        path = self._path(header)
        state = self.index.state([(h.partition, h.task, h.rows) for h in self.handouts.live()])
        n = len(self.units)
        keep: list[dict[str, list[int]]] = [{} for _ in range(n)]
        for part in state["partitions"]:
            for name, rows in part["produced"].items():
                for row in rows:
                    keep[shard_of(row, n)].setdefault(name, []).append(row)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(path, "index.msgpack"))  # a save that fails leaves no loadable half
        os.makedirs(path, exist_ok=True)
        args = [{"path": path, "unit": u, "n_units": n, "keep": keep[u]} for u in range(n)]
        return self._admin(ident, header, "save", args, lambda: save_state(path, self.schema, state))

    def load(self, header: dict, frames: list, ident: bytes) -> Any:
        path = self._path(header)
        state = load_state(path, self.schema)

        def done() -> None:
            self.index, self.reserved = RowIndex.from_state(state), set()
            self.leases = Leases(LEASE_TTL_S)  # the units' bytes were replaced
            self.handouts = Handouts(self.handouts.ttl)
            self.loaded()  # (a controller restarted without state serves again: controller_start)
            self._wake()

        n = len(self.units)
        return self._admin(ident, header, "load", [{"path": path, "unit": u, "n_units": n} for u in range(n)], done)

    def _admin(self, ident: bytes, header: dict, op: str, args: list[dict], done: Callable[[], Any]) -> Any:
        if self.admin is not None:
            raise RuntimeError(f"{op} refused: a {self.admin.op} is still running; retry when it has finished")
        self.admin = self.units.start(ident, header.get("id"), op, args, self.unit_deadline, done)
        return _PARKED

    def _poll_units(self, now: float) -> None:
        """Collect the units' replies; answer the waiting save/load once it is finished."""
        admin = self.admin
        if not self.units.poll(admin, now) or admin is None:
            return
        self.admin = None
        if admin.error:
            self.reply(admin.ident, admin.rid, error=self.units.failure(admin))
            return
        try:
            result = admin.done()
        except Exception as exc:
            self.reply(admin.ident, admin.rid, error=exc)
            return
        self.reply(admin.ident, admin.rid, result)

    def _path(self, header: dict) -> str:
        if self.state_dir is None:
            raise PermissionError("save/load refused: this controller was started without a state folder "
                                  "(launch(state_dir=...) or --state-dir)")
        return contained_path(self.state_dir, _args(header, "path")[0])
