"""A controller's start: it learns its storage units before it serves a row.

A mixin of :class:`~asyncflow.dataplane.transport.controller_server.ControllerServer`. At
start the controller asks every unit ``unit_info`` (:meth:`UnitLinks.probe`): the unit's
random id (which its write receipts carry: :mod:`asyncflow.dataplane.transport.receipts`)
and how many values it already holds. Until every unit has answered, requests are *held*
(in arrival order, at most :data:`START_QUEUE`) and handled once the start is decided;
``hello``, ``ping``, ``stats``, ``load`` and ``shutdown`` are answered at once. Units answer
in milliseconds, so a client rarely notices.

Then the controller serves, unless serving would corrupt the plane:

* **Restarted without state.** A controller that starts with an empty index (no ``load``)
  while a unit already holds values is a controller restarted on its port: it would hand
  out row ids from 0 again (writes of them refused as "already stored", or worse, reads of
  another put's bytes) and leave the earlier rows allocated for good. It refuses every
  request but those above with :class:`~asyncflow.dataplane.core.rules.DataPlaneUnavailable`
  naming the unit and the fix, until a ``load`` succeeds (or the units are restarted too).
* **A unit that does not answer** within ``unit_deadline``, or answers with an error: the
  controller refuses likewise, naming the unit (a plane without it cannot serve its rows).

Cost once serving: one attribute test per request (:attr:`ControllerStart.gated`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from asyncflow.dataplane.core.rules import DataPlaneUnavailable
from asyncflow.dataplane.transport.protocol import unpack_header
from asyncflow.dataplane.transport.unit_links import UnitLinks

__all__ = ["START_QUEUE", "UNGATED", "ControllerStart"]

UNGATED = frozenset({"hello", "ping", "stats", "load", "shutdown"})  # answered while starting or refusing
START_QUEUE = 10_000  # requests held while the units answer; more are refused (retry)


class ControllerStart:
    """The start probe, the requests held meanwhile, and the refusal to serve."""

    units: UnitLinks
    unit_deadline: float

    if TYPE_CHECKING:  # the server's
        def reply(self, ident: bytes, rid: Any, result: Any = None, buffers: Any = (),
                  error: BaseException | None = None) -> bool: ...
        def handle(self, frames: list) -> None: ...

    def start_probe(self) -> None:
        """Ask every unit ``unit_info``; hold requests until they all answered."""
        self.unit_ids: list[bytes] = []
        self.refusal: str | None = None  # why this controller does not serve, while it does not
        self.restarted = False  # the refusal is the one a load lifts
        self.starting: list[list] | None = []  # requests held until the start is decided
        self.gated = True  # starting or refusing: handle() asks held_back() first
        self._loaded = False
        self._probe_deadline = time.monotonic() + self.unit_deadline
        self.units.probe()

    def held_back(self, frames: list) -> bool:
        """Whether a request is held (starting) or refused (not serving) instead of handled now."""
        try:
            header = unpack_header(frames[1].buffer)
        except Exception:  # (handle answers a malformed message)
            return False
        if header.get("op") in UNGATED:
            return False
        if self.refusal is not None:
            self.reply(frames[0].bytes, header.get("id"), error=DataPlaneUnavailable(self.refusal))
            return True
        if self.starting is None:
            return False
        if len(self.starting) >= START_QUEUE:
            self.reply(frames[0].bytes, header.get("id"), error=DataPlaneUnavailable(
                "the data plane's controller is still waiting for its storage units to answer; retry"))
            return True
        self.starting.append(frames)
        return True

    def check_start(self, now: float) -> None:
        """Once every unit answered (or the deadline passed): serve, or refuse; then handle
        the held requests in arrival order."""
        if self.starting is None:
            return
        info = self.units.info
        missing = [u for u, got in enumerate(info) if got is None]
        if missing and now < self._probe_deadline:
            return
        self.refusal = self._refusal(info, missing)
        if self.refusal is None or self.restarted:  # (every unit answered with its id)
            self.unit_ids = [got["id"] for got in info if got is not None]
        held, self.starting = self.starting, None
        self.gated = self.refusal is not None
        for frames in held:
            self.handle(frames)

    def loaded(self) -> None:
        """A ``load`` succeeded: the index is the saved state, so a restarted controller serves."""
        self._loaded = True
        if self.restarted:
            self.refusal, self.restarted, self.gated = None, False, self.starting is not None

    def _refusal(self, info: list[dict | None], missing: list[int]) -> str | None:
        where = self.units.endpoints
        if missing:
            return (f"storage unit {missing[0]} ({where[missing[0]]}) did not answer the data plane controller's "
                    f"start within {self.unit_deadline:g}s; the controller does not serve (is the unit running?)")
        for u, got in enumerate(info):
            if got is None or "error" in got or not isinstance(got.get("id"), bytes):
                return (f"storage unit {u} ({where[u]}) answered the controller's start with "
                        f"{got and got.get('error')!r}; the controller does not serve (a unit of another version?)")
        held = [(u, got["held"]) for u, got in enumerate(info) if got and got.get("held")]
        if held and not self._loaded:
            self.restarted = True
            u, n = held[0]
            return (f"the data plane's controller started without state, but storage unit {u} ({where[u]}) "
                    f"already holds {n} values of earlier rows: the controller was restarted without load. It "
                    "refuses to serve (it would hand out row ids from 0 again and leave those rows allocated for "
                    "good): load the saved state (load(NAME)), or restart the storage units with it")
        return None
