"""The ``algorithm`` section: advantage estimator, policy loss, KL, off-policy corrections."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from asyncflow.config.base import Section


class AlgorithmConfig(Section):
    name: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "ppo"] = Field(
        "grpo", description="Advantage estimator: grpo (group mean/std), dr_grpo (group mean), rloo (leave-one-out), "
                            "reinforce_pp (batch-whitened returns), reinforce_pp_baseline (group mean, then "
                            "batch-whitened), ppo (GAE on the values of a critic role, trained beside the policy).")
    clip_eps: float = Field(0.2, gt=0, lt=1, description="PPO clip range (both sides unless "
                                                         "clip_low/clip_high are set).")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL to the reference model (0 = no reference role).")
    std_normalize: bool = Field(True, description="Divide group advantages by the group std (False = Dr.GRPO).")
    clip_low: float | None = Field(None, gt=0, lt=1, description="Lower clip: ratio >= 1 - clip_low (None = clip_eps).")
    clip_high: float | None = Field(None, gt=0, description="Upper clip: ratio <= 1 + clip_high (None "
                                                            "= clip_eps; DAPO clip-higher: 0.28).")
    dual_clip: float | None = Field(None, gt=1, description="Dual-clip bound c > 1 on the loss of "
                                                            "negative-advantage tokens (None = off; typical 3).")
    ratio_level: Literal["token", "sequence"] = Field("token", description="'sequence' = GSPO: one "
                                                                           "length-normalised ratio per answer.")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = Field(
        "seq-mean-token-mean", description="Loss aggregation over the step: token-mean (DAPO), "
                                           "seq-mean-token-mean (GRPO), seq-mean-token-sum.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator (k1 = log-ratio, k2 = "
                                                                      "squared/2, k3 = exp(d) - d - 1).")
    kl_in_reward: bool = Field(False, description="Subtract kl_coef x KL from the reward (per "
                                                  "token) instead of adding a loss term.")
    correction: Literal["none", "tis", "mask", "decoupled"] = Field(
        "none", description="Off-policy correction: tis (truncated IS weight), mask "
                            "(drop extreme ratios), decoupled (decoupled PPO).")
    correction_level: Literal["token", "geo"] = Field("token", description="tis/mask: per-token ratio, or "
                                                                           "per-sequence geometric mean (geo).")
    is_cap: float | None = Field(2.0, gt=1, description="tis: truncate the IS weight here; decoupled: drop "
                                                        "tokens whose weight exceeds it (None = no cap).")
    mask_low: float = Field(0.5, gt=0, lt=1, description="mask: drop tokens whose IS ratio is below this.")
    mask_high: float = Field(2.0, gt=1, description="mask: drop tokens whose IS ratio is above this.")
    gamma: float = Field(1.0, ge=0, le=1, description="ppo: GAE discount per response token.")
    lam: float = Field(1.0, ge=0, le=1, description="ppo: GAE lambda (1 = Monte-Carlo "
                                                    "return minus value, 0 = one-step TD).")
    value_clip: float | None = Field(0.2, gt=0, description="ppo: clip the new value to old value +- value_clip "
                                                            "in the value loss (None = no clipping).")
    vf_coef: float = Field(0.5, gt=0, description="ppo: weight of the value loss (the critic has its own "
                                                  "optimizer: this scales its gradient before clipping).")
    critic_lr: float | None = Field(None, gt=0, description="ppo: critic AdamW learning rate (None = train.lr).")
    critic_epochs: int = Field(1, ge=1, description="ppo: critic optimizer steps per training step, each a pass "
                                                    "over the step's answers (value_clip acts from the second on).")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus: add -entropy_coef x (token "
                                                       "entropy of the current policy, aggregated by "
                                                       "loss_agg) to the loss (0 = off; typical 0.001).")
    dynamic_sampling: bool = Field(False, description="DAPO dynamic sampling: drop groups whose rewards are all "
                                                      "equal (no signal) and keep generating until the step is full.")
    overlong_buffer: int = Field(0, ge=0, description="DAPO soft overlong punishment: answers "
                                                      "longer than max_new_tokens - overlong_buffer "
                                                      "tokens lose reward linearly (0 = off).")
    overlong_penalty: float = Field(1.0, ge=0, description="Reward lost by an answer of max_new_tokens "
                                                           "tokens (the overlong penalty's full size).")

    ear: bool = Field(False, description="EAR (ETTRL's entropy-based advantage reshaping): move each answer's "
                                         "group advantage by its entropy relative to its group's, "
                                         "A + clip(ear_alpha x (H - mean_group H), +-|A| / ear_kappa), H = the "
                                         "answer's mean -log-prob; grpo, dr_grpo, rloo only. docs/ttrl.md")
    ear_alpha: float = Field(1.0, gt=0, description="EAR: advantage per nat of relative answer entropy.")
    ear_kappa: float = Field(2.0, gt=1, description="EAR: the reshaping is at most |A| / ear_kappa (> 1: an "
                                                    "advantage keeps its sign).")

    @model_validator(mode="after")
    def _algorithm(self) -> AlgorithmConfig:
        if self.kl_in_reward and self.kl_coef <= 0:
            raise ValueError("kl_in_reward = true needs kl_coef > 0 (set algorithm.kl_coef=0.01, "
                             "or algorithm.kl_in_reward=false)")
        if self.correction == "tis" and self.is_cap is None:
            raise ValueError("is_cap = null with correction = tis: truncated IS needs a cap (set algorithm.is_cap=2.0)")
        if self.correction_level == "geo" and self.correction not in ("tis", "mask"):
            raise ValueError(f"correction_level = geo applies to correction tis or mask, not "
                             f"'{self.correction}' (set algorithm.correction_level=token)")
        if self.ear and self.name not in ("grpo", "dr_grpo", "rloo"):
            raise ValueError(f"ear = true reshapes a group estimator's advantages (grpo, dr_grpo, rloo), not "
                             f"name={self.name}: set algorithm.name=grpo or algorithm.ear=false")
        if self.name != "grpo" and not self.std_normalize:
            raise ValueError(f"std_normalize = false only applies to name=grpo (it makes Dr.GRPO); with "
                             f"name={self.name} remove algorithm.std_normalize")
        return self
