"""The ``warmstart`` config section: the SFT warm-start before RL (run by
:mod:`asyncflow.tasks.warmstart`, cached by data, model and recipe). Light, as the rest of the
config package.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class WarmStartConfig(_Section):
    enabled: bool = Field(True, description="Run a short SFT warm-start of the built-in model before RL, on the "
                                            "task's reference answers (a dataset task without answers skips it).")
    model_folder: bool = Field(False, description="Warm-start a model.path folder too (off: RL starts from the folder "
                                                  "as it is). Cached by data, folder contents and recipe.")
    target_acc: float = Field(0.65, gt=0, le=1, description="Stop SFT when the held-out metric (the one RL reports: "
                                                            "exact match, accuracy, mean reward or eval.metric) "
                                                            "reaches this.")
    cache_dir: str = Field("~/.cache/asyncflow/warmstart", description="Warm-started models are cached here.")
    warmup_steps: int = Field(0, ge=0, description="SFT learning-rate warmup steps (0 = none). 200 makes the "
                                                   "warm-start's length steadier across seeds; see docs/benchmarks.md.")
    near_every: int | None = Field(None, gt=0, description="Evaluate every N SFT steps once an evaluation reached half "
                                                           "the target, to stop closer to it (None = every 50).")
    land_every: int | None = Field(1, gt=0, description="An evaluation > 3 points past the target rewinds to the one "
                                   "before and replays, checking every N steps (None = stop where it overshot).")
    lr: float | None = Field(None, gt=0, description="SFT learning rate (None = the built-in recipe's, 1e-3).")
    traces: str | None = Field(None, description="Multi-turn SFT (with env): 'package.module:fn' or "
                                                 "'path/to/file.py:fn', fn(prompt, answer) -> the conversation that "
                                                 "solves a training problem (chat messages with tool calls and tool "
                                                 "results, or {messages: ..., tools: ...}); SFT trains the "
                                                 "assistant's tokens only, and the held-out metric runs episodes.")

    @field_validator("traces")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        if v is not None and (v.count(":") != 1 or not all(v.split(":"))):
            raise ValueError(f"traces = '{v}' is not an import path: write 'package.module:fn' or 'path/to/file.py:fn'")
        return v
