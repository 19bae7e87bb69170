"""One algorithm = an advantage estimator + a policy loss, built from ``AlgorithmConfig``.

The actor calls only three things: :meth:`Algorithm.advantages` on a micro-batch of whole
groups (or, for :attr:`batch_level` estimators, on the whole step), :meth:`Algorithm.loss`
once per step with the step's totals, and :attr:`needs_reference` to request reference
log-probs. Engines never see any of it (they run whatever loss callable they are given).

PPO (estimator ``gae``, :attr:`needs_critic`): the critic role calls
:meth:`Algorithm.critic_targets` (advantages and returns from its values) and
:meth:`Algorithm.value_loss`; the actor's :meth:`Algorithm.advantages` then only reads the
``advantages`` column the critic wrote.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

from asyncflow.algorithms.advantages import BATCH_LEVEL, CRITIC_LEVEL, ESTIMATORS, compute_advantages, ppo_targets
from asyncflow.algorithms.corrections import Correction
from asyncflow.algorithms.ear import EAR
from asyncflow.algorithms.kl import kl_estimate
from asyncflow.algorithms.losses import LossAgg, PolicyLoss
from asyncflow.algorithms.shaping import overlong_penalty
from asyncflow.algorithms.value import ValueLoss

if TYPE_CHECKING:
    from asyncflow.config import AlgorithmConfig


@dataclass
class Algorithm:
    estimator: str = "grpo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    ratio_level: Literal["token", "sequence"] = "token"
    loss_agg: LossAgg = "seq-mean-token-mean"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_in_reward: bool = False
    correction: Correction = field(default_factory=Correction)
    gamma: float = 1.0  # gae only
    lam: float = 1.0
    value_clip: float | None = 0.2
    vf_coef: float = 0.5
    entropy_coef: float = 0.0
    max_new_tokens: int = 0  # the rollout's length limit (for the overlong penalty)
    overlong_buffer: int = 0  # 0 = no overlong penalty
    overlong_penalty: float = 1.0
    ear: EAR | None = None  # entropy-based advantage reshaping (group estimators), None = off

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"unknown advantage estimator {self.estimator!r} (known: {', '.join(ESTIMATORS)})")

    @classmethod
    def from_config(cls, a: AlgorithmConfig, max_new_tokens: int = 0) -> Algorithm:
        """From an :class:`asyncflow.config.AlgorithmConfig` (``grpo`` + ``std_normalize=False`` = ``dr_grpo``);
        ``max_new_tokens`` (``rollout.max_new_tokens``) is needed by the overlong penalty."""
        name: str = "dr_grpo" if (a.name == "grpo" and not a.std_normalize) else a.name
        name = "gae" if name == "ppo" else name
        low = a.clip_low if a.clip_low is not None else a.clip_eps
        high = a.clip_high if a.clip_high is not None else a.clip_eps
        cap = a.is_cap
        return cls(estimator=name, clip_low=low, clip_high=high, dual_clip=a.dual_clip, ratio_level=a.ratio_level,
                   loss_agg=a.loss_agg, kl_coef=a.kl_coef, kl_estimator=a.kl_estimator, kl_in_reward=a.kl_in_reward,
                   correction=Correction(a.correction, a.correction_level, cap, a.mask_low, a.mask_high),
                   gamma=a.gamma, lam=a.lam, value_clip=a.value_clip, vf_coef=a.vf_coef,
                   entropy_coef=a.entropy_coef, max_new_tokens=max_new_tokens,
                   overlong_buffer=a.overlong_buffer, overlong_penalty=a.overlong_penalty,
                   ear=EAR(a.ear_alpha, a.ear_kappa) if a.ear else None)

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0

    @property
    def batch_level(self) -> bool:
        """True when advantages need the whole step (batch whitening), not just whole groups."""
        return self.estimator in BATCH_LEVEL

    @property
    def needs_critic(self) -> bool:
        """True for PPO: a critic role computes values, GAE advantages, and trains."""
        return self.estimator in CRITIC_LEVEL

    @property
    def penalties_needed(self) -> bool:
        """True when the reward carries a per-token KL penalty (needs logprobs and ref_logprobs)."""
        return self.kl_in_reward and self.kl_coef > 0

    def penalties(self, data: dict) -> list[np.ndarray] | None:
        """Per-token KL penalties ``kl_coef * k(logprobs, ref_logprobs)`` when ``kl_in_reward``, else None."""
        if not self.penalties_needed:
            return None
        return [self.kl_coef * kl_estimate(self.kl_estimator, np.asarray(lp, np.float64), np.asarray(ref, np.float64))
                for lp, ref in zip(data["logprobs"], data["ref_logprobs"])]

    def shaped_rewards(self, rewards: Sequence[float] | np.ndarray, lengths: Sequence[int]) -> np.ndarray:
        """The rewards advantages are computed from: raw scores plus the overlong penalty."""
        r = np.asarray(rewards, dtype=np.float64)
        if self.overlong_buffer > 0:
            r = r + overlong_penalty(lengths, self.max_new_tokens, self.overlong_buffer, self.overlong_penalty)
        return r

    def advantages(self, data: dict) -> list[np.ndarray]:
        """Per-token advantage rows for a batch of rows (``reward``, ``group``, ``response_ids``...).

        ``gae``: the ``advantages`` column written by the critic role, as is.
        """
        if self.needs_critic:
            return [np.array(a, dtype=np.float32) for a in data["advantages"]]
        lengths = [len(r) for r in data["response_ids"]]
        rewards = self.shaped_rewards(data["reward"], lengths) if self.overlong_buffer > 0 else data["reward"]
        return compute_advantages(self.estimator, rewards, data["group"], lengths, self.penalties(data),
                                  ear=self.ear, logprobs=data.get("logprobs") if self.ear is not None else None)

    def critic_targets(self, data: dict, values: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """PPO: ``(advantages, returns)`` rows by GAE from the critic's per-token ``values``
        (on the shaped rewards: the overlong penalty applies to PPO too)."""
        rewards = data["reward"]
        if self.overlong_buffer > 0:
            rewards = self.shaped_rewards(rewards, [len(r) for r in data["response_ids"]])
        return ppo_targets(rewards, values, self.penalties(data), self.gamma, self.lam)

    def value_loss(self, total_tokens: float) -> ValueLoss:
        return ValueLoss(total_tokens=total_tokens, clip=self.value_clip, vf_coef=self.vf_coef)

    def loss(self, total_seqs: float, total_tokens: float | None = None) -> PolicyLoss:
        return PolicyLoss(total_seqs=total_seqs, total_tokens=total_tokens, clip_low=self.clip_low,
                          clip_high=self.clip_high, dual_clip=self.dual_clip, ratio_level=self.ratio_level,
                          loss_agg=self.loss_agg, kl_coef=0.0 if self.kl_in_reward else self.kl_coef,
                          kl_estimator=self.kl_estimator, correction=self.correction,
                          entropy_coef=self.entropy_coef)
