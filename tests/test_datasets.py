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
