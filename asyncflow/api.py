"""The public entry point: :func:`train` a job from a :class:`~asyncflow.config.RunConfig`.

It resolves what must be settled before the driver runs, in this order: ``plan: auto``
(profile or reuse the cached profile, search, apply: :mod:`asyncflow.planner.auto`), the
device (``resources.device`` must exist where the roles run), and the launcher
(``launcher``: ``local`` or ``ray``, unless one is passed in). Then the driver loop
(:func:`asyncflow.workflow.driver.train`) runs the job. This module sits at the top of the
layers (with the CLI): it may import every package below it.
"""

from __future__ import annotations

from pathlib import Path

from asyncflow.config import RunConfig
from asyncflow.launch.local import LocalLauncher
from asyncflow.launch.registry import get_launcher
from asyncflow.planner.auto import resolve  # light: it imports the profiler's torch only when it profiles
from asyncflow.planner.check import annotate
from asyncflow.workflow import driver
from asyncflow.workflow.checkpoint import check_resume
from asyncflow.workflow.launcher import Launcher


def train(cfg: RunConfig, launcher: Launcher | None = None, run_dir: Path | None = None,
          evaluate: bool = True, resume: str | Path | None = None) -> dict:
    """Run one job; return its summary (also written to ``<run_dir>/summary.json``).

    ``launcher``: None starts the one ``cfg.launcher`` names and shuts it down at the end;
    a launcher passed in is left running (several jobs may share one). ``resume``: a run
    folder to continue from its latest checkpoint (``cfg`` must be its ``config.yaml``,
    ``train.steps`` excepted: :mod:`asyncflow.workflow.checkpoint`). A lost worker or a
    stalled step restarts the job from its checkpoint (``train.max_restarts``: the driver).
    """
    if resume is not None:
        check_resume(cfg, Path(resume))
        run_dir = Path(resume)
    if cfg.plan == "auto":
        cfg, text = resolve(cfg)
        print(text, flush=True)
    if cfg.resources.device != "cpu" and cfg.launcher == "local" and launcher is None:
        LocalLauncher.check_device(cfg.resources.device)  # before a warm-start, not after it
    owns = launcher is None
    launcher = launcher or get_launcher(cfg.launcher)
    try:  # (the summary gets the planner's prediction for this config beside what the run measured)
        return driver.train(cfg, launcher, run_dir, evaluate, resume=resume is not None,
                            annotate=annotate(cfg, launcher.cpus, evaluate))
    finally:
        if owns:
            launcher.shutdown()
