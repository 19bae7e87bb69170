"""The critic's value loss (PPO) and explained variance.

Per response token, with the new prediction ``V``, the value ``V_old`` the critic gave the
token when the step's advantages were computed, and the GAE return ``R = A + V_old``:

* unclipped: ``l = 0.5 * (V - R)^2``;
* clipped (``clip = c``, as in PPO2 / verl / OpenRLHF): ``V_c = V_old + clamp(V - V_old, -c, c)``
  and ``l = 0.5 * max((V - R)^2, (V_c - R)^2)``: a step cannot move a value more than ``c``
  away from ``V_old`` to lower the loss (it can always move toward ``R``).

The loss is ``vf_coef * sum_{i,t} l_{i,t} / total_tokens`` over valid tokens, with
``total_tokens`` the **step's** token count, so micro-batch losses sum to the loss of one
big batch (exact gradient accumulation, as for the policy losses). Padding never counts.

Explained variance of values ``V`` against returns ``R`` over the valid tokens:
``1 - Var(R - V) / Var(R)`` (1 = perfect, 0 = no better than a constant, < 0 worse); 0 when
``Var(R) = 0``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from asyncflow.algorithms.losses import pad_rows


def explained_variance(values: Sequence[np.ndarray], returns: Sequence[np.ndarray]) -> float:
    """``1 - Var(R - V) / Var(R)`` over every token of ragged rows (0 when ``Var(R) = 0``)."""
    v = np.concatenate([np.asarray(x, np.float64) for x in values]) if len(values) else np.zeros(0)
    r = np.concatenate([np.asarray(x, np.float64) for x in returns]) if len(returns) else np.zeros(0)
    var = r.var() if r.size else 0.0
    return float(1.0 - (r - v).var() / var) if var > 0 else 0.0


@dataclass
class ValueLoss:
    """Callable loss for :meth:`CriticEngine.forward_backward` (per-token value predictions).

    ``extras`` keys: ``values`` (``V_old``, per-token rows) and ``returns`` (per-token rows).
    """

    total_tokens: float  # response tokens in the whole step
    clip: float | None = 0.2
    vf_coef: float = 1.0

    def __call__(self, vpred: torch.Tensor, batch, extras: dict) -> tuple[torch.Tensor, dict]:
        mask = batch.mask
        old = pad_rows(extras["values"], mask)
        ret = pad_rows(extras["returns"], mask)
        err = (vpred - ret) ** 2
        if self.clip is not None:
            clipped = old + (vpred - old).clamp(-self.clip, self.clip)
            err_c = (clipped - ret) ** 2
            per_tok = 0.5 * torch.maximum(err, err_c)
            clip_hit = (err_c > err).float()
        else:
            per_tok, clip_hit = 0.5 * err, torch.zeros_like(err)
        loss = self.vf_coef * (per_tok * mask).sum() / float(max(self.total_tokens, 1))
        with torch.no_grad():
            n = mask.sum().clamp(min=1)
            metrics = {"value_loss": float((per_tok * mask).sum() / n),
                       "vf_clip_frac": float((clip_hit * mask).sum() / n),
                       "value_pred_mean": float((vpred * mask).sum() / n)}
        return loss, metrics
