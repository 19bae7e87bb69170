"""GRPO, spelled with the library's parts (kept for callers of the original API).

* Advantages: for the N answers of one prompt with rewards r, ``A_i = (r_i - mean(r)) /
  (std(r) + eps)`` (``std_normalize=False`` gives Dr.GRPO's ``r_i - mean(r)``).
* Loss: token-level clipped PG with an optional k3 KL term, token-mean per sequence, summed
  over sequences and divided by the step's batch size (additive over micro-batches).

See :mod:`asyncflow.algorithms.advantages` and :mod:`asyncflow.algorithms.losses`.
"""

from __future__ import annotations

import numpy as np

from asyncflow.algorithms.advantages import dr_grpo_advantages, grpo_advantages
from asyncflow.algorithms.losses import PolicyLoss, pad_rows as _pad  # noqa: F401  (re-export)


def group_advantages(rewards: np.ndarray, groups: np.ndarray, std_normalize: bool = True,
                     eps: float = 1e-6) -> np.ndarray:
    """Per-sequence advantages, normalised within each group id."""
    groups = np.asarray(groups)
    return grpo_advantages(rewards, groups, eps) if std_normalize else dr_grpo_advantages(rewards, groups)


def GRPOLoss(batch_size: int, clip_eps: float = 0.2, kl_coef: float = 0.0) -> PolicyLoss:  # noqa: N802
    """The original GRPO loss: symmetric clip, k3 KL term, seq-mean-token-mean over ``batch_size``."""
    return PolicyLoss(total_seqs=batch_size, clip_low=clip_eps, clip_high=clip_eps, kl_coef=kl_coef,
                      kl_estimator="k3", loss_agg="seq-mean-token-mean")
