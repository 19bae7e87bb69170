"""Two built-in arithmetic tasks beside addition: ``countdown`` and ``multistep``.

Design
------
Each task draws a fixed pool of distinct problems from a seeded generator, then splits it
once into ``train`` and ``heldout`` (a seeded permutation, ``holdout_frac`` held out), as
:class:`~asyncflow.tasks.addition.AdditionTask` does. Prompts and answers use only
characters of the built-in char tokenizer (``asyncflow.engines.tiny.CHARSET``).

* **multistep**: ``terms`` single-digit operands joined by ``+ - *`` with standard
  precedence, e.g. ``"3+4*2-5="`` -> ``"6"``. Reward: exact match (1 or 0).
* **countdown**: ``terms`` numbers 1..9 and a target, e.g. ``"3,5,2:16="``; write an
  expression with ``+ - * / ( )`` using each given number at most once (as a multiset)
  that equals the target. The reference answer (used by the SFT warm-start) is the
  expression the problem was generated from, e.g. ``"3+5*2"`` for target 13; any other
  correct expression scores the same. Reward: 1.0 correct, 0.1 well formed (parses, uses
  only given numbers) but wrong, 0.0 otherwise. Parsing is :mod:`asyncflow.tasks.arith`
  (no ``eval``).

Invariants
----------
* ``train`` and ``heldout`` are disjoint by prompt and depend only on
  ``(terms, holdout_frac, seed)``; ``cache_key()`` names exactly those (plus the task), so
  the warm-start cache of addition is unaffected.
* ``eval_score`` is the held-out metric: 1.0 for a correct answer, else 0.0 (accuracy;
  for countdown any correct expression counts, not just the reference).
"""

from __future__ import annotations

import random
from collections import Counter

import numpy as np

from asyncflow.tasks.addition import Problem
from asyncflow.tasks.arith import ArithError, evaluate, numbers

OPS = "+-*"


class _ArithTask:
    name = "?"
    pool_size = 20000
    patience = 2000  # stop drawing after this many duplicates in a row (small problem spaces)

    def __init__(self, terms: int = 3, holdout_frac: float = 0.2, seed: int = 0) -> None:
        if not 2 <= terms <= 5:
            raise ValueError(f"terms must be in 2..5, got {terms}")
        self.terms, self.holdout_frac, self.seed = terms, holdout_frac, seed
        rng = random.Random(f"{self.name}-{seed}-{terms}")  # python's: fast per draw
        seen: dict[str, Problem] = {}
        dup = 0
        while len(seen) < self.pool_size and dup < self.patience:
            p = self._problem(rng)
            if p is None or p.prompt in seen:
                dup += 1
                continue
            seen[p.prompt], dup = p, 0
        problems = list(seen.values())
        order = np.random.default_rng(seed).permutation(len(problems))
        k = int(round(holdout_frac * len(problems)))
        self.heldout = [problems[i] for i in order[:k]]
        self.train = [problems[i] for i in order[k:]]
        self.greedy_eval_tokens = max(len(p.answer) for p in problems) + 1

    def _problem(self, rng: random.Random) -> Problem | None:
        """One random problem, or None to draw again (each task defines it)."""
        raise NotImplementedError

    def reward(self, prompt: str, response: str, answer: str) -> float:
        raise NotImplementedError

    def cache_key(self) -> dict:
        return {"name": self.name, "terms": self.terms, "holdout_frac": self.holdout_frac, "seed": self.seed}

    def _expression(self, rng: random.Random, nums: list[int]) -> tuple[str, int]:
        """A random ``+ - *`` expression over ``nums`` (in order) and its value (precedence:
        products first, computed directly; equal to :func:`evaluate` of the text)."""
        ops = [rng.choice(OPS) for _ in nums[1:]]
        total, sign, prod = 0, 1, nums[0]
        for o, n in zip(ops, nums[1:]):
            if o == "*":
                prod *= n
            else:
                total, sign, prod = total + sign * prod, (1 if o == "+" else -1), n
        return "".join(f"{n}{o}" for n, o in zip(nums, ops)) + str(nums[-1]), total + sign * prod

    def eval_score(self, prompt: str, response: str, answer: str) -> float:
        return 1.0 if self.reward(prompt, response, answer) >= 1.0 else 0.0


class MultistepTask(_ArithTask):
    """``terms`` single-digit operands with ``+ - *``: ``"3+4*2-5="`` -> ``"6"``.

    >>> t = MultistepTask(terms=4, seed=0)
    >>> t.reward("3+4*2-5=", " 6", "6"), t.reward("3+4*2-5=", "9", "6")
    (1.0, 0.0)
    """

    name = "multistep"

    def _problem(self, rng: random.Random) -> Problem:
        expr, value = self._expression(rng, [rng.randrange(10) for _ in range(self.terms)])
        return Problem(prompt=f"{expr}=", answer=str(value))

    def reward(self, prompt: str, response: str, answer: str) -> float:
        del prompt
        return 1.0 if response.strip() == answer.strip() else 0.0


class CountdownTask(_ArithTask):
    """Reach the target with the given numbers: ``"3,5,2:13="`` -> e.g. ``"3+5*2"``.

    >>> t = CountdownTask(terms=3, seed=0)
    >>> [t.reward("3,5,2:13=", r, "3+5*2") for r in ("5*2+3", "(3+5)*2", "3+5+5", "3+x")]
    [1.0, 0.1, 0.0, 0.0]
    """

    name = "countdown"

    def _problem(self, rng: random.Random) -> Problem | None:
        nums = [rng.randrange(1, 10) for _ in range(self.terms)]
        expr, target = self._expression(rng, nums)
        if not 0 <= target <= 99:
            return None
        shown = ",".join(str(n) for n in sorted(nums))  # the given numbers, in a canonical order
        return Problem(prompt=f"{shown}:{target}=", answer=expr)

    def reward(self, prompt: str, response: str, answer: str) -> float:
        del answer  # any correct expression counts
        try:
            given, target = prompt.rstrip("=").split(":")
            allowed = Counter(int(x) for x in given.split(","))
            value = evaluate(response.strip())
            used = Counter(numbers(response.strip()))
        except (ArithError, ValueError):
            return 0.0
        if used - allowed:  # a number not given, or used more often than given
            return 0.0
        return 1.0 if value == int(target) else 0.1
