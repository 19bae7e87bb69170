"""EAR: entropy-based advantage reshaping (ETTRL, arXiv 2508.11356), an option of the group estimators.

Why: in test-time RL the early pseudo-labels are biased, and the answers that agree with the
majority are mostly the ones the policy is already sure of. Rewarding them at full strength
sharpens the policy onto its first guesses (ETTRL's "overconfidence"): diversity collapses and
the majority stops improving. EAR moves each answer's advantage by how uncertain the policy was
when it wrote it, relative to the other answers of its prompt.

Source of the formula: the ETTRL paper's own equation could not be retrieved (the machine that
wrote this has no internet and no stored copy of its method section). What is implemented is
the best-documented reading, stated here so it can be checked against the paper:

* the entropy term and its clipping follow Cheng et al. 2025 ("Reasoning with Exploration: An
  Entropy Perspective", arXiv 2506.14758), which adds ``psi = min(alpha * H, |A| / kappa)`` to
  the advantage: bounded by a fraction of ``|A|``, so it never flips an advantage's sign;
* per answer, not per token (the issue: "reshaped by the answer's entropy"), and relative to
  the answer's group, so the term is centred and does not push every answer of a group up.

Per answer ``i`` of group ``g`` with advantage ``A_i`` (any group estimator's, after the
reward shaping), response log-probs ``l_{i,t}`` (the behaviour policy's, as sampled), ``n_i``
tokens:

* ``H_i = -(1 / n_i) sum_t l_{i,t}``: the answer's mean surprisal, a one-sample estimate of the
  sampling policy's per-token entropy along it (0 for an empty answer);
* ``d_i = H_i - mean_{j in g} H_j``;
* ``A'_i = A_i + clip(alpha * d_i, -|A_i| / kappa, |A_i| / kappa)``.

So an answer surer than its group (``d_i < 0``) gets less credit when it agrees with the
majority and more blame when it does not; an exploratory one (``d_i > 0``) the reverse. With
``kappa > 1``: ``sign(A'_i) = sign(A_i)`` and ``(1 - 1/kappa) |A_i| <= |A'_i| <= (1 + 1/kappa) |A_i|``;
``A_i = 0`` stays 0 (a group that agrees unanimously still carries no signal). Hand-checked
values in ``tests/test_ear.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def answer_entropy(logprobs: Sequence[Sequence[float] | np.ndarray]) -> np.ndarray:
    """``H_i = -mean_t logprob_{i,t}`` per answer (0 for an empty one), float64."""
    return np.array([-float(np.mean(np.asarray(r, dtype=np.float64))) if len(r) else 0.0 for r in logprobs])


@dataclass(frozen=True)
class EAR:
    """The reshaping's two constants: ``alpha`` (advantage per nat of relative entropy) and
    ``kappa > 1`` (the term is at most ``|A| / kappa``)."""

    alpha: float = 1.0
    kappa: float = 2.0

    def __post_init__(self) -> None:
        if self.alpha <= 0 or self.kappa <= 1:
            raise ValueError(f"EAR needs alpha > 0 and kappa > 1, got alpha={self.alpha}, kappa={self.kappa}")

    def reshape(self, advantages: np.ndarray, entropies: np.ndarray, groups: np.ndarray) -> np.ndarray:
        """``A'`` from per-answer advantages, entropies ``H`` and group ids (see the module doc)."""
        adv, h = np.asarray(advantages, dtype=np.float64), np.asarray(entropies, dtype=np.float64)
        groups = np.asarray(groups)
        rel = np.zeros(len(h))
        for g in np.unique(groups):
            idx = groups == g
            rel[idx] = h[idx] - h[idx].mean()
        bound = np.abs(adv) / self.kappa
        return (adv + np.clip(self.alpha * rel, -bound, bound)).astype(np.float32)
