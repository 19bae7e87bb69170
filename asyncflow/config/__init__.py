"""Typed configuration (:mod:`~asyncflow.config.schema`) and its loading (:mod:`~asyncflow.config.load`).

Every field is documented in the schema and nowhere else (``docs/configuration.md`` is
generated from it); ``asyncflow train --dry-run`` prints the resolved config. This package
must stay light: it imports no torch (the CLI parses configs before any heavy import).
"""

from asyncflow.config.load import dump_config, load_config
from asyncflow.config.outputs import EvalConfig, LogConfig
from asyncflow.config.schema import (
    BUILTIN_TASKS,
    AlgorithmConfig,
    ConfigError,
    ModelConfig,
    ResourcesConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    TaskConfig,
    TrainConfig,
    WarmStartConfig,
    engine_installed,
)

__all__ = [
    "BUILTIN_TASKS", "AlgorithmConfig", "ConfigError", "EvalConfig", "LogConfig", "ModelConfig", "ResourcesConfig",
    "RewardConfig", "RolloutConfig", "RunConfig", "TaskConfig", "TrainConfig", "WarmStartConfig", "dump_config",
    "engine_installed", "load_config",
]
