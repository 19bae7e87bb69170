"""Property test of the lease bookkeeping that makes a distributed ``get_batch`` atomic
with respect to ``clear`` (:mod:`asyncflow.dataplane.core.leases`), against a plain model."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from asyncflow.dataplane.core.leases import Leases

ROWS = st.lists(st.integers(0, 15), min_size=1, max_size=6, unique=True)
OPS = st.lists(st.one_of(
    st.tuples(st.just("pin"), ROWS),
    st.tuples(st.just("forget"), ROWS),
    st.tuples(st.just("release"), st.integers(0, 12)),
    st.tuples(st.just("expire"), st.integers(0, 5)),
), max_size=40)


@given(OPS)
def test_drops_happen_once_and_never_under_a_live_lease(ops):
    leases, now = Leases(ttl=3.0), 0.0
    live: dict[int, tuple[set[int], float]] = {}  # model: lease -> (rows, expiry)
    forgotten: set[int] = set()
    dropped: Counter[int] = Counter()
    for op, arg in ops:
        if op == "pin":
            rows = [r for r in arg if r not in forgotten]  # the index hands out live rows only
            if rows:
                live[leases.pin(rows, now)] = (set(rows), now + 3.0)
            continue
        if op == "forget":
            rows = [r for r in arg if r not in forgotten]
            forgotten.update(rows)
            out = leases.forget(rows)
        elif op == "release":
            live.pop(arg, None)
            out = leases.release(arg)
        else:
            now += arg
            for k in [k for k, (_, expiry) in live.items() if expiry <= now]:
                del live[k]
            out = leases.expire(now)
        held = set().union(*(rows for rows, _ in live.values()))
        for row in out:
            assert row in forgotten and row not in held, (row, held)
            dropped[row] += 1
        assert all(c == 1 for c in dropped.values())  # exactly once
        assert leases.pinned == len(held)
        assert set(dropped) == forgotten - held  # everything not held is freed already
        assert leases.deferred == len(forgotten & held)
