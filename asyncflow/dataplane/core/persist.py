"""Saved state of a data plane: ``<dir>/index.msgpack`` + ``<dir>/data*.npz``, no pickle.

* ``index.msgpack``: ``{"format": 1, "schema": [[name, dtype, shape, ragged], ...],
  "index": RowIndex.state()}`` (row ids, produced/consumed marks, tags, seals, counters).
* ``data.npz`` (in process) or ``data-<i>-of-<N>.npz`` (one per storage unit): the
  arrays of :meth:`Storage.to_arrays` (per field: row ids, flat data, ragged lengths).

Any deployment loads any saved state: it reads every ``data*.npz`` and keeps the rows it
owns, so an in-process save loads into a distributed plane and back. Files are written
to a temporary name and renamed, so a crash never leaves a half-written file.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping

import msgpack
import numpy as np

from asyncflow.dataplane.core.schema import Schema, schema_from_msg, schema_to_msg

__all__ = ["contained_path", "data_files", "load_state", "save_arrays", "save_state"]


def contained_path(root: str | os.PathLike, name: str) -> str:
    """``name`` resolved inside the folder ``root``, or ``PermissionError``.

    A relative name is taken inside ``root``; an absolute one must already lie inside it.
    ``..`` components are refused, and so is any path that leaves ``root`` once symlinks
    are resolved (a server writes or reads nothing outside its state folder)."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise ValueError(f"save/load path must be a non-empty str, got {name!r}")
    real_root = os.path.realpath(root)
    if ".." in name.replace("\\", "/").split("/"):
        raise PermissionError(f"save/load path {name!r} refused: '..' is not allowed; pass a name inside "
                              f"the data plane's state folder {real_root}")
    path = os.path.realpath(os.path.join(real_root, name))
    if os.path.commonpath([real_root, path]) != real_root:
        raise PermissionError(f"save/load path {name!r} refused: it lies outside the data plane's state "
                              f"folder {real_root}; pass a name relative to it")
    return path


def save_state(path: str | os.PathLike, schema: Schema, index_state: dict) -> None:
    """Write ``<path>/index.msgpack`` (schema + control-plane state; creates ``path``)."""
    os.makedirs(path, exist_ok=True)
    blob = msgpack.packb({"format": 1, "schema": schema_to_msg(schema), "index": index_state})
    _atomic_write(os.path.join(path, "index.msgpack"), blob)


def load_state(path: str | os.PathLike, schema: Schema) -> dict:
    """Read ``<path>/index.msgpack``; the saved schema must equal ``schema``."""
    with open(os.path.join(path, "index.msgpack"), "rb") as fh:
        blob = msgpack.unpackb(fh.read(), strict_map_key=False)
    saved = schema_from_msg(blob["schema"])
    if saved != schema:
        raise ValueError(f"{path}: saved schema {saved} differs from this data plane's {schema}")
    return blob["index"]


def save_arrays(path: str, arrays: Mapping[str, np.ndarray]) -> None:
    """``np.savez`` to ``path`` atomically (write then rename)."""
    tmp = path + ".tmp.npz"
    np.savez(tmp, **arrays)  # type: ignore[arg-type]  # numpy's stub: a ** mapping could fill allow_pickle
    os.replace(tmp, path)


def data_files(path: str | os.PathLike) -> list[str]:
    """Every ``data*.npz`` of a saved state (one per storage unit, or one in process)."""
    return sorted(glob.glob(os.path.join(glob.escape(str(path)), "data*.npz")))


def _atomic_write(path: str, blob: bytes) -> None:
    with open(path + ".tmp", "wb") as fh:
        fh.write(blob)
    os.replace(path + ".tmp", path)
