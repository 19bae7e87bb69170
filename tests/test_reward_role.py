"""The reward role scores streamed samples; a broken reward never stops it (counted instead)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from asyncflow.queue import DataPlane
from asyncflow.workflow.fields import SCHEMA, encode_text
from asyncflow.workflow.reward import RewardRole

CHARS = "0123456789+="


def decode(ids):
    return "".join(CHARS[i] for i in ids)


def encode(s):
    return np.asarray([CHARS.index(c) for c in s], dtype=np.int64)


def put_samples(dp, answers_and_responses):
    dp.put({"prompt_ids": [encode("1+1=")] * len(answers_and_responses),
            "response_ids": [encode(r) for _, r in answers_and_responses],
            "answer": [encode_text(a) for a, _ in answers_and_responses]}, partition=0)


def run_until(role, n, timeout=5.0):
    deadline = time.monotonic() + timeout
    while role.items < n:
        assert time.monotonic() < deadline, f"only {role.items} of {n} scored"
        role.poll(0.05)


def rewards(dp, n):
    meta, data = dp.get_batch("check", ["reward"], n=n)
    return data["reward"].tolist()


def exact(prompt, response, answer):
    return 1.0 if response == answer else 0.0


@pytest.mark.parametrize("latency", [None, (20.0, 40.0)])
def test_scores_every_sample(latency):
    dp = DataPlane(SCHEMA)
    put_samples(dp, [("2", "2"), ("2", "3"), ("11", "11")])
    role = RewardRole(dp, exact, decode, micro=2, concurrency=8, latency_ms=latency)
    try:
        run_until(role, 3)
        assert rewards(dp, 3) == [1.0, 0.0, 1.0]
        assert role.errors == 0
    finally:
        role.close()


def test_remote_calls_overlap():
    """64 calls of 100 ms each with 64 in flight take ~0.1 s, not 6.4 s."""
    dp = DataPlane(SCHEMA)
    put_samples(dp, [("2", "2")] * 64)
    role = RewardRole(dp, exact, decode, micro=64, concurrency=64, latency_ms=(100.0, 100.0))
    try:
        t = time.perf_counter()
        run_until(role, 64)
        assert time.perf_counter() - t < 1.0
    finally:
        role.close()


@pytest.mark.parametrize("latency", [None, (1.0, 2.0)])
def test_broken_rewards_score_zero_and_are_counted(latency):
    def broken(prompt, response, answer):
        return {"2": 1.0, "3": float("nan"), "4": "high", "5": None}.get(response) or 1 / 0

    dp = DataPlane(SCHEMA)
    put_samples(dp, [("2", r) for r in "23456"])
    role = RewardRole(dp, broken, decode, micro=8, concurrency=8, latency_ms=latency)
    try:
        run_until(role, 5)
        assert rewards(dp, 5) == [1.0, 0.0, 0.0, 0.0, 0.0]
        assert role.errors == 4  # nan, a string, None, ZeroDivisionError
        assert role.stats()["errors"] == 4
    finally:
        role.close()


def test_trickling_remote_results_are_written_once_per_window():
    """64 calls finishing one by one over ~0.2 s reach the data plane in a few puts (one per
    collection window of 50 ms), not one put per result: each data-plane call costs CPU on
    both sides, which a small machine takes from the trainer."""
    dp = DataPlane(SCHEMA)
    puts = []
    real_put = dp.put_nowait
    dp.put_nowait = lambda data, **kw: (puts.append(len(data["reward"])), real_put(data, **kw))[1]
    put_samples(dp, [("2", "2")] * 64)
    role = RewardRole(dp, exact, decode, micro=64, concurrency=64, latency_ms=(20.0, 220.0))
    try:
        run_until(role, 64)
        assert sum(puts) == 64
        assert len(puts) <= 0.25 / RewardRole.window_s + 2  # old behaviour: ~one put per result
        assert rewards(dp, 64) == [1.0] * 64
    finally:
        role.close()
