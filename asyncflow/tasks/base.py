"""What a task is: the :class:`Task` protocol, and the reward function's signature.

A task is any object with ``train`` and ``heldout`` lists of :class:`Problem`-like records
(``.prompt``, ``.answer``), a ``reward(prompt, response, answer) -> float`` and
``greedy_eval_tokens`` (answer tokens to generate at evaluation; None = the answer's length,
for short exact answers). Optional: ``eval_score`` (a held-out metric other than the
reward) and ``cache_key()`` (what the warm-start cache keys on). The built-in tasks and a
user's task (``task.name=my_pkg.tasks:build``) are checked against this protocol by one
contract test.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class ProblemLike(Protocol):
    prompt: str
    answer: str


@runtime_checkable
class Task(Protocol):
    train: Sequence[ProblemLike]
    heldout: Sequence[ProblemLike]
    greedy_eval_tokens: int | None

    def reward(self, prompt: str, response: str, answer: str) -> float: ...


class TaskReward(Protocol):
    """A task's reward: 1.0 for a correct answer, 0.0 otherwise, or anything in between."""

    def __call__(self, prompt: str, response: str, answer: str) -> float: ...
