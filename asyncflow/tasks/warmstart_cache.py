"""The warm-start cache: its key (data, model, recipe) and its entries on disk.

An entry is a folder named by the first 16 hex digits of the SHA-256 of the recipe (JSON,
sorted keys): ``save_pretrained`` model and tokenizer plus ``info.json``. It is written to
a temp folder and moved into place with ``os.replace``, so a folder that exists is
complete. A model folder enters the key through :func:`folder_digest` (its files' names
and contents), so retraining or editing the folder starts a new entry.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from asyncflow.engines.tiny import tiny_config
from asyncflow.tasks.layout import load_tokenizer

HASH_WHOLE = 256 << 20  # files up to this size are hashed whole; bigger ones by name, size and mtime


def folder_digest(folder: Path) -> dict[str, str]:
    """``{"digest": sha256 of the folder's files' names and contents}`` (top level; not its path)."""
    h = hashlib.sha256()
    for f in sorted(p for p in folder.iterdir() if p.is_file()):
        st = f.stat()
        h.update(f.name.encode() + b"\0")
        if st.st_size <= HASH_WHOLE:
            h.update(f.read_bytes())
        else:
            h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return {"digest": h.hexdigest()[:16]}


def resolved_dims(model_dims: dict[str, int]) -> dict[str, int]:
    """``model_dims`` with tiny_config's defaults filled in, so ``{}`` and explicit
    defaults hash to the same key; unknown names fail here, not deep inside SFT."""
    defaults = {
        name: p.default
        for name, p in inspect.signature(tiny_config).parameters.items()
        if name != "tokenizer"
    }
    unknown = set(model_dims) - set(defaults)
    if unknown:
        raise ValueError(f"unknown model_dims {sorted(unknown)}; valid names: {sorted(defaults)}")
    return {**defaults, **model_dims}


def cache_key(recipe: dict[str, Any]) -> str:
    blob = json.dumps(recipe, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def save_entry(
    folder: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, info: dict[str, Any]
) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "info.json").write_text(json.dumps(info, indent=2, sort_keys=True))
        os.replace(tmp, folder)
    except OSError:
        # A concurrent run may have published the same key first (os.replace cannot
        # overwrite a non-empty folder); its entry is equivalent, so keep it.
        if not (folder / "info.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_entry(folder: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, dict[str, Any]]:
    info = json.loads((folder / "info.json").read_text())
    tokenizer = load_tokenizer(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    return model.eval(), tokenizer, {**info, "path": str(folder), "cached": True}
