"""Local datasets: JSONL, Parquet and Hugging Face ``save_to_disk`` folders, with a field mapping.

Formats, chosen by the path: ``.jsonl``/``.json``/``.ndjson`` (one object per line),
``.parquet``, or a folder written by ``datasets.Dataset.save_to_disk`` /
``DatasetDict.save_to_disk``. The folder is read with pyarrow alone (the ``datasets``
library is not needed): a ``Dataset`` folder holds ``state.json`` (its ``_data_files``
list the shards, in order), ``dataset_info.json`` and ``data-XXXXX-of-YYYYY.arrow``
shards in Arrow IPC *stream* format; a ``DatasetDict`` folder holds ``dataset_dict.json``
(``{"splits": [...]}``) and one ``Dataset`` folder per split, of which ``split`` picks one
(a split's subfolder may also be given directly). Parquet and Arrow rows are numbered from
1 across all shards, in file order.

A dataset is a sequence of rows; ``fields`` maps our names to the file's, e.g.
``{"prompt": "question", "answer": "answer"}`` (a dotted name reaches into nested objects:
``"answer": "reward_model.ground_truth"``). Every mapped field is required; ``prompt`` must
be a non-empty string; ``answer`` a string or a number (kept as its text). The whole
source row travels along as :attr:`Sample.row`, so a reward function sees it as ``sample``.
With a ``template`` (``task.prompt_template``), the prompt is ``template.format_map(row)``
(e.g. ``"reverse {word}="``) instead of a field: a field it names that a row lacks is a bad row.

A bad row (invalid JSON, not an object, a missing or ill-typed field) either raises
:class:`DatasetError` naming the file, line (Parquet, Arrow: row) and field (``on_error="raise"``,
the default), or is skipped and counted in :attr:`Dataset.skipped`, with the first few
messages kept in :attr:`Dataset.errors` (``on_error="skip"``).

Example:
    >>> ds = load_dataset("gsm8k.jsonl", {"prompt": "question", "answer": "answer"})  # doctest: +SKIP
    >>> ds.samples[0].prompt, ds.skipped  # doctest: +SKIP
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

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
                 on_error: Literal["raise", "skip"] = "raise", split: str = "train",
                 skip_hint: str = "load with on_error='skip'", template: str | None = None) -> Dataset:
    """Read a ``.jsonl`` / ``.json`` (one object per line) or ``.parquet`` file, or a
    ``save_to_disk`` folder (``split`` picks a ``DatasetDict``'s split; see module doc).
    ``skip_hint``: how the caller's user skips bad rows, named in a bad row's error.
    ``template``: the prompt is ``template.format_map(row)`` rather than a field."""
    p = Path(path).expanduser()
    fields = {**{k: k for k in REQUIRED}, **(fields or {})}
    if template is not None:
        fields.pop("prompt", None)
    if on_error not in ("raise", "skip"):
        raise DatasetError(f"on_error = {on_error!r}: use 'raise' or 'skip'")
    if not p.exists():
        raise DatasetError(f"dataset '{p}' not found (give a local .jsonl or .parquet file, "
                           f"or a folder saved by datasets' save_to_disk)")
    suffix = p.suffix.lower()
    if p.is_dir():
        p, shards = _hf_folder(p, split)
        rows, where = _arrow_rows(shards), "row"
    elif suffix in (".jsonl", ".json", ".ndjson"):
        rows, where = _jsonl_rows(p), "line"
    elif suffix == ".parquet":
        rows, where = _parquet_rows(p), "row"
    else:
        raise DatasetError(f"dataset '{p}': unknown format '{suffix}' (use .jsonl, .parquet "
                           f"or a save_to_disk folder)")
    ds = Dataset(str(p), [])
    for n, row in rows:
        try:
            ds.samples.append(_sample(row, fields, template))
        except _BadRow as e:
            msg = f"{p}:{n}: {e}" if where == "line" else f"{p}: row {n}: {e}"
            if on_error == "raise":
                raise DatasetError(
                    msg + f" (fix the row, or {skip_hint} to skip and count bad rows)") from None
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
        import pyarrow.parquet as pq  # lazy: pyarrow, an optional dependency
    except ImportError:
        raise DatasetError(f"dataset '{p}': reading Parquet needs pyarrow (pip install pyarrow)") from None
    yield from enumerate(pq.read_table(p).to_pylist(), 1)


def _read_json(p: Path) -> Any:
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DatasetError(f"dataset '{p}': unreadable JSON ({e}); re-save the dataset with save_to_disk") from None


def _hf_folder(p: Path, split: str) -> tuple[Path, list[Path]]:
    """The ``Dataset`` folder to read (a ``DatasetDict``'s ``split``) and its shards, in order."""
    if (p / "dataset_dict.json").is_file():
        splits = _read_json(p / "dataset_dict.json").get("splits") or \
            sorted(d.name for d in p.iterdir() if (d / "state.json").is_file())
        if split not in splits:
            raise DatasetError(f"dataset '{p}': split '{split}' not found; available: {', '.join(splits)} "
                               f"(set task.split / task.heldout_split to one of them)")
        p = p / split
    if not (p / "state.json").is_file():
        raise DatasetError(f"dataset '{p}': a folder must be saved by datasets' save_to_disk "
                           f"(no state.json or dataset_dict.json in it)")
    state = _read_json(p / "state.json")
    names = [f["filename"] for f in state.get("_data_files", []) if isinstance(f, dict) and "filename" in f]
    shards = [p / n for n in names] or sorted(p.glob("*.arrow"))
    missing = [s.name for s in shards if not s.is_file()]
    if not shards or missing:
        raise DatasetError(f"dataset '{p}': shard {', '.join(missing) or '*.arrow'} missing "
                           f"(state.json lists the data files; re-save the dataset with save_to_disk)")
    return p, shards


def _arrow_rows(shards: list[Path]) -> Iterator[tuple[int, Any]]:
    try:
        import pyarrow as pa  # lazy: pyarrow, an optional dependency
        import pyarrow.ipc as ipc  # lazy: pyarrow
    except ImportError:
        raise DatasetError(f"dataset '{shards[0].parent}': reading save_to_disk folders needs pyarrow "
                           f"(pip install pyarrow)") from None
    n = 0
    for shard in shards:
        try:
            with pa.memory_map(str(shard)) as source:
                table = ipc.open_stream(source).read_all()
        except (pa.ArrowInvalid, OSError) as e:
            raise DatasetError(f"dataset shard '{shard}': not an Arrow stream file ({e}); "
                               f"re-save the dataset with save_to_disk") from None
        for row in table.to_pylist():
            n += 1
            yield n, row


def _get(row: dict, dotted: str) -> Any:
    cur: Any = row
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise KeyError(part)
        cur = cur[part]
    return cur


def _prompt(row: dict, template: str) -> str:
    try:
        return template.format_map(row)
    except KeyError as e:
        known = ", ".join(list(row)[:8])
        raise _BadRow(f"field {e} named by task.prompt_template is missing; the row has: {known}") from None
    except (ValueError, IndexError, AttributeError) as e:
        raise _BadRow(f"task.prompt_template = {template!r} cannot be filled in ({e})") from None


def _sample(row: Any, fields: dict[str, str], template: str | None = None) -> Sample:
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
    prompt, answer = _prompt(row, template) if template is not None else vals["prompt"], vals["answer"]
    if not isinstance(prompt, str) or not prompt.strip():
        raise _BadRow(f"field '{fields.get('prompt', 'prompt_template')}' (prompt) must be a non-empty string, "
                      f"got {prompt!r:.40}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise _BadRow(f"field '{fields['answer']}' (answer) must be a string or a number, got {type(answer).__name__}")
    return Sample(prompt, str(answer), row)
