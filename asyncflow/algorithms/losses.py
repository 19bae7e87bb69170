"""Policy losses: clipped policy gradient, sequence-level ratio, KL term, aggregation.

Per token, with update ratio ``rho = exp(logp - base)`` and advantage ``A``:

* clip (PPO; DAPO's clip-higher when ``clip_high > clip_low``):
  ``pg = max(-rho * A, -clip(rho, 1 - clip_low, 1 + clip_high) * A)``;
* dual clip (``dual_clip = c > 1``, Ye et al. 2020): for ``A < 0`` also
  ``pg = min(pg, -c * A)``, bounding the loss of a very large ratio on a bad token;
* GSPO (``ratio_level="sequence"``): ``rho`` is the sequence ratio
  ``exp(mean_t (logp - base))`` (length-normalised), broadcast to the sequence's tokens;
* off-policy correction (:mod:`asyncflow.algorithms.corrections`): ``pg *= weight``,
  dropped tokens zeroed;
* KL to the reference as a loss term: ``+ kl_coef * k(logp, ref)`` (k1/k2/k3, see
  :mod:`asyncflow.algorithms.kl`) on every valid token;
* entropy bonus: ``- entropy_coef * H_t`` with ``H_t = -sum_v p_v log p_v`` the entropy of
  the current policy's next-token distribution at response token ``t`` (the engine
  computes it when the loss sets ``needs_entropy``). Like every other term it is
  per-token and aggregated below, so it sums exactly over micro-batches.

Aggregation (``loss_agg``) over the valid tokens, normalised by the **step's** totals so
that summing the losses of micro-batches equals the loss of one big batch (gradient
accumulation is then exact):

* ``token-mean``: ``sum_{i,t} l_{i,t} / total_tokens`` (DAPO: every token weighs the same);
* ``seq-mean-token-mean``: ``sum_i (sum_t l_{i,t} / n_i) / total_seqs`` (GRPO);
* ``seq-mean-token-sum``: ``sum_i sum_t l_{i,t} / total_seqs`` (Dr.GRPO-style, no length
  normalisation inside a sequence).

A streaming trainer knows the step's sequence count up front but not its token count;
with ``total_tokens=None`` ``token-mean`` returns the plain token sum, and the caller scales
the accumulated gradient by ``1 / total_tokens`` before the optimizer step (exactly
equivalent, see ``TrainEngine.optimizer_step(grad_scale=...)``).

"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from asyncflow.algorithms.corrections import Correction, off_policy, seq_mean
from asyncflow.algorithms.kl import kl_estimate

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, total_seqs: float,
              total_tokens: float | None = None, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Scalar loss from per-token ``values [B, R]`` over ``mask`` (see module doc).

    ``lengths`` (default ``mask.sum(1)``) is the per-sequence token count used by
    ``seq-mean-token-mean``; pass the unmasked lengths when ``mask`` drops tokens.
    """
    summed = values * mask
    if mode == "token-mean":
        return summed.sum() / (1.0 if total_tokens is None else float(total_tokens))
    if mode == "seq-mean-token-mean":
        n = (mask.sum(1) if lengths is None else lengths).clamp(min=1)
        return (summed.sum(1) / n).sum() / float(total_seqs)
    if mode == "seq-mean-token-sum":
        return summed.sum() / float(total_seqs)
    raise ValueError(f"unknown loss aggregation {mode!r} (known: {', '.join(LOSS_AGGS)})")


