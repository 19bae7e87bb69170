"""Multi-turn episodes, token in / token out: :class:`EpisodeRunner` and the :class:`Trajectory` it makes.

The runner owns the episodes; an engine driver (rollout's loop, or :func:`run_episodes` for an
evaluation) owns the decoding. They meet at two calls: the driver hands every finished turn to
:meth:`EpisodeRunner.on_turns`, and :meth:`EpisodeRunner.take` gives it the turns to generate
next (a new request, or an ``extend`` of a kept row) and the episodes that finished. Environment
calls run in :class:`~asyncflow.agents.calls.EnvCalls`, so a slow tool never holds a decode step.

An episode: ``reset(sample)`` -> the prompt ids (:func:`~asyncflow.agents.chat.prompt_ids`) ->
[a turn is generated -> ``step(turn)`` -> the observation's ids are appended] until the
environment says ``done`` or a limit ends it. Its sample (:class:`Trajectory`) is one row:

* ``prompt_ids``: the first observation; ``response_ids``: every turn and every observation after
  it, in order, exactly the ids generated and appended (never decoded and encoded again: a turn's
  ids are the engine's, an observation's are tokenised alone, :mod:`asyncflow.agents.chat`);
* ``loss_mask``: 1 on generated tokens, 0 on observation tokens (these never enter the loss);
* ``logprobs`` and ``token_versions``: per token; a generated token's own, an observation token
  0.0 and the version of the turn before it; ``version``: the oldest version of a generated token
  (the row's start version, as the trainer's staleness check reads it);
* ``reward``: the sum of the steps' rewards; ``end``: ``done``, ``max_turns``, ``max_tokens`` or
  ``error``.

Limits (:class:`Limits`): ``max_turns`` model turns (the last one is still stepped, for its
reward); ``max_tokens`` response-side tokens in all (a turn gets at most what is left, an
observation that does not fit ends the episode without it); ``turn_tokens`` per turn. A turn ends
at EOS or a stop id (the end of a tool call); an engine that ignores ``stop_ids`` is cut at the
first one (the tokens after it are dropped, never seen by the environment nor trained).

An environment that raises, times out, returns something else than the contract says, or whose
messages the chat template cannot continue ends its episode as an **error**: the trajectory so far
is kept with reward ``on_error`` (a failed ``reset`` gives a one-token, fully masked row), and the
error is counted by kind with the first tracebacks kept (``stats``): the run goes on.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from asyncflow.agents.calls import CallTimeout, EnvCalls, describe
from asyncflow.agents.chat import TemplateMismatch, continuation, decode, prompt_ids, tokens
from asyncflow.agents.env import EnvError, Observation, StepResult, Tokens, Turn, as_step_result, check_observation
from asyncflow.engines.types import Completion, Request

KEEP_FAILURES = 5  # tracebacks kept for env_errors.log


@dataclass(frozen=True)
class Limits:
    """How long an episode may run (module doc)."""

    max_turns: int = 4
    max_tokens: int = 256
    turn_tokens: int = 64
    stop_ids: tuple[int, ...] = ()
    on_error: float = 0.0


@dataclass
class Trajectory(Completion):
    """A finished episode as one sample (module doc); ``key`` is the row's."""

    loss_mask: list[int] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    end: str = ""
    error: str | None = None


@dataclass
class Episode:
    """One episode in flight (``phase``: ``reset``, ``turn`` generating, ``env`` stepping, ``done``)."""

    key: Any  # the row's request key: the trajectory's
    turn_key: Hashable  # its turns' request key
    env: Any
    sample: dict[str, Any]
    fallback: list[int]  # the row's prompt ids (the sample of an episode whose reset failed)
    prompt: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    text: str = ""  # the conversation's text so far (chat.continuation's "before")
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    turns: int = 0
    reward: float = 0.0
    phase: str = "reset"
    stepping: Turn | None = None  # the turn whose step is in flight
    state: dict[str, Any] | None = None  # env.state_dict() after its last call (for a checkpoint)
    kept: bool = False  # the engine keeps its last turn's KV cache (extend)


@dataclass(frozen=True)
class NextTurn:
    """A turn to generate: ``request`` (a new row: the whole history as its prompt) or, for a kept
    row, ``extend`` = (the observation's ids, max new tokens)."""

    key: Hashable
    request: Request | None = None
    extend: tuple[list[int], int] | None = None


