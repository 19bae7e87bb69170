"""Reward shaping applied by the algorithm before advantages: DAPO's soft overlong punishment.

With ``L = max_new_tokens`` and buffer ``b``, an answer of ``n`` generated tokens (EOS
included, as the trainer sees it) gets

* ``0`` when ``n <= L - b``;
* ``-penalty * (n - (L - b)) / b`` when ``L - b < n <= L`` (linear, reaching ``-penalty``
  exactly at ``n = L``: a truncated answer);
* ``-penalty`` beyond ``L`` (cannot happen with the built-in engine; kept for safety).

Invariants: ``buffer = 0`` is "off" (all zeros); the penalty depends only on the length,
so it is the same wherever it is computed (the rollout's dynamic-sampling filter and the
trainer's advantages agree).

>>> overlong_penalty([4, 6, 7, 8], max_len=8, buffer=4, penalty=1.0).tolist()
[0.0, -0.5, -0.75, -1.0]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def overlong_penalty(lengths: Sequence[int], max_len: int, buffer: int, penalty: float = 1.0) -> np.ndarray:
    """Per-answer penalty (``<= 0``) of the DAPO soft overlong punishment; see module doc."""
    n = np.asarray(lengths, dtype=np.float64)
    if buffer <= 0:
        return np.zeros_like(n)
    over = np.clip((n - (max_len - buffer)) / buffer, 0.0, 1.0)
    return -penalty * over
