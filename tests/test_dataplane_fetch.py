"""The frames path's read plan (``transport/fetch.py``): big spans alone, small ones batched.

A hand-computed plan, a property test (every row covered once, in order, per unit; a
split read reassembles exactly), and a live frames-only deployment whose get is split
into per-span requests and must return the put's values in ``meta.rows`` order. Also:
a storage unit's heap keeps freed frames (``transport/heap.py``), so the next put's
frames fault no fresh pages (counted in a child process; off: every page faults).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow.dataplane import Field, Schema
from asyncflow.dataplane.transport.deploy import launch
from asyncflow.dataplane.transport.fetch import SPLIT_BYTES, place, plan_requests
from asyncflow.dataplane.transport.protocol import shard_of


def test_plan_by_hand():
    rows = [*range(60, 70), *range(130, 140), 1]  # spans: 60-63 (u0), 64-69 (u1), 130-139 (u0), 1 (u0)
    big = -(-SPLIT_BYTES // 6)  # bytes a row: 6 rows make a big span, 4 do not
    assert plan_requests(rows, [big, big]) == [(1, [(4, 10)]), (0, [(10, 20)]), (0, [(0, 4), (20, 21)])]
    assert plan_requests(rows, [0, big]) == [(1, [(4, 10)]), (0, [(0, 4), (10, 20), (20, 21)])]
    assert plan_requests([], [big]) == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 600), unique=True, max_size=120), st.integers(1, 3),
       st.sampled_from([0, 1, SPLIT_BYTES // 64, SPLIT_BYTES]))
def test_plan_covers_every_row_once_and_place_reassembles(rows, n_units, row_bytes):
    plan = plan_requests(rows, [row_bytes] * n_units)
    seen = [i for _, spans in plan for i, j in spans for i in range(i, j)]
    assert sorted(seen) == list(range(len(rows)))
    for unit, spans in plan:
        assert all(shard_of(rows[k], n_units) == unit for i, j in spans for k in range(i, j))
        assert spans == sorted(spans)
    out = {"a": np.full((len(rows), 2), -1)}
    for _, spans in plan:  # each answer: its rows' values, spans one after another
        answer = np.array([[rows[k], 2 * rows[k]] for i, j in spans for k in range(i, j)]).reshape(-1, 2)
        place(out, spans, {"a": answer}, whole=len(plan) == 1 and len(spans) == 1)
    assert out["a"].tolist() == [[r, 2 * r] for r in rows]


@pytest.mark.parametrize("sealed", [True, False])
def test_frames_get_split_per_span_returns_rows_in_order(sealed):
    """Frames on the units' sealed bulk ports (the default) and on their CURVE sockets."""
    schema = Schema([Field("x", "float32", (4096,)), Field("n", "int64")])  # 16 KiB a row: 64 rows = 1 MiB
    dep = launch(schema, n_storage=2)
    try:
        plane = dep.client(use_shm=False, sealed=sealed)
        assert plane.transports() == (["sealed", "sealed"] if sealed else ["zmq", "zmq"])
        x = np.arange(300 * 4096, dtype=np.float32).reshape(300, 4096)
        rows = plane.put({"x": x, "n": np.arange(300)}, partition="p")
        meta, got = plane.get_batch("t", ["x", "n"], n=300, partition="p")
        assert meta.rows == rows and got["n"].tolist() == list(range(300))
        assert np.array_equal(got["x"], x)
        meta = plane.get_meta("t2", ["x", "n"], n=100, partition="p")  # a read not aligned to the blocks
        part = plane.get_data(meta)
        want = [rows.index(r) for r in meta.rows]
        assert np.array_equal(part["x"], x[want]) and part["n"].tolist() == want
        plane.disconnect()
    finally:
        dep.shutdown()


_FAULTS = """
import resource, sys
import numpy as np
import pytest
from asyncflow.dataplane.transport.heap import keep_freed_pages
kept = keep_freed_pages()
for k in range(3):  # a put's frames, stored, then cleared: the second and third reuse the pages
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    frames = [np.ones(2 << 20, np.uint8) for _ in range(8)]  # 16 MiB in 2 MiB frames, written
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    del frames
print(kept, faults)
"""


def test_storage_unit_heap_keeps_freed_frames_for_the_next_put():
    import os
    import subprocess
    import sys

    def run(env: dict) -> tuple[str, int]:
        out = subprocess.run([sys.executable, "-c", _FAULTS], capture_output=True, text=True, timeout=60,
                             env={**os.environ, **env}, check=True).stdout.split()
        return out[0], int(out[1])

    kept, faults = run({})
    if kept != "True":
        pytest.skip("not glibc: keep_freed_pages is a no-op")
    assert faults < 200  # 16 MiB is 4096 pages: fresh pages would fault each one
    assert run({"ASYNCFLOW_PLANE_KEEP_HEAP": "0"})[0] == "False"
