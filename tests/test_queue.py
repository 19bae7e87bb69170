"""Unit tests of the data plane (asyncflow.dataplane) with hand-computed expectations."""

from __future__ import annotations

import ast
import pickle
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from asyncflow.dataplane import (
    BatchMeta,
    DataPlane,
    Field,
    GroupSampler,
    QueueClosed,
    QueueTimeout,
    Sampler,
    Schema,
    SchemaError,
    SequentialSampler,
    StalenessSampler,
    TokenBalancedSampler,
    chunk_sizes,
)
from asyncflow.dataplane.core.samplers import check_sample
from asyncflow.dataplane.core.schema import validate_tags

SCHEMA = Schema(
    [
        Field("prompt_ids", "int64", ragged=True),
        Field("response_ids", "int64", ragged=True),
        Field("reward", "float32"),
        Field("logp", "float32", shape=(2,)),
    ]
)


def plane(capacity: int | None = None) -> DataPlane:
    return DataPlane(SCHEMA, capacity=capacity)


def in_thread(fn, *args, **kwargs):
    """Run fn in a daemon thread; return (thread, box) where box gets 'result' or 'error'."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def wait_until_blocked(t: threading.Thread, box: dict, seconds: float = 0.1) -> None:
    t.join(seconds)
    assert t.is_alive() and not box, f"expected a blocked call, got {box}"


# -- schema ------------------------------------------------------------------------------
def test_field_normalises_dtype_and_shape():
    f = Field("x", "float", shape=[2, 3])  # type: ignore[arg-type]
    assert (f.dtype, f.shape) == ("float64", (2, 3))
    with pytest.raises(ValueError, match="ragged"):
        Field("r", "int64", shape=(2,), ragged=True)
    with pytest.raises(ValueError, match="unknown dtype"):
        Field("x", "nope")
    with pytest.raises(ValueError, match="duplicate field 'x'"):
        Schema([Field("x", "int64"), Field("x", "int64")])


def test_validate_normalises_fixed_and_ragged_columns():
    cols = SCHEMA.validate(
        {
            "prompt_ids": [[1, 2, 3], np.array([4], dtype=np.int32), []],
            "reward": [1, 0, 2],  # int -> float32 is same_kind: accepted
            "logp": np.zeros((3, 2), dtype=np.float64),
        }
    )
    assert [r.tolist() for r in cols["prompt_ids"]] == [[1, 2, 3], [4], []]
    assert all(r.dtype == np.int64 for r in cols["prompt_ids"])
    assert cols["reward"].dtype == np.float32 and cols["reward"].tolist() == [1.0, 0.0, 2.0]
    assert cols["logp"].shape == (3, 2) and cols["logp"].dtype == np.float32


def test_validate_copies_and_freezes_values():
    src = np.array([1.0, 2.0], dtype=np.float32)
    row = np.array([5, 6])
    cols = SCHEMA.validate({"reward": src, "prompt_ids": [row, row]})
    src[0], row[0] = 99.0, 99
    assert cols["reward"].tolist() == [1.0, 2.0] and cols["prompt_ids"][0].tolist() == [5, 6]
    with pytest.raises(ValueError):
        cols["prompt_ids"][0][0] = 0  # read-only


def test_schema_error_names_field_and_row_for_ragged_shape():
    bad = [[1], [2, 3], [4], np.zeros((2, 2), dtype=np.int64)]
    with pytest.raises(SchemaError) as err:
        SCHEMA.validate({"response_ids": bad})
    assert str(err.value) == (
        "field 'response_ids' row 3: expected 1-D int64 array, got shape (2, 2)"
    )


@pytest.mark.parametrize(
    "data, message",
    [
        ({"reward": [1.0, 2.5, np.float64(3.0)], "nope": [1]}, "unknown field 'nope'"),
        ({"response_ids": [[1], [2.5]]}, "field 'response_ids' row 1: expected int64 values, got float64"),
        ({"reward": [0.0, [1.0, 2.0]]}, r"field 'reward' row 1: expected shape \(\), got \(2,\)"),
        ({"logp": np.zeros((2, 3))}, r"field 'logp' row 0: expected shape \(2,\), got \(3,\)"),
        ({"reward": [1.0, 2.0], "response_ids": [[1]]}, "field 'response_ids': got 1 rows, field 'reward' has 2"),
        ({"reward": 1.0}, "field 'reward': expected one value per row"),
        ({"response_ids": "abc"}, "field 'response_ids': expected one value per row"),
        ({"response_ids": [[1, 2], [[1, 2], [3]]]}, "field 'response_ids' row 1: not an array"),
    ],
)
def test_schema_errors(data, message):
    with pytest.raises(SchemaError, match=message):
        SCHEMA.validate(data)


def test_float_into_int_refused_int_into_float_accepted():
    s = Schema([Field("i", "int64"), Field("f", "float32")])
    with pytest.raises(SchemaError, match="field 'i' row 0: expected int64 values, got float64"):
        s.validate({"i": np.array([1.0, 2.0])})
    assert s.validate({"f": np.array([1, 2])})["f"].dtype == np.float32


def test_validate_row_count_against_n_rows_and_tags():
    with pytest.raises(SchemaError, match="field 'reward': got 2 rows, expected 3"):
        SCHEMA.validate({"reward": [1.0, 2.0]}, n_rows=3)
    assert validate_tags({"v": np.array([1, 2])}, 2) == {"v": [1, 2]}
    with pytest.raises(SchemaError, match="tag 'v' row 1: expected an int, got 1.5"):
        validate_tags({"v": [1, 1.5]}, 2)
    with pytest.raises(SchemaError, match="tag 'v': got 1 values for 2 rows"):
        validate_tags({"v": [1]}, 2)


# -- samplers ----------------------------------------------------------------------------
def test_sequential_sampler():
    assert SequentialSampler().sample([2, 5, 7], 2, {}) == ([2, 5], [2, 5])
    assert SequentialSampler().sample([2], 4, {}) == ([2], [2])


def test_group_sampler_takes_only_whole_groups_oldest_first():
    tags = {"group": {0: 10, 1: 11, 2: 10, 3: 12, 4: 11, 5: 12, 6: 13}}
    ready = [0, 1, 2, 4, 5, 6]  # group 12 lacks row 3, group 13 lacks its second row
    s = GroupSampler(2)
    assert s.sample(ready, 8, tags) == ([0, 2, 1, 4], [0, 2, 1, 4])
    assert s.sample(ready, 3, tags) == ([0, 2], [0, 2])  # n // 2 = 1 group
    assert s.sample(ready, 1, tags) == ([0, 2], [0, 2])  # n < group_size: one group
    assert s.sample([5, 6], 4, tags) == ([], [])
    with pytest.raises(ValueError, match="group 10 has 3 ready rows"):
        s.sample([0, 1, 2], 4, {"group": {0: 10, 1: 10, 2: 10}})
    with pytest.raises(ValueError, match="row 0 has no 'group' tag"):
        s.sample([0], 4, {})
    with pytest.raises(ValueError):
        GroupSampler(0)


def test_staleness_sampler_drops_old_rows():
    tags = {"version": {0: 3, 1: 5, 2: 4, 3: 6, 4: 2}, "group": {1: 0, 2: 1, 3: 0}}
    s = StalenessSampler(min_version=4)
    assert s.sample([0, 1, 2, 3, 4], 2, tags) == ([1, 2], [0, 4, 1, 2])
    inner = StalenessSampler(min_version=4, inner=GroupSampler(2))
    assert inner.sample([0, 1, 2, 3, 4], 2, tags) == ([1, 3], [0, 4, 1, 3])
    assert s.sample([0, 4], 2, tags) == ([], [0, 4])  # all stale: dropped, nothing chosen


def test_token_balanced_sampler_hand_computed():
    tags = {"tokens": {0: 9, 1: 8, 2: 1, 3: 2, 4: 5}}
    # largest first: 0(9)->r0, 1(8)->r1, 3(2)->r1 (8<9), 2(1)->r0 (9<10); sums 10/10
    assert TokenBalancedSampler(2).sample([0, 1, 2, 3], 4, tags) == ([0, 2, 1, 3], [0, 1, 2, 3])
    # 5 rows, chunks of 3 and 2: 0->r0(9), 1->r1(8), 4->r1(13), 3->r0(11), 2->r0(12) full
    assert TokenBalancedSampler(2).sample([0, 1, 2, 3, 4], 5, tags) == ([0, 2, 3, 1, 4], [0, 1, 2, 3, 4])
    assert chunk_sizes(5, 2) == [3, 2] and chunk_sizes(2, 4) == [1, 1, 0, 0]
    with pytest.raises(ValueError, match="row 7 has no 'tokens' tag"):
        TokenBalancedSampler(2).sample([7], 4, tags)


def test_samplers_are_picklable_and_follow_the_protocol():
    samplers = [
        SequentialSampler(),
        GroupSampler(4),
        StalenessSampler(3, inner=GroupSampler(2)),
        TokenBalancedSampler(8, inner=StalenessSampler(1)),
    ]
    for s in samplers:
        assert isinstance(s, Sampler)
        assert pickle.loads(pickle.dumps(s)) == s


def test_check_sample_rejects_contract_violations():
    for chosen, consumed, problem in [
        ([1, 2, 3], [1, 2, 3], "more than n=2"),
        ([1], [2], "did not consume"),
        ([1], [1, 9], "not ready"),
        ([1, 1], [1], "twice"),
    ]:
        with pytest.raises(ValueError, match=problem):
            check_sample(SequentialSampler(), [1, 2, 3], 2, chosen, consumed)
    assert check_sample(SequentialSampler(), [1, 2], 2, (np.int64(1),), [1, 2]) == ([1], [1, 2])


# -- DataPlane: writes -------------------------------------------------------------------
def test_put_allocates_global_monotonic_rows():
    dp = plane()
    assert dp.put({"reward": [1.0, 2.0]}, partition="a") == [0, 1]
    assert dp.put({"reward": [3.0]}, partition="b") == [2]
    assert dp.put({"reward": [4.0]}, partition="a") == [3]
    st = dp.stats()
    assert st["live_rows"] == 4 and st["partitions"] == {"a": 3, "b": 1}
    assert st["puts"] == 3 and st["rows_allocated"] == 4


def test_ragged_stored_without_padding_and_fixed_fields_stacked():
    dp = plane()
    prompts = [np.arange(5), np.arange(1), np.arange(3)]
    rows = dp.put(
        {"prompt_ids": prompts, "reward": [0.5, 1.5, 2.5], "logp": [[1, 2], [3, 4], [5, 6]]}
    )
    assert [len(v) for v in dp._storage.gather(rows, ["prompt_ids"])["prompt_ids"]] == [5, 1, 3]
    data = dp.get_data(BatchMeta(0, [2, 0], ["prompt_ids", "reward", "logp"]))
    assert [x.tolist() for x in data["prompt_ids"]] == [[0, 1, 2], [0, 1, 2, 3, 4]]
    assert isinstance(data["reward"], np.ndarray) and data["reward"].tolist() == [2.5, 0.5]
    assert data["logp"].shape == (2, 2) and data["logp"].tolist() == [[5, 6], [1, 2]]
    empty = dp.get_data(BatchMeta(0, [], ["prompt_ids", "logp"]))
    assert empty["prompt_ids"] == [] and empty["logp"].shape == (0, 2)


def test_schema_error_on_put_writes_nothing():
    dp = plane()
    with pytest.raises(SchemaError, match="field 'response_ids' row 1"):
        dp.put({"reward": [1.0, 2.0], "response_ids": [[1], [[1, 2]]]})
    with pytest.raises(SchemaError, match="tag 'version' row 0"):
        dp.put({"reward": [1.0]}, tags={"version": ["x"]})
    st = dp.stats()
    assert st["live_rows"] == 0 and st["rows_allocated"] == 0 and st["puts"] == 0


def test_write_fields_into_existing_rows_all_or_nothing():
    dp = plane()
    a = dp.put({"prompt_ids": [[1], [2]]}, partition="p")
    b = dp.put({"prompt_ids": [[3]]}, partition="q")
    with pytest.raises(ValueError, match="row 99 does not exist"):
        dp.put({"reward": [1.0, 2.0]}, partition="p", rows=[a[0], 99])
    with pytest.raises(ValueError, match=f"row {b[0]} belongs to partition 'q', not 'p'"):
        dp.put({"reward": [1.0]}, partition="p", rows=b)
    with pytest.raises(ValueError, match="appears more than once"):
        dp.put({"reward": [1.0, 2.0]}, partition="p", rows=[a[0], a[0]])
    with pytest.raises(SchemaError, match="got 1 rows, expected 2"):
        dp.put({"reward": [1.0]}, partition="p", rows=a)
    # none of the failed writes stored anything: row a[0] can still get its reward once
    assert dp.put({"reward": [1.0, 2.0]}, partition="p", rows=a) == a
    with pytest.raises(ValueError, match=f"row {a[1]} field 'reward' was already written"):
        dp.put({"reward": [5.0], "response_ids": [[1]]}, partition="p", rows=[a[1]])
    assert dp.get_data(BatchMeta("p", a, ["reward"]))["reward"].tolist() == [1.0, 2.0]
    with pytest.raises(ValueError, match="field 'response_ids' has not been produced"):
        dp.get_data(BatchMeta("p", a, ["response_ids"]))
    with pytest.raises(SchemaError, match="unknown field 'nope'"):
        dp.get_data(BatchMeta("p", a, ["nope"]))


def test_tags_merge_across_writes():
    dp = plane()
    rows = dp.put({"prompt_ids": [[1], [2]]}, tags={"group": [7, 7]})
    dp.put({"reward": [0.0, 1.0]}, rows=rows, tags={"version": [3, 4]})
    dp.put({}, rows=rows[:1], tags={"version": [5]})  # tag-only write, last one wins
    assert dp.tags(rows) == {"group": [7, 7], "version": [5, 4]}
    r2 = dp.put({"prompt_ids": [[3]]})
    assert dp.tags(rows + r2) == {}  # only tags defined on every row
    with pytest.raises(ValueError, match="row 42 does not exist"):
        dp.tags([42])


def test_seal_refuses_new_rows_but_not_new_fields():
    dp = plane()
    rows = dp.put({"prompt_ids": [[1]]}, partition=1)
    dp.seal(1)
    with pytest.raises(ValueError, match="partition 1 is sealed"):
        dp.put({"prompt_ids": [[2]]}, partition=1)
    assert dp.put({"reward": [1.0]}, partition=1, rows=rows) == rows


def test_clear_frees_rows_and_never_reuses_ids():
    dp = plane()
    rows = dp.put({"reward": [1.0, 2.0]}, partition="old")
    meta = dp.get_meta("t", ["reward"], n=2)
    dp.clear("old")
    dp.clear("never-existed")  # no-op
    assert dp.stats()["live_rows"] == 0 and dp.stats()["partitions"] == {}
    with pytest.raises(ValueError, match=f"row {rows[0]} does not exist"):
        dp.get_data(meta)
    assert dp.put({"reward": [3.0]}, partition="old") == [2]
    assert dp.get_meta("t", ["reward"], n=1).rows == [2]  # a new partition, fresh consumption


# -- DataPlane: reads --------------------------------------------------------------------
def test_rows_are_handed_out_only_when_all_fields_are_produced():
    dp = plane()
    rows = dp.put({"prompt_ids": [[1], [2], [3]]})
    assert dp.get_meta("train", ["prompt_ids", "reward"], n=1, block=False).rows == []
    dp.put({"reward": [0.5]}, rows=[rows[1]])
    meta = dp.get_meta("train", ["prompt_ids", "reward"], n=2, min_n=1, block=False)
    assert meta == BatchMeta(0, [rows[1]], ["prompt_ids", "reward"], [])
    # another task consumes independently; the same task never gets a row twice
    assert dp.get_meta("ref", ["prompt_ids"], n=3).rows == rows
    dp.put({"reward": [0.1, 0.9]}, rows=[rows[0], rows[2]])
    assert dp.get_meta("train", ["prompt_ids", "reward"], n=2).rows == [rows[0], rows[2]]
    assert dp.get_meta("train", ["prompt_ids", "reward"], n=1, block=False).rows == []
    assert dp.stats()["consumed"] == {"train": 3, "ref": 3}


def test_non_blocking_below_min_n_consumes_nothing():
    dp = plane()
    dp.put({"reward": [1.0, 2.0]})
    assert len(dp.get_meta("t", ["reward"], n=3, block=False)) == 0
    assert dp.get_meta("t", ["reward"], n=3, min_n=2, block=False).rows == [0, 1]
    assert dp.get_meta("u", ["reward"], n=3, min_n=0, block=False).rows == [0, 1]


def test_partition_none_serves_oldest_partition_first_and_skips_finished_ones():
    dp = plane()
    dp.put({"reward": [1.0, 2.0]}, partition="s1")
    dp.put({"reward": [3.0, 4.0, 5.0]}, partition="s2")
    dp.seal("s1")
    assert dp.get_meta("t", ["reward"], n=3, min_n=1) == BatchMeta("s1", [0, 1], ["reward"])
    assert dp.get_meta("t", ["reward"], n=3) == BatchMeta("s2", [2, 3, 4], ["reward"])
    assert dp.get_meta("t", ["reward"], n=1, block=False) == BatchMeta(None, [], ["reward"])


def test_seal_releases_a_partial_final_batch():
    dp = plane()
    dp.put({"reward": [1.0, 2.0, 3.0]}, partition=5)
    t, box = in_thread(dp.get_meta, "t", ["reward"], n=4, partition=5, timeout=5)
    wait_until_blocked(t, box)
    dp.seal(5)
    t.join(2)
    assert box["result"] == BatchMeta(5, [0, 1, 2], ["reward"])
    # sealed and fully consumed: an empty answer at once, not a wait
    assert dp.get_meta("t", ["reward"], n=4, partition=5, timeout=0.5).rows == []


def test_sealed_partition_still_waits_for_fields_of_existing_rows():
    dp = plane()
    rows = dp.put({"prompt_ids": [[1], [2]]}, partition=0)
    dp.seal(0)
    dp.put({"reward": [1.0]}, partition=0, rows=rows[:1])
    meta = dp.get_meta("t", ["reward"], n=4, partition=0, block=False)
    assert meta.rows == []  # row 1 may still get its reward: not exhausted
    dp.put({"reward": [2.0]}, partition=0, rows=rows[1:])
    assert dp.get_meta("t", ["reward"], n=4, partition=0).rows == rows


def test_get_meta_timeout_is_honoured_and_says_what_it_waited_for():
    dp = plane()
    start = time.monotonic()
    with pytest.raises(QueueTimeout) as err:
        dp.get_meta("trainer", ["reward"], n=8, partition="step3", timeout=0.2)
    elapsed = time.monotonic() - start
    assert 0.2 <= elapsed < 0.7
    for part in ("trainer", "reward", "8", "step3", "0.2"):
        assert part in str(err.value)


def test_close_wakes_blocked_getter_and_putter():
    dp = plane(capacity=1)
    dp.put({"reward": [1.0]})
    getter, gbox = in_thread(dp.get_meta, "t", ["response_ids"], n=1)
    putter, pbox = in_thread(dp.put, {"reward": [2.0]})
    wait_until_blocked(getter, gbox)
    wait_until_blocked(putter, pbox)
    dp.close()
    getter.join(2)
    putter.join(2)
    assert isinstance(gbox["error"], QueueClosed) and "task 't'" in str(gbox["error"])
    assert isinstance(pbox["error"], QueueClosed)
    assert dp.closed
    with pytest.raises(QueueClosed):
        dp.get_meta("t", ["reward"], n=1, block=False)
    with pytest.raises(QueueClosed):
        dp.put({"reward": [3.0]}, rows=None)
    assert dp.get_data(BatchMeta(0, [0], ["reward"]))["reward"].tolist() == [1.0]


def test_a_blocked_waiter_does_not_block_other_callers():
    dp = plane()
    t, box = in_thread(dp.get_meta, "slow", ["response_ids"], n=1, timeout=5)
    wait_until_blocked(t, box)
    start = time.monotonic()
    dp.put({"reward": [1.0]})
    assert dp.get_meta("fast", ["reward"], n=1).rows == [0]
    assert time.monotonic() - start < 0.5
    dp.close()
    t.join(2)


def test_back_pressure_blocks_then_proceeds_after_clear_and_loses_nothing():
    dp = plane(capacity=4)
    dp.put({"reward": [0.0, 1.0, 2.0, 3.0]}, partition="old")
    t, box = in_thread(dp.put, {"reward": [4.0, 5.0]}, partition="new")
    wait_until_blocked(t, box)
    assert dp.stats()["live_rows"] == 4
    dp.clear("old")
    t.join(2)
    assert box["result"] == [4, 5]
    meta, data = dp.get_batch("t", ["reward"], n=2, partition="new")
    assert meta.rows == [4, 5] and data["reward"].tolist() == [4.0, 5.0]


def test_put_timeout_on_capacity_writes_nothing():
    dp = plane(capacity=2)
    dp.put({"reward": [0.0, 1.0]})
    start = time.monotonic()
    with pytest.raises(QueueTimeout, match="room for 1 new rows in partition 0"):
        dp.put({"reward": [2.0]}, timeout=0.1)
    assert 0.1 <= time.monotonic() - start < 0.6
    assert dp.stats()["rows_allocated"] == 2
    with pytest.raises(ValueError, match="can never fit capacity 2"):
        dp.put({"reward": [1.0, 2.0, 3.0]})


def test_group_and_staleness_samplers_through_the_plane():
    dp = plane()
    dp.put({"reward": [0.0, 1.0, 2.0]}, tags={"group": [0, 1, 0], "version": [1, 2, 2]})
    meta = dp.get_meta("t", ["reward"], n=2, sampler=GroupSampler(2), block=False)
    assert meta.rows == [0, 2]
    fresh = StalenessSampler(min_version=2)
    meta = dp.get_meta("u", ["reward"], n=2, sampler=fresh)
    assert meta == BatchMeta(0, [1, 2], ["reward"], dropped=[0])
    assert dp.stats()["dropped"] == {"u": 1} and dp.stats()["consumed"]["u"] == 2


def test_broken_sampler_fails_the_call_and_consumes_nothing():
    class Greedy:
        def sample(self, ready, n, tags):
            return list(ready), list(ready)

    dp = plane()
    dp.put({"reward": [0.0, 1.0, 2.0]})
    with pytest.raises(ValueError, match="broke the contract: chose 3 rows, more than n=2"):
        dp.get_meta("t", ["reward"], n=2, sampler=Greedy())
    assert dp.get_meta("t", ["reward"], n=3).rows == [0, 1, 2]


def test_get_batch_equals_get_meta_plus_get_data():
    dp = plane()
    dp.put({"prompt_ids": [[1, 2], [3]], "reward": [1.0, 2.0]})
    meta, data = dp.get_batch("a", ["prompt_ids", "reward"], n=2)
    ref = dp.get_meta("b", ["prompt_ids", "reward"], n=2)
    ref_data = dp.get_data(ref)
    assert meta.rows == ref.rows
    assert data["reward"].tolist() == ref_data["reward"].tolist()
    assert [x.tolist() for x in data["prompt_ids"]] == [[1, 2], [3]]
    assert dp.stats()["gets"] == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(fields=["nope"], n=1), "unknown field 'nope'"),
        (dict(fields=["reward"], n=0), "n must be >= 1"),
        (dict(fields=["reward"], n=2, min_n=3), "min_n must be in"),
        (dict(fields=["reward"], n=1, timeout=-1), "timeout must be >= 0"),
    ],
)
def test_get_meta_argument_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plane().get_meta("t", **kwargs)


def test_api_values_are_picklable():
    values = [
        SCHEMA,
        BatchMeta("p", [1, 2], ["reward"], [3]),
        SchemaError("field 'x' row 1: bad"),
        QueueClosed("closed"),
        QueueTimeout("late"),
    ]
    for v in values:
        back = pickle.loads(pickle.dumps(v))
        assert type(back) is type(v) and str(back) == str(v)
    assert pickle.loads(pickle.dumps(SCHEMA)) == SCHEMA


def test_queue_package_imports_neither_torch_nor_ray():
    root = Path(__file__).resolve().parents[1] / "asyncflow" / "queue"
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert name.split(".")[0] not in {"torch", "ray"}, f"{path.name} imports {name}"


def test_docstring_examples_hold():
    import doctest

    from asyncflow.dataplane.core import controller, samplers, schema

    for module in (schema, samplers, controller):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0, module.__name__
