"""The ``model.lora`` section: low-rank adapters trained through ``peft`` on a frozen base (light: no torch).

``r`` set (> 0) turns LoRA on: the trainer optimises the adapters only, each weight sync ships
only them, checkpoints hold them and their optimizer state, and the end of a run writes a
PEFT adapter folder (``asyncflow/engines/lora.py`` has the design). :func:`check_lora` holds
the checks across sections, called by ``RunConfig``'s validator.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from pydantic import Field, field_validator

from asyncflow.config.base import Section

if TYPE_CHECKING:  # (the schema imports this module)
    from asyncflow.config.schema import RunConfig


class LoraConfig(Section):
    r: int | None = Field(0, ge=0, description="LoRA rank: the trainer optimises rank-r adapters B A of the "
                          "target modules on a frozen base, and each weight sync ships only them. 0 or null = off "
                          "(full fine-tuning). Needs the [lora] extra (peft).")
    alpha: int = Field(16, gt=0, description="The adapters' scale numerator: a module's weight is "
                                                 "W0 + (alpha / r) B A.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input while training "
                                                        "(log-probs, rollout and evaluation run without).")
    target_modules: list[str] | str = Field(
        "all-linear", description="Modules that get adapters: 'all-linear' (every linear layer but the LM head), "
                                  "or names such as [q_proj, v_proj] (peft's target_modules).")
    merged: bool = Field(False, description="Also write checkpoint/merged/ in the run folder: a whole model folder "
                                            "with the adapters merged into the base (checkpoint/ itself is the PEFT "
                                            "adapter folder either way).")

    @field_validator("target_modules")
    @classmethod
    def _some(cls, v: list[str] | str) -> list[str] | str:
        if not v:
            raise ValueError("target_modules is empty: name the modules to adapt (e.g. [q_proj, v_proj]) "
                             "or write 'all-linear'")
        return v

    @property
    def on(self) -> bool:
        return bool(self.r)


def check_lora(cfg: RunConfig) -> None:
    """The checks of a run with ``model.lora.r > 0`` (one line each, naming the fields and the fix)."""
    if importlib.util.find_spec("peft") is None:
        raise ValueError("model.lora.r > 0 needs peft: pip install -c constraints.txt -e '.[lora]'")
    if cfg.rollout.engine != "builtin":
        raise ValueError(f"model.lora with rollout.engine={cfg.rollout.engine}: adapters are merged into the "
                         f"built-in engine's weights only so far; set rollout.engine=builtin")
    if cfg.train.dp > 1 and cfg.train.strategy == "fsdp":
        raise ValueError("model.lora with train.strategy=fsdp is not wired yet (FSDP's gathered copy on rank 0 and "
                         "its sharded checkpoints take whole weights, not adapters); use train.strategy=ddp")
    if cfg.train.tp > 1:
        raise ValueError(f"model.lora with train.tp={cfg.train.tp} is not wired yet (the tensor-parallel plan shards "
                         f"the linear layers that peft wraps); set train.tp=1")
    if cfg.algorithm.name == "ppo":
        raise ValueError("model.lora with algorithm.name=ppo: the critic (a copy of the policy) has no adapters of "
                         "its own yet; use a critic-free estimator (algorithm.name=grpo, rloo, ...) with LoRA")
