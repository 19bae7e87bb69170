"""Property tests of the data plane: random thread interleavings and sampler invariants.

The streaming test wires a miniature pipeline:

    producers --put 'a' (new rows)--> stage consumers --put 'b' (same rows)-->
        two final tasks reading ['a', 'b'] --> the last one to finish a partition clears it

Each producer fills its own partitions one after another and seals each, and the capacity
is the sum of the producers' largest partitions, so producers block on back-pressure but
can never deadlock (every producer can always finish its current partition, and finished
partitions drain and are cleared).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter, defaultdict

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncflow.dataplane import (
    DataPlane,
    Field,
    GroupSampler,
    QueueClosed,
    Schema,
    SequentialSampler,
    StalenessSampler,
    TokenBalancedSampler,
    chunk_sizes,
)

SCHEMA = Schema([Field("a", "int64", ragged=True), Field("b", "int64")])
FINAL_TASKS = ("final1", "final2")
WAIT = 10.0  # seconds; only reached if the data plane deadlocks

put_sizes = st.lists(st.integers(1, 3), min_size=1, max_size=3)  # one partition
producer_plans = st.lists(st.lists(put_sizes, min_size=1, max_size=3), min_size=1, max_size=3)


def payload(uid: int) -> np.ndarray:
    """Ragged value of row ``uid``: its id repeated, length 1..3."""
    return np.full(uid % 3 + 1, uid, dtype=np.int64)


def check_rows(a: list[np.ndarray]) -> list[int]:
    """Every 'a' is intact (length and content); return the uids."""
    uids = [int(x[0]) for x in a]
    for uid, x in zip(uids, a):
        assert len(x) == uid % 3 + 1 and (x == uid).all(), (uid, x)
    return uids


@settings(deadline=None, max_examples=30, suppress_health_check=[HealthCheck.too_slow])
@given(
    plans=producer_plans,
    n_stage=st.integers(1, 2),
    n_final=st.integers(1, 2),
    stage_n=st.integers(1, 4),
    final_n=st.integers(1, 4),
    take_partial=st.booleans(),
    extra_capacity=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_streaming_pipeline_consumes_every_row_exactly_once_per_task(
    plans, n_stage, n_final, stage_n, final_n, take_partial, extra_capacity, seed
):
    sizes = {(i, k): sum(puts) for i, plan in enumerate(plans) for k, puts in enumerate(plan)}
    capacity = sum(max(sum(puts) for puts in plan) for plan in plans) + extra_capacity
    plane = DataPlane(SCHEMA, capacity=capacity)
    min_n = 1 if take_partial else None

    lock = threading.Lock()
    errors: list[BaseException] = []
    produced: list[int] = []
    seen: dict[str, list[int]] = defaultdict(list)
    done_per_partition: Counter = Counter()  # (task, partition) -> rows consumed
    cleared: list = []
    all_cleared = threading.Event()

    def jitter(rnd: random.Random) -> None:
        time.sleep(rnd.choice([0, 0, 0, 0.0005]))

    def guarded(fn):
        def run(*args):
            try:
                fn(*args)
            except QueueClosed:
                pass
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                with lock:
                    errors.append(exc)
                plane.close()

        return run

    @guarded
    def producer(i: int, plan: list[list[int]]) -> None:
        rnd = random.Random(seed * 31 + i)
        uid = i * 1000
        for k, puts in enumerate(plan):
            for size in puts:
                uids = list(range(uid, uid + size))
                uid += size
                plane.put({"a": [payload(u) for u in uids]}, partition=(i, k), timeout=WAIT)
                assert plane.stats()["live_rows"] <= capacity
                with lock:
                    produced.extend(uids)
                jitter(rnd)
            plane.seal((i, k))

    @guarded
    def stage(j: int) -> None:
        rnd = random.Random(seed * 37 + j)
        while True:
            meta, data = plane.get_batch("stage", ["a"], n=stage_n, min_n=min_n, timeout=WAIT)
            assert 1 <= len(meta) <= stage_n
            uids = check_rows(data["a"])
            with lock:
                seen["stage"].extend(uids)
            jitter(rnd)
            plane.put({"b": [2 * u for u in uids]}, partition=meta.partition, rows=meta.rows)

    @guarded
    def final(task: str, j: int) -> None:
        rnd = random.Random(seed * 41 + j)
        while True:
            meta, data = plane.get_batch(task, ["a", "b"], n=final_n, min_n=min_n, timeout=WAIT)
            assert 1 <= len(meta) <= final_n and not meta.dropped
            uids = check_rows(data["a"])
            assert data["b"].tolist() == [2 * u for u in uids]  # 'b' was produced before
            jitter(rnd)
            with lock:
                seen[task].extend(uids)
                done_per_partition[task, meta.partition] += len(meta)
                finished = all(
                    done_per_partition[t, meta.partition] == sizes[meta.partition]
                    for t in FINAL_TASKS
                )
                if finished:
                    cleared.append(meta.partition)
            if finished:  # exactly one consumer sees the second task complete
                plane.clear(meta.partition)
                with lock:
                    if len(cleared) == len(sizes):
                        all_cleared.set()

    threads = [threading.Thread(target=producer, args=(i, p)) for i, p in enumerate(plans)]
    threads += [threading.Thread(target=stage, args=(j,)) for j in range(n_stage)]
    threads += [
        threading.Thread(target=final, args=(task, j))
        for task in FINAL_TASKS
        for j in range(n_final)
    ]
    for t in threads:
        t.daemon = True
        t.start()
    all_cleared.wait(WAIT)
    plane.close()
    for t in threads:
        t.join(WAIT)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)

    expected = sorted(produced)
    assert len(expected) == sum(sizes.values())
    for task in ("stage", *FINAL_TASKS):
        assert sorted(seen[task]) == expected, task  # none lost, none duplicated
    assert sorted(cleared) == sorted(sizes)
    stats = plane.stats()
    assert stats["live_rows"] == 0
    # a partition cleared before its producer sealed it is re-created empty by seal()
    assert set(stats["partitions"].values()) <= {0}
    assert stats["consumed"] == {t: len(expected) for t in ("stage", *FINAL_TASKS)}
    assert stats["dropped"] == {}


# -- samplers ----------------------------------------------------------------------------
@st.composite
def put_ops(draw):
    """Batches of row versions, each followed by some non-blocking gets."""
    return draw(
        st.lists(
            st.tuples(st.lists(st.integers(0, 5), max_size=6), st.integers(0, 3)),
            min_size=1,
            max_size=5,
        )
    )


@settings(deadline=None, max_examples=50)
@given(ops=put_ops(), min_version=st.integers(0, 6), n=st.integers(1, 5))
def test_staleness_sampler_never_hands_out_stale_rows(ops, min_version, n):
    plane = DataPlane(SCHEMA)
    version: dict[int, int] = {}
    chosen: list[int] = []
    dropped: list[int] = []
    sampler = StalenessSampler(min_version)

    def take(meta):
        assert all(version[r] >= min_version for r in meta.rows)
        assert all(version[r] < min_version for r in meta.dropped)
        assert not set(meta.rows) & set(meta.dropped) and len(meta.rows) <= n
        chosen.extend(meta.rows)
        dropped.extend(meta.dropped)

    for versions, n_gets in ops:
        if versions:
            rows = plane.put({"b": versions}, tags={"version": versions})
            version.update(zip(rows, versions))
        for _ in range(n_gets):
            take(plane.get_meta("t", ["b"], n=n, min_n=1, sampler=sampler, block=False))
    plane.seal(0)
    for _ in range(len(version) + 1):  # drain: the sealed partition answers at once
        meta = plane.get_meta("t", ["b"], n=n, partition=0, sampler=sampler)
        if not meta.rows and not meta.dropped:
            break
        take(meta)
    assert not plane.get_meta("t", ["b"], n=n, partition=0, sampler=sampler).dropped
    # chosen + dropped is exactly the consumed set: every row once, stale ones dropped
    assert sorted(chosen + dropped) == sorted(version)
    assert sorted(dropped) == sorted(r for r, v in version.items() if v < min_version)
    stats = plane.stats()
    assert stats["consumed"].get("t", 0) == len(chosen)
    assert stats["dropped"].get("t", 0) == len(dropped)


@settings(deadline=None, max_examples=100)
@given(
    groups=st.lists(st.integers(0, 6), max_size=24),
    present=st.data(),
    group_size=st.integers(1, 4),
    n=st.integers(1, 12),
)
def test_group_sampler_returns_only_whole_groups_oldest_first(groups, present, group_size, n):
    # rows of each group id: at most group_size (a larger group is a tagging error)
    count: Counter = Counter()
    tags: dict[int, int] = {}
    for row, g in enumerate(groups):
        if count[g] < group_size:
            count[g] += 1
            tags[row] = g
    ready = sorted(present.draw(st.sets(st.sampled_from(sorted(tags)))) if tags else [])
    chosen, consumed = GroupSampler(group_size).sample(ready, n, {"group": tags})
    assert chosen == consumed
    by_group: dict[int, list[int]] = defaultdict(list)
    for row in ready:
        by_group[tags[row]].append(row)
    complete = [rows for rows in by_group.values() if len(rows) == group_size]
    complete.sort(key=min)
    k = min(len(complete), max(1, n // group_size))
    assert chosen == [row for rows in complete[:k] for row in rows]


@settings(deadline=None, max_examples=100)
@given(
    tokens=st.lists(st.integers(0, 1000), max_size=30),
    world_size=st.integers(1, 8),
    n=st.integers(1, 30),
)
def test_token_balanced_sampler_balances_contiguous_chunks(tokens, world_size, n):
    ready = list(range(len(tokens)))
    tags = {"tokens": dict(enumerate(tokens))}
    chosen, consumed = TokenBalancedSampler(world_size).sample(ready, n, tags)
    assert consumed == SequentialSampler().sample(ready, n, tags)[1]
    assert sorted(chosen) == consumed
    sums, start = [], 0
    for size in chunk_sizes(len(chosen), world_size):
        sums.append(sum(tokens[r] for r in chosen[start : start + size]))
        start += size
    if chosen:
        assert max(sums) - min(sums) <= max(tokens[r] for r in chosen)


index_ops = st.lists(st.tuples(st.sampled_from(["alloc", "write", "consume", "drop", "unconsume", "reload"]),
                               st.integers(0, 2**16)), min_size=1, max_size=40)


@settings(deadline=None, max_examples=60)
@given(ops=index_ops)
def test_index_ready_rows_and_is_ready_agree_with_a_brute_force_model(ops):
    """``RowIndex.ready`` (with its shortcut when a field is on every live row) and ``is_ready``
    (what ``check_sample`` asks per row) answer exactly "live, every field written, not
    consumed by the task", ascending, through writes, consumption, dropped rows, given-back rows
    and a state round trip."""
    from asyncflow.dataplane.core.index import RowIndex

    index, fields, tasks = RowIndex(), ("f", "g"), ("t1", "t2")
    live: dict[int, str] = {}  # row -> partition
    written: dict[str, set[int]] = {f: set() for f in fields}
    consumed: dict[str, set[int]] = {t: set() for t in tasks}
    for op, seed in ops:
        rnd = random.Random(seed)
        if op == "alloc":
            part = rnd.choice(["p", "q"])
            live.update(dict.fromkeys(index.allocate(part, rnd.randint(1, 4)), part))
        elif op == "write" and live:
            name, part = rnd.choice(fields), rnd.choice(["p", "q"])
            rows = [r for r in live if live[r] == part and r not in written[name] and rnd.random() < 0.7]
            if rows:
                index.check_write(part, rows, [name])
                index.mark_produced(part, rows, [name])
                written[name].update(rows)
        elif op in ("consume", "unconsume") and live:
            task, part = rnd.choice(tasks), rnd.choice(sorted(set(live.values())))
            if op == "consume":
                want = rnd.choice([[], ["f"], list(fields)])
                rows = [r for r in index.ready(part, task, want) if rnd.random() < 0.5]
                index.consume(part, task, rows, 0)
                consumed[task].update(rows)
            else:
                rows = [r for r in consumed[task] if live.get(r) == part and rnd.random() < 0.5]
                index.unconsume(part, task, rows)
                consumed[task].difference_update(rows)
        elif op == "drop" and live:
            rows = [r for r in live if rnd.random() < 0.3]
            index.drop_rows(rows)
            for r in rows:
                del live[r]
                for s in (*written.values(), *consumed.values()):
                    s.discard(r)
        elif op == "reload":
            index = RowIndex.from_state(index.state())
        for part in ("p", "q"):
            for task in tasks:
                for want in ([], ["f"], ["f", "g"]):
                    expect = sorted(r for r in live if live[r] == part and r not in consumed[task]
                                    and all(r in written[f] for f in want))
                    assert index.ready(part, task, want) == expect
                    assert [r for r in range(index._next_row) if index.is_ready(part, task, want, r)] == expect
