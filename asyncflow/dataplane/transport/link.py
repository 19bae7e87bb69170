"""One multiplexed DEALER connection from a data-plane client to one server.

:class:`Link` is read by the client's event loop (``loop.add_reader`` on the socket's file
descriptor): every readable edge drains all pending replies, each handed to the future
waiting for its request id, so any number of coroutines wait on one socket at once.
Requests leave in call order; big buffers are sent zero-copy.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import zmq

from asyncflow.dataplane.transport.protocol import ProtocolError, error_from_msg, pack_header, unpack_header

__all__ = ["Link"]

_ZERO_COPY_BYTES = 65536  # below this, copying into the message is cheaper than tracking


class Link:
    """One DEALER socket to one server, read by the event loop: the socket's file
    descriptor is registered with ``loop.add_reader`` and every readable edge drains all
    pending replies, each handed to the future waiting for its request id (one loop
    wake-up per burst of replies, no task per receive)."""

    def __init__(self, endpoint: str, token: str, loop: asyncio.AbstractEventLoop) -> None:
        # The process-wide context: never collected mid-run (a collected context with a
        # socket still open would hang in term()).
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # never block a send: the caller bounds what it sends
        self.sock.connect(endpoint)
        self.token, self.ids, self.loop = token, itertools.count(1), loop
        self.waiting: dict[int, asyncio.Future] = {}
        self.fd = cast(int, self.sock.getsockopt(zmq.FD))  # an int option (pyzmq types every option int | bytes)
        loop.add_reader(self.fd, self._drain)

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

    async def call(self, op: str, args: dict, buffers: Sequence[Any] = ()) -> tuple[Any, list]:
        """Send a request and wait for its reply: ``(result, data frames)``, or its error raised."""
        fut = self.loop.create_future()
        rid = self.send(op, args, buffers)
        self.waiting[rid] = fut
        try:
            header, frames = await fut
        finally:
            self.waiting.pop(rid, None)
        if not header.get("ok"):
            raise error_from_msg(header.get("err", {}))
        return header.get("r"), frames

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
            fut = self.waiting.get(header.get("id", 0))  # ids start at 1
            if fut is not None and not fut.done():
                fut.set_result((header, frames[1:]))

    def close(self) -> None:
        if not self.loop.is_closed():
            self.loop.remove_reader(self.fd)
        for fut in self.waiting.values():
            if not fut.done():
                fut.set_exception(ConnectionError("data plane connection closed"))
        self.sock.close(0)
