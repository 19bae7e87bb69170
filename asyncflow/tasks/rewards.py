"""Reward functions: the user-facing API and the built-in verifiers.

Contract
--------
A reward function is a plain Python function named in the config by import path
(``reward.fn: "package.module:function"``)::

    def my_reward(prompt: str, response: str, sample: dict) -> float | dict[str, float]

``sample`` holds the dataset row's fields (at least ``answer``). A float is the reward. A
dict holds named scores: the reward is ``reward.key``'s score when set, else the sum; every
named score is averaged into the run's metrics. Each call gets ``reward.timeout_s``; an
exception, a timeout, or a result that is not a finite number (or a dict of them) scores
``reward.on_error`` and is counted by kind: it never stops the run.

Three more shapes, same scores and error policy:

* **async**: ``async def my_reward(prompt, response, sample)`` (detected with
  :func:`inspect.iscoroutinefunction`). The reward role keeps ``reward.concurrency`` calls
  in flight on one event-loop thread (:meth:`RewardFunction.ascore`, timeout by
  :func:`asyncio.wait_for`, which cancels the hung coroutine) and writes each result back
  as it completes. Never block inside it (use an async client; blocking stalls the loop).
* **batched**: ``def my_reward(prompts, responses, samples) -> list[float | dict]``,
  declared with ``reward.batched: true`` in the config (the only switch: a batched
  function cannot be told apart from a per-sample one by its signature). It is called once
  per micro-batch the reward role fetches; ``reward.timeout_s`` bounds that one call. An
  exception, a timeout or a list of the wrong length scores every sample of the batch
  ``on_error`` and counts each one; a bad single entry counts only its sample.
* **async batched**: ``async def`` with ``reward.batched: true``.

The signatures are declared once, here: :class:`RewardFn` (per sample, sync or ``async def``)
and :class:`BatchedRewardFn`; :class:`RewardFunction` turns either into the
:class:`~asyncflow.tasks.base.TaskReward` the roles call (``rf(prompt, response, answer)``),
and ``tests/test_contracts_rewards.py`` checks that every shape scores alike.

Invariants: :meth:`RewardFunction.score`, ``__call__`` and :meth:`RewardFunction.score_batch`
work for every shape (a per-sample call of a batched function is a batch of one; a sync
call of an async function runs on the function's own loop thread), always return finite
floats and never raise. ``reward_calls`` counts samples scored, ``reward_batches`` the calls
of a batched function; ``reward_{exception,timeout,non_number}`` count samples.

Built-ins (use them by path, e.g. ``asyncflow.tasks.rewards:math_answer``):

* :func:`exact_match`: whitespace-stripped response equals the answer;
* :func:`math_answer`: the answer extracted from the response (``\\boxed{...}``, else
  GSM8K's ``#### n``, else the last number) equals the reference, numerically when both parse;
* :func:`format_reward`: 1 when the response states a final answer in a recognised form;
* :func:`math_answer_and_format`: both, as named scores ``{"correct", "format"}``.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import re
import threading
import traceback
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol, runtime_checkable

from asyncflow.config import ConfigError
from asyncflow.tasks.plugins import load_callable

Score = float | dict[str, float]  # a reward, or named scores (see the module doc)


@runtime_checkable
class RewardFn(Protocol):
    """A user's per-sample reward (``reward.fn``), ``def`` or ``async def``:
    ``fn(prompt, response, sample) -> float | dict[str, float]``, ``sample`` holding the
    dataset row's fields (at least ``answer``). It may raise or hang: :class:`RewardFunction`
    scores that ``on_error`` and counts it."""

    def __call__(self, prompt: str, response: str, sample: dict) -> Score: ...


@runtime_checkable
class BatchedRewardFn(Protocol):
    """A user's batched reward (``reward.fn`` with ``reward.batched: true``), ``def`` or
    ``async def``: lists in, one score per sample out, in order."""

    def __call__(self, prompts: list[str], responses: list[str], samples: list[dict]) -> Sequence[Score]: ...

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_GSM8K = re.compile(r"####\s*([^\n]+)")
KEEP_FAILURES = 5  # failures whose traceback (or what went wrong) RewardFunction keeps for reward_errors.log


# --------------------------------------------------------------------------- extraction


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None  # unbalanced: no answer


def extract_gsm8k(text: str) -> str | None:
    """The text after the last ``#### `` marker (GSM8K's final-answer line), or None."""
    found = _GSM8K.findall(text)
    return found[-1].strip() if found else None


