"""Driving episodes on an engine batch: the turns into the batch, and a whole evaluation run.

:func:`submit_turns` is the one place a driver puts an :class:`~asyncflow.agents.episode.EpisodeRunner`'s
next turns into an engine batch: new requests with ``add``, kept rows with ``extend`` (the engine's
multi-turn capability, :mod:`asyncflow.engines.types`), and frees the rows it no longer needs with
``release``. Rollout's loop (:mod:`asyncflow.workflow.rollout`) calls it at every decode step.

:func:`run_episodes` runs a list of episodes to the end on one batch (continuous batching: an
episode waiting for its environment holds no decode slot, a new one starts when one finishes);
:func:`evaluate_episodes` is the held-out evaluation of a multi-turn run: greedy episodes, the
mean episode reward (with a task's reward: its exact match or score of the final answer).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from asyncflow.agents.calls import EnvCalls
from asyncflow.agents.episode import EpisodeRunner, Limits, NextTurn, Trajectory
from asyncflow.engines.types import Completion, Engine, EngineBatch, SamplingParams


def can_extend(batch: EngineBatch) -> bool:
    """Does the batch continue kept rows (``extend`` and ``release``)?"""
    return callable(getattr(batch, "extend", None)) and callable(getattr(batch, "release", None))


def submit_turns(batch: EngineBatch, nexts: list[NextTurn], release: Sequence[Hashable] = ()) -> list[Completion]:
    """Start ``nexts`` in ``batch`` and release the kept rows of ``release``; the turns that finished at once."""
    for key in release:
        try:
            batch.release(key)  # type: ignore[attr-defined]  # (only with can_extend)
        except KeyError:  # (already gone: an engine may drop a kept row it cannot keep)
            pass
    reqs = [n.request for n in nexts if n.request is not None]
    done = batch.add(reqs) if reqs else []
    for n in nexts:
        if n.extend is not None:
            ids, room = n.extend
            done += batch.extend(n.key, ids, room)  # type: ignore[attr-defined]  # (only with can_extend)
    return done


def run_episodes(engine: Engine, sampling: SamplingParams, runner: EpisodeRunner,
                 rows: Sequence[tuple[Any, dict[str, Any], list[int]]]) -> list[Trajectory]:
    """Run the episodes of ``rows`` (``(key, sample, fallback prompt ids)``) to the end; their
    trajectories in the order they finished. Terminates: every episode is bounded by its limits
    and every environment call by its timeout."""
    batch = engine.new_batch(sampling)
    runner.keep = can_extend(batch)
    pending = deque(enumerate(rows))
    out: list[Trajectory] = []
    while pending or runner.active:
        while pending and runner.active < engine.max_batch:  # (at most a batch of episodes at once)
            i, (key, sample, fallback) = pending.popleft()
            runner.start(key, i, sample, fallback)
        runner.collect()
        nexts, done, release = runner.take(engine.max_batch - len(batch))
        out += done
        finished = submit_turns(batch, nexts, release)
        if len(batch):
            finished += batch.step()
        elif not nexts and not finished and runner.active and not runner.queued:
            runner.calls.wait(0.05)  # (only environment calls in flight)
        runner.on_turns(finished)
    return out


def evaluate_episodes(engine: Engine, tokenizer: PreTrainedTokenizerBase, make_env: Callable[[], Any],
                      samples: Sequence[dict[str, Any]], limits: Limits, concurrency: int = 64,
                      timeout_s: float = 10.0) -> float:
    """Mean episode reward of greedy episodes on ``samples`` (0.0 for none)."""
    if not samples:
        return 0.0
    calls = EnvCalls(concurrency, timeout_s)
    try:
        runner = EpisodeRunner(tokenizer, make_env, limits, calls)
        rows: list[tuple[Any, dict[str, Any], list[int]]] = [(i, s, []) for i, s in enumerate(samples)]
        trajectories = run_episodes(engine, SamplingParams(temperature=0.0, max_new_tokens=limits.turn_tokens),
                                    runner, rows)
    finally:
        calls.close()
    return sum(t.reward for t in trajectories) / len(samples)
