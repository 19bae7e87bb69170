"""What a task is: the :class:`Task` protocol, and the reward function's signature.

A task is any object with ``train`` and ``heldout`` lists of :class:`Problem`-like records
(``.prompt``, ``.answer``), a ``reward(prompt, response, answer) -> float`` and
``greedy_eval_tokens`` (answer tokens to generate at evaluation; None = the answer's length,
for short exact answers). Optional: ``eval_score`` (a held-out metric other than the
reward) and ``cache_key()`` (what the warm-start cache keys on). The built-in tasks and a
user's task (``task.name=my_pkg.tasks:build``) are checked against this protocol by one
contract test (``tests/test_contracts_tasks.py``): ``train`` and ``heldout`` are non-empty,
and the reward of a problem's reference answer is 1.0, of a wrong answer less.

:class:`TaskReward` is the reward signature the roles call, ``(prompt, response, answer)
-> float``: a task's ``reward``, and a configured ``reward.fn`` once
:class:`~asyncflow.tasks.rewards.RewardFunction` wraps it (the user's own signature,
:class:`~asyncflow.tasks.rewards.RewardFn`, takes the sample's fields instead of the answer).
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
    """Problems to train on and to evaluate on, and their reward (see the module doc)."""

    train: Sequence[ProblemLike]
    heldout: Sequence[ProblemLike]
    greedy_eval_tokens: int | None

    def reward(self, prompt: str, response: str, answer: str) -> float: ...


@runtime_checkable
class TaskReward(Protocol):
    """A reward as the roles call it: 1.0 for a correct answer, 0.0 otherwise, or anything in
    between; a finite float. Implementations (one contract test, ``tests/test_contracts_rewards.py``):
    a task's ``reward`` and :class:`~asyncflow.tasks.rewards.RewardFunction` around every shape
    of user function; for the same triple they give the same score."""

    def __call__(self, prompt: str, response: str, answer: str) -> float: ...
