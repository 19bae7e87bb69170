"""``log.backends: [wandb]``: a Weights & Biases run in offline mode under ``RUN_DIR/wandb``
(``pip install 'asyncflow[wandb]'``). Nothing goes over the network; upload it later with
``wandb sync RUN_DIR/wandb/offline-run-*``. The project is ``log.project``; the summary's
numbers go in the run summary as ``summary/...`` (beside the last step's values).
"""

from __future__ import annotations

import os
from pathlib import Path

from asyncflow.observe.trackers import numbers_only


class WandbTracker:
    def __init__(self, run_dir: Path, project: str):
        import wandb  # the wandb extra: only when asked for

        os.environ["WANDB_MODE"] = "offline"  # (also for wandb's own service process)
        self.wandb = wandb
        self.run = wandb.init(project=project, dir=str(run_dir), mode="offline", name=Path(run_dir).name,
                              settings=wandb.Settings(console="off", silent=True))

    def log_config(self, config: dict) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log_metrics(self, step: int, metrics: dict) -> None:
        self.run.log(numbers_only(metrics), step=step)

    def log_summary(self, summary: dict) -> None:
        self.run.summary.update(numbers_only(summary, "summary/"))  # (a step's "samples" is not the run's)

    def close(self) -> None:
        self.run.finish()