def extract_last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def extract_answer(text: str) -> str | None:
    """``\\boxed{}`` first, then ``#### n``, then the last number in the text."""
    for fn in (extract_boxed, extract_gsm8k, extract_last_number):
        got = fn(text)
        if got is not None:
            return got
    return None


def _as_number(s: str) -> float | None:
    s = s.strip().rstrip(".").replace(",", "").replace("$", "")
    try:
        return float(s)
    except ValueError:
        return None


def answers_equal(got: str | None, want: str) -> bool:
    if got is None:
        return False
    a, b = _as_number(got), _as_number(want)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    return got.strip() == want.strip()


# --------------------------------------------------------------------------- built-in rewards


def exact_match(prompt: str, response: str, sample: dict) -> float:
    """1.0 if the stripped response equals ``sample["answer"]``."""
    return 1.0 if response.strip() == str(sample["answer"]).strip() else 0.0


def math_answer(prompt: str, response: str, sample: dict) -> float:
    """1.0 if the extracted final answer equals the reference (GSM8K-style references are unwrapped)."""
    want = str(sample["answer"])
    want = extract_gsm8k(want) or want
    return 1.0 if answers_equal(extract_answer(response), want) else 0.0


def format_reward(prompt: str, response: str, sample: dict) -> float:
    """1.0 if the response states its final answer as ``\\boxed{...}`` or ``#### ...``."""
    return 1.0 if (extract_boxed(response) is not None or extract_gsm8k(response) is not None) else 0.0


def math_answer_and_format(prompt: str, response: str, sample: dict) -> dict[str, float]:
    """Named scores: ``correct`` (:func:`math_answer`) and ``format`` (:func:`format_reward`)."""
    return {"correct": math_answer(prompt, response, sample), "format": format_reward(prompt, response, sample)}


# --------------------------------------------------------------------------- loading and calling


class RewardError(ConfigError):
    """A reward function that cannot be loaded (one line naming ``reward.fn`` and the fix)."""


def load_reward_fn(path: str) -> RewardFn | BatchedRewardFn:
    """Resolve ``"package.module:function"`` or ``"path/to/file.py:function"`` to the function."""
    try:
        return load_callable(path, "reward.fn")
    except ConfigError as e:
        raise RewardError(str(e)) from None


