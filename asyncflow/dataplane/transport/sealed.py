"""Sealed messages: the data plane's fast encrypted path for bulk bytes (put and get frames).

Why: CURVE (:mod:`asyncflow.dataplane.transport.auth`) encrypts inside libzmq, with
XSalsa20-Poly1305 on its one I/O thread, at 0.5-0.8 GB/s here; AES-256-GCM with AES-NI
(``cryptography``) seals 4-6 GB/s a core, into buffers we choose (no allocation per message).
So the control traffic stays on the CURVE sockets, and a storage unit of a secure deployment
also binds a *bulk* socket (:mod:`asyncflow.dataplane.transport.bulk`) that carries only
``write`` and ``gather``, every message sealed here.

Protocol:

1. **Session.** Over its CURVE link to a unit (authenticated: only the job's client key gets
   there) a client asks ``bulk_session``; the unit answers a fresh session: an 8-byte random
   id, a 32-byte random AES-256-GCM key (``os.urandom``) and the bulk endpoint. The key
   travels only inside CURVE, so only an authenticated client ever holds it. Each client core
   makes its own session per unit (a fork or a pickled copy makes new ones: sessions never
   leave the process that asked for them).
2. **Message.** ``[envelope, sealed header, sealed buffer 1, ..., sealed buffer n]``. The
   envelope (clear, 24 bytes) is ``b"AFS1" | session id | counter (u64) | n + 1 (u32)``;
   every other frame ``i`` (0 the msgpack header, 1.. the buffers) is
   ``AES-256-GCM(key, nonce(direction, i, counter), plaintext, aad=envelope)`` (ciphertext
   + 16-byte tag). ``nonce`` = direction (1 byte: 0 client->server, 1 server->client) |
   ``i`` (3 bytes) | counter (8 bytes).
3. **Receiving.** The envelope must name a live session of this peer, the frame count must
   match the envelope's, and the counter must exceed the last one accepted from that
   session in that direction; the header must open (its tag checks the envelope too). Only
   then is the counter recorded and the header decoded; the buffers are opened before use
   (the unit opens every one before its handler runs; the client opens each into its
   destination). Anything else is refused: logged, counted, never decoded, no reply, but
   for one case: a message whose envelope names a session the unit does not hold gets a
   *notice* back (:func:`notice`: ``AFS0``, that id, nothing else), as a unit holds at most
   ``max_sessions`` and forgets the least recently used past that. The client then asks a
   new session over CURVE and sends its request again (the unit never decoded it, so
   nothing ran twice); a forged notice can only make a client do that.

Invariants:

* A nonce never repeats under a key: each session has its own key, each direction its own
  nonce prefix, each message of a direction a new counter (``Session.sent``, strictly
  increasing, kept only in the process that owns the session), each frame its index.
* Replay and reordering: a counter is accepted once and only above the last accepted one
  (ZeroMQ keeps one connection's messages in order, so an honest peer never trips it).
* Splicing, truncation and extension: every frame's tag covers the envelope (session,
  counter, frame count) and its nonce its index, so a frame moved to another message,
  position or session, or a frame count changed, fails to open.
* Nothing from a peer without the session key is decoded: msgpack sees only an opened header.
  A stranger's message costs the unit a 24-byte parse and a lookup (a session id is 64
  random bits), at most the opening of one header (if it copied a live id off the wire).
* A message whose header opened but a buffer did not is refused whole, its counter spent
  (an honest sender's later messages still pass); a buffer opened in place or into the
  caller's array holds garbage then, and is never used (the unit drops the message, the
  client's get raises).

Not covered: traffic analysis (sizes, timing and session ids are visible) and an on-path
peer dropping messages (the caller's deadline then fails the call, as with CURVE).
"""

from __future__ import annotations

import os
import struct
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from asyncflow.dataplane.transport.protocol import ProtocolError

__all__ = ["TAG", "TO_CLIENT", "TO_SERVER", "BufferPool", "SealError", "Sealed", "Session", "as_bytes", "notice",
           "notice_of"]