class EpisodeRunner:
    """The episodes of one driver (module doc). ``make_env()`` builds a fresh environment;
    ``keep``: the driver's batch can ``extend`` kept rows."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, make_env: Callable[[], Any], limits: Limits,
                 calls: EnvCalls, keep: bool = False, version: Callable[[], int] = lambda: 0):
        self.tok, self.make_env, self.limits, self.calls, self.keep = tokenizer, make_env, limits, calls, keep
        self.version = version  # the policy version now (a failed reset's row is tagged with it)
        self.episodes: dict[Hashable, Episode] = {}
        self._next: list[NextTurn] = []
        self._done: list[Trajectory] = []
        self._release: list[Hashable] = []
        self.errors: dict[str, int] = {"exception": 0, "timeout": 0, "bad_return": 0, "template": 0}
        self.failures: list[str] = []
        self.env_calls = self.turns = self.episodes_done = self.cut_at_stop = 0

    @property
    def active(self) -> int:
        """Episodes not finished (generating, waiting for a slot, or waiting on their environment)."""
        return len(self.episodes)

    # ------------------------------------------------------------------ starting and stepping
    def start(self, key: Any, turn_key: Hashable, sample: dict[str, Any], fallback: list[int]) -> None:
        """A new episode for the row ``key`` (its turns keyed ``turn_key``): its env is reset off-loop."""
        ep = Episode(key, turn_key, None, dict(sample), list(fallback))
        self.episodes[turn_key] = ep
        try:
            ep.env = self.make_env()
        except Exception as e:
            self._fail(ep, e)
            return
        self._call(ep, ep.env.reset, ep.sample, "reset")

    def resume(self, ep: Episode, turn: Turn | None) -> None:
        """Continue a saved episode (a checkpoint's, :mod:`asyncflow.workflow.rollout.episodes`): a fresh
        environment given the saved state, then what was in flight: the reset, the step of ``turn``, or
        the next turn (from the whole history: a kept row did not survive)."""
        self.episodes[ep.turn_key] = ep
        ep.kept = False
        try:
            ep.env = self.make_env()
            if ep.phase != "reset":
                ep.env.load_state_dict(ep.state)
        except Exception as e:
            self._fail(ep, e)
            return
        if ep.phase == "reset":
            self._call(ep, ep.env.reset, ep.sample, "reset")
        elif ep.phase == "env" and turn is not None:
            ep.stepping = turn
            self._call(ep, ep.env.step, turn, "step")
        else:
            self._next_turn(ep, None)

    def on_turns(self, done: list[Completion]) -> None:
        """Finished turns (completions keyed by turn keys) from the driver's batch."""
        for c in done:
            ep = self.episodes.get(c.key)
            if ep is None or ep.phase != "turn":
                continue  # (an episode dropped meanwhile)
            self.turns += 1
            turn = self._append_turn(ep, c)
            if turn is None:
                continue
            ep.turns += 1
            ep.stepping = turn
            self._call(ep, ep.env.step, turn, "step")

    def _append_turn(self, ep: Episode, c: Completion) -> Turn | None:
        """Record a turn's tokens (cut at the first stop id); the :class:`Turn` the env steps."""
        ids, lps, vers = list(c.response_ids), list(c.logprobs), list(c.token_versions)
        cut = next((i for i, t in enumerate(ids) if t in self.limits.stop_ids), None)
        if cut is not None and cut + 1 < len(ids):  # (an engine that ignores stop_ids ran on)
            ids, lps, vers = ids[: cut + 1], lps[: cut + 1], vers[: cut + 1]
            self.cut_at_stop += 1
            if ep.kept:  # its kept cache holds the tokens cut off: continue by whole history instead
                self._release.append(ep.turn_key)
                ep.kept = False
        eos = bool(ids) and ids[-1] == self.tok.eos_token_id
        reason = "stop" if cut is not None else "eos" if eos else "length"
        ep.ids += ids
        ep.logprobs += lps
        ep.versions += vers
        ep.mask += [1] * len(ids)
        ep.text += decode(self.tok, ids)
        body = ids[:-1] if eos else ids
        text = decode(self.tok, body)
        ep.messages.append({"role": "assistant", "content": text})
        return Turn(text, str(self.tok.decode(body, skip_special_tokens=True)), tuple(ids), reason, ep.turns)

    def collect(self) -> None:
        """Take the environment calls that came back (answers, errors, timeouts)."""
        for tag, value, err in self.calls.done():
            ep = self.episodes.get(tag)
            if ep is None:
                continue
            self.env_calls += 1
            if err is not None:
                self._fail(ep, err)
                continue
            try:
                if ep.phase == "reset":
                    self._on_reset(ep, value)
                else:
                    self._on_step(ep, as_step_result(value))
            except Exception as e:  # a bad return value, or the template cannot continue the conversation
                self._fail(ep, e)

    @property
    def queued(self) -> int:
        """Turns waiting for a decode slot (:meth:`take` with a ``limit`` leaves them queued)."""
        return len(self._next)

    def take(self, limit: int | None = None) -> tuple[list[NextTurn], list[Trajectory], list[Hashable]]:
        """The turns to generate next (at most ``limit``, the oldest first: the rest stay queued), the
        finished episodes, and kept rows to release; each once."""
        n = len(self._next) if limit is None else max(0, limit)
        out = (self._next[:n], self._done, self._release)
        self._next, self._done, self._release = self._next[n:], [], []
        return out

    def _call(self, ep: Episode, fn: Callable[..., Any], arg: Any, what: str) -> None:
        ep.phase = what if what == "reset" else "env"
        self.calls.submit(ep.turn_key, fn, arg, what=f"env {what}()")

    def _on_reset(self, ep: Episode, first: Observation) -> None:
        check_observation(first)
        ep.tools = getattr(ep.env, "tools", None) or None
        ep.prompt, ep.text = prompt_ids(self.tok, first, ep.tools)
        ep.messages = list(first) if isinstance(first, list) else []
        ep.state = self._state(ep)
        self._next_turn(ep, None)

    def _on_step(self, ep: Episode, result: StepResult) -> None:
        ep.reward += result.reward
        ep.stepping = None
        ep.state = self._state(ep)
        if result.done or result.observation is None:
            return self._finish(ep, "done")
        if ep.turns >= self.limits.max_turns:
            return self._finish(ep, "max_turns")
        obs = self._observation_ids(ep, result.observation)
        if len(ep.ids) + len(obs) >= self.limits.max_tokens:
            return self._finish(ep, "max_tokens")
        ep.ids += obs
        ep.logprobs += [0.0] * len(obs)
        ep.versions += [ep.versions[-1] if ep.versions else self.version()] * len(obs)
        ep.mask += [0] * len(obs)
        self._next_turn(ep, obs)

    def _observation_ids(self, ep: Episode, obs: Observation) -> list[int]:
        """An observation's ids, tokenised alone (module doc of :mod:`asyncflow.agents.chat`)."""
        if isinstance(obs, Tokens):
            ids = list(obs.ids)
            ep.text += decode(self.tok, ids)
            return ids
        if isinstance(obs, list):
            ep.messages += obs
            text = continuation(self.tok, ep.text, ep.messages, ep.tools)
        else:
            text = obs
        ep.text += text
        return tokens(self.tok, text)

    def _next_turn(self, ep: Episode, obs: list[int] | None) -> None:
        room = min(self.limits.turn_tokens, self.limits.max_tokens - len(ep.ids))
        if room <= 0:
            return self._finish(ep, "max_tokens")
        ep.phase = "turn"
        if obs is not None and ep.kept:
            self._next.append(NextTurn(ep.turn_key, extend=(obs, room)))
            return
        ep.kept = self.keep
        self._next.append(NextTurn(ep.turn_key, Request(ep.turn_key, ep.prompt + ep.ids, room,
                                                        stop_ids=self.limits.stop_ids, keep=self.keep)))

    def _state(self, ep: Episode) -> dict[str, Any] | None:
        get = getattr(ep.env, "state_dict", None)
        return get() if get is not None else None

    # ------------------------------------------------------------------ ending
    def _finish(self, ep: Episode, end: str, error: str | None = None) -> None:
        del self.episodes[ep.turn_key]
        self.calls.forget(ep.turn_key)
        if ep.kept:
            self._release.append(ep.turn_key)
        ep.phase = "done"
        self.episodes_done += 1
        close = getattr(ep.env, "close", None)
        if close is not None:
            try:
                close()
            except Exception as e:  # (counted; the trajectory stands)
                self._count(e)
        self._done.append(self._trajectory(ep, end, error))

    def _trajectory(self, ep: Episode, end: str, error: str | None) -> Trajectory:
        if not ep.ids:  # (a failed reset or first turn: one masked token keeps the group whole)
            ep.prompt = ep.prompt or ep.fallback
            ep.ids, ep.logprobs, ep.versions, ep.mask = [self.tok.eos_token_id], [0.0], [self.version()], [0]
        generated = [v for v, m in zip(ep.versions, ep.mask) if m] or ep.versions
        eos = bool(ep.ids) and ep.ids[-1] == self.tok.eos_token_id
        reward = self.limits.on_error if error is not None else ep.reward
        return Trajectory(ep.key, ep.prompt, ep.ids, ep.logprobs, min(generated), eos, ep.versions, "",
                          ep.mask, reward, ep.turns, end, error)

    def _fail(self, ep: Episode, err: BaseException) -> None:
        self._count(err)
        self._finish(ep, "error", f"{type(err).__name__}: {err}")

    def _count(self, err: BaseException) -> None:
        kind = "timeout" if isinstance(err, CallTimeout) else "bad_return" if isinstance(err, EnvError) else \
            "template" if isinstance(err, TemplateMismatch) else "exception"
        self.errors[kind] += 1
        if len(self.failures) < KEEP_FAILURES:
            self.failures.append(describe(err))

    def drop(self, turn_keys: set[Hashable]) -> None:
        """Forget these episodes (their turns left the batch): nothing of them comes back."""
        for k in turn_keys & set(self.episodes):
            ep = self.episodes.pop(k)
            self.calls.forget(k)
            if ep.kept:
                self._release.append(k)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"episodes": self.episodes_done, "turns": self.turns, "env_calls": self.env_calls,
                               "env_errors": sum(self.errors.values()), "turns_cut_at_stop": self.cut_at_stop,
                               **{f"env_{k}": n for k, n in self.errors.items()}}
        if self.failures:
            out["env_failures"] = list(self.failures)
        return out
