"""Reward functions: the user-facing API and the built-in verifiers.

Contract
--------
A reward function is a plain Python function named in the config by import path
(``reward.fn: "package.module:function"``)::

    def my_reward(prompt: str, response: str, sample: dict) -> float | dict[str, float]

``sample`` holds the dataset row's fields (at least ``answer``). A float is the reward. A
dict holds named scores: the reward is ``reward.key``'s score when set, else the sum; every
named score is averaged into the run's metrics. The function runs once per answer, in a
worker thread, with ``reward.timeout_s`` per call; an exception, a timeout, or a result that
is not a finite number (or a dict of them) scores ``reward.on_error`` and is counted by kind:
it never stops the run.

Built-ins (use them by path, e.g. ``asyncflow.tasks.rewards:math_answer``):

* :func:`exact_match`: whitespace-stripped response equals the answer;
* :func:`math_answer`: the answer extracted from the response (``\\boxed{...}``, else
  GSM8K's ``#### n``, else the last number) equals the reference, numerically when both parse;
* :func:`format_reward`: 1 when the response states a final answer in a recognised form;
* :func:`math_answer_and_format`: both, as named scores ``{"correct", "format"}``.
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable

from asyncflow.config import ConfigError

RewardFn = Callable[[str, str, dict], Any]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_GSM8K = re.compile(r"####\s*([^\n]+)")


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


def load_reward_fn(path: str) -> RewardFn:
    """Resolve ``"package.module:function"`` to the function."""
    if path.count(":") != 1:
        raise RewardError(f"reward.fn = '{path}': expected 'package.module:function'")
    mod_name, fn_name = path.split(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise RewardError(f"reward.fn = '{path}': cannot import module '{mod_name}' ({e}); "
                          f"is it installed or on PYTHONPATH?") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise RewardError(f"reward.fn = '{path}': module '{mod_name}' has no function '{fn_name}'")
    return fn


class RewardFunction:
    """A user reward function made safe: timeout, error scoring and counting, named scores.

    Call it as the reward role does: ``rf(prompt, response, answer) -> float`` (``answer`` is
    wrapped as ``sample = {"answer": answer}``), or :meth:`score` with a full sample dict.
    A timed-out call is abandoned (its thread finishes in the background; Python cannot kill
    a thread) and scored ``on_error``.
    """

    def __init__(self, fn: RewardFn, timeout_s: float | None = 10.0, on_error: float = 0.0,
                 key: str | None = None, max_workers: int = 4):
        self.fn, self.timeout_s, self.on_error, self.key = fn, timeout_s, float(on_error), key
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="reward-fn") if timeout_s else None
        self._lock = threading.Lock()
        self.calls = 0
        self.errors = {"exception": 0, "timeout": 0, "non_number": 0}
        self._named: dict[str, list[float]] = {}

    def __call__(self, prompt: str, response: str, answer: str) -> float:
        return self.score(prompt, response, {"answer": answer})

    def score(self, prompt: str, response: str, sample: dict) -> float:
        with self._lock:
            self.calls += 1
        try:
            if self._pool is None:
                value = self.fn(prompt, response, sample)
            else:
                value = self._pool.submit(self.fn, prompt, response, sample).result(timeout=self.timeout_s)
        except FutureTimeout:
            return self._fail("timeout")
        except Exception:
            return self._fail("exception")
        reward = self._reduce(value)
        return self._fail("non_number") if reward is None else reward

    def _reduce(self, value) -> float | None:
        if isinstance(value, dict):
            scores = {k: _finite(v) for k, v in value.items()}
            if not scores or any(v is None for v in scores.values()) or (self.key and self.key not in scores):
                return None
            with self._lock:
                for k, v in scores.items():
                    self._named.setdefault(k, []).append(v)
            return scores[self.key] if self.key else float(sum(scores.values()))
        return _finite(value)

    def _fail(self, kind: str) -> float:
        with self._lock:
            self.errors[kind] += 1
        return self.on_error

    def stats(self) -> dict:
        """Counters and the mean of each named score so far."""
        with self._lock:
            out = {"reward_calls": self.calls, **{f"reward_{k}": n for k, n in self.errors.items()}}
            out.update({f"score_{k}": sum(v) / len(v) for k, v in self._named.items() if v})
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _finite(v) -> float | None:
    """``v`` as a finite float if it is a real number (bool and numpy scalars included), else None."""
    if not isinstance(v, numbers.Real):
        return None  # strings, None, lists... ("1" is not a score: it is a bug in the function)
    f = float(v)
    return f if math.isfinite(f) else None
