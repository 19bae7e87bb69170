"""reset_consumption, clear_rows and save/load of the in-process data plane."""

from __future__ import annotations

import pytest

from asyncflow.dataplane import DataPlane, Field, Schema

SCHEMA = Schema([Field("ids", "int64", ragged=True), Field("r", "float32"), Field("v", "int32", (2,))])


def filled(capacity=None) -> DataPlane:
    plane = DataPlane(SCHEMA, capacity=capacity)
    plane.put({"ids": [[1, 2, 3], [4], []], "r": [1.0, 2.0, 3.0]}, partition="p", tags={"group": [0, 0, 1]})
    plane.put({"ids": [[5]], "r": [5.0], "v": [[1, 2]]}, partition=7)
    return plane


def test_reset_consumption_hands_rows_out_again():
    plane = filled()
    assert plane.get_meta("t", ["r"], n=3, partition="p").rows == [0, 1, 2]
    assert plane.get_meta("t", ["r"], n=1, partition="p", block=False).rows == []
    plane.reset_consumption("t")
    assert plane.get_meta("t", ["r"], n=3, partition="p").rows == [0, 1, 2]
    assert plane.get_meta("u", ["r"], n=1, partition="p").rows == [0]  # other tasks untouched


def test_clear_rows_frees_storage_and_capacity():
    plane = filled(capacity=4)
    plane.clear_rows([1, 3])
    assert plane.stats()["live_rows"] == 2
    assert plane.get_meta("t", ["r"], n=2, partition="p").rows == [0, 2]
    with pytest.raises(ValueError, match="row 1 does not exist"):
        plane.get_data(plane.get_meta("x", ["r"], n=1, partition="p").__class__("p", [1], ["r"]))
    with pytest.raises(ValueError, match="row 99 does not exist"):
        plane.clear_rows([0, 99])
    assert plane.stats()["live_rows"] == 2  # all-or-nothing
    assert plane.put({"r": [0.0, 0.0]}, partition="q", timeout=0.1) == [4, 5]  # room again
    assert all(1 not in col and 3 not in col for col in plane._storage._columns.values())


def test_save_load_round_trip(tmp_path):
    plane = filled()
    plane.seal(7)
    plane.ack(plane.get_meta("t", ["ids"], n=2, partition="p"))  # acknowledged: saved as consumed
    plane.save(tmp_path / "s")
    other = DataPlane(SCHEMA)
    other.load(tmp_path / "s")
    drop_calls = lambda s: {k: v for k, v in s.items() if k not in ("puts", "gets")}  # per instance
    assert drop_calls(other.stats()) == drop_calls(plane.stats())
    meta, data = other.get_batch("t", ["ids", "r"], n=1, partition="p")
    assert meta.rows == [2] and data["ids"][0].tolist() == [] and data["r"].tolist() == [3.0]
    meta, data = other.get_batch("t", ["ids", "v"], n=5, partition=7)  # sealed: short batch
    assert meta.rows == [3] and data["v"].tolist() == [[1, 2]]
    assert other.tags([0, 1]) == {"group": [0, 0]}
    assert other.put({"r": [1.0]}, partition="p") == [4]  # ids continue
    with pytest.raises(ValueError, match="schema"):
        DataPlane(Schema([Field("r", "float32")])).load(tmp_path / "s")


def test_save_refuses_unsendable_partition_names(tmp_path):
    plane = DataPlane(SCHEMA)
    plane.put({"r": [1.0]}, partition=("a", 1))
    with pytest.raises(ValueError, match="partition"):
        plane.save(tmp_path / "s")
