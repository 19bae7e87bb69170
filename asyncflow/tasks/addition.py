"""Integer addition: the built-in verifiable task.

Design
------
The problem space is every ordered pair ``(a, b)`` with ``0 <= a, b < 10**digits``
(10,000 problems for two digits), split once into a train and a held-out set. The
split is what makes held-out accuracy meaningful: RL and SFT only ever sample from
``train``, evaluation uses ``heldout``.

Invariants
----------
* Prompts are ``f"{a}+{b}="`` and answers ``str(a + b)``; neither contains special
  tokens, so the strings are tokenizer-agnostic. Callers add ``<bos>``/``<eos>``.
* ``train`` and ``heldout`` are disjoint, together cover the whole problem space, and
  depend only on ``(digits, holdout_frac, seed)``.
* ``reward`` is exact match after stripping whitespace: 1.0 or 0.0, never partial.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Problem:
    """One addition problem, e.g. ``Problem(prompt="12+34=", answer="46")``."""

    prompt: str
    answer: str


class AdditionTask:
    """All ``digits``-digit addition problems, split into ``train`` and ``heldout``.

    Example:
        >>> task = AdditionTask(digits=1, holdout_frac=0.2, seed=0)
        >>> len(task.train), len(task.heldout)
        (80, 20)
        >>> task.reward("3+4=", " 7", "7")
        1.0
    """

    def __init__(self, digits: int = 2, holdout_frac: float = 0.2, seed: int = 0) -> None:
        if digits < 1:
            raise ValueError(f"digits must be >= 1, got {digits}")
        if not 0.0 <= holdout_frac < 1.0:
            raise ValueError(f"holdout_frac must be in [0, 1), got {holdout_frac}")
        self.digits = digits
        self.holdout_frac = holdout_frac
        self.seed = seed
        problems = _all_problems(digits)
        order = np.random.default_rng(seed).permutation(len(problems))
        n_heldout = int(round(holdout_frac * len(problems)))
        self.heldout: list[Problem] = [problems[i] for i in order[:n_heldout]]
        self.train: list[Problem] = [problems[i] for i in order[n_heldout:]]

    greedy_eval_tokens = None  # evaluate generates the answer's length + EOS

    @property
    def max_answer_len(self) -> int:
        """Longest answer in characters: the sum of two n-digit numbers has <= n+1 digits."""
        return self.digits + 1

    def reward(self, prompt: str, response: str, answer: str) -> float:
        """1.0 if ``response`` (whitespace-stripped) equals ``answer``, else 0.0.

        ``prompt`` is unused but kept so every task shares one reward signature.
        """
        del prompt
        return 1.0 if response.strip() == answer else 0.0


def _all_problems(digits: int) -> list[Problem]:
    """Every ordered pair in row-major order (the fixed base that the split permutes)."""
    n = 10**digits
    return [Problem(prompt=f"{a}+{b}=", answer=str(a + b)) for a in range(n) for b in range(n)]