MAGIC = b"AFS1"
FORGOTTEN = b"AFS0"  # a unit's notice: "I hold no session of this id" (clear, 24 bytes: see notice())
ENVELOPE = struct.Struct("!4s8sQI")  # magic, session id, counter, frames after the envelope
TAG = 16  # AES-GCM tag bytes at the end of every sealed frame
TO_SERVER, TO_CLIENT = 0, 1
MAX_FRAMES = 1 << 20  # frames per message (the nonce has 3 bytes for the index)
_COUNTER_MAX = (1 << 64) - 1


class SealError(ProtocolError):
    """A sealed message that is refused: unknown session, replayed, tampered or malformed."""


def as_bytes(buf: Any) -> memoryview:
    """A flat writable-or-not byte view of a C-contiguous buffer (what the AEAD calls take)."""
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _nonce(direction: int, index: int, counter: int) -> bytes:
    return bytes((direction,)) + index.to_bytes(3, "big") + counter.to_bytes(8, "big")


def envelope_of(frame: Any) -> tuple[bytes, int, int]:
    """``(session id, counter, frames after the envelope)``; :class:`SealError` if malformed."""
    view = memoryview(frame)
    if view.nbytes != ENVELOPE.size:
        raise SealError(f"not a sealed message (envelope of {view.nbytes} bytes, expected {ENVELOPE.size})")
    magic, sid, counter, n = ENVELOPE.unpack(view)
    if magic != MAGIC:
        raise SealError("not a sealed message (bad magic)")
    return sid, counter, n


def notice(sid: bytes) -> bytes:
    """The unit's answer to a message under a session it does not hold (never handed out, or
    forgotten: :mod:`~asyncflow.dataplane.transport.bulk`): an envelope with magic ``AFS0``, the
    session id the message named, counter 0 and no frames. In clear, as the message's sender
    may not hold a key; it carries nothing but the id the sender sent."""
    return ENVELOPE.pack(FORGOTTEN, sid, 0, 0)


def notice_of(frames: Sequence[Any]) -> bytes | None:
    """The session id of a unit's :func:`notice`, or ``None`` if ``frames`` are not one."""
    if len(frames) != 1:
        return None
    view = memoryview(frames[0])
    if view.nbytes != ENVELOPE.size or bytes(view[:4]) != FORGOTTEN:
        return None
    return bytes(view[4:12])


class Session:
    """One client's session with one storage unit: id, key, and both directions' counters.

    ``sent``: the counter of the last message this side sealed; ``seen``: the counter of the
    last message it accepted. ``mine``: the direction this side sends in.
    """

    def __init__(self, sid: bytes, key: bytes, mine: int) -> None:
        if len(sid) != 8 or len(key) != 32:
            raise ValueError("a sealed session needs an 8-byte id and a 32-byte key")
        self.sid, self.aead, self.mine = sid, AESGCM(key), mine
        self.sent = self.seen = 0

    @classmethod
    def fresh(cls, mine: int) -> tuple[Session, bytes]:
        """A new random session (the unit's side) and its key (to hand to the client)."""
        key = AESGCM.generate_key(256)
        return cls(os.urandom(8), key, mine), key

    def seal(self, header: bytes, buffers: Sequence[Any], alloc: Callable[[int], np.ndarray]) -> list[Any]:
        """The frames of one message: envelope, sealed header, each buffer sealed into
        ``alloc(nbytes + TAG)`` (a fresh or pooled byte array; sent without a copy)."""
        if len(buffers) + 1 >= MAX_FRAMES or self.sent >= _COUNTER_MAX:
            raise SealError("sealed message: too many frames, or the session's counter is spent")
        self.sent += 1
        env = ENVELOPE.pack(MAGIC, self.sid, self.sent, len(buffers) + 1)
        out: list[Any] = [env, self.aead.encrypt(_nonce(self.mine, 0, self.sent), header, env)]
        for i, buf in enumerate(buffers, 1):
            src = as_bytes(buf)
            dst = alloc(src.nbytes + TAG)
            self.aead.encrypt_into(_nonce(self.mine, i, self.sent), src, env, as_bytes(dst))
            out.append(dst)
        return out

    def open(self, frames: Sequence[Any]) -> tuple[bytes, Sealed]:
        """Check and open one received message's envelope and header: ``(header bytes,
        the sealed buffers)``. The counter is recorded only once the header opened."""
        if len(frames) < 2:
            raise SealError("sealed message: no header frame")
        env = bytes(memoryview(frames[0]))
        sid, counter, n = envelope_of(env)
        if sid != self.sid:
            raise SealError("sealed message of another session")
        if n != len(frames) - 1 or n > MAX_FRAMES:
            raise SealError(f"sealed message: {len(frames) - 1} frames, its envelope says {n} (at most {MAX_FRAMES})")
        if counter <= self.seen:
            raise SealError(f"sealed message replayed or reordered (counter {counter}, last accepted {self.seen})")
        peer = 1 - self.mine
        try:
            header = self.aead.decrypt(_nonce(peer, 0, counter), memoryview(frames[1]), env)
        except InvalidTag:
            raise SealError("sealed message: the header does not authenticate (tampered, or not this "
                            "session's key)") from None
        self.seen = counter
        return header, Sealed(self, env, counter, peer, list(frames[2:]))