def clipped_pg(ratio: torch.Tensor, adv: torch.Tensor, clip_low: float, clip_high: float,
               dual_clip: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped policy-gradient loss and boolean masks of which clip was active."""
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    pg = torch.maximum(pg1, pg2)
    flags = {"clip_low": (pg2 > pg1) & (ratio < 1 - clip_low), "clip_high": (pg2 > pg1) & (ratio > 1 + clip_high)}
    if dual_clip is not None:
        bound = -dual_clip * adv
        dual = (adv < 0) & (pg > bound)
        pg = torch.where(dual, bound, pg)
        flags["dual"] = dual
    return pg, flags


def pad_rows(rows: Iterable[Any], mask: torch.Tensor) -> torch.Tensor:
    """List of 1-D arrays -> ``[B, R]`` float tensor matching ``mask`` (0 past each row; on
    ``mask``'s device, filled on the host and copied once)."""
    out = torch.zeros(mask.shape, dtype=mask.dtype)
    for i, r in enumerate(rows):
        r = np.array(r, dtype=np.float32)[: mask.shape[1]]  # a copy: data-plane buffers are read-only
        out[i, : len(r)] = torch.from_numpy(r)
    return out.to(mask.device)


def advantages_tensor(adv: np.ndarray | Sequence[Any], mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence ``[B]`` array (broadcast) or per-token rows -> ``[B, R]``."""
    if isinstance(adv, np.ndarray) and adv.ndim == 1 and adv.dtype != object:
        return torch.as_tensor(adv, dtype=torch.float32, device=mask.device)[:, None].expand_as(mask)
    return pad_rows(adv, mask)


@dataclass
class PolicyLoss:
    """Callable loss for :meth:`TrainEngine.forward_backward`.

    ``extras`` keys: ``logprobs`` (behaviour, per-token rows), ``advantages`` (``[B]`` or
    per-token rows), ``ref_logprobs`` (when ``kl_coef > 0``), optional ``prox_logprobs``, and
    optional ``loss_mask`` (per-token rows of 0/1, multi-turn samples: a 0 token, an observation,
    is left out of every term, the metrics and the normalisation, as padding is).
    """

    total_seqs: float  # sequences in the whole step
    total_tokens: float | None = None  # response tokens in the whole step (token-mean)
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    ratio_level: Literal["token", "sequence"] = "token"
    loss_agg: LossAgg = "seq-mean-token-mean"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    correction: Correction = field(default_factory=Correction)
    entropy_coef: float = 0.0

    @property
    def needs_entropy(self) -> bool:
        """Ask the engine for per-token entropy (always: it is also logged as a metric)."""
        return True

    def __call__(self, logp: torch.Tensor, batch: Any, extras: dict) -> tuple[torch.Tensor, dict]:
        mask = batch.mask
        if "loss_mask" in extras:  # multi-turn: observation tokens (0) are in the response, never in the loss
            mask = mask * pad_rows(extras["loss_mask"], mask)
        lengths = mask.sum(1)
        behav = pad_rows(extras["logprobs"], mask)
        prox = pad_rows(extras["prox_logprobs"], mask) if "prox_logprobs" in extras else None
        adv = advantages_tensor(extras["advantages"], mask)
        base, weight, keep, metrics = off_policy(logp, behav, mask, self.correction, prox)
        log_ratio = (logp - base) * mask
        if self.ratio_level == "sequence":
            log_ratio = seq_mean(log_ratio, mask)
        ratio = torch.exp(log_ratio)
        pg, flags = clipped_pg(ratio, adv, self.clip_low, self.clip_high, self.dual_clip)
        per_tok = pg * weight * keep
        if self.kl_coef > 0:
            kl = kl_estimate(self.kl_estimator, logp, pad_rows(extras["ref_logprobs"], mask))
            per_tok = per_tok + self.kl_coef * kl * mask
            metrics["kl"] = float((kl.detach() * mask).sum() / mask.sum().clamp(min=1))
        entropy = getattr(batch, "entropy", None)
        if self.entropy_coef:
            if entropy is None:
                raise ValueError("entropy_coef > 0 needs batch.entropy: the engine must honour needs_entropy")
            per_tok = per_tok - self.entropy_coef * entropy * mask
        if entropy is not None:
            metrics["entropy"] = float((entropy.detach() * mask).sum() / mask.sum().clamp(min=1))
        loss = aggregate(per_tok, mask, self.loss_agg, self.total_seqs, self.total_tokens, lengths)
        with torch.no_grad():
            n = mask.sum().clamp(min=1)
            local = aggregate(per_tok, mask, self.loss_agg, max(len(lengths), 1), n, lengths)
            behav_ratio = torch.exp((logp - behav) * mask)
            valid = mask > 0
            metrics.update(
                loss=float(local),
                clip_frac=float(((flags["clip_low"] | flags["clip_high"]).float() * keep).sum() / n),
                clip_frac_low=float((flags["clip_low"].float() * keep).sum() / n),
                clip_frac_high=float((flags["clip_high"].float() * keep).sum() / n),
                ratio_mean=float((behav_ratio * mask).sum() / n),
                ratio_max=float(behav_ratio[valid].max()) if valid.any() else 1.0,
                ratio_min=float(behav_ratio[valid].min()) if valid.any() else 1.0)
            if "dual" in flags:
                metrics["dual_clip_frac"] = float((flags["dual"].float() * keep).sum() / n)
        return loss, metrics
