"""Light checks that the code files a config names exist (no imports of user code, no torch).

``asyncflow train --dry-run`` runs them, so a ``reward.fn`` file that is not there is found
before a run is even tried; ``asyncflow train`` runs them too, and later imports the code
(:mod:`asyncflow.tasks.plugins`). Data files and model folders are not checked here: a
script often makes them just before the run (the examples' ``make_data.py``); ``train`` checks
them in full before any worker starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from asyncflow.config.base import ConfigError

if TYPE_CHECKING:  # (the schema does not import this module)
    from asyncflow.config.schema import RunConfig

RELATIVE = ("a relative path is relative to the folder of the YAML file that gives it, or on the command line to "
            "the directory asyncflow runs in")


def missing_code_file(what: str, spec: str, path: Path) -> str:
    """The one-line message for a ``file.py:name`` whose file is not there."""
    return f"{what} = '{spec}': no such file '{path}' ({RELATIVE})"


def check_files(cfg: RunConfig) -> None:
    """Raise :class:`ConfigError` for the first ``file.py:name`` of ``cfg`` whose file does not exist."""
    for what, spec in (("reward.fn", cfg.reward.fn), ("task.name", cfg.task.name), ("eval.metric", cfg.eval.metric)):
        target = (spec or "").rpartition(":")[0]
        if spec and target.endswith(".py") and not Path(target).expanduser().is_file():
            raise ConfigError(missing_code_file(what, spec, Path(target).expanduser()))
