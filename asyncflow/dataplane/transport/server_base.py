"""The request loop shared by the data plane's servers (controller and storage units).

One thread, one ROUTER socket, non-blocking: each message is one request, decoded and
answered (or *parked* by a handler that answers later, see the controller). Every
failure of a request becomes an error reply naming it; the loop goes on.

Security (:mod:`asyncflow.dataplane.transport.auth`): with ``creds`` the ROUTER is a CURVE
server and this loop also answers the ZAP requests of its context (only the job's client
key is admitted), so an unauthenticated peer never gets a frame decoded. A monitor on the
ROUTER counts every failed handshake (``refused``, logged). The token, if any, is checked
on top; a server without a token refuses a request that carries one (both counted in
``refused`` too). Limits, ``max_msg_bytes`` (default :data:`MAX_MSG_BYTES`): a *frame* larger
than that is refused by ZeroMQ at its header, before its body is read (``MAXMSGSIZE``; the
peer is disconnected, nothing of it is buffered or decrypted); a *message* of frames that
are each under it but larger together (ZeroMQ hands over a multipart message only whole,
so this is checked once it arrived) gets an error reply naming the limit before anything
of it is decoded (:func:`over_limit`: the frames' lengths summed, no byte read). Clients
split their puts below the limit (the controller's ``hello`` tells it), so only a broken or
hostile peer meets either. ``ROUTER_MANDATORY`` makes a reply to a client
that is gone fail at once (:meth:`_Server.gone` tells the controller to forget its
waiters); ZMTP heartbeats drop connections of peers that vanished silently.

Lifetime: a server started by :func:`~asyncflow.dataplane.transport.deploy.launch` belongs to
the process that launched it (:meth:`_Server.watch_owner`): when that process is gone, even
killed with ``kill -9``, the server stops within one poll and releases what it holds (a storage
unit's shared memory; the controller, the job's folder) instead of serving nobody forever. A
server started on its own (``deploy storage``/``controller``) has no owner.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from asyncflow.dataplane.transport.auth import Credentials, ZapCheck, secure_server
from asyncflow.dataplane.transport.protocol import ProtocolError, error_to_msg, pack_header, unpack_header

__all__ = ["MAX_MSG_BYTES", "_PARKED", "_POLL_MS", "_Server", "_args", "check_bind", "over_limit", "tcp_bind"]

log = logging.getLogger(__name__)

_PARKED = object()
_POLL_MS = 50
MAX_MSG_BYTES = 1 << 30  # per message (all frames); a bigger frame is refused at its header, unread
_SMALL_HEADER = 1 << 16  # an oversized message's header is decoded (for its request id) only if this small
_FAILED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


class _Server:
    """A ROUTER socket and the request loop shared by both servers."""

    def __init__(self, bind: str, token: str | None, creds: Credentials | None = None,
                 max_msg_bytes: int = MAX_MSG_BYTES) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.MAXMSGSIZE, int(max_msg_bytes))
        self.max_msg_bytes = int(max_msg_bytes)
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10000)
        check_bind(bind, creds)
        self.zap = None
        if creds is not None:
            self.zap = ZapCheck(self.ctx, creds)
            secure_server(self.sock, creds)
        self.monitor = self.sock.get_monitor_socket(_FAILED)
        self.sock.bind(bind[:-2] + ":*" if bind.endswith(":0") else bind)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.token = token.encode() if token else None
        self.running, self.refused, self._logged = True, 0, 0.0
        self.poller = zmq.Poller()
        for s in (self.sock, self.monitor, self.zap and self.zap.sock):
            if s is not None:
                self.poller.register(s, zmq.POLLIN)
        self.parking_ops: frozenset[str] = frozenset()  # handlers that may answer later
        self.ops: dict[str, Callable[..., Any]] = {"ping": lambda h, f: "pong", "shutdown": self._shutdown}
        self.side: dict[zmq.Socket, Callable[[], None]] = {}  # more sockets of this loop: socket -> drain
        self.owner: int | None = None  # watch_owner: the launching process
        self.orphaned = False  # serving stopped because the owner is gone
        self._owner_fd: int | None = None  # ... its pidfd, readable once it exits (Linux)
        self._owner_ppid: int | None = None  # ... else our parent pid while it lives

    def watch_owner(self, pid: int) -> None:
        """Stop serving once process ``pid`` (the one that launched this server) exits: its pidfd
        is polled with the sockets (Linux 5.3+), else the parent pid is checked each poll."""
        self.owner = pid
        try:
            self._owner_fd = os.pidfd_open(pid)
        except ProcessLookupError:  # (gone already)
            self._owner_gone()
        except (AttributeError, OSError):  # (no pidfd here: the parent pid changes when the owner dies)
            self._owner_ppid = os.getppid()
            if self._owner_ppid != pid:
                self._owner_gone()
        else:
            self.poller.register(self._owner_fd, zmq.POLLIN)

    def _owner_gone(self) -> None:
        log.warning("data plane server %s: the process that launched it (pid %s) is gone; stopping", self.endpoint,
                    self.owner)
        self.running, self.orphaned = False, True

    def add_side(self, sock: zmq.Socket, drain: Callable[[], None]) -> None:
        """Serve another socket of this server's context in the same loop (``drain`` reads it)."""
        self.side[sock] = drain
        self.poller.register(sock, zmq.POLLIN)

    def _shutdown(self, header: dict, frames: list) -> None:
        self.running = False

    def reply(self, ident: bytes, rid: Any, result: Any = None, buffers: Sequence[Any] = (),
              error: BaseException | None = None) -> bool:
        """Send an answer; ``False`` if its client is gone (then :meth:`gone` is called)."""
        header = {"id": rid, "ok": True, "r": result} if error is None else {
            "id": rid, "ok": False, "err": error_to_msg(error)}
        try:
            self.sock.send_multipart([ident, pack_header(header), *buffers], zmq.NOBLOCK, copy=False)
        except zmq.Again:  # the client reads nothing (its queue is full): as without ROUTER_MANDATORY
            log.warning("data plane server %s: a reply dropped, its client's queue is full", self.endpoint)
            return False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self.gone(ident)
            return False
        return True

    def gone(self, ident: bytes) -> None:
        """The client of ``ident`` disconnected (the controller drops its waiters)."""

    def check_token(self, header: dict) -> None:
        """Refuse (and count) a request whose token differs from this server's."""
        tok = header.get("tok")
        if self.token is None and not tok:
            return
        self.refused += self.token is None or not hmac.compare_digest(str(tok or "").encode(), self.token)
        if self.token is None:
            raise PermissionError("request refused: it carries a token but this server has none "
                                  "(a client of another deployment?)")
        if not hmac.compare_digest(str(tok or "").encode(), self.token):
            raise PermissionError("request refused: missing or wrong token")

    def handle(self, frames: list) -> None:
        ident, rest, header = frames[0].bytes, frames[1:], {}  # bytes: compared and hashed by value
        try:
            if not rest:
                raise ProtocolError("empty message")
            if (too_big := over_limit(rest, self.max_msg_bytes)) is not None:
                header = unpack_header(rest[0].buffer) if len(rest[0]) <= _SMALL_HEADER else {}  # (for its id)
                raise ProtocolError(too_big)
            header = unpack_header(rest[0].buffer)
            self.check_token(header)
            op = self.ops.get(str(header.get("op", "")))
            if op is None:
                raise ProtocolError(f"unknown op {header.get('op')!r}; known: {sorted(self.ops)}")
            if header.get("op") in self.parking_ops:
                out = op(header, rest[1:], ident=ident)
            else:
                out = op(header, rest[1:])
            if out is _PARKED or header.get("noreply"):
                return
            result, buffers = out if isinstance(out, tuple) else (out, ())
            self.reply(ident, header.get("id"), result, buffers)
        except Exception as exc:  # every failure becomes an error reply; the loop goes on
            if not header.get("noreply"):
                self.reply(ident, header.get("id") if isinstance(header, dict) else None, error=exc)

    def _watch(self) -> None:
        """Count failed handshakes; log the first, then at most one line a minute."""
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            self.refused += 1
            now = time.monotonic()
            if now - self._logged >= 60.0 or self.refused == 1:
                self._logged = now
                log.warning("data plane server %s: refused a connection (%s; %d refused so far)", self.endpoint,
                            "authentication" if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH else "handshake",
                            self.refused)

    def on_idle(self) -> None:
        pass

    def serve_forever(self) -> None:
        try:
            while self.running:
                ready = dict(self.poller.poll(_POLL_MS))
                if self.zap is not None and self.zap.sock in ready:
                    self.zap.handle()
                if self.monitor in ready:
                    self._watch()
                if self.sock in ready:
                    for _ in range(64):  # a burst, then the idle work
                        try:
                            frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self.handle(frames)
                        if not self.running:
                            break
                for sock, drain in self.side.items():
                    if sock in ready and self.running:
                        drain()
                self.on_idle()
                if (self._owner_fd is not None and self._owner_fd in ready) or (
                        self._owner_ppid is not None and os.getppid() != self._owner_ppid):
                    self._owner_gone()
        finally:
            if self._owner_fd is not None:
                os.close(self._owner_fd)
            self.sock.disable_monitor()
            self.ctx.destroy(linger=0)  # closes every socket of this server


