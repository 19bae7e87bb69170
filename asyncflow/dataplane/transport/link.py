"""One multiplexed DEALER connection from a data-plane client to one server.

:class:`Link` is read by the client's event loop (``loop.add_reader`` on the socket's file
descriptor): every readable edge drains all pending replies, each handed to the future
waiting for its request id, so any number of coroutines wait on one socket at once.
Requests leave in call order; big buffers are sent zero-copy.

Failures never hang a caller: each call has a deadline (``deadline`` seconds by default;
``None`` only for a request that waits server-side on purpose, bounded by its own
timeout plus a margin when it has one). A socket monitor, read by the same loop, fails
every waiting call at once with :class:`~asyncflow.dataplane.core.rules.DataPlaneUnavailable`
when the server refuses this client's credentials (``HANDSHAKE_FAILED_AUTH``), a connect is
refused or times out (``CONNECT_RETRIED``: a dead server, or nothing at that address; a TCP
connect gets :data:`CONNECT_TIMEOUT_MS`), or an established connection is lost (its replies can
no longer arrive), naming the server as ``who`` says (a client's storage-unit links:
``storage unit <i> (<endpoint>)``); until a handshake succeeds again, every new call fails at
once with the same reason (a client made while a server is dead fails in milliseconds, not
at its deadline). ZMTP heartbeats
notice a peer that went away silently. While the connection is lost (a disconnect and no
handshake since), a request waits at most ``LOST_GRACE_S`` (ZeroMQ reconnects a live peer
within a fraction of that; a dead server is never reconnected, so no later event would
fail it and the full deadline would only delay the error). With ``creds`` the socket is a CURVE client
(:mod:`asyncflow.dataplane.transport.auth`).
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from asyncflow.dataplane.core.rules import DataPlaneUnavailable
from asyncflow.dataplane.transport.auth import Credentials, secure_client
from asyncflow.dataplane.transport.protocol import ProtocolError, error_from_msg, pack_header, unpack_header

__all__ = ["DEADLINE_S", "Link"]

_ZERO_COPY_BYTES = 65536  # below this, copying into the message is cheaper than tracking
DEADLINE_S = 30.0  # a request not answered by then raises DataPlaneUnavailable
LOST_GRACE_S = 5.0  # a request sent while the connection is lost waits this long for a reconnect at most
_HEARTBEAT_MS = 2000  # ZMTP ping interval; a peer silent for 5 of them is gone
CONNECT_TIMEOUT_MS = 2000  # a TCP connect not established by then fails (a host that drops it: no refusal comes)
_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
           | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
_REFUSED = " refused the connection or cannot be reached (nothing listens at that address: is it running?)"


class Link:
    """One DEALER socket to one server, read by the event loop: the socket's file
    descriptor is registered with ``loop.add_reader`` and every readable edge drains all
    pending replies, each handed to the future waiting for its request id (one loop
    wake-up per burst of replies, no task per receive)."""

    def __init__(self, endpoint: str, token: str, loop: asyncio.AbstractEventLoop,
                 creds: Credentials | None = None, deadline: float | None = DEADLINE_S,
                 who: str | None = None) -> None:
        _check_ipc(endpoint)
        self.who = who or f"data plane server {endpoint}"  # what its errors call the server
        # The process-wide context: never collected mid-run (a collected context with a
        # socket still open would hang in term()).
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # never block a send: the caller bounds what it sends
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_MS)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5 * _HEARTBEAT_MS)
        self.sock.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS)
        if creds is not None:
            secure_client(self.sock, creds)
        self.monitor: zmq.Socket = self.sock.get_monitor_socket(_EVENTS)
        self.sock.connect(endpoint)
        self.endpoint, self.deadline, self.trouble, self.lost = endpoint, deadline, "", False
        self.token, self.ids, self.loop = token, itertools.count(1), loop
        self.waiting: dict[int, tuple[str, asyncio.Future]] = {}
        self.fd = cast(int, self.sock.getsockopt(zmq.FD))  # an int option (pyzmq types every option int | bytes)
        self.monitor_fd = cast(int, self.monitor.getsockopt(zmq.FD))
        loop.add_reader(self.fd, self._drain)
        loop.add_reader(self.monitor_fd, self._watch)
        loop.call_soon(self._watch)  # arms the descriptor: it signals only after a read found it empty

    def send(self, op: str, args: dict, buffers: Sequence[Any] = (), noreply: bool = False) -> int:
        """Send one request now (requests leave in call order); returns its id."""
        rid = next(self.ids)
        header = {"op": op, "id": rid, "a": args, "tok": self.token}
        if noreply:
            header["noreply"] = True
        big = any(np.asarray(b).nbytes >= _ZERO_COPY_BYTES for b in buffers)
        self.sock.send_multipart([pack_header(header), *buffers], copy=not big)
        # ZeroMQ's descriptor is edge-triggered and a send can consume the edge of a reply
        # that is already queued: drain again from the loop.
        self.loop.call_soon(self._drain)
        return rid

    async def call(self, op: str, args: dict, buffers: Sequence[Any] = (),
                   deadline: float | None | bool = True) -> tuple[Any, list]:
        """Send a request and wait for its reply: ``(result, data frames)``, or its error
        raised. ``deadline``: seconds, ``None`` (wait as long as the connection lives) or
        ``True`` (this link's default); past it, :class:`DataPlaneUnavailable`."""
        limit = self.deadline if deadline is True else deadline
        if self.lost:  # (a dead server: nothing would ever fail the wait, no new connection is made to be lost)
            limit = LOST_GRACE_S if limit is None else min(limit, LOST_GRACE_S)
        if self.trouble:  # the last handshake failed and none succeeded since: fail fast
            raise DataPlaneUnavailable(f"{self.who}{self.trouble}; request {op!r} not sent")
        fut = self.loop.create_future()
        rid = self.send(op, args, buffers)
        self.waiting[rid] = (op, fut)
        # A timer handle, not asyncio.wait_for (a task per call: ~35 us more per request here).
        timer = None if limit is None else self.loop.call_later(limit, _expire, fut)
        try:
            header, frames = await fut
        except _Expired:
            if self.lost:
                raise DataPlaneUnavailable(f"connection to {self.who} lost (not re-established within {limit:g}s); "
                                           f"request {op!r} not answered") from None
            raise DataPlaneUnavailable(
                f"{self.who} did not answer {op!r} within {limit:g}s"
                f"{self.trouble or ''}; is it running, and is this the job's client (Deployment.client())?"
            ) from None
        finally:
            self._forget(rid)
            if timer is not None:
                timer.cancel()
        if not header.get("ok"):
            raise error_from_msg(header.get("err", {}))
        return header.get("r"), frames

    def _forget(self, rid: int) -> None:
        """Request ``rid`` is answered, failed or expired."""
        self.waiting.pop(rid, None)

    def _watch(self) -> None:
        """Monitor events: a refused handshake or a lost connection fails every waiting call."""
        while not self.monitor.closed and cast(int, self.monitor.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.trouble, self.lost = "", False
                continue
            self.lost = self.lost or event == zmq.EVENT_DISCONNECTED
            if event == zmq.EVENT_DISCONNECTED and not self.trouble:
                self._fail(f"connection to {self.who} lost")
                continue
            if event == zmq.EVENT_CONNECT_RETRIED:  # a connect refused or timed out: fail now, not at the deadline
                if not self.trouble:
                    self.trouble = _REFUSED
                    self._fail(f"{self.who}{self.trouble}")
                continue
            self.trouble = (" (authentication refused: this client's key is not the job's; use Deployment.client())"
                            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH else
                            " (authentication refused: the CURVE handshake failed, this client lacks the "
                            "job's credentials or the server runs without them)")
            self._fail(f"{self.who}{self.trouble}")

    def _fail(self, why: str) -> None:
        for op, fut in list(self.waiting.values()):
            if not fut.done():
                fut.set_exception(DataPlaneUnavailable(f"{why}; request {op!r} not answered"))

    def _drain(self) -> None:
        sock = self.sock
        while not sock.closed and cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                header = unpack_header(frames[0].buffer)
            except ProtocolError:
                continue  # not a reply of ours
            rid = header.get("id")
            got = self.waiting.get(rid) if isinstance(rid, int) else None
            fut = got[1] if got is not None else None
            if fut is not None and not fut.done():
                fut.set_result((header, frames[1:]))

    def close(self) -> None:
        if not self.loop.is_closed():
            self.loop.remove_reader(self.fd)
            self.loop.remove_reader(self.monitor_fd)
        for _, fut in self.waiting.values():
            if not fut.done():
                fut.set_exception(ConnectionError("data plane connection closed"))
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)


class _Expired(Exception):
    """A request's deadline passed (raised into its future by the timer)."""


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(_Expired())


def _check_ipc(endpoint: str) -> None:
    """An ``ipc`` socket this process cannot reach (missing, or in another user's 0700
    job folder) fails now: ZeroMQ would retry the connect forever, silently."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        try:
            os.stat(path)
        except OSError as exc:
            raise DataPlaneUnavailable(f"data plane socket {path} cannot be reached ({exc.strerror}); is the data "
                                       "plane running, and is this process the job's user?") from None


async def gather_all(calls: Sequence[Any]) -> list[Any]:
    """Await every call (so no reply is left behind); then raise the first error, if any."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results
