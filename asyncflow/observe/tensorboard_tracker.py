"""``log.backends: [tensorboard]``: event files in ``RUN_DIR/tensorboard`` (``pip install 'asyncflow[tensorboard]'``).

Per-step numbers are scalars under their metric names; the config is a text entry
(``config``, YAML-like JSON) and the summary both a text entry (``summary``) and scalars
under ``summary/...`` at the last step. View with ``tensorboard --logdir RUN_DIR/tensorboard``.
"""

from __future__ import annotations

import json
from pathlib import Path

from asyncflow.observe.trackers import numbers_only


class TensorBoardTracker:
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # torch + the tensorboard extra: only when asked for

        self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        self.step = 0

    def log_config(self, config: dict) -> None:
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```")

    def log_metrics(self, step: int, metrics: dict) -> None:
        self.step = step
        for k, v in numbers_only(metrics).items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def log_summary(self, summary: dict) -> None:
        self.writer.add_text("summary", "```\n" + json.dumps(summary, indent=2, default=str) + "\n```")
        for k, v in numbers_only(summary, "summary/").items():
            self.writer.add_scalar(k, v, self.step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
