"""The sealed bulk path (transport/sealed.py, bulk.py, link_sealed.py): AES-256-GCM messages
under a session key a storage unit hands out over CURVE.

Unit level: a sealed message opens to what was sealed; a flipped byte in any frame, a frame
moved, dropped or added, a replayed or older counter, another session's key or id: each
refused with :class:`SealError`, and a refused header leaves the counter where it was.
Live: a storage unit (in a thread of this process, with CURVE keys) and raw sockets: a
client without the keys gets no session; a write and a gather round-trip; a tampered
write, its replay or a forged key are each dropped unanswered, counted and logged, nothing
of them stored, and the unit keeps serving; a message under an unknown session gets only a
notice naming that id. Sessions are bounded per unit, the least recently used forgotten
first. The whole client (put/get through ``launch``) is in tests/test_dataplane_fetch.py;
8,192 sessions and a forgotten one renewed in tests/test_dataplane_sessions.py.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow.dataplane import Field, Schema
from asyncflow.dataplane.transport import bulk
from asyncflow.dataplane.transport.auth import Credentials, secure_client
from asyncflow.dataplane.transport.link_sealed import PUT_WINDOW, SealedLink
from asyncflow.dataplane.transport.protocol import encode_columns, pack_header, unpack_header
from asyncflow.dataplane.transport.sealed import TAG, TO_CLIENT, TO_SERVER, SealError, Session, notice_of
from asyncflow.dataplane.transport.storage_server import StorageServer


def _pair() -> tuple[Session, Session]:
    server, key = Session.fresh(TO_CLIENT)
    return Session(server.sid, key, TO_SERVER), server


def _seal(session: Session, header: dict, buffers=()) -> list[bytes]:
    return [bytes(memoryview(f)) for f in session.seal(pack_header(header), list(buffers), bytearray)]


def test_a_sealed_message_opens_to_what_was_sealed_and_hides_it():
    client, server = _pair()
    data = np.arange(1000, dtype=np.float32)
    frames = _seal(client, {"op": "write", "id": 7}, [data, b"tail"])
    assert len(frames) == 4 and len(frames[2]) == data.nbytes + TAG and len(frames[0]) == 24
    assert data.tobytes()[:64] not in b"".join(frames)  # ciphertext
    raw, sealed = server.open([bytearray(f) for f in frames])  # received frames are writable
    assert unpack_header(raw) == {"op": "write", "id": 7} and server.seen == 1
    assert np.array_equal(np.frombuffer(sealed.open(0), np.float32), data) and bytes(sealed.open(1)) == b"tail"
    into = np.empty(1000, np.float32)
    _, again = server.open(_seal(client, {"id": 8}, [data]))
    again.open_into(0, into)  # read-only source frames: decrypted into the caller's array
    assert np.array_equal(into, data) and server.seen == 2
    reply = _seal(server, {"id": 8, "ok": True}, [data[:10]])  # the other direction, its own counter
    raw, back = client.open(reply)
    assert unpack_header(raw)["ok"] and bytes(back.open(0)) == data[:10].tobytes()


def test_replayed_reordered_and_foreign_messages_are_refused():
    client, server = _pair()
    first, second = _seal(client, {"id": 1}), _seal(client, {"id": 2})
    server.open(second)
    with pytest.raises(SealError, match="replayed"):
        server.open(first)  # older than the last accepted
    with pytest.raises(SealError, match="replayed"):
        server.open(second)  # the same again
    other_client, _ = _pair()
    with pytest.raises(SealError, match="another session"):
        server.open(_seal(other_client, {"id": 3}))
    forged = Session(server.sid, bytes(32), TO_SERVER)  # the right id, not the key
    forged.sent = 10
    with pytest.raises(SealError, match="does not authenticate"):
        server.open(_seal(forged, {"id": 4}))
    assert server.seen == 2  # the second message's; nothing refused moved it
    with pytest.raises(SealError, match="does not authenticate"):  # a client's message sent back to it
        client.open(_seal(client, {"id": 5}))
    raw, _ = server.open(_seal(client, {"id": 6}))  # the session still works
    assert unpack_header(raw)["id"] == 6


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_change_to_a_sealed_message_is_refused(data):
    client, server = _pair()
    frames = _seal(client, {"op": "gather", "id": 1}, [np.arange(40, dtype=np.int64), b"abc"])
    kind = data.draw(st.sampled_from(["flip", "drop", "add", "swap", "truncate"]))
    if kind == "flip":
        f = data.draw(st.integers(0, len(frames) - 1))
        i = data.draw(st.integers(0, len(frames[f]) - 1))
        bit = data.draw(st.integers(0, 7))
        frames[f] = frames[f][:i] + bytes([frames[f][i] ^ (1 << bit)]) + frames[f][i + 1:]
    elif kind == "drop":
        del frames[data.draw(st.integers(1, len(frames) - 1))]
    elif kind == "add":
        frames.insert(data.draw(st.integers(1, len(frames))), data.draw(st.binary(max_size=64)))
    elif kind == "swap":
        frames[2], frames[3] = frames[3], frames[2]
    else:
        f = data.draw(st.integers(1, len(frames) - 1))
        frames[f] = frames[f][:-1]
    with pytest.raises(SealError):
        _, sealed = server.open(frames)
        sealed.open_all()


# -- a live storage unit -------------------------------------------------------------------
SCHEMA = Schema([Field("x", "float32", (4,))])


@pytest.fixture
def unit():
    creds = Credentials.generate()
    server = StorageServer(SCHEMA, creds=creds, use_shm=False)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    ctx = zmq.Context()
    yield server, creds, ctx
    ctl = _curve(ctx, server.endpoint, creds)
    ctl.send_multipart([pack_header({"op": "shutdown", "id": 0})])
    thread.join(10)
    ctx.destroy(linger=0)
    assert not thread.is_alive()


def _curve(ctx: zmq.Context, endpoint: str, creds: Credentials | None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if creds is not None:
        secure_client(sock, creds)
    sock.connect(endpoint)
    return sock


def _session(ctx: zmq.Context, server: StorageServer, creds: Credentials | None, wait_ms: int = 5000) -> dict | None:
    sock = _curve(ctx, server.endpoint, creds)
    sock.send_multipart([pack_header({"op": "bulk_session", "id": 1})])
    got = unpack_header(sock.recv_multipart()[0]) if sock.poll(wait_ms) else None
    sock.close(0)
    return None if got is None else got["r"]


def _ask(sock: zmq.Socket, frames: list, session: Session, wait_ms: int = 5000):
    """Send sealed ``frames``; the opened reply ``(header, buffers)``, or None if unanswered."""
    sock.send_multipart(frames)
    if not sock.poll(wait_ms):
        return None
    raw, sealed = session.open(sock.recv_multipart())
    return unpack_header(raw), sealed.open_all()


def test_a_live_unit_serves_sealed_requests_and_refuses_forged_ones(unit, caplog):
    server, creds, ctx = unit
    assert _session(ctx, server, None, 500) is None  # no keys: the CURVE handshake fails, no session
    stranger = Credentials(creds.server_public, "", *[k.decode() for k in zmq.curve_keypair()])
    assert _session(ctx, server, stranger, 500) is None  # a stranger's keys: refused likewise
    got = _session(ctx, server, creds.for_client())
    assert got is not None and len(got["key"]) == 32 and got["endpoint"] != server.endpoint
    me = Session(got["sid"], got["key"], TO_SERVER)
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(got["endpoint"])
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    spec, bufs = encode_columns({"x": x})
    write = _seal(me, {"op": "write", "id": 1, "a": {"rows": [0, 1], "cols": spec}}, bufs)
    tampered = list(write)
    tampered[2] = tampered[2][:5] + bytes([tampered[2][5] ^ 1]) + tampered[2][6:]
    caplog.set_level(logging.ERROR, logger="asyncflow.dataplane.transport.bulk")
    assert _ask(sock, tampered, me, 400) is None and server.bulk.refused == 1  # dropped unanswered
    assert "refused a message" in caplog.text and "does not authenticate" in caplog.text
    assert _ask(sock, write, me, 400) is None and server.bulk.refused == 2  # the same counter again: a replay
    assert 0 not in server.storage._columns["x"]  # nothing of either stored
    unknown = Session(bytes(8), bytes(32), TO_SERVER)
    sock.send_multipart(_seal(unknown, {"op": "ping", "id": 2}))  # an unknown session: a notice, nothing else
    assert sock.poll(2000) and notice_of(sock.recv_multipart()) == bytes(8)
    forged = Session(got["sid"], bytes(32), TO_SERVER)
    forged.sent = 100
    assert _ask(sock, _seal(forged, {"op": "ping", "id": 3}), me, 400) is None
    sock.send_multipart([b"garbage"])  # not even an envelope
    assert _ask(sock, _seal(me, {"op": "drop", "id": 4, "a": {"rows": [0]}}), me)[0]["ok"] is False  # CURVE only
    assert server.bulk.refused == 5
    header, _ = _ask(sock, _seal(me, {"op": "write", "id": 5, "a": {"rows": [0, 1], "cols": spec}}, bufs), me)
    assert header["id"] == 5 and header["ok"] and len(header["r"]["receipt"]) == 16  # the unit kept serving
    header, frames = _ask(sock, _seal(me, {"op": "gather", "id": 6, "a": {"rows": [0, 1], "fields": ["x"]}}), me)
    assert header["ok"] and np.array_equal(np.frombuffer(frames[0], np.float32).reshape(2, 4), x)
    replayed = _seal(me, {"op": "gather", "id": 7, "a": {"rows": [0, 1], "fields": ["x"]}})
    assert _ask(sock, replayed, me)[0]["ok"] and _ask(sock, replayed, me, 400) is None  # answered once
    assert server.bulk.refused == 6


def test_sessions_per_unit_are_bounded_least_recently_used_forgotten_first():
    ctx = zmq.Context()
    port = bulk.BulkPort(ctx, "tcp://127.0.0.1:0", 1 << 20, {"ping": lambda h, f: "pong"}, lambda header: None,
                         max_sessions=3)
    try:
        sids = [port.new_session({}, [])["sid"] for _ in range(3)]
        port.sessions.move_to_end(sids[0])  # (what an opened message of sids[0] does: it was used last)
        sids += [port.new_session({}, [])["sid"] for _ in range(2)]
        assert len(set(sids)) == 5 and list(port.sessions) == [sids[0], sids[3], sids[4]] and port.forgotten == 2
        again = port.new_session({"a": {"replaces": sids[3]}}, [])["sid"]  # a renewal drops the session it replaces
        assert list(port.sessions) == [sids[0], sids[4], again] and port.forgotten == 2
        assert port.endpoint.startswith("tcp://127.0.0.1:") and not port.endpoint.endswith(":0")
    finally:
        port.close()
        ctx.term()
    assert bulk.bulk_bind("ipc:///run/job/sock/3") == "ipc:///run/job/sock/3.bulk"


def test_a_message_of_more_frames_than_a_nonce_can_number_is_refused(monkeypatch):
    from asyncflow.dataplane.transport import sealed  # reason: patched module, not its names

    client, server = _pair()
    frames = _seal(client, {"id": 1}, [b"a", b"b", b"c"])
    monkeypatch.setattr(sealed, "MAX_FRAMES", 3)
    with pytest.raises(SealError, match="at most 3"):
        server.open(frames)


class _Calls:
    """A stand-in for :class:`SealedLink` in :meth:`SealedLink.pipeline`: counts requests
    unanswered at once; each answers after yielding to the loop ``delay`` times."""

    def __init__(self, fail: int = -1, delay: int = 3) -> None:
        self.open = self.most = 0
        self.done: list[int] = []
        self.fail, self.delay = fail, delay

    async def call(self, op: str, args: dict, buffers=()) -> tuple[None, list]:
        self.open += 1
        self.most = max(self.most, self.open)
        for _ in range(self.delay + args["k"] % 2):  # uneven answers: the window, not the order, bounds
            await asyncio.sleep(0)
        self.open -= 1
        self.done.append(args["k"])
        if args["k"] == self.fail:
            raise ValueError(f"request {args['k']} failed")
        return None, []


@pytest.mark.parametrize("window", [1, 2, 3])
def test_a_puts_pipeline_keeps_at_most_its_window_unanswered(window):
    assert PUT_WINDOW == 3  # one message per stage: sealed, carried, opened
    fake = _Calls()
    asyncio.run(SealedLink.pipeline(fake, (("write", {"k": k}, ()) for k in range(10)), window))  # type: ignore[arg-type]
    assert fake.most == window and sorted(fake.done) == list(range(10))


def test_a_failed_request_of_a_pipeline_is_raised_after_every_sent_one_answered():
    fake = _Calls(fail=1)
    with pytest.raises(ValueError, match="request 1 failed"):
        asyncio.run(SealedLink.pipeline(fake, (("write", {"k": k}, ()) for k in range(10)), 3))
    # 0, 1, 2 sent; 0 answered, 3 sent; waiting on 1, its error stops the generator, and
    # 2 and 3 (sent) are still awaited: 0-3 answered, nothing more sent.
    assert sorted(fake.done) == [0, 1, 2, 3] and fake.open == 0
