"""Where a run's metrics go (``log.backends``): the :class:`Tracker` protocol and its fan-out.

Every backend gets the run's config once (:meth:`Tracker.log_config`), each step's metrics
(:meth:`Tracker.log_metrics`) and the end-of-run summary (:meth:`Tracker.log_summary`).
``jsonl`` is ``RUN_DIR/metrics.jsonl`` (one JSON object per step; the config and the summary
are ``config.yaml`` and ``summary.json`` beside it, written by the driver). The others are
optional extras, each written through its own library in a module of its own:
``tensorboard`` (:mod:`~asyncflow.observe.tensorboard_tracker`), ``wandb`` (offline,
:mod:`~asyncflow.observe.wandb_tracker`), ``mlflow`` (:mod:`~asyncflow.observe.mlflow_tracker`).
A missing package is caught earlier, at config validation (:class:`asyncflow.config.LogConfig`).
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol


class Tracker(Protocol):
    def log_config(self, config: dict) -> None: ...

    def log_metrics(self, step: int, metrics: dict) -> None: ...

    def log_summary(self, summary: dict) -> None: ...

    def close(self) -> None: ...


class JsonlTracker:
    """``metrics.jsonl``: one JSON line per step, flushed at once (config and summary: the driver's files)."""

    def __init__(self, run_dir: Path, append: bool = False):
        self.file = (Path(run_dir) / "metrics.jsonl").open("a" if append else "w")  # append: a resumed run

    def log_config(self, config: dict) -> None:
        pass  # config.yaml

    def log_metrics(self, step: int, metrics: dict) -> None:
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()

    def log_summary(self, summary: dict) -> None:
        pass  # summary.json

    def close(self) -> None:
        self.file.close()


class Trackers:
    """All of a run's trackers as one (calls each in turn; ``close`` closes every one)."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    def log_config(self, config: dict) -> None:
        for t in self.trackers:
            t.log_config(config)

    def log_metrics(self, step: int, metrics: dict) -> None:
        for t in self.trackers:
            t.log_metrics(step, metrics)

    def log_summary(self, summary: dict) -> None:
        for t in self.trackers:
            t.log_summary(summary)

    def close(self) -> None:
        for t in self.trackers:
            t.close()


def open_trackers(backends: Sequence[str], run_dir: Path, project: str = "asyncflow",
                  mlflow_uri: str | None = None, append: bool = False) -> Trackers:
    """One tracker per backend name, writing under ``run_dir`` (``append``: to ``metrics.jsonl``, a resumed run)."""
    out: list[Tracker] = []
    for name in backends:
        if name == "jsonl":
            out.append(JsonlTracker(run_dir, append))
        elif name == "tensorboard":
            from asyncflow.observe.tensorboard_tracker import TensorBoardTracker  # optional extra

            out.append(TensorBoardTracker(run_dir))
        elif name == "wandb":
            from asyncflow.observe.wandb_tracker import WandbTracker  # optional extra

            out.append(WandbTracker(run_dir, project))
        elif name == "mlflow":
            from asyncflow.observe.mlflow_tracker import MlflowTracker  # optional extra

            out.append(MlflowTracker(run_dir, project, mlflow_uri))
        else:
            raise ValueError(f"unknown log backend {name!r}")
    return Trackers(out)


def _leaves(d: dict, sep: str, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(key, value)`` of every non-dict value of a nested dict, keys joined with ``sep``."""
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _leaves(v, sep, f"{prefix}{k}{sep}")
        else:
            yield f"{prefix}{k}", v


def numbers_only(d: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of a nested dict as a flat ``{"a/b": float}`` (strings, lists and None are left out)."""
    return {k: float(v) for k, v in _leaves(d, "/", prefix) if isinstance(v, numbers.Real)}


def flat(d: dict) -> dict[str, Any]:
    """A nested config as ``{"section.key": value}`` (values as their JSON text when not scalars)."""
    return {k: v if isinstance(v, (str, int, float, bool)) or v is None else json.dumps(v)
            for k, v in _leaves(d, ".")}
