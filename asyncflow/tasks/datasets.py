"""Local datasets: JSONL (and Parquet when ``pyarrow`` is installed) with a field mapping.

A dataset is a file of rows; ``fields`` maps our names to the file's, e.g.
``{"prompt": "question", "answer": "answer"}`` (a dotted name reaches into nested objects:
``"answer": "reward_model.ground_truth"``). Every mapped field is required; ``prompt`` must
be a non-empty string; ``answer`` a string or a number (kept as its text). The whole
source row travels along as :attr:`Sample.row`, so a reward function sees it as ``sample``.

A bad row (invalid JSON, not an object, a missing or ill-typed field) either raises
:class:`DatasetError` naming the file, line (Parquet: row) and field (``on_error="raise"``,
the default), or is skipped and counted in :attr:`Dataset.skipped`, with the first few
messages kept in :attr:`Dataset.errors` (``on_error="skip"``).

Example:
    >>> ds = load_dataset("gsm8k.jsonl", {"prompt": "question", "answer": "answer"})  # doctest: +SKIP
    >>> ds.samples[0].prompt, ds.skipped  # doctest: +SKIP
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal

REQUIRED = ("prompt", "answer")
KEEP_ERRORS = 20


class DatasetError(ValueError):
    """A bad dataset file or row; one line naming the file, line or row, and the field."""


@dataclass(frozen=True)
class Sample:
    prompt: str
    answer: str
    row: dict = field(default_factory=dict, compare=False)


@dataclass
class Dataset:
    path: str
    samples: list[Sample]
    skipped: int = 0
    errors: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.samples)


def load_dataset(path: str | Path, fields: dict[str, str] | None = None,
                 on_error: Literal["raise", "skip"] = "raise") -> Dataset:
    """Read a ``.jsonl`` / ``.json`` (one object per line) or ``.parquet`` file (see module doc)."""
    p = Path(path).expanduser()
    fields = {**{k: k for k in REQUIRED}, **(fields or {})}
    if on_error not in ("raise", "skip"):
        raise DatasetError(f"on_error = {on_error!r}: use 'raise' or 'skip'")
    if not p.is_file():
        raise DatasetError(f"dataset '{p}' not found (give a local .jsonl or .parquet file)")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        rows, where = _jsonl_rows(p), "line"
    elif suffix == ".parquet":
        rows, where = _parquet_rows(p), "row"
    else:
        raise DatasetError(f"dataset '{p}': unknown format '{suffix}' (use .jsonl or .parquet)")
    ds = Dataset(str(p), [])
    for n, row in rows:
        try:
            ds.samples.append(_sample(row, fields))
        except _BadRow as e:
            msg = f"{p}:{n}: {e}" if where == "line" else f"{p}: row {n}: {e}"
            if on_error == "raise":
                raise DatasetError(msg + " (fix the row, or load with on_error='skip' to skip and count bad rows)") from None
            ds.skipped += 1
            if len(ds.errors) < KEEP_ERRORS:
                ds.errors.append(msg)
    return ds


class _BadRow(Exception):
    pass


def _jsonl_rows(p: Path) -> Iterator[tuple[int, Any]]:
    with p.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue  # blank lines (a trailing newline) are not rows
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                yield n, _BadRow(f"not valid JSON ({e.msg} at column {e.colno})")


def _parquet_rows(p: Path) -> Iterator[tuple[int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"dataset '{p}': reading Parquet needs pyarrow (pip install pyarrow)") from None
    for n, row in enumerate(pq.read_table(p).to_pylist(), 1):
        yield n, row


def _get(row: dict, dotted: str):
    cur: Any = row
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise KeyError(part)
        cur = cur[part]
    return cur


def _sample(row, fields: dict[str, str]) -> Sample:
    if isinstance(row, _BadRow):
        raise row
    if not isinstance(row, dict):
        raise _BadRow(f"expected a JSON object, got {type(row).__name__}")
    vals = {}
    for ours, theirs in fields.items():
        try:
            vals[ours] = _get(row, theirs)
        except KeyError:
            known = ", ".join(list(row)[:8])
            raise _BadRow(f"field '{theirs}' (mapped to {ours}) is missing; the row has: {known}") from None
    prompt, answer = vals["prompt"], vals["answer"]
    if not isinstance(prompt, str) or not prompt.strip():
        raise _BadRow(f"field '{fields['prompt']}' (prompt) must be a non-empty string, got {prompt!r:.40}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise _BadRow(f"field '{fields['answer']}' (answer) must be a string or a number, got {type(answer).__name__}")
    return Sample(prompt, str(answer), row)
