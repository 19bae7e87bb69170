"""Reward API contract: loading by import path, timeouts, error scoring and counting, built-ins."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from asyncflow.config import ConfigError, load_config
from asyncflow.tasks import rewards as R
from asyncflow.tasks.rewards import RewardError, RewardFunction, load_reward_fn

BUILTINS = ["exact_match", "math_answer", "format_reward", "math_answer_and_format"]


# --------------------------------------------------------------------------- plugins used by the tests


def flaky(prompt: str, response: str, sample: dict):
    """Misbehaves on purpose, chosen by the response text."""
    if response == "raise":
        raise RuntimeError("verifier crashed")
    if response == "slow":
        time.sleep(0.5)
        return 1.0
    if response == "text":
        return "1.0"
    if response == "nan":
        return float("nan")
    if response == "none":
        return None
    if response == "named":
        return {"correct": 1.0, "format": 0.25}
    if response == "named-bad":
        return {"correct": 1.0, "format": "x"}
    return np.float32(0.5)


# --------------------------------------------------------------------------- loading


def test_load_by_import_path():
    assert load_reward_fn("asyncflow.tasks.rewards:math_answer") is R.math_answer


@pytest.mark.parametrize("path, words", [
    ("no_such_pkg.mod:fn", ["no_such_pkg", "PYTHONPATH"]),
    ("asyncflow.tasks.rewards:nope", ["has no function 'nope'"]),
    ("asyncflow.tasks.rewards", ["package.module:function"]),
])
def test_load_errors_name_the_field_and_fix(path, words):
    with pytest.raises(RewardError) as e:
        load_reward_fn(path)
    msg = str(e.value)
    assert "reward.fn" in msg and "\n" not in msg and all(w in msg for w in words)
    assert isinstance(e.value, ConfigError)  # the CLI prints it as a one-line config error


def test_config_checks_the_path_shape():
    assert load_config(None, ["reward.fn=asyncflow.tasks.rewards:math_answer"]).reward.fn.endswith(":math_answer")
    with pytest.raises(ConfigError, match=r"reward: fn = 'math_answer' is not an import path.*package.module:function"):
        load_config(None, ["reward.fn=math_answer"])


# --------------------------------------------------------------------------- calling


def test_errors_timeouts_and_non_numbers_score_on_error_and_are_counted():
    rf = RewardFunction(flaky, timeout_s=0.1, on_error=-1.0)
    assert rf.score("p", "ok", {"answer": "1"}) == 0.5  # numpy scalars are numbers
    t = time.perf_counter()
    assert rf.score("p", "slow", {}) == -1.0
    assert time.perf_counter() - t < 0.4  # the caller is not held for the slow call
    assert [rf.score("p", r, {}) for r in ("raise", "text", "nan", "none", "named-bad")] == [-1.0] * 5
    s = rf.stats()
    assert s["reward_calls"] == 7
    assert (s["reward_exception"], s["reward_timeout"], s["reward_non_number"]) == (1, 1, 4)
    rf.close()


def test_named_scores_sum_or_key_and_are_logged():
    rf = RewardFunction(flaky, timeout_s=None)
    assert rf("p", "named", "1") == pytest.approx(1.25)  # role-style call: answer -> sample
    assert rf.stats()["score_format"] == pytest.approx(0.25)
    assert RewardFunction(flaky, key="correct")("p", "named", "1") == 1.0
    missing = RewardFunction(flaky, key="bogus", on_error=0.0)
    assert missing("p", "named", "1") == 0.0 and missing.stats()["reward_non_number"] == 1


# --------------------------------------------------------------------------- built-ins


@pytest.mark.parametrize("text, boxed, gsm, last", [
    ("so \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}", None, "2"),
    ("first \\boxed{3} then \\boxed{4}", "4", None, "4"),
    ("\\boxed{5", None, None, "5"),                     # unbalanced: no boxed answer
    ("48 + 24 = 72\n#### 72", None, "72", "72"),
    ("total 1,234.5 apples, 7 pears", None, None, "7"),
    ("no digits", None, None, None),
])
def test_extractors(text, boxed, gsm, last):
    assert (R.extract_boxed(text), R.extract_gsm8k(text), R.extract_last_number(text)) == (boxed, gsm, last)


@pytest.mark.parametrize("response, answer, want", [
    ("The answer is \\boxed{72}.", "72", 1.0),
    ("#### 1,234", "1234", 1.0),                        # commas ignored, numeric compare
    ("so it is 72.0", "Natalia sold 72 clips.\n#### 72", 1.0),  # GSM8K reference unwrapped
    ("\\boxed{x+1}", "x+1", 1.0),                       # non-numeric: string compare
    ("\\boxed{71} but maybe 72", "72", 0.0),            # boxed wins over the last number
    ("", "72", 0.0),
])
def test_math_answer(response, answer, want):
    assert R.math_answer("q", response, {"answer": answer}) == want


def test_exact_match_and_format():
    assert R.exact_match("1+2=", " 3 ", {"answer": "3"}) == 1.0
    assert R.exact_match("1+2=", "3.0", {"answer": "3"}) == 0.0
    assert R.format_reward("q", "x \\boxed{2}", {}) == 1.0 and R.format_reward("q", "#### 2", {}) == 1.0
    assert R.format_reward("q", "2", {}) == 0.0
    assert R.math_answer_and_format("q", "\\boxed{2}", {"answer": "2"}) == {"correct": 1.0, "format": 1.0}


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_contract(name):
    """Every built-in honours the contract: finite float or dict of finite floats, on any text."""
    fn = load_reward_fn(f"asyncflow.tasks.rewards:{name}")
    for response in ["", "\\boxed{", "#### ", "12", "\\boxed{12}", "é ∑ \x00"]:
        out = fn("prompt", response, {"answer": "12"})
        vals = out.values() if isinstance(out, dict) else [out]
        assert all(isinstance(v, float) and math.isfinite(v) for v in vals), (name, response, out)


def test_reward_fn_in_a_run_never_crashes_and_is_counted(tmp_path):
    """A configured function that misbehaves on every answer: the run finishes, errors are counted."""
    from asyncflow.launch.local import LocalLauncher
    from asyncflow.api import train

    cfg = load_config(None, [
        "mode=stream", "launcher=local", "warmstart.enabled=false", "progress=false", "train.steps=2",
        "train.prompts_per_step=2", "train.micro_prompts=1", "rollout.group_size=2", "rollout.max_batch=4",
        "reward.fn=test_rewards:always_raises", "reward.timeout_s=1", f"run_dir={tmp_path}"])
    summary = train(cfg, launcher=LocalLauncher(), run_dir=tmp_path, evaluate=False)
    assert summary["reward_fn"]["reward_calls"] == 8
    assert summary["reward_fn"]["reward_exception"] == 8 == summary["reward_errors"]  # one figure, agreeing


def always_raises(prompt, response, sample):
    raise ValueError("broken verifier")


# --------------------------------------------------------------------------- async and batched shapes


async def async_flaky(prompt, response, sample):
    import asyncio

    if response == "hang":
        await asyncio.sleep(30)
    if response == "raise":
        raise RuntimeError("verifier crashed")
    if response == "named":
        return {"correct": 1.0, "format": 0.25}
    return 1.0 if response == sample["answer"] else 0.0


def test_async_fn_called_synchronously_has_timeout_and_counters():
    """The inline path (dynamic sampling's score_ids) calls an async function on its own loop."""
    rf = RewardFunction(async_flaky, timeout_s=0.2, on_error=-1.0, key="correct")
    assert rf.is_async and not rf.batched
    assert rf("p", "7", "7") == 1.0 and rf("p", "8", "7") == 0.0 and rf("p", "named", "7") == 1.0
    t = time.perf_counter()
    assert rf("p", "hang", "7") == -1.0 and rf("p", "raise", "7") == -1.0
    assert time.perf_counter() - t < 1.0  # the hanging coroutine was cut at 0.2 s
    s = rf.stats()
    assert (s["reward_calls"], s["reward_timeout"], s["reward_exception"]) == (5, 1, 1)
    assert s["score_format"] == 0.25
    rf.close()


def test_batched_fn_one_call_per_batch_and_error_policy():
    seen = []

    def batched(prompts, responses, samples):
        seen.append(len(prompts))
        if "raise" in responses:
            raise ValueError("batch verifier crashed")
        if "short" in responses:
            return [1.0] * (len(responses) - 1)
        return np.array([{"2": 1.0, "3": 0.0}.get(r, np.nan) for r in responses])  # an array is fine too

    rf = RewardFunction(batched, timeout_s=1.0, on_error=-1.0, batched=True)
    assert rf.score_batch(["p"] * 3, ["2", "3", "x"], [{}] * 3) == [1.0, 0.0, -1.0]  # nan: only its sample
    assert rf.score_batch(["p"] * 4, ["2", "short", "2", "3"], [{}] * 4) == [-1.0] * 4
    assert rf.score_batch(["p"] * 2, ["raise", "2"], [{}] * 2) == [-1.0] * 2
    assert rf("p", "2", "2") == 1.0  # a per-sample call is a batch of one
    assert seen == [3, 4, 2, 1]
    s = rf.stats()
    assert (s["reward_calls"], s["reward_batches"]) == (10, 4)
    assert (s["reward_non_number"], s["reward_wrong_length"], s["reward_exception"]) == (1, 4, 2)
    rf.close()


def test_batched_fn_timeout_marks_the_whole_batch():
    def slow(prompts, responses, samples):
        time.sleep(0.5)
        return [1.0] * len(prompts)

    rf = RewardFunction(slow, timeout_s=0.1, on_error=-2.0, batched=True)
    assert rf.score_batch(["p"] * 3, ["a", "b", "c"], [{}] * 3) == [-2.0] * 3
    assert rf.stats()["reward_timeout"] == 3
    rf.close()


def test_batched_config_checks():
    cfg = load_config(None, ["reward.fn=test_rewards:flaky", "reward.batched=true"])
    assert cfg.reward.batched
    with pytest.raises(ConfigError, match=r"reward: batched = true needs fn.*reward.fn="):
        load_config(None, ["reward.batched=true"])
    with pytest.raises(ConfigError, match=r"batched = true with latency_ms.*drop one"):
        load_config(None, ["reward.fn=test_rewards:flaky", "reward.batched=true", "reward.latency_ms=[1,2]"])
