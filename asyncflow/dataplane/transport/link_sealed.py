"""A client's link to a storage unit's bulk port: every message sealed (AES-256-GCM).

The protocol is :mod:`asyncflow.dataplane.transport.sealed`; the unit's side is
:mod:`asyncflow.dataplane.transport.bulk`. :class:`SealedLink` is a
:class:`~asyncflow.dataplane.transport.link.Link` (same request ids, deadlines, monitor and
loop reader) whose socket has no CURVE: each request is sealed under the session the unit
handed out over this client's CURVE link (:func:`open_session`), and each reply must open
under it (its envelope and header checked at once; a reply that does not is dropped and
logged, and its caller's deadline fails the call). A reply's data buffers come back still
sealed (:class:`~asyncflow.dataplane.transport.sealed.Sealed`); :func:`open_columns`
opens each fixed column that fills one slice of the caller's output straight into it (one
pass over the bytes: decrypt and place at once), and every other buffer in place in its
received frame. Outgoing buffers are sealed into a :class:`BufferPool` (pages reused from
message to message) and sent without a copy; a put's messages go out :data:`PUT_WINDOW` at a
time (:meth:`SealedLink.pipeline`), so the pool holds about four messages, not the whole put.
Three, not two: a message passes three stages (sealed here, carried by the kernel, opened by
the unit), and with two in flight the unit sat idle while the client sealed the next one
(a put of 0.28 GB in 19 MB messages: best of rounds 10-25% faster with three, interleaved A/B on
a loaded machine; docs/benchmarks.md).

A unit holds a bounded number of sessions and forgets the least recently used past it
(:mod:`asyncflow.dataplane.transport.bulk`); it answers a message under a session it no
longer holds with a notice (:func:`~asyncflow.dataplane.transport.sealed.notice`). Every
request waiting under that session then fails inside :meth:`SealedLink.call`, which asks
the unit for a new session over CURVE (once for all of them) and sends the request again:
the unit never decoded it, so nothing runs twice. One warning line says so; a session
forgotten again at once (:data:`RENEWALS` times in a row) fails the call naming the cause.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, cast

import numpy as np
import zmq

from asyncflow.dataplane.core.rules import DataPlaneUnavailable
from asyncflow.dataplane.transport import shm
from asyncflow.dataplane.transport.link import Link, gather_all
from asyncflow.dataplane.transport.protocol import ProtocolError, pack_header, unpack_header
from asyncflow.dataplane.transport.sealed import TO_SERVER, BufferPool, Sealed, SealError, Session, notice_of

__all__ = ["PUT_WINDOW", "RENEWALS", "SealedLink", "open_columns", "open_session"]

log = logging.getLogger(__name__)

PUT_WINDOW = 3  # a put's messages unanswered at once per unit: one per stage (seal, carry, open)
RENEWALS = 3  # new sessions one request asks before it fails (each forgotten again before its answer)
Renew = Callable[[bytes], Awaitable["tuple[Session, str] | None"]]  # a new session replacing this id


class _Forgotten(Exception):
    """The unit sent a notice: it no longer holds the session this request was sealed under."""


class SealedLink(Link):
    """A DEALER socket to one unit's bulk port, every message sealed under ``session``."""

    def __init__(self, endpoint: str, token: str, loop: asyncio.AbstractEventLoop, session: Session,
                 deadline: float | None, renew: Renew | None = None) -> None:
        super().__init__(endpoint, token, loop, None, deadline)
        self.session, self.pool, self.refused = session, BufferPool(256 << 20), 0
        self.renew, self.renewed = renew, 0  # renew: asks the unit a new session over CURVE (open_session)
        self.sealed_under: dict[int, bytes] = {}  # request id -> the session id it was sealed under
        self._renewal: asyncio.Future | None = None

    def send(self, op: str, args: dict, buffers: Sequence[Any] = (), noreply: bool = False) -> int:
        rid = next(self.ids)
        header = {"op": op, "id": rid, "a": args, "tok": self.token}
        if noreply:
            header["noreply"] = True
        self.sock.send_multipart(self.session.seal(pack_header(header), buffers, self.pool.take), copy=False)
        if not noreply:
            self.sealed_under[rid] = self.session.sid
        self.loop.call_soon(self._drain)  # a send can consume the edge of a queued reply (see Link.send)
        return rid

    def _forget(self, rid: int) -> None:
        super()._forget(rid)
        self.sealed_under.pop(rid, None)

    async def call(self, op: str, args: dict, buffers: Sequence[Any] = (),
                   deadline: float | None | bool = True) -> tuple[Any, list]:
        """As :meth:`Link.call`; a request whose session the unit forgot is sent again under a new one."""
        for _ in range(RENEWALS):
            sid = self.session.sid
            try:
                return await super().call(op, args, buffers, deadline)
            except _Forgotten:
                if self.renew is None:
                    raise DataPlaneUnavailable(f"{self.who} no longer holds this client's sealed session; request "
                                               f"{op!r} not answered") from None
                await self._renew(sid)
        raise DataPlaneUnavailable(
            f"{self.who} forgot this client's sealed session {RENEWALS} times before answering {op!r} (more "
            "clients use it at once than its max_sessions; launch the data plane with a larger max_sessions)")

    async def _renew(self, old: bytes) -> None:
        """A new session in place of ``old`` (once, however many requests wait for it)."""
        if self.session.sid != old:
            return  # (already renewed)
        if self._renewal is None or self._renewal.done():
            self._renewal = asyncio.ensure_future(self._new_session(old))
        await asyncio.shield(self._renewal)

    async def _new_session(self, old: bytes) -> None:
        assert self.renew is not None
        got = await self.renew(old)
        if got is None:
            raise DataPlaneUnavailable(f"{self.who} forgot this client's sealed session and gives no new one")
        self.session, self.renewed = got[0], self.renewed + 1
        log.warning("data plane: %s had forgotten this client's sealed session (a unit keeps its max_sessions most "
                    "recently used ones); made a new one and sent the waiting requests again", self.who)

    def _forgotten(self, sid: bytes) -> None:
        """A notice: every request sealed under ``sid`` and still waiting fails with :class:`_Forgotten`."""
        for rid, (_, fut) in list(self.waiting.items()):
            if self.sealed_under.get(rid) == sid and not fut.done():
                fut.set_exception(_Forgotten())

    async def pipeline(self, requests: Iterable[tuple[str, dict, Sequence[Any]]],
                       window: int = PUT_WINDOW) -> list[Any]:
        """Send ``requests`` (op, args, buffers; generated lazily) with at most ``window``
        unanswered: sealing request k+2 overlaps carrying k+1 and the unit opening k, and
        the pool's buffers of older ones are free again (memory bounded by the window, not
        by the whole put). Every sent request is awaited before the first error is raised.
        Returns each request's result, in order."""
        pending: deque[asyncio.Future] = deque()
        done: list[asyncio.Future] = []
        try:
            for op, args, buffers in requests:
                pending.append(asyncio.ensure_future(self.call(op, args, buffers)))
                done.append(pending[-1])
                if len(pending) >= window:
                    await pending.popleft()
        finally:
            await gather_all(list(pending))
        return [f.result()[0] for f in done]

    def _drain(self) -> None:
        sock = self.sock
        while not sock.closed and cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if (sid := notice_of([f.buffer for f in frames])) is not None:
                self._forgotten(sid)
                continue
            try:
                raw, sealed = self.session.open([f.buffer for f in frames])
                header = unpack_header(raw)
            except Exception as exc:  # SealError or anything else: nothing of it is used
                self.refused += 1
                log.error("data plane: refused a reply from bulk port %s (%s)", self.endpoint, exc)
                continue
            rid = header.get("id")
            got = self.waiting.get(rid) if isinstance(rid, int) else None
            if got is not None and not got[1].done():
                got[1].set_result((header, sealed))


