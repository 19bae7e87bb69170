"""The base of every config section: unknown keys are refused, assignments validated."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A user mistake in a config file or override. The message is one line."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