def over_limit(frames: Sequence[Any], limit: int) -> str | None:
    """Why a received message is refused for its size (its frames together over ``limit``
    bytes), or ``None``. Only the frames' lengths are read (one addition per frame)."""
    total = sum(len(f) for f in frames)
    if total <= limit:
        return None
    return (f"message of {total} bytes refused: over this server's limit of {limit} bytes a message "
            "(max_msg_bytes; nothing of it was read; a client splits its puts below it)")


def tcp_bind(host: str) -> str:
    """``--bind``'s value as an endpoint: a bare address (``10.0.0.5``) becomes
    ``tcp://10.0.0.5:0`` (a free port); an endpoint (``tcp://...``, ``ipc://...``) stays."""
    return host if "://" in host else f"tcp://[{host}]:0" if ":" in host else f"tcp://{host}:0"


def check_bind(bind: str, creds: Credentials | None) -> None:
    """Refuse what would listen where it must not: a wildcard address (``*``, ``0.0.0.0``,
    ``::``; a client must be told one address, and a wildcard listens on every network)
    and a non-loopback TCP address without CURVE keys (nothing listens unauthenticated
    beyond this host)."""
    if not bind.startswith("tcp://"):
        return
    host = bind[6:].rsplit(":", 1)[0].strip("[]")
    if host in ("*", "0.0.0.0", "::"):
        raise ValueError(f"data plane: refusing to bind {bind}: bind the one address clients use (this host's "
                         "address on the job's network), not a wildcard")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # an interface or host name: treated as reachable from other hosts
        loopback = False
    if not loopback and creds is None:
        raise ValueError(f"data plane: refusing to bind {bind} without CURVE keys: a non-loopback address needs "
                         "the job's credentials (launch(secure=True) or --keys FILE)")


def _args(header: dict, *names: str) -> list[Any]:
    try:
        return [header["a"][n] for n in names]
    except (KeyError, TypeError) as exc:
        raise ProtocolError(f"op {header.get('op')!r}: missing argument {exc}") from None
