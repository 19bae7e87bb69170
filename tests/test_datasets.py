"""Local datasets: field mapping, nested fields, bad rows raise with file/line/field or are skipped and counted."""

from __future__ import annotations

import json

import pytest

from asyncflow.tasks.datasets import DatasetError, Sample, load_dataset

GOOD = [{"question": "1+1?", "answer": "2", "id": 0},
        {"question": "2+3?", "answer": 5, "id": 1},
        {"question": "nested?", "meta": {"gt": "7"}, "answer": "x", "id": 2}]


def _write(tmp_path, lines, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return p


def test_jsonl_with_field_mapping(tmp_path):
    ds = load_dataset(_write(tmp_path, GOOD), {"prompt": "question"})
    assert [s.prompt for s in ds.samples] == ["1+1?", "2+3?", "nested?"]
    assert [s.answer for s in ds.samples] == ["2", "5", "x"]  # numbers kept as text
    assert ds.samples[1].row["id"] == 1 and ds.skipped == 0 and len(ds) == 3
    nested = load_dataset(_write(tmp_path, GOOD[2:]), {"prompt": "question", "answer": "meta.gt"})
    assert nested.samples == [Sample("nested?", "7")]


@pytest.mark.parametrize("bad, line, words", [
    ('{"question": "a", "answer": ', 2, ["not valid JSON"]),
    ('[1, 2]', 2, ["expected a JSON object", "list"]),
    ('{"q": "a", "answer": "1"}', 2, ["field 'question' (mapped to prompt) is missing", "q"]),
    ('{"question": "", "answer": "1"}', 2, ["field 'question' (prompt) must be a non-empty string"]),
    ('{"question": "a", "answer": [1]}', 2, ["field 'answer' (answer) must be a string or a number", "list"]),
])
def test_bad_row_names_file_line_and_field(tmp_path, bad, line, words):
    p = _write(tmp_path, [GOOD[0], bad, GOOD[1]])
    with pytest.raises(DatasetError) as e:
        load_dataset(p, {"prompt": "question"})
    msg = str(e.value)
    assert msg.startswith(f"{p}:{line}: ") and "\n" not in msg and "on_error='skip'" in msg
    assert all(w in msg for w in words), msg


def test_bad_rows_skipped_and_counted(tmp_path):
    p = _write(tmp_path, [GOOD[0], "{oops", "", '{"answer": 1}', GOOD[1]])  # blank line is not a row
    ds = load_dataset(p, {"prompt": "question"}, on_error="skip")
    assert len(ds) == 2 and ds.skipped == 2
    assert ds.errors[0].startswith(f"{p}:2: ") and ds.errors[1].startswith(f"{p}:4: ")


def test_file_level_errors(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        load_dataset(tmp_path / "missing.jsonl")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match="unknown format '.csv'"):
        load_dataset(tmp_path / "d.csv")


def test_parquet_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"question": ["1+1?", None, "3+4?"], "answer": ["2", "9", "7"]}), p)
    ds = load_dataset(p, {"prompt": "question"}, on_error="skip")
    assert [s.answer for s in ds.samples] == ["2", "7"] and ds.skipped == 1
    assert ds.errors[0].startswith(f"{p}: row 2: field 'question' (prompt)")


# --------------------------------------------------------------------------- Hugging Face save_to_disk folders


