"""The ``rollout`` and ``reward`` sections: how answers are generated and scored (light: no torch)."""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import Field, model_validator

from asyncflow.config.base import Section


class RolloutConfig(Section):
    group_size: int = Field(8, ge=2, description="Answers sampled per prompt (GRPO group).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (also used by the trainer's log-probs).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    max_new_tokens: int = Field(8, gt=0, description="Longest answer, in tokens.")
    max_batch: int = Field(128, gt=0, description="Continuous-batching slots of one rollout worker (a decode step of "
                                                  "the tiny model costs about the same for 64 or 128 rows on a CPU).")
    recompute_on_swap: bool = Field(True, description="At a weight swap, rebuild the KV cache of "
                                                      "unfinished answers under the new weights.")
    engine: Literal["builtin", "hf_paged", "vllm", "sglang"] = Field(
        "builtin", description="Inference engine of the rollout role: builtin (torch, any device), hf_paged "
                               "(transformers' continuous batching with a paged KV cache, any device, mode=stream or "
                               "async), vllm or sglang (optional extras for CUDA machines: pip install "
                               "'asyncflow[vllm]' / '[sglang]').")
    cuda_graphs: bool = Field(True, description="builtin engine on a CUDA GPU: replay each decode step from a "
                                                 "CUDA graph (one per batch-size/length bucket, captured on first "
                                                 "use) instead of launching its kernels one by one; ignored on a CPU.")
    on_swap: Literal["continue", "discard"] = Field(
        "continue", description="At a weight swap: 'continue' unfinished answers under the new weights (partial "
                                "rollout), or 'discard' them and restart their whole groups from the prompt.")
    overprovision: int = Field(
        0, ge=0, description="Extra prompt groups rollout may run beyond the staleness bound's admission (APRIL "
                             "over-provisioning): a step fills with its fastest groups and the stragglers continue "
                             "into the next step; one that would break the staleness bound is restarted from its "
                             "prompt (with staleness 0, every straggler is). 0 = off.")
    gen_len: Literal["natural", "longtail"] = Field(
        "natural", description="'longtail' forces each answer's length from a "
                               "long-tailed distribution (benchmark workload emulation).")
    longtail_short: int = Field(8, gt=0, description="longtail: length of most answers.")
    longtail_long: int = Field(48, gt=0, description="longtail: length of the long answers.")
    longtail_frac: float = Field(0.125, ge=0, le=1, description="longtail: fraction of long answers.")


    @model_validator(mode="after")
    def _engine_installed(self) -> RolloutConfig:
        if self.engine != "builtin" and not engine_installed(self.engine):
            raise ValueError(f"rollout.engine={self.engine} needs the {self.engine} package, which is not installed: "
                             f"pip install 'asyncflow[{self.engine}]' on a CUDA machine, or set rollout.engine=builtin")
        return self


def engine_installed(name: str) -> bool:
    """Is the optional inference engine ``name`` importable? (find_spec: nothing is imported;
    hf_paged is transformers' own, a core dependency)"""
    return importlib.util.find_spec("transformers" if name == "hf_paged" else name) is not None


class RewardConfig(Section):
    latency_ms: tuple[float, float] | None = Field(
        None, description="Emulated remote verifier: each call waits uniform(lo, hi) ms. None = local reward.")
    concurrency: int = Field(64, gt=0, description="Reward calls in flight at once.")
    fn: str | None = Field(None, description="Reward function 'package.module:function' or "
                                             "'path/to/file.py:function' (relative like task.path), called "
                                             "(prompt, response, sample) -> float or dict of "
                                             "named scores; None = the task's built-in reward.")
    key: str | None = Field(None, description="fn returns a dict: the named score used "
                                              "as the reward (None = sum of all).")
    timeout_s: float | None = Field(10.0, gt=0, description="fn: seconds per call before it "
                                                            "scores on_error (None = no limit).")
    on_error: float = Field(0.0, description="fn: score of a call that raises, times "
                                             "out or returns a non-number (counted).")
    batched: bool = Field(False, description="fn takes lists (prompts, responses, samples) -> list "
                                             "of scores, called once per micro-batch (timeout_s "
                                             "per call; a wrong-length list scores on_error).")
    placement: Literal["rollout", "separate"] = Field(
        "rollout", description="Where rewards are computed: 'rollout' = inside the rollout process, each answer group "
                               "as it finishes (remote/async calls in flight there; no reward process, no data-plane "
                               "round trip); 'separate' = a reward worker of its own that streams rows from the data "
                               "plane (for a heavy local reward that should not take rollout's CPU).")

    @model_validator(mode="after")
    def _fn_path(self) -> RewardConfig:
        if self.fn is not None and (self.fn.count(":") != 1 or not all(self.fn.split(":"))):
            raise ValueError(f"fn = '{self.fn}' is not an import path: write 'package.module:function' "
                             f"(e.g. asyncflow.tasks.rewards:math_answer)")
        if self.batched and self.fn is None:
            raise ValueError("batched = true needs fn: name your batched function with "
                             "reward.fn=package.module:function")
        if self.batched and self.latency_ms is not None:
            raise ValueError("batched = true with latency_ms: the emulated remote latency applies to "
                             "per-sample functions only; drop one of them")
        return self
