"""Off-policy corrections for asynchronous training.

In async mode an answer is sampled by a *behaviour* policy ``mu`` (the rollout's weights,
version ``w``, log-probs recorded token by token by the inference engine) and trained at
version ``v >= w``. Decoupled PPO (Hilton et al.; AReaL) separates two ratios:

* the **update ratio** ``pi_theta / pi_prox``, clipped as in PPO, where ``pi_prox`` is the
  *proximal* policy: the trainer's weights before this step's update;
* the **off-policy weight** ``pi_prox / mu``, which corrects for the staleness (and for any
  train/inference numerical mismatch) and is never differentiated.

Why ``pi_prox`` costs nothing here: the actor takes exactly one optimizer step per
partition (micro-batches only accumulate gradients), so during every ``forward_backward``
of step ``v`` the weights *are* the proximal policy, and ``pi_prox = logp.detach()`` of the
very forward pass that computes the loss: no extra forward pass, exact. A caller that does
several updates per batch (PPO epochs) passes recomputed ``prox_logprobs`` instead.

Modes (``level`` ``token``: one weight per token; ``geo``: per sequence, the geometric
mean ``exp(mean_t log(pi_prox/mu))`` broadcast to its tokens):

* ``none``: plain PPO against the behaviour policy: update ratio ``pi_theta / mu``, weight 1
  (staleness is absorbed by the clip; the current GRPO behaviour);
* ``tis``: truncated importance sampling: weight ``min(pi_prox / mu, cap)``;
* ``mask``: tokens (``geo``: whole sequences) whose ``pi_prox / mu`` lies outside
  ``[low, high]`` are dropped from the policy-gradient term, weight 1 otherwise;
* ``decoupled``: weight ``pi_prox / mu``, tokens whose weight exceeds ``cap`` are dropped
  (AReaL's ``behav_imp_weight_cap``; ``cap=None`` keeps all).

Dropped tokens contribute 0 but keep their place in the loss normalisers, so the loss
stays additive over micro-batches (see :mod:`asyncflow.algorithms.losses`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

CorrectionMode = Literal["none", "tis", "mask", "decoupled"]


@dataclass(frozen=True)
class Correction:
    mode: CorrectionMode = "none"
    level: Literal["token", "geo"] = "token"
    cap: float | None = 2.0  # tis: truncation; decoupled: drop tokens above (None: keep all)
    low: float = 0.5  # mask: keep pi_prox / mu in [low, high]
    high: float = 2.0


def seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean of each row, broadcast back to ``[B, R]``."""
    n = mask.sum(1, keepdim=True).clamp(min=1)
    return ((x * mask).sum(1, keepdim=True) / n).expand_as(x)


def off_policy(logp: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor, corr: Correction,
               prox: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """Return ``(base_logp, weight, keep, metrics)`` for the loss.

    ``base_logp`` is the denominator of the update ratio (``mu`` for ``none``, else
    ``pi_prox``); ``weight`` multiplies the per-token policy-gradient loss; ``keep`` is
    ``mask`` with dropped tokens zeroed. ``weight`` and ``base_logp`` carry no gradient.
    """
    if corr.mode == "none":
        return behav, torch.ones_like(mask), mask, {}
    prox = logp.detach() if prox is None else prox
    log_w = (prox - behav) * mask
    if corr.level == "geo":
        log_w = seq_mean(log_w, mask)
    w = torch.exp(log_w)
    keep = mask
    if corr.mode == "tis":
        weight = w.clamp(max=corr.cap) if corr.cap is not None else w
    elif corr.mode == "mask":
        weight = torch.ones_like(mask)
        keep = mask * ((w >= corr.low) & (w <= corr.high)).float()
    elif corr.mode == "decoupled":
        weight = w
        if corr.cap is not None:
            keep = mask * (w <= corr.cap).float()
    else:
        raise ValueError(f"unknown off-policy correction {corr.mode!r} (known: none, tis, mask, decoupled)")
    n = mask.sum().clamp(min=1)
    big = torch.where(mask > 0, w, torch.zeros_like(w))
    metrics = {"is_weight_mean": float((w * mask).sum() / n), "is_weight_max": float(big.max()) if big.numel() else 0.0,
               "masked_frac": float((mask - keep).sum() / n)}
    return prox, weight.detach(), keep, metrics
