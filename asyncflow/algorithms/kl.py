"""KL estimators between the policy and the reference model, per token.

With ``d = logp_ref - logp`` (log of the ratio ref / policy on the sampled token), the three
estimators of ``KL(policy || ref)`` from Schulman's note "Approximating KL divergence":

* ``k1 = -d = logp - logp_ref``: unbiased, can be negative, high variance;
* ``k2 = d**2 / 2``: biased (low bias near 0), non-negative, low variance;
* ``k3 = exp(d) - d - 1``: unbiased and non-negative (the GRPO default).

Each works on torch tensors (differentiable, for a loss term) and on numpy arrays (for a
penalty folded into the reward before advantages are computed). Padding is the caller's
business: every estimator is 0 where ``logp == logp_ref``, so zero-padded rows stay 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import numpy as np
import torch

KLEstimator = Literal["k1", "k2", "k3"]


def _exp(x):
    return torch.exp(x) if isinstance(x, torch.Tensor) else np.exp(x)


def kl_k1(logp, ref_logp):
    return logp - ref_logp


def kl_k2(logp, ref_logp):
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp, ref_logp):
    d = ref_logp - logp
    return _exp(d) - d - 1


KL_ESTIMATORS: dict[str, Callable] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_estimate(name: str, logp, ref_logp):
    """Per-token KL estimate ``name`` (k1, k2 or k3) of ``logp`` against ``ref_logp``."""
    try:
        fn = KL_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown KL estimator {name!r} (known: {', '.join(KL_ESTIMATORS)})") from None
    return fn(logp, ref_logp)