def save_to_disk(folder, columns: dict, shards: int = 1):
    """Write ``columns`` as ``datasets.Dataset.save_to_disk`` does, with pyarrow only:
    ``data-XXXXX-of-YYYYY.arrow`` shards in Arrow IPC stream format, ``dataset_info.json``
    and ``state.json`` (whose ``_data_files`` list the shards in order)."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.ipc as ipc

    folder.mkdir(parents=True)
    table = pa.table(columns)
    per = -(-table.num_rows // shards)
    files = []
    for i in range(shards):
        name = f"data-{i:05d}-of-{shards:05d}.arrow"
        with pa.OSFile(str(folder / name), "wb") as sink, ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table.slice(i * per, per))
        files.append({"filename": name})
    (folder / "dataset_info.json").write_text(json.dumps(
        {"citation": "", "description": "", "homepage": "", "license": "",
         "features": {c: {"dtype": "string", "_type": "Value"} for c in columns}}))
    (folder / "state.json").write_text(json.dumps(
        {"_data_files": files, "_fingerprint": "0123abcd", "_format_columns": None, "_format_kwargs": {},
         "_format_type": None, "_output_all_columns": False, "_split": None}))
    return folder


def save_dict_to_disk(folder, splits: dict):
    """``DatasetDict.save_to_disk``: ``dataset_dict.json`` and one Dataset folder per split."""
    for name, columns in splits.items():
        save_to_disk(folder / name, columns)
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))
    return folder


def test_save_to_disk_folder_shards_in_order_with_mapping_and_bad_rows(tmp_path):
    q = ["1+1?", "2+3?", None, "4+4?", "5+0?"]  # row 3 has no prompt
    folder = save_to_disk(tmp_path / "ds", {"question": q, "meta": [{"gt": str(i)} for i in range(5)],
                                            "answer": ["2", "5", "x", "8", "5"]}, shards=2)
    assert sorted(p.name for p in folder.iterdir()) == [
        "data-00000-of-00002.arrow", "data-00001-of-00002.arrow", "dataset_info.json", "state.json"]
    ds = load_dataset(folder, {"prompt": "question", "answer": "meta.gt"}, on_error="skip")
    assert [(s.prompt, s.answer) for s in ds.samples] == [("1+1?", "0"), ("2+3?", "1"), ("4+4?", "3"), ("5+0?", "4")]
    assert ds.samples[3].row == {"question": "5+0?", "meta": {"gt": "4"}, "answer": "5"}  # row from shard 2
    assert ds.skipped == 1 and ds.errors[0].startswith(f"{folder}: row 3: field 'question' (prompt)")
    with pytest.raises(DatasetError, match=rf"^{folder}: row 3: field 'question' \(prompt\).*on_error='skip'"):
        load_dataset(folder, {"prompt": "question"})


def test_dataset_dict_folder_splits(tmp_path):
    folder = save_dict_to_disk(tmp_path / "dd", {
        "train": {"prompt": ["a", "b", "c"], "answer": ["1", "2", "3"]},
        "test": {"prompt": ["z"], "answer": ["9"]}})
    assert [s.prompt for s in load_dataset(folder).samples] == ["a", "b", "c"]  # default split: train
    assert load_dataset(folder, split="test").samples == [Sample("z", "9")]
    assert load_dataset(folder / "test").samples == [Sample("z", "9")]  # a split's folder directly
    with pytest.raises(DatasetError) as e:
        load_dataset(folder, split="validation")
    msg = str(e.value)
    assert "split 'validation' not found; available: train, test" in msg and "task.split" in msg and "\n" not in msg


def test_save_to_disk_folder_errors(tmp_path):
    pa = pytest.importorskip("pyarrow")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match=r"empty': a folder must be saved by datasets' save_to_disk"):
        load_dataset(tmp_path / "empty")
    folder = save_to_disk(tmp_path / "ds", {"prompt": ["a"], "answer": ["1"]})
    shard = folder / "data-00000-of-00001.arrow"
    with pa.OSFile(str(shard), "wb") as sink, pa.ipc.new_file(sink, pa.schema([("prompt", pa.string())])) as w:
        w.write_table(pa.table({"prompt": ["a"]}))  # IPC *file* format: not what save_to_disk writes
    with pytest.raises(DatasetError, match=r"data-00000-of-00001.arrow': not an Arrow stream file"):
        load_dataset(folder)
    shard.unlink()
    with pytest.raises(DatasetError, match=r"shard data-00000-of-00001.arrow missing"):
        load_dataset(folder)


def test_dataset_task_reads_train_and_test_splits_of_one_folder(tmp_path):
    from asyncflow.config import load_config
    from asyncflow.tasks.registry import build_task

    folder = save_dict_to_disk(tmp_path / "dd", {
        "train": {"q": ["1+1=", "2+2=", "3+3="], "a": ["2", "4", "6"]},
        "test": {"q": ["4+4="], "a": ["8"]}})
    cfg = load_config(None, ["task.name=dataset", f"task.path={folder}", f"task.heldout_path={folder}",
                             "task.fields={prompt: q, answer: a}", "model.path=/unused"])
    task = build_task(cfg)
    assert [s.answer for s in task.train] == ["2", "4", "6"] and [s.answer for s in task.heldout] == ["8"]