class RewardFunction:
    """A user reward function made safe: timeout, error scoring and counting, named scores.

    Call it as the reward role does: ``rf(prompt, response, answer) -> float`` (``answer`` is
    wrapped as ``sample = {"answer": answer}``), :meth:`call_batch` with such triples, or
    :meth:`score` / :meth:`score_batch` / :meth:`ascore` with full sample dicts. Every entry
    point accepts every shape of function (sync or async, per-sample or ``batched``; see the
    module doc). A timed-out sync call is abandoned (its thread finishes in the background;
    Python cannot kill a thread); a timed-out coroutine is cancelled. Both score ``on_error``.
    """

    def __init__(self, fn: RewardFn | BatchedRewardFn, timeout_s: float | None = 10.0, on_error: float = 0.0,
                 key: str | None = None, max_workers: int = 4, batched: bool = False):
        # either shape, called by the entry point that fits ``batched`` (sync or async: checked at run time)
        self.fn: Any = fn
        self.timeout_s, self.on_error, self.key = timeout_s, float(on_error), key
        self.batched = bool(batched)
        self.is_async = inspect.iscoroutinefunction(fn)
        use_pool = timeout_s and not self.is_async
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="reward-fn") if use_pool else None
        self._loop: asyncio.AbstractEventLoop | None = None  # started on the first sync call of an async fn
        self._lock = threading.Lock()
        self.calls = 0
        self.batches = 0
        self.errors = {"exception": 0, "timeout": 0, "non_number": 0, "wrong_length": 0}
        self._named: dict[str, list[float]] = {}
        self.failures: list[str] = []  # the first KEEP_FAILURES failures: a traceback, or what went wrong

    # ------------------------------------------------------------------ role-style entry points
    def __call__(self, prompt: str, response: str, answer: str) -> float:
        return self.score(prompt, response, {"answer": answer})

    async def acall(self, prompt: str, response: str, answer: str) -> float:
        return await self.ascore(prompt, response, {"answer": answer})

    def call_batch(self, texts: list[tuple[str, str, str]]) -> list[float]:
        """``(prompt, response, answer)`` triples -> one score each (one call when batched)."""
        return self.score_batch([t[0] for t in texts], [t[1] for t in texts], [{"answer": t[2]} for t in texts])

    # ------------------------------------------------------------------ per sample
    def score(self, prompt: str, response: str, sample: dict) -> float:
        if self.batched:
            return self.score_batch([prompt], [response], [sample])[0]
        if self.is_async:
            return self._on_loop(self.ascore(prompt, response, sample))
        self._count(1)
        try:
            value = self._invoke(prompt, response, sample)
        except (FutureTimeout, asyncio.TimeoutError):
            return self._fail("timeout", detail=f"timed out after reward.timeout_s = {self.timeout_s} s")
        except Exception:
            return self._fail("exception", detail=traceback.format_exc())
        return self._one(value)

    async def ascore(self, prompt: str, response: str, sample: dict) -> float:
        """One call on the caller's running loop: an async function is awaited under
        ``timeout_s`` (cancelled past it); any other shape runs in a worker thread."""
        if self.batched or not self.is_async:
            return await asyncio.get_running_loop().run_in_executor(None, self.score, prompt, response, sample)
        self._count(1)
        try:
            value = await asyncio.wait_for(self.fn(prompt, response, sample), self.timeout_s)
        except (asyncio.TimeoutError, FutureTimeout):
            return self._fail("timeout", detail=f"timed out after reward.timeout_s = {self.timeout_s} s")
        except Exception:
            return self._fail("exception", detail=traceback.format_exc())
        return self._one(value)

    # ------------------------------------------------------------------ batches
    def score_batch(self, prompts: list[str], responses: list[str], samples: list[dict]) -> list[float]:
        """One score per sample. A ``batched`` function is called once for the whole list."""
        if not self.batched:
            return [self.score(p, r, s) for p, r, s in zip(prompts, responses, samples)]
        n = len(prompts)
        self._count(n, batch=True)
        try:
            if self.is_async:
                values = self._on_loop(asyncio.wait_for(self.fn(prompts, responses, samples), self.timeout_s))
            else:
                values = self._invoke(prompts, responses, samples)
        except (FutureTimeout, asyncio.TimeoutError):
            return [self._fail("timeout", n, f"timed out after reward.timeout_s = {self.timeout_s} s")] * n
        except Exception:
            return [self._fail("exception", n, traceback.format_exc())] * n
        if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__") or len(values) != n:
            got = f"{len(values)} scores" if hasattr(values, "__len__") else type(values).__name__
            return [self._fail("wrong_length", n, f"returned {got:.80} for a batch of {n}")] * n
        return [self._one(v) for v in list(values)]

    # ------------------------------------------------------------------ helpers
    def _invoke(self, *args):
        if self._pool is None:
            return self.fn(*args)
        return self._pool.submit(self.fn, *args).result(timeout=self.timeout_s)

    def _on_loop(self, coro):
        """Run ``coro`` on this function's own event-loop thread and wait for it."""
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="reward-fn-loop", daemon=True).start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _count(self, n: int, batch: bool = False) -> None:
        with self._lock:
            self.calls += n
            self.batches += batch

    def _one(self, value: Any) -> float:
        reward = self._reduce(value)
        return self._fail("non_number", detail=f"returned {value!r:.80} (not a finite number{self._keyed})") \
            if reward is None else reward

    def _reduce(self, value: Any) -> float | None:
        if isinstance(value, dict):
            scores = {k: _finite(v) for k, v in value.items()}
            finite = {k: v for k, v in scores.items() if v is not None}
            if not scores or len(finite) < len(scores) or (self.key and self.key not in scores):
                return None
            with self._lock:
                for k, f in finite.items():
                    self._named.setdefault(k, []).append(f)
            return finite[self.key] if self.key else float(sum(finite.values()))
        return _finite(value)

    @property
    def _keyed(self) -> str:
        return f", or a dict of them with '{self.key}'" if self.key else ", or a dict of them"

    def _fail(self, kind: str, n: int = 1, detail: str = "") -> float:
        with self._lock:
            self.errors[kind] += n
            if len(self.failures) < KEEP_FAILURES:
                self.failures.append(detail.rstrip() or kind)
        return self.on_error

    def stats(self) -> dict:
        """Counters (samples; ``reward_batches``: calls of a batched function) and the mean of each named score."""
        with self._lock:
            out: dict[str, Any] = {"reward_calls": self.calls, **{f"reward_{k}": n for k, n in self.errors.items()}}
            if self.batched:
                out["reward_batches"] = self.batches
            out.update({f"score_{k}": sum(v) / len(v) for k, v in self._named.items() if v})
            if self.failures:
                out["failures"] = list(self.failures)
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)

def _finite(v: object) -> float | None:
    """``v`` as a finite float if it is a real number (bool and numpy scalars included), else None."""
    if not isinstance(v, numbers.Real):
        return None  # strings, None, lists... ("1" is not a score: it is a bug in the function)
    f = float(v)
    return f if math.isfinite(f) else None