async def connect_units(units: Sequence[Link], use_shm: bool, sealed: bool, token: str,
                        loop: asyncio.AbstractEventLoop,
                        deadline: float | None) -> tuple[list[str | None], list[SealedLink | None]]:
    """Per unit (its CURVE link in ``units``): its shared-memory prefix if shared memory
    works with it, and, for the others when ``sealed``, a sealed link to its bulk port.
    On any failure every link is closed (``units`` too) and the error raised."""
    bulk: list[SealedLink | None] = []
    try:
        prefixes = await gather_all([shm.handshake(u.call) for u in units]) if use_shm else [None] * len(units)
        for u, prefix in zip(units, prefixes):
            want = prefix is None and sealed
            bulk.append(await open_session(u.call, u.endpoint, token, loop, deadline) if want else None)
    except BaseException:
        for link in [*units, *(b for b in bulk if b is not None)]:
            link.close()
        raise
    return prefixes, bulk


async def open_session(call: Callable[..., Awaitable[tuple[Any, list]]], endpoint: str, token: str,
                       loop: asyncio.AbstractEventLoop, deadline: float | None) -> SealedLink | None:
    """Ask a unit for a bulk session over its CURVE link (``call``); ``None`` if it has no
    bulk port (started without keys, or an older unit). The link asks again through
    ``call`` when the unit forgets the session."""

    async def ask(replaces: bytes | None) -> tuple[Session, str] | None:
        try:
            got = (await call("bulk_session", {} if replaces is None else {"replaces": replaces}))[0]
        except ProtocolError:  # "unknown op": a unit without a bulk port
            return None
        if not (isinstance(got, dict) and isinstance(got.get("sid"), bytes) and isinstance(got.get("key"), bytes)
                and isinstance(got.get("endpoint"), str)):
            raise ProtocolError(f"storage unit {endpoint}: malformed bulk session {type(got).__name__}")
        return Session(got["sid"], got["key"], TO_SERVER), _reachable(got["endpoint"], endpoint)

    first = await ask(None)
    if first is None:
        return None
    return SealedLink(first[1], token, loop, first[0], deadline, renew=ask)


