"""Property test of the distributed data plane across processes.

Producer processes put field ``a`` as new rows and later ``b`` into the same rows, in
random chunks with random pauses; consumer processes of two tasks read ``['a', 'b']``
concurrently until the sealed partition is exhausted. Checked: per task every row is
consumed exactly once over all its consumers (none lost, none duplicated), and every
row handed out has both fields produced with the right values (a row is never handed out
before ``b`` is written, else the fetch would fail or the value would be wrong).

Workers are a process pool kept for the module and receive the client pickled (it
reconnects in the worker), one deployment serves every example (fresh partition each).
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import random
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncflow.dataplane import Field, Schema
from asyncflow.dataplane.transport.deploy import launch

SCHEMA = Schema([Field("a", "int64", ragged=True), Field("b", "int64"), Field("uid", "int64")])
TASKS = ("t1", "t2")
_example = itertools.count()


def produce(client, partition: str, uids: list[int], chunks: list[int], seed: int) -> None:
    rnd = random.Random(seed)
    i = 0
    written = []
    for k in chunks:
        part = uids[i:i + k]
        i += k
        if not part:
            break
        rows = client.put({"a": [np.full(u % 3 + 1, u) for u in part], "uid": part}, partition=partition)
        written.append((rows, part))
        if rnd.random() < 0.5:  # sometimes b at once, else later
            rows, part = written.pop()
            client.put({"b": [10 * u for u in part]}, partition=partition, rows=rows)
        time.sleep(rnd.random() * 0.003)
    for rows, part in written:
        client.put({"b": [10 * u for u in part]}, partition=partition, rows=rows)


def consume(client, partition: str, task: str, n: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    got = []
    while True:
        meta, data = client.get_batch(task, ["a", "b", "uid"], n=n, partition=partition, min_n=1, timeout=20)
        if not meta.rows:
            return got  # sealed and exhausted
        for a, b, u in zip(data["a"], data["b"].tolist(), data["uid"].tolist()):
            assert b == 10 * u and len(a) == u % 3 + 1 and (a == u).all(), (u, a, b)
            got.append(u)
        time.sleep(rnd.random() * 0.003)


@pytest.fixture(scope="module")
def env():
    dep = launch(SCHEMA, n_storage=2)
    pool = mp.get_context("spawn").Pool(5)
    yield dep, pool
    pool.terminate()
    dep.shutdown()


@settings(deadline=None, max_examples=5, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(
    plans=st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=4), min_size=1, max_size=2),
    consumers=st.lists(st.integers(1, 5), min_size=1, max_size=3),  # batch size per consumer
    seed=st.integers(0, 2**16),
)
def test_every_row_once_per_task_across_processes(env, plans, consumers, seed):
    dep, pool = env
    client = dep.client()
    partition = f"ex{next(_example)}"
    uid = itertools.count()
    jobs = [pool.apply_async(produce, (client, partition, [next(uid) for _ in range(sum(c))], c, seed + i))
            for i, c in enumerate(plans)]
    total = next(uid)
    cons = [(task, pool.apply_async(consume, (client, partition, task, n, seed + j)))
            for j, (task, n) in enumerate((TASKS[j % 2], n) for j, n in enumerate([*consumers, 2]))]
    for j in jobs:
        j.get(30)
    client.seal(partition)
    per_task = {t: [] for t in TASKS}
    for task, j in cons:
        per_task[task].extend(j.get(30))
    for task, got in per_task.items():
        assert sorted(got) == list(range(total)), (task, sorted(got))
    client.clear(partition)