class Sealed:
    """The sealed buffers of one accepted message; each opened (authenticated) before use."""

    def __init__(self, session: Session, env: bytes, counter: int, direction: int, frames: list[Any]) -> None:
        self.session, self.env, self.counter, self.direction, self.frames = session, env, counter, direction, frames

    def __len__(self) -> int:
        return len(self.frames)

    def size(self, i: int) -> int:
        """Plaintext bytes of buffer ``i``."""
        return memoryview(self.frames[i]).nbytes - TAG

    def open_into(self, i: int, dst: Any) -> None:
        """Authenticate and decrypt buffer ``i`` into ``dst`` (exactly :meth:`size` bytes;
        on failure ``dst`` holds garbage and :class:`SealError` is raised)."""
        out = as_bytes(dst)
        if out.nbytes != self.size(i):
            raise SealError(f"sealed buffer {i}: {self.size(i)} bytes, destination {out.nbytes}")
        try:
            self.session.aead.decrypt_into(_nonce(self.direction, i + 1, self.counter),
                                           memoryview(self.frames[i]), self.env, out)
        except InvalidTag:
            raise SealError(f"sealed buffer {i} does not authenticate (tampered)") from None

    def open(self, i: int) -> memoryview:
        """Buffer ``i`` opened in place when its frame is writable (received frames are),
        else into a new array."""
        src = memoryview(self.frames[i])
        if src.nbytes < TAG:
            raise SealError(f"sealed buffer {i}: shorter than its tag")
        dst = src[:-TAG] if not src.readonly else as_bytes(np.empty(src.nbytes - TAG, np.uint8))
        self.open_into(i, dst)
        return dst

    def open_all(self) -> list[memoryview]:
        return [self.open(i) for i in range(len(self.frames))]


class BufferPool:
    """Reused byte arrays to seal outgoing buffers into (a client's puts): fresh pages cost a
    page fault each, about as much as the cipher itself here. An array is free again once
    only the pool references it (ZeroMQ drops its reference when the zero-copy send is
    done). At most ``max_bytes`` are kept; past that, arrays are made fresh and not kept."""

    def __init__(self, max_bytes: int = 512 << 20) -> None:
        self.max_bytes, self.kept = max_bytes, 0
        self.arrays: dict[int, list[np.ndarray]] = {}

    def take(self, nbytes: int) -> np.ndarray:
        same = self.arrays.setdefault(nbytes, [])
        for arr in same:
            if sys.getrefcount(arr) <= 3:  # the list, this loop's name, getrefcount's argument
                return arr
        arr = np.empty(nbytes, np.uint8)
        if self.kept + nbytes <= self.max_bytes:
            same.append(arr)
            self.kept += nbytes
        return arr