def _reachable(bulk: str, unit: str) -> str:
    """The bulk endpoint as this client reaches it: the unit's own host (the client already
    reaches that address) with the bulk port."""
    if bulk.startswith("tcp://") and unit.startswith("tcp://"):
        return unit.rsplit(":", 1)[0] + ":" + bulk.rsplit(":", 1)[1]
    return bulk


def open_columns(spec: Any, sealed: Sealed, out: dict[str, Any],
                 spans: Sequence[tuple[int, int]]) -> tuple[list, list]:
    """Open a sealed ``gather`` answer: each fixed column whose answer is the one slice
    ``out[name][i:j]`` (one span) is decrypted straight into it; the rest are opened in
    place and returned as ``(spec, frames)`` for ``decode_columns`` and ``place``."""
    if not isinstance(spec, list):
        raise ProtocolError(f"column spec must be a list, got {type(spec).__name__}")
    rest_spec, rest = [], []
    k = 0
    try:
        for entry in spec:
            need = 2 if isinstance(entry, list) and len(entry) == 4 and entry[1] == "r" else 1
            if k + need > len(sealed):
                raise ProtocolError("sealed answer: missing data frames")
            dst = _slot(entry, out, spans)
            if dst is not None:
                sealed.open_into(k, dst)
            else:
                rest_spec.append(entry)
                rest += [sealed.open(k + m) for m in range(need)]
            k += need
        rest += [sealed.open(m) for m in range(k, len(sealed))]  # decode_columns names the surplus
    except SealError as exc:
        log.error("data plane: refused a sealed answer (%s)", exc)
        raise
    return rest_spec, rest


def _slot(entry: Any, out: dict[str, Any], spans: Sequence[tuple[int, int]]) -> np.ndarray | None:
    """The slice of ``out`` a fixed column answer fills exactly, or ``None``."""
    if len(spans) != 1 or not (isinstance(entry, list) and len(entry) == 4 and entry[1] == "f"):
        return None
    name, _, dtype, shape = entry
    dst = out.get(name) if isinstance(name, str) else None
    if not isinstance(dst, np.ndarray):
        return None
    i, j = spans[0]
    try:
        same = np.dtype(dtype) == dst.dtype and [int(d) for d in shape] == [j - i, *dst.shape[1:]]
    except (TypeError, ValueError):
        return None
    return dst[i:j] if same and dst[i:j].flags.c_contiguous else None

