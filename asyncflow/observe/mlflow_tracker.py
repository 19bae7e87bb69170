"""``log.backends: [mlflow]``: an MLflow run (``pip install 'asyncflow[mlflow]'``).

The tracking URI is ``log.mlflow_uri``, by default a local file store ``file:RUN_DIR/mlruns``
(view it with ``mlflow ui --backend-store-uri RUN_DIR/mlruns``); the experiment is
``log.project``. The config goes in as params (``section.key``), each step's numbers as
metrics at that step, the summary's numbers as ``summary/...`` metrics and the whole summary
as the artifact ``summary.json``.
"""

from __future__ import annotations

import os
from pathlib import Path

from asyncflow.observe.trackers import flat, numbers_only

PARAMS_PER_CALL = 100  # MLflow's limit on params in one batch


class MlflowTracker:
    def __init__(self, run_dir: Path, project: str, uri: str | None = None):
        import mlflow  # the mlflow extra: only when asked for

        if uri is None:
            # the local file store is a maintenance-mode backend that MLflow 3 asks to opt in to
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (Path(run_dir).resolve() / "mlruns").as_uri()
        self.mlflow, self.step = mlflow, 0
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(project)
        self.run = mlflow.start_run(run_name=Path(run_dir).name)

    def log_config(self, config: dict) -> None:
        params = {k: str(v)[:500] for k, v in flat(config).items()}
        items = list(params.items())
        for i in range(0, len(items), PARAMS_PER_CALL):
            self.mlflow.log_params(dict(items[i:i + PARAMS_PER_CALL]))

    def log_metrics(self, step: int, metrics: dict) -> None:
        self.step = step
        self.mlflow.log_metrics(_keys(numbers_only(metrics)), step=step)

    def log_summary(self, summary: dict) -> None:
        self.mlflow.log_metrics(_keys(numbers_only(summary, "summary/")), step=self.step)
        self.mlflow.log_dict(summary, "summary.json")

    def close(self) -> None:
        self.mlflow.end_run()


def _keys(d: dict[str, float]) -> dict[str, float]:
    """MLflow metric names allow letters, digits, ``_ - . / `` and space: anything else becomes ``_``."""
    return {"".join(c if c.isalnum() or c in "_-./ " else "_" for c in k): v for k, v in d.items()}
