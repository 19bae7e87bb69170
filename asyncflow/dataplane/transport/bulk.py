"""A storage unit's bulk port: ``write`` and ``gather`` over sealed messages (AES-256-GCM).

The protocol and its invariants are in :mod:`asyncflow.dataplane.transport.sealed`. This is
the unit's side: a second ROUTER socket (only in a deployment with CURVE keys), bound next to
the unit's CURVE socket (same host; ``tcp`` on a free port, ``ipc`` beside the unit's socket
in the 0700 job folder), with ZeroMQ's NULL mechanism: the socket itself authenticates
nobody, every *message* is authenticated instead. A session exists only after an
authenticated client asked for it on the CURVE socket (:meth:`BulkPort.new_session`), so:

* a message that names no live session, fails to open, replays a counter or miscounts its
  frames is dropped unread (nothing decoded, no reply: a reply could not be authenticated
  to a stranger), counted in ``refused`` and logged (the first, then one line a minute);
* the header of an opened message is checked as on the CURVE socket (token, op, arguments)
  and only ``write``, ``gather`` and ``ping`` run here: everything else (drop, save, load,
  shutdown, shared memory) only on the CURVE socket;
* the unit opens every buffer (in place, in the received frame) before the handler runs;
  replies are sealed under the same session (buffers into fresh arrays: the unit's heap
  keeps freed pages, :mod:`asyncflow.dataplane.transport.heap`) and sent without a copy.

Sessions: at most ``max_sessions`` per unit (default :data:`MAX_SESSIONS`; each client core
asks one per unit and holds it for its life; a session costs the unit ~2.5 KB, mostly the
cipher's context: 40 MB at the default). Past that the least recently *used* one is forgotten
(logged, at most a line a minute). Its client is not stranded: a message under a session the
unit does not hold is answered with a clear notice (:func:`~asyncflow.dataplane.transport.sealed.notice`)
instead of silence, and the client asks a new session over CURVE (``bulk_session`` with
``replaces``, so renewals never grow the table) and sends the request again (one log line).
Per message this costs one ``move_to_end`` of an ordered dict. Limits as the CURVE socket:
``MAXMSGSIZE`` per frame, :func:`~asyncflow.dataplane.transport.server_base.over_limit` per
message (checked before anything is opened), heartbeats, ``ROUTER_MANDATORY``.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from asyncflow.dataplane.transport.protocol import ProtocolError, error_to_msg, pack_header, unpack_header
from asyncflow.dataplane.transport.sealed import TO_CLIENT, SealError, Session, envelope_of, notice
from asyncflow.dataplane.transport.server_base import over_limit

__all__ = ["MAX_SESSIONS", "BULK_OPS", "BulkPort", "bulk_bind"]

log = logging.getLogger(__name__)

MAX_SESSIONS = 16384  # per unit (2x TransferQueue's 8,192 clients); past it the least recently used is forgotten
BULK_OPS = frozenset({"write", "gather", "ping"})


def bulk_bind(bind: str) -> str:
    """Where a unit bound at ``bind`` binds its bulk socket: a free port on the same
    address (``tcp``), or ``<path>.bulk`` (``ipc``, in the same 0700 folder)."""
    if bind.startswith("tcp://"):
        return bind.rsplit(":", 1)[0] + ":*"
    return bind + ".bulk"


class BulkPort:
    """The bulk socket of one storage unit and its sessions; run by the unit's own loop."""

    def __init__(self, ctx: zmq.Context, bind: str, max_msg_bytes: int,
                 ops: dict[str, Callable[..., Any]], check_token: Callable[[dict], None],
                 max_sessions: int = MAX_SESSIONS) -> None:
        if not (isinstance(max_sessions, int) and max_sessions >= 1):
            raise ValueError(f"max_sessions must be an int >= 1, got {max_sessions!r}")
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.MAXMSGSIZE, int(max_msg_bytes))
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10000)
        self.sock.bind(bulk_bind(bind))
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.ops, self.check_token = ops, check_token
        self.max_sessions, self.max_msg_bytes = max_sessions, int(max_msg_bytes)
        self.sessions: OrderedDict[bytes, Session] = OrderedDict()  # least recently used first
        self.refused = self.forgotten = 0
        self._logged = self._logged_forgot = 0.0

    def new_session(self, header: dict, frames: list) -> dict:
        """The ``bulk_session`` op (CURVE socket only): a fresh session for the asking client;
        ``replaces`` (a session id it held) is dropped first."""
        replaces = (header.get("a") or {}).get("replaces")
        if isinstance(replaces, bytes):
            self.sessions.pop(replaces, None)
        session, key = Session.fresh(TO_CLIENT)
        self.sessions[session.sid] = session
        while len(self.sessions) > self.max_sessions:
            self.sessions.popitem(last=False)
            self.forgotten += 1
            now = time.monotonic()
            if self.forgotten == 1 or now - self._logged_forgot >= 60.0:
                self._logged_forgot = now
                log.warning("data plane bulk port %s: forgot the least recently used sealed session (this unit "
                            "holds at most max_sessions=%d; %d forgotten so far): its client makes a new one on its "
                            "next request", self.endpoint, self.max_sessions, self.forgotten)
        return {"sid": session.sid, "key": key, "endpoint": self.endpoint}

    def drain(self, budget: int = 64) -> None:
        """Handle up to ``budget`` pending messages (non-blocking)."""
        for _ in range(budget):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.handle(frames)

    def handle(self, frames: list) -> None:
        ident, rest = frames[0].bytes, frames[1:]
        try:
            if not rest:
                raise SealError("empty message")
            sid = envelope_of(rest[0].buffer)[0]
            session = self.sessions.get(sid)
            if session is None:
                self._send(ident, [notice(sid)])  # (its client asks a new session and sends again)
                raise SealError("sealed message of an unknown session (never handed out by this unit, or forgotten; "
                                "a notice was sent back)")
            raw, sealed = session.open([f.buffer for f in rest])  # (the header only: small)
            self.sessions.move_to_end(sid)
            too_big = over_limit(rest, self.max_msg_bytes)
            plain = [] if too_big else sealed.open_all()  # (an oversized message's buffers are never opened)
        except Exception as exc:  # SealError, or anything else before authentication: refused, never decoded
            self._refuse(exc)
            return
        header: Any = {}
        try:
            header = unpack_header(raw)
            self.check_token(header)
            if too_big:
                raise ProtocolError(too_big)
            op = str(header.get("op", ""))
            if op not in BULK_OPS:
                raise ProtocolError(f"op {op!r} is not served on the bulk socket (only {sorted(BULK_OPS)})")
            out = self.ops[op](header, plain)
            result, buffers = out if isinstance(out, tuple) else (out, ())
            self._reply(ident, session, {"id": header.get("id"), "ok": True, "r": result}, buffers)
        except Exception as exc:  # every failure of an authenticated request becomes an error reply
            rid = header.get("id") if isinstance(header, dict) else None
            self._reply(ident, session, {"id": rid, "ok": False, "err": error_to_msg(exc)}, ())

    def _reply(self, ident: bytes, session: Session, header: dict, buffers: Any) -> None:
        self._send(ident, session.seal(pack_header(header), buffers, lambda n: np.empty(n, np.uint8)))

    def _send(self, ident: bytes, frames: list) -> None:
        try:
            self.sock.send_multipart([ident, *frames], zmq.NOBLOCK, copy=False)
        except zmq.Again:
            log.warning("data plane bulk port %s: a reply dropped, its client's queue is full", self.endpoint)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:  # the client is gone: nothing to answer
                raise

    def _refuse(self, exc: Exception) -> None:
        self.refused += 1
        now = time.monotonic()
        if self.refused == 1 or now - self._logged >= 60.0:
            self._logged = now
            log.error("data plane bulk port %s: refused a message (%s; %d refused so far)", self.endpoint, exc,
                      self.refused)

    def close(self) -> None:
        self.sock.close(0)
