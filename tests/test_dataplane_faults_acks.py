"""Ack-based consumption of the in-process data plane under random consumers (property test).

Consumers take rows (``get_meta``), then acknowledge them (``get_data`` or ``ack``), give
them back (``nack``) or vanish, while a fake clock moves past hand-out TTLs. Checked
against a plain model: no row is ever delivered to two successful consumers (an ack of an
expired hand-out is refused), a row in flight is never handed out again, and once every
hand-out has expired a final consumer gets exactly the rows nobody acknowledged, so every
row is delivered exactly once in the end.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow.dataplane import DataPlane, Field, Schema
from asyncflow.dataplane.core import consumption, controller
from asyncflow.dataplane.core.rules import HandoutExpired

TTL = 10.0
OPS = st.lists(st.one_of(
    st.tuples(st.just("get"), st.integers(1, 5)),
    st.tuples(st.sampled_from(["read", "ack", "nack"]), st.integers(0, 20)),
    st.tuples(st.just("wait"), st.floats(0.0, 8.0)),
), max_size=40)


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now


@settings(max_examples=200, deadline=None)
@given(n_rows=st.integers(1, 24), ops=OPS)
def test_every_row_is_delivered_exactly_once(n_rows, ops):
    clock = _Clock()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(controller, "time", clock)
        mp.setattr(consumption, "time", clock)
        plane = DataPlane(Schema([Field("x", "int64")]), handout_ttl=TTL)
        rows = plane.put({"x": list(range(n_rows))})
        metas, given_at, status = [], [], []  # every hand-out, when, and "live" | "acked" | "back"
        delivered: list[int] = []
        for op, arg in ops:
            if op == "get":
                meta = plane.get_meta("t", ["x"], n=arg, block=False, min_n=0)
                in_flight = {r for m, t, s in zip(metas, given_at, status) if s == "live" and clock.now < t + TTL
                             for r in m.rows}
                assert not set(meta.rows) & in_flight and not set(meta.rows) & set(delivered)
                if meta.rows:
                    metas.append(meta)
                    given_at.append(clock.now)
                    status.append("live")
            elif op == "wait":
                clock.now += arg
            elif metas:
                k = arg % len(metas)
                meta, gone = metas[k], status[k] == "back" or (status[k] == "live" and clock.now >= given_at[k] + TTL)
                try:
                    if op == "read":
                        assert plane.get_data(meta)["x"].tolist() == meta.rows
                    elif op == "ack":
                        plane.ack(meta)
                    else:
                        plane.nack(meta)
                        status[k] = "acked" if status[k] == "acked" else "back"
                        continue
                except HandoutExpired:
                    assert gone
                    status[k] = "back"
                    continue
                assert not gone
                if status[k] == "live":
                    delivered.extend(meta.rows)
                    status[k] = "acked"
        clock.now += TTL  # every hand-out left has expired: its rows are back
        last = plane.get_meta("t", ["x"], n=1000, block=False, min_n=0)
        plane.ack(last)
        assert sorted(delivered + last.rows) == rows  # exactly once, in the end
        assert plane.stats()["consumed"]["t"] == n_rows and plane.stats()["in_flight"] == {}
