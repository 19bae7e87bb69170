"""The config sections of what a run reports: the held-out metric (``eval``) and where
metrics go (``log``). Light, as the rest of the config package (find_spec: nothing is imported).
"""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# backend -> (the module it needs, the extra that installs it)
TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
                    "mlflow": ("mlflow", "mlflow")}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class EvalConfig(_Section):
    metric: str | None = Field(
        None, description="Held-out metric 'package.module:fn' or 'path/to/file.py:fn' (a relative file in a YAML "
                          "file: relative to that file), called fn(prompt, response, answer) -> float and averaged; "
                          "None = exact match (addition), accuracy (a task's eval_score) or mean reward (dataset "
                          "task, reward.fn).")

    @field_validator("metric")
    @classmethod
    def _import_path(cls, v: str | None) -> str | None:
        if v is not None and (v.count(":") != 1 or not all(v.split(":"))):
            raise ValueError(f"metric = '{v}' is not an import path: write 'package.module:fn' or 'path/to/file.py:fn'")
        return v


Backend = Literal["jsonl", "tensorboard", "wandb", "mlflow"]


class LogConfig(_Section):
    backends: list[Backend] = Field(
        default_factory=lambda: list[Backend](["jsonl"]),
        description="Where the config, per-step metrics and summary go: jsonl (metrics.jsonl), tensorboard "
                    "(RUN_DIR/tensorboard), wandb (offline, RUN_DIR/wandb), mlflow (mlflow_uri). Each but jsonl is "
                    "an extra: pip install 'asyncflow[tensorboard]' / '[wandb]' / '[mlflow]'.")
    project: str = Field("asyncflow", description="wandb: the project; mlflow: the experiment.")
    mlflow_uri: str | None = Field(None, description="mlflow: tracking URI (None = a local file store, "
                                                     "file:RUN_DIR/mlruns).")

    @field_validator("backends", mode="before")
    @classmethod
    def _one_or_many(cls, v: object) -> object:
        return [b.strip() for b in v.split(",") if b.strip()] if isinstance(v, str) else v  # log.backends=a,b

    @model_validator(mode="after")
    def _installed(self) -> LogConfig:
        for b in self.backends:
            module, extra = TRACKER_PACKAGES.get(b, (None, None))
            if module and importlib.util.find_spec(module) is None:
                raise ValueError(f"backends: {b} needs the {module} package, which is not installed: "
                                 f"pip install 'asyncflow[{extra}]', or drop {b} from log.backends")
        return self
