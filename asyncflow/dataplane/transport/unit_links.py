"""The controller's links to its storage units: never blocking, every answer awaited with a deadline.

The controller sends its units two kinds of message: drops of forgotten rows (no reply)
and admin requests (``save``/``load``, one reply each). A dead or stuck unit must never
stop the controller, so:

* every send is non-blocking: a message the socket cannot take now (a unit that is gone
  or not reading, its queue full) waits in this unit's *outbox*, in order, and is retried
  on every idle turn of the controller's loop. Messages to one unit keep their order (a
  ``save`` is never overtaken by a later drop). An outbox holds at most :data:`OUTBOX_MAX`
  messages; past that the oldest drops are discarded (logged once): a unit that reads
  nothing for that long is dead, and a dead unit's rows are lost anyway;
* an admin request (:class:`AdminOp`) is sent to every unit and the controller goes on
  serving; :meth:`UnitLinks.poll` collects the replies as they come, and the request fails
  with :class:`~asyncflow.dataplane.core.rules.DataPlaneUnavailable` naming the first unit
  that did not answer within its deadline.

* at start, :meth:`UnitLinks.probe` asks every unit ``unit_info`` (its id and how many
  values it holds); :meth:`UnitLinks.poll` files the answers in ``info`` (per unit: the
  reply's result, or ``{"error": ...}``), read by the controller's start
  (:mod:`asyncflow.dataplane.transport.controller_start`).

The unit sockets are registered in the controller's poller, so a reply wakes its loop.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from asyncflow.dataplane.core.rules import DataPlaneUnavailable
from asyncflow.dataplane.transport.auth import Credentials, secure_client
from asyncflow.dataplane.transport.protocol import ProtocolError, pack_header, shard_of, unpack_header

__all__ = ["OUTBOX_MAX", "AdminOp", "UnitLinks"]

log = logging.getLogger(__name__)

OUTBOX_MAX = 100_000  # messages waiting for one unit; older drops are discarded past this


@dataclass
class AdminOp:
    """A ``save``/``load`` sent to every unit: who asked, what is still awaited, and what
    to do once every unit answered (``done`` returns the reply's result)."""

    ident: bytes
    rid: Any
    op: str
    waiting: dict[int, int]  # request id -> unit
    deadline: float
    done: Callable[[], Any]
    error: str = field(default="")


class UnitLinks:
    """One DEALER socket per storage unit, with an outbox each."""

    def __init__(self, ctx: zmq.Context, endpoints: Sequence[str], creds: Credentials | None,
                 token: str) -> None:
        self.endpoints, self.token, self.socks = list(endpoints), token, []
        for ep in self.endpoints:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 1000)
            s.setsockopt(zmq.HEARTBEAT_IVL, 2000)
            s.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10000)
            if creds is not None:
                secure_client(s, creds)
            s.connect(ep)
            self.socks.append(s)
        self.outbox: list[deque[bytes]] = [deque() for _ in self.socks]
        self._rid, self._warned = 0, False
        self.info: list[dict | None] = [None] * len(self.socks)  # per unit: its unit_info answer (probe)
        self._probes: dict[int, int] = {}  # request id -> unit

    def __len__(self) -> int:
        return len(self.socks)

    def send(self, unit: int, header: dict) -> None:
        """Queue one message for ``unit`` and send what its socket takes now."""
        box = self.outbox[unit]
        box.append(pack_header({**header, "tok": self.token}))
        if len(box) > OUTBOX_MAX:
            box.popleft()
            if not self._warned:
                self._warned = True
                log.warning("data plane controller: storage unit %d (%s) reads nothing; discarding its oldest "
                            "queued messages", unit, self.endpoints[unit])
        self._flush(unit)

    def flush(self) -> None:
        for unit in range(len(self.socks)):
            self._flush(unit)

    def _flush(self, unit: int) -> None:
        box, sock = self.outbox[unit], self.socks[unit]
        while box:
            try:
                sock.send(box[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            box.popleft()

    def drop(self, rows: Sequence[int]) -> None:
        """Tell each unit to free its share of ``rows`` (no reply)."""
        n = len(self.socks)
        for unit in range(n):
            mine = [r for r in rows if shard_of(r, n) == unit]
            if mine:
                self.send(unit, {"op": "drop", "noreply": True, "a": {"rows": mine}})

    def start(self, ident: bytes, rid: Any, op: str, args: Sequence[dict], timeout: float,
              done: Callable[[], Any]) -> AdminOp:
        """Send ``op`` with ``args[unit]`` to every unit; the :class:`AdminOp` to wait on."""
        waiting = {}
        for unit, a in enumerate(args):
            self._rid += 1
            waiting[self._rid] = unit
            self.send(unit, {"op": op, "id": self._rid, "a": a})
        return AdminOp(ident, rid, op, waiting, time.monotonic() + timeout, done)

    def probe(self) -> None:
        """Ask every unit its ``unit_info`` (answers land in ``info``)."""
        for unit in range(len(self.socks)):
            self._rid += 1
            self._probes[self._rid] = unit
            self.send(unit, {"op": "unit_info", "id": self._rid, "a": {}})

    def poll(self, pending: AdminOp | None, now: float) -> bool:
        """Read every unit's replies into ``pending``; ``True`` once it is finished (all
        answered, one failed, or its deadline passed: then ``pending.error`` says why)."""
        for sock in self.socks:
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    reply = unpack_header(frames[0])
                except ProtocolError:
                    continue
                rid = reply.get("id")
                if isinstance(rid, int) and rid in self._probes:
                    probed = self._probes.pop(rid)
                    ok = reply.get("ok") and isinstance(reply.get("r"), dict)
                    self.info[probed] = reply["r"] if ok else {"error": str((reply.get("err") or {}).get("msg"))}
                    continue
                unit = pending.waiting.pop(rid, None) if pending is not None and isinstance(rid, int) else None
                if pending is not None and unit is not None and not reply.get("ok"):
                    err = reply.get("err") or {}
                    pending.error = pending.error or f"storage unit {unit} {pending.op} failed: {err.get('msg')}"
        if pending is None:
            return False
        if pending.error or not pending.waiting:
            return True
        if now >= pending.deadline:
            unit = min(pending.waiting.values())
            pending.error = (f"storage unit {unit} ({self.endpoints[unit]}) did not answer {pending.op!r} in time; "
                             "is it running?")
            return True
        return False

    def failure(self, pending: AdminOp) -> Exception:
        if "did not answer" in pending.error:
            return DataPlaneUnavailable(pending.error)
        return RuntimeError(pending.error)
