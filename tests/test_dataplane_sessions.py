"""Sealed bulk sessions at scale (transport/bulk.py, link_sealed.py): a storage unit holds
the sessions of 8,192 clients and serves each; a client whose session the unit forgot (past
``max_sessions``, least recently used first) makes a new one and carries on, saying so.

Before: a unit held 4,096 sessions and forgot the oldest past that; a message under a
forgotten session was dropped without a word, so a client connected early failed every
read of that unit after its deadline ("did not answer 'gather' within 30s; is it
running?") and never recovered.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
import pytest

from asyncflow.dataplane import BatchMeta, Field, Schema
from asyncflow.dataplane.core.rules import DataPlaneUnavailable
from asyncflow.dataplane.transport.client_async import AsyncZmqDataPlane
from asyncflow.dataplane.transport.deploy import launch
from asyncflow.dataplane.transport.protocol import decode_columns
from asyncflow.dataplane.transport.sealed import TO_SERVER, Session

SCHEMA = Schema([Field("x", "float32", (4,))])
CLIENTS = 8192  # TransferQueue's published test ran 8,192 clients


async def _sessions_then_reads(dep, rows: list[int], x: np.ndarray) -> int:
    """Ask the unit for ``CLIENTS`` sessions, then read under every one of them, oldest first.
    Returns how many reads returned exactly the rows asked for."""
    core = AsyncZmqDataPlane(dep.endpoint, credentials=dep.credentials, use_shm=False, deadline=10)
    try:
        assert await core.transports() == ["sealed"]
        unit, link = core._units[0], core._bulk[0]
        link.renew = None  # (a forgotten session must fail the read here, not be renewed)
        sessions: list[Session] = []
        for start in range(0, CLIENTS, 256):  # 256 requests in flight on the unit's CURVE socket at a time
            got = await asyncio.gather(*[unit.call("bulk_session", {}) for _ in range(start, start + 256)])
            sessions += [Session(r["sid"], r["key"], TO_SERVER) for r, _ in got]
        assert len({s.sid for s in sessions}) == CLIENTS
        good = 0
        for k, session in enumerate(sessions):
            i = k % (len(rows) - 3)
            link.session = session  # this client's key: the unit finds the session by the id it names
            spec, sealed = await link.call("gather", {"rows": rows[i:i + 3], "fields": ["x"], "pid": 0, "shm": None})
            got = decode_columns(spec, sealed.open_all())["x"]
            good += bool(np.array_equal(got, x[i:i + 3]))
        return good
    finally:
        await core.aclose()


def test_8192_clients_each_holding_a_session_on_one_unit_all_read_correctly():
    """Each of 8,192 sessions is asked by ``bulk_session`` over the unit's CURVE socket and
    used for a real sealed ``gather`` (AES-256-GCM both ways, the rows checked), oldest first,
    after all were made: none was forgotten. Honest about the scale: the 8,192 *clients* are
    8,192 session keys held by one test process and used over one bulk socket, not 8,192
    processes or sockets; the unit does not care, as it keys its session table by the id a
    message names (not by connection), so its table and its reads are exercised exactly as
    8,192 clients would (a real client asks one session per unit and holds it for its life)."""
    d = launch(SCHEMA, n_storage=1)
    plane = d.client(use_shm=False)
    try:
        x = np.arange(64 * 4, dtype=np.float32).reshape(64, 4)
        rows = plane.put({"x": x}, partition=0)
        t = time.monotonic()
        assert asyncio.run(_sessions_then_reads(d, rows, x)) == CLIENTS
        print(f"{CLIENTS} sessions made and read under in {time.monotonic() - t:.1f} s")
        assert plane.get_data(BatchMeta(0, rows, ["x"]))["x"].tolist() == x.tolist()  # the first client too
    finally:
        plane.disconnect()
        d.shutdown()


def test_a_client_whose_session_was_forgotten_makes_a_new_one_and_reads_and_writes_on(caplog):
    """``max_sessions=2``: clients B and C push A's session out (A used it least recently).
    A's next read and write are answered at once under a new session (the unit's notice, no
    deadline), the write applied once, and a warning line says what happened; A's new session
    pushes out B's, and so on: every client renews once and reads on."""
    d = launch(SCHEMA, n_storage=1, max_sessions=2)
    a, b, c = (d.client(use_shm=False, deadline=10) for _ in range(3))
    try:
        x = np.arange(16, dtype=np.float32).reshape(4, 4)
        rows = a.put({"x": x}, partition=0)
        meta = BatchMeta(0, rows, ["x"])
        for other in (b, c):
            assert other.get_data(meta)["x"].tolist() == x.tolist()
        link = a._core._bulk[0]
        before = link.session.sid
        caplog.set_level(logging.WARNING, logger="asyncflow.dataplane.transport.link_sealed")
        t = time.monotonic()
        assert a.get_data(meta)["x"].tolist() == x.tolist()
        assert a.put({"x": -x}, partition=1) == [4, 5, 6, 7]
        assert time.monotonic() - t < 5  # (no request waited for its deadline)
        assert link.session.sid != before and link.renewed == 1
        assert "had forgotten this client's sealed session" in caplog.text
        # A's new session pushed out B's (C had used its own since), B's then C's: each renews once, in turn
        assert b.get_data(BatchMeta(1, [4, 5, 6, 7], ["x"]))["x"].tolist() == (-x).tolist()  # written once
        assert c.get_data(meta)["x"].tolist() == x.tolist()
        assert [p._core._bulk[0].renewed for p in (a, b, c)] == [1, 1, 1]
    finally:
        for p in (a, b, c):
            p.disconnect()
        d.shutdown()


def test_a_client_of_a_unit_that_forgets_at_once_fails_naming_the_cause():
    """A session forgotten again before every answer (more clients at once than
    ``max_sessions``) ends the call with an error naming the setting, not a hang."""
    d = launch(SCHEMA, n_storage=1, max_sessions=1)
    a = d.client(use_shm=False, deadline=10)
    try:
        rows = a.put({"x": np.ones((2, 4), np.float32)}, partition=0)
        link = a._core._bulk[0]
        real = link.renew

        async def renew_then_push_out(old):  # another client's session arrives right after each renewal
            got = await real(old)
            await a._core._units[0].call("bulk_session", {})
            return got

        link.renew = renew_then_push_out
        asyncio.run_coroutine_threadsafe(a._core._units[0].call("bulk_session", {}), a._core._loop).result(10)
        with pytest.raises(DataPlaneUnavailable, match="forgot this client's sealed session 3 times.*max_sessions"):
            a.get_data(BatchMeta(0, rows, ["x"]))
    finally:
        a.disconnect()
        d.shutdown()
