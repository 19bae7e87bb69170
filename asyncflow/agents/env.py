"""What an environment is: the :class:`Environment` protocol, a model's :class:`Turn`, a :class:`StepResult`.

An episode starts from a dataset row and alternates model turns with the environment's answers:

* ``reset(sample) -> observation``: the episode's first prompt, from the row (``sample``:
  ``prompt``, ``answer`` and the row's other text fields);
* ``step(turn) -> StepResult`` (or a plain ``(observation, reward, done)`` tuple): the
  environment's answer to one model turn. ``reward``\\ s of an episode add up to its reward;
  ``done`` ends it (a turn that calls no tool, a solved puzzle, a lost game).

Both may be ``async def``; each call runs under ``env.timeout_s`` off rollout's decode loop
(a slow tool is latency the other episodes fill). An observation is one of

* ``str``: text, tokenised as it is and appended;
* ``list[dict]``: chat messages (``{"role": "tool", "content": ...}``, a user's reply...), rendered
  by the tokenizer's chat template as the continuation of the conversation so far
  (:mod:`asyncflow.agents.chat`);
* :class:`Tokens`: exact token ids (the endpoint's agents: :mod:`asyncflow.agents.agent_env`).

Optional members: ``tools`` (JSON schemas offered through the chat template's ``tools=``),
``state_dict() -> dict`` and ``load_state_dict(dict)`` (JSON-able: an episode in flight at a
checkpoint continues on resume only with them; without them it restarts from its prompt) and
``close()`` (called once when the episode ends, whatever ended it).

A user's environment loads by import path, like ``reward.fn``: ``env.fn=pkg.mod:make`` or
``env.fn=path/to/file.py:make``, ``make()`` returning a fresh environment per episode (a class
works). The contract test (``tests/test_contracts_env.py``) runs every implementation: the built-in
:class:`~asyncflow.agents.tools.ToolEnv`, a user's by path, and the endpoint's
:class:`~asyncflow.agents.agent_env.AgentEnv`.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Tokens:
    """An observation given as exact token ids (never re-tokenised)."""

    ids: tuple[int, ...]


Observation = str | list[dict[str, Any]] | Tokens


@dataclass(frozen=True)
class Turn:
    """One model turn as the environment sees it.

    ``text``: decoded with special tokens kept (tool-call tags included), without the EOS that
    ended it; ``content``: decoded with special tokens skipped (what a reward reads); ``ids``:
    the generated token ids (the stopping token included); ``stop_reason``: ``eos``, ``stop``
    (a stop token: the end of a tool call) or ``length``; ``index``: 0 for the first turn.
    """

    text: str
    content: str
    ids: tuple[int, ...]
    stop_reason: str
    index: int


@dataclass(frozen=True)
class StepResult:
    """The environment's answer to a turn: what the model sees next (None: nothing), the
    reward of this step, and whether the episode is over."""

    observation: Observation | None = None
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """An episode's counterpart (module doc). ``reset`` and ``step`` may be ``async def``."""

    def reset(self, sample: dict[str, Any]) -> Observation | Awaitable[Observation]: ...

    def step(self, turn: Turn) -> Any: ...  # StepResult | (observation, reward, done), or an awaitable of one


class EnvError(RuntimeError):
    """An environment broke its contract (a wrong return type): the episode ends, counted."""


def as_step_result(value: Any) -> StepResult:
    """A step's return value as a :class:`StepResult` (a ``(observation, reward, done)`` tuple
    is accepted); :class:`EnvError` naming what was wrong otherwise."""
    if isinstance(value, StepResult):
        result = value
    elif isinstance(value, tuple) and len(value) == 3:
        result = StepResult(value[0], value[1], value[2])
    else:
        raise EnvError(f"step() returned {type(value).__name__} {value!r:.80}: expected a StepResult or an "
                       f"(observation, reward, done) tuple")
    check_observation(result.observation, allow_none=True)
    if isinstance(result.reward, bool) or not isinstance(result.reward, (int, float)):
        raise EnvError(f"step() returned the reward {result.reward!r:.80}: expected a number")
    return StepResult(result.observation, float(result.reward), bool(result.done), result.info)


def check_observation(obs: Any, allow_none: bool = False) -> None:
    """Raise :class:`EnvError` unless ``obs`` is text, a list of message dicts or :class:`Tokens`."""
    if obs is None and allow_none:
        return
    if isinstance(obs, (str, Tokens)):
        return
    if isinstance(obs, list) and all(isinstance(m, dict) and "role" in m for m in obs):
        return
    raise EnvError(f"observation {obs!r:.80} ({type(obs).__name__}): expected text, a list of chat messages "
                   f"(dicts with 'role') or Tokens")


def is_async(fn: Any) -> bool:
    """Is ``fn`` (a bound method) a coroutine function?"""
    return inspect.iscoroutinefunction(fn)
