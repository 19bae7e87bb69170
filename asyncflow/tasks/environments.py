"""The ``env`` config as environments: the factory every episode's environment comes from, and its limits.

One place turns ``env.tools`` / ``env.fn`` / ``env.agent`` into ``make_env()`` (a fresh
:class:`~asyncflow.agents.env.Environment` per episode), for rollout and for the held-out
evaluation alike, so both run the same episodes:

* ``env.tools``: the built-in :class:`~asyncflow.agents.tools.ToolEnv` over those functions, its final
  answer scored by ``reward`` (the task's reward or ``reward.fn``);
* ``env.fn``: the user's factory, loaded by import path (``make()``; a class works too);
* ``env.agent``: an :class:`~asyncflow.agents.agent_env.AgentEnv` per episode, its agent function
  driving it through this process's OpenAI-compatible endpoint (started on first use, one per
  factory, with its own bearer token).

``env.latency_ms`` wraps each environment so every ``step`` first sleeps ``uniform(lo, hi)`` ms
(an emulated remote tool; :class:`Delayed`, awaited on the shared event loop, so it holds no thread).

The held-out evaluation of a multi-turn run (:func:`heldout_episodes`) runs greedy episodes in the
same environments: with ``env.tools`` the final answer is scored by the held-out metric of a
single-turn run (exact match, the task's ``eval_score``, ``eval.metric``...), with ``env.fn`` or
``env.agent`` the episode's own reward is the metric. :func:`trace_tensors` makes the warm-start's
multi-turn SFT rows (``warmstart.traces``): each training problem's conversation, tokenised as
rollout builds episodes, labels on the assistant's tokens only.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from asyncflow.agents.chat import trace_ids
from asyncflow.agents.drive import evaluate_episodes
from asyncflow.agents.env import Turn
from asyncflow.agents.episode import Limits
from asyncflow.agents.tools import ToolEnv
from asyncflow.config import ConfigError, RunConfig
from asyncflow.engines.inference import InferenceEngine
from asyncflow.tasks.base import ProblemLike, Task
from asyncflow.tasks.plugins import load_callable
from asyncflow.tasks.registry import heldout_metric

Reward = Callable[[str, str, str], float]


class Delayed:
    """An environment whose every ``step`` first waits ``uniform(lo, hi)`` ms (module doc)."""

    def __init__(self, env: Any, latency_ms: tuple[float, float], rng: random.Random):
        self.env, self.latency_ms, self.rng = env, latency_ms, rng
        self.tools = getattr(env, "tools", None)

    def reset(self, sample: dict[str, Any]) -> Any:
        return self.env.reset(sample)

    async def step(self, turn: Turn) -> Any:
        await asyncio.sleep(self.rng.uniform(*self.latency_ms) / 1000)
        out = self.env.step(turn)
        return await out if asyncio.iscoroutine(out) else out

    def __getattr__(self, name: str) -> Any:  # (state_dict, load_state_dict, close: the wrapped env's)
        return getattr(self.env, name)


def env_factory(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase, reward: Reward,
                seed: int = 0, latency: bool = True) -> Callable[[], Any]:
    """``make_env()`` for ``cfg.env`` (module doc); ``reward`` scores a ToolEnv's final answers;
    ``latency``: with ``env.latency_ms`` (off for evaluations)."""
    e = cfg.env
    make: Callable[[], Any]
    if e.tools:
        tools = [load_callable(spec, "env.tools") for spec in e.tools]

        def tool_env() -> ToolEnv:
            return ToolEnv(tools, reward, e.max_calls)

        make = tool_env
    elif e.fn:
        make = load_callable(e.fn, "env.fn")
    elif e.agent:
        from asyncflow.agents.agent_env import agent_factory  # (starts a server: only for env.agent)

        make = agent_factory(load_callable(e.agent, "env.agent"), tokenizer, e.host, e.port, e.timeout_s)
    else:
        raise ConfigError("no environment: set env.tools, env.fn or env.agent")
    if e.latency_ms is None or not latency:
        return make
    rng, lat, inner = random.Random(seed), e.latency_ms, make

    def delayed() -> Delayed:
        return Delayed(inner(), lat, rng)

    return delayed


def episode_limits(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase) -> Limits:
    """The episodes' limits, with ``env.stop``'s texts as token ids (those that are one token)."""
    e, vocab = cfg.env, tokenizer.get_vocab()
    stop = tuple(vocab[t] for t in e.stop if t in vocab)
    return Limits(max_turns=e.max_turns, max_tokens=e.max_tokens, turn_tokens=e.turn_tokens or
                  cfg.rollout.max_new_tokens, stop_ids=stop, on_error=e.on_error)


def tool_schemas(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase) -> list[dict[str, Any]] | None:
    """The tools the chat template offers in this run's episodes (None: none)."""
    if cfg.env.tools:
        return ToolEnv([load_callable(spec, "env.tools") for spec in cfg.env.tools]).tools
    return None


def trace_tensors(tokenizer: PreTrainedTokenizerBase, problems: Sequence[ProblemLike],
                  traces: Callable[[str, str], Any],
                  tools: list[dict[str, Any]] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids of each problem's conversation ``traces(prompt, answer)`` (its messages, or
    ``{"messages": ..., "tools": ...}`` with the tools it offers: an agent's) and labels (-100 but on
    the assistant's tokens; :func:`asyncflow.agents.chat.trace_ids`)."""
    rows = []
    for p in problems:
        trace = traces(p.prompt, p.answer)  # the messages, or {"messages": ..., "tools": ...} (an agent's own tools)
        if isinstance(trace, dict):
            rows.append(trace_ids(tokenizer, trace["messages"], trace.get("tools", tools)))
        else:
            rows.append(trace_ids(tokenizer, trace, tools))
    width = max(len(ids) for ids, _, _ in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (row, mask, _) in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, : len(row)] = torch.tensor([t if m else -100 for t, m in zip(row, mask)])
    return ids, labels


def heldout_episodes(cfg: RunConfig, task: Task, reward: Callable[[], Reward]
                     ) -> tuple[str, Callable[[Any, PreTrainedTokenizerBase, Sequence[ProblemLike]], float]]:
    """The held-out metric of a multi-turn run (module doc): its name and ``run(model, tokenizer, problems)``."""
    name, score = heldout_metric(cfg, task, reward)
    if not cfg.env.tools:
        name = "mean episode reward"
    makers: dict[int, Callable[[], Any]] = {}  # per tokenizer (env.agent: one endpoint each)

    def run(model: Any, tokenizer: PreTrainedTokenizerBase, problems: Sequence[ProblemLike]) -> float:
        if id(tokenizer) not in makers:
            makers[id(tokenizer)] = env_factory(cfg, tokenizer, (score or exact_match) if cfg.env.tools else reward(),
                                                latency=False)
        was_training = model.training
        engine = InferenceEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, cfg.rollout.max_batch,
                                 cfg.seed, dtype=cfg.model.dtype)
        samples = [{"prompt": p.prompt, "answer": p.answer} for p in problems]
        try:
            with torch.no_grad():
                return evaluate_episodes(engine, tokenizer, makers[id(tokenizer)], samples,
                                         episode_limits(cfg, tokenizer), cfg.env.concurrency, cfg.env.timeout_s)
        finally:
            model.train(was_training)

    return name, run


def exact_match(prompt: str, response: str, answer: str) -> float:
    return float(response.strip() == answer)
