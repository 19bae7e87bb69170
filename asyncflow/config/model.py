"""The ``model`` and ``task`` sections: which model, which data (light: no torch)."""

from __future__ import annotations

import difflib
from typing import Literal

from pydantic import Field, field_validator, model_validator

from asyncflow.config.base import Section
from asyncflow.config.lora import LoraConfig


class ModelConfig(Section):
    path: str | None = Field(None, description="Local Hugging Face model folder; None = the built-in tiny model. "
                                               "Relative, in a YAML file: to that file's folder.")
    hidden_size: int = Field(128, gt=0, description="Built-in model: hidden size.")
    num_layers: int = Field(2, gt=0, description="Built-in model: transformer layers.")
    num_heads: int = Field(4, gt=0, description="Built-in model: attention heads.")
    num_kv_heads: int = Field(2, gt=0, description="Built-in model: key/value heads (GQA).")
    intermediate_size: int = Field(512, gt=0, description="Built-in model: MLP width.")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Compute precision of training and inference: float32, or bfloat16 (autocast; "
                               "float32 master weights and AdamW states).")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters through peft (r > 0: on).")

    @model_validator(mode="after")
    def _heads(self) -> ModelConfig:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads}) "
                             f"and num_heads by num_kv_heads ({self.num_kv_heads})")
        return self

    def dims(self) -> dict:
        return dict(hidden_size=self.hidden_size, num_layers=self.num_layers, num_heads=self.num_heads,
                    num_kv_heads=self.num_kv_heads, intermediate_size=self.intermediate_size)


BUILTIN_TASKS = ("addition", "countdown", "multistep", "dataset")  # asyncflow.tasks.registry.FACTORIES' keys


class TaskConfig(Section):
    name: str = Field(
        "addition", description="Built-in: 'addition' (12+34=), 'countdown' (reach a target with given numbers: "
                                "3,5,2:13=), 'multistep' (3+4*2-5=); 'dataset': prompts and answers from task.path. Or "
                                "your own: 'package.module:factory' / 'path/to/file.py:factory', factory(cfg) -> task "
                                "(a relative file in a YAML file: relative to that file's folder).")
    path: str | None = Field(None, description="dataset: local .jsonl or .parquet file, or a folder saved by "
                                               "datasets' save_to_disk, of training rows (relative, in a YAML "
                                               "file: to that file's folder; on the command line: to the "
                                               "working directory).")
    heldout_path: str | None = Field(None, description="dataset: held-out rows (None = hold out holdout_frac of path); "
                                                       "relative like path.")
    split: str = Field("train", description="dataset: the split of a DatasetDict folder at path.")
    heldout_split: str = Field("test", description="dataset: the split of a DatasetDict folder at heldout_path.")
    fields: dict[str, str] = Field(default_factory=dict,
                                   description="dataset: our field -> the file's, e.g. "
                                               "{prompt: question, answer: answer}.")
    prompt_template: str | None = Field(None, description="dataset: the prompt as a Python format string over the "
                                                          "row's fields, e.g. 'reverse {word}=' (None = the "
                                                          "prompt field).")
    on_bad_row: Literal["raise", "skip"] = Field("raise", description="dataset: stop at a bad "
                                                                      "row, or skip and count it.")
    chat_template: bool = Field(False, description="Wrap each prompt as a user message "
                                                   "with the tokenizer's chat template.")
    digits: int = Field(2, ge=1, le=4, description="Operand digits of the addition task.")
    terms: int | None = Field(None, ge=2, le=5, description="countdown: numbers given; multistep: operands "
                                                          "(None = 3 for countdown, 4 for multistep).")
    holdout_frac: float = Field(0.2, gt=0, lt=1, description="Fraction of problems held out for evaluation.")
    eval_n: int = Field(500, gt=0, description="Held-out problems scored at each evaluation.")
    test_time: bool = Field(False, description="Test-time RL (TTRL): the RL prompts are the evaluation problems "
                                               "themselves (the first eval_n held-out ones), trained without their "
                                               "labels (needs reward.mode=majority) and evaluated on; the warm-start "
                                               "still learns from task's train problems. docs/ttrl.md")

    @field_validator("name")
    @classmethod
    def _known_task(cls, v: str) -> str:
        if v in BUILTIN_TASKS or ":" in v:
            return v
        near = difflib.get_close_matches(v, BUILTIN_TASKS, n=1)
        hint = f"did you mean '{near[0]}'? " if near else ""
        raise ValueError(f"unknown task '{v}': {hint}choose {', '.join(BUILTIN_TASKS)}, or name your own as "
                         "'package.module:factory' or 'path/to/file.py:factory'")
