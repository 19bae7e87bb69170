"""GRPO: group-normalised advantages and the token-level clipped policy-gradient loss.

* Advantages: for the N answers of one prompt with rewards r, ``A_i = (r_i - mean(r)) /
  (std(r) + eps)`` (``std_normalize=False`` gives Dr.GRPO's ``r_i - mean(r)``). One
  advantage per sequence, broadcast to its tokens.
* Loss per token: ``-min(rho * A, clip(rho, 1 - eps, 1 + eps) * A)`` with
  ``rho = exp(logp - logp_behaviour)``; optional ``+ beta * k3(logp, logp_ref)`` where
  ``k3 = exp(ref - logp) - (ref - logp) - 1`` (unbiased, non-negative KL estimator).
* Aggregation: mean over each sequence's tokens, then **sum over sequences divided by the
  step's batch size** (not the micro-batch's). That makes the loss additive over
  micro-batches, so a step that streams its groups through gradient accumulation gets
  exactly the gradient of one big batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def group_advantages(rewards: np.ndarray, groups: np.ndarray, std_normalize: bool = True,
                     eps: float = 1e-6) -> np.ndarray:
    """Per-sequence advantages, normalised within each group id."""
    rewards = np.asarray(rewards, dtype=np.float64)
    adv = np.zeros_like(rewards)
    for g in np.unique(groups):
        idx = groups == g
        r = rewards[idx]
        a = r - r.mean()
        if std_normalize:
            a = a / (r.std() + eps)
        adv[idx] = a
    return adv.astype(np.float32)


@dataclass
class GRPOLoss:
    """Callable loss for :meth:`TrainEngine.forward_backward` (see module doc)."""

    batch_size: int  # sequences in the whole step (normaliser)
    clip_eps: float = 0.2
    kl_coef: float = 0.0

    def __call__(self, logp: torch.Tensor, batch, extras: dict) -> tuple[torch.Tensor, dict]:
        mask = batch.mask
        old = _pad(extras["logprobs"], mask)
        adv = torch.as_tensor(extras["advantages"], dtype=torch.float32)[:, None]
        ratio = torch.exp(logp - old)
        pg1 = ratio * adv
        pg2 = ratio.clamp(1 - self.clip_eps, 1 + self.clip_eps) * adv
        per_tok = -torch.minimum(pg1, pg2)
        metrics = {}
        if self.kl_coef > 0:
            ref = _pad(extras["ref_logprobs"], mask)
            d = ref - logp
            kl = torch.exp(d) - d - 1
            per_tok = per_tok + self.kl_coef * kl
            metrics["kl"] = float((kl.detach() * mask).sum() / mask.sum().clamp(min=1))
        n_tok = mask.sum(1).clamp(min=1)
        loss = ((per_tok * mask).sum(1) / n_tok).sum() / self.batch_size
        with torch.no_grad():
            clipped = ((pg2 < pg1).float() * mask).sum()
            metrics.update(loss=float(loss) * self.batch_size / max(len(n_tok), 1),
                           clip_frac=float(clipped / mask.sum().clamp(min=1)),
                           ratio_max=float((ratio * mask).max()))
        return loss, metrics


def _pad(rows, mask: torch.Tensor) -> torch.Tensor:
    """List of 1-D arrays -> [B, R] float tensor matching ``mask``."""
    out = torch.zeros_like(mask)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.from_numpy(np.array(r, dtype=np.float32))
    return out
