"""The reward role scores streamed samples; a broken reward never stops it (counted instead)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from asyncflow.dataplane import DataPlane
from asyncflow.workflow.fields import SCHEMA, encode_text
from asyncflow.workflow.roles.reward import RewardRole

CHARS = "0123456789+="


def decode(ids):
    return "".join(CHARS[i] for i in ids)


def encode(s):
    return np.asarray([CHARS.index(c) for c in s], dtype=np.int64)


def put_samples(plane, answers_and_responses):
    plane.put({"prompt_ids": [encode("1+1=")] * len(answers_and_responses),
            "response_ids": [encode(r) for _, r in answers_and_responses],
            "answer": [encode_text(a) for a, _ in answers_and_responses]}, partition=0)


def run_until(role, n, timeout=5.0):
    deadline = time.monotonic() + timeout
    while role.items < n:
        assert time.monotonic() < deadline, f"only {role.items} of {n} scored"
        role.poll(0.05)


def rewards(plane, n):
    meta, data = plane.get_batch("check", ["reward"], n=n)
    return data["reward"].tolist()


def exact(prompt, response, answer):
    return 1.0 if response == answer else 0.0


@pytest.mark.parametrize("latency", [None, (20.0, 40.0)])
def test_scores_every_sample(latency):
    plane = DataPlane(SCHEMA)
    put_samples(plane, [("2", "2"), ("2", "3"), ("11", "11")])
    role = RewardRole(plane, exact, decode, micro=2, concurrency=8, latency_ms=latency)
    try:
        run_until(role, 3)
        assert rewards(plane, 3) == [1.0, 0.0, 1.0]
        assert role.errors == 0
    finally:
        role.close()


def test_remote_calls_overlap():
    """64 calls of 100 ms each with 64 in flight take ~0.1 s, not 6.4 s."""
    plane = DataPlane(SCHEMA)
    put_samples(plane, [("2", "2")] * 64)
    role = RewardRole(plane, exact, decode, micro=64, concurrency=64, latency_ms=(100.0, 100.0))
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

    plane = DataPlane(SCHEMA)
    put_samples(plane, [("2", r) for r in "23456"])
    role = RewardRole(plane, broken, decode, micro=8, concurrency=8, latency_ms=latency)
    try:
        run_until(role, 5)
        assert rewards(plane, 5) == [1.0, 0.0, 0.0, 0.0, 0.0]
        assert role.errors == 4  # nan, a string, None, ZeroDivisionError
        assert role.stats()["errors"] == 4
    finally:
        role.close()


def test_trickling_remote_results_are_written_once_per_window():
    """64 calls finishing one by one over ~0.2 s reach the data plane in a few puts (one per
    collection window of 50 ms), not one put per result: each data-plane call costs CPU on
    both sides, which a small machine takes from the trainer."""
    plane = DataPlane(SCHEMA)
    puts = []
    real_put = plane.put_nowait
    plane.put_nowait = lambda data, **kw: (puts.append(len(data["reward"])), real_put(data, **kw))[1]
    put_samples(plane, [("2", "2")] * 64)
    role = RewardRole(plane, exact, decode, micro=64, concurrency=64, latency_ms=(20.0, 220.0))
    try:
        run_until(role, 64)
        assert sum(puts) == 64
        assert len(puts) <= 0.25 / RewardRole.window_s + 2  # old behaviour: ~one put per result
        assert rewards(plane, 64) == [1.0] * 64
    finally:
        role.close()


# --------------------------------------------------------------------------- async and batched reward functions


async def slow_exact(prompt, response, sample):
    import asyncio

    await asyncio.sleep(30 if response == "9" else 0.05)  # "9" hangs
    return {"correct": 1.0 if response == sample["answer"] else 0.0, "format": 0.5}


def test_async_reward_calls_overlap_and_a_hang_is_cut_by_the_timeout():
    """32 async calls of 50 ms with 32 in flight take ~0.1 s, not 32 x 50 ms = 1.6 s; a call
    that hangs scores on_error at timeout_s and is counted; key picks the named score."""
    from asyncflow.tasks.rewards import RewardFunction

    plane = DataPlane(SCHEMA)
    put_samples(plane, [("2", "2")] * 16 + [("2", "3")] * 15 + [("2", "9")])
    rf = RewardFunction(slow_exact, timeout_s=0.3, on_error=-1.0, key="correct")
    role = RewardRole(plane, rf, decode, micro=32, concurrency=32)
    try:
        t = time.perf_counter()
        run_until(role, 32)
        assert time.perf_counter() - t < 0.8  # bounded by the 0.3 s timeout, far below 1.6 s serial
        assert rewards(plane, 32) == [1.0] * 16 + [0.0] * 15 + [-1.0]
        s = role.stats()
        assert (s["reward_calls"], s["reward_timeout"], s["score_format"]) == (32, 1, 0.5)
        assert s["errors"] == 0 and s["inflight"] == 0
    finally:
        role.close()
        rf.close()


def test_bare_coroutine_function_runs_on_the_loop():
    async def exact_async(prompt, response, answer):
        return 1.0 if response == answer else 0.0

    plane = DataPlane(SCHEMA)
    put_samples(plane, [("2", "2"), ("2", "3")])
    role = RewardRole(plane, exact_async, decode, micro=8, concurrency=8)
    try:
        run_until(role, 2)
        assert rewards(plane, 2) == [1.0, 0.0]
    finally:
        role.close()


def test_batched_reward_gets_the_whole_micro_batch_in_one_call():
    from asyncflow.tasks.rewards import RewardFunction

    calls = []

    def batched(prompts, responses, samples):
        calls.append(list(responses))
        if "4" in responses:
            return [1.0]  # wrong length: the whole batch scores on_error
        return [{"correct": float(r == s["answer"]), "format": 1.0} for r, s in zip(responses, samples)]

    plane = DataPlane(SCHEMA)
    rf = RewardFunction(batched, on_error=-1.0, key="correct", batched=True)
    role = RewardRole(plane, rf, decode, micro=8, concurrency=2)  # concurrency bounds in-flight calls only
    try:
        put_samples(plane, [("2", r) for r in "23232323"])
        run_until(role, 8)
        put_samples(plane, [("2", r) for r in "245"])
        run_until(role, 11)
        assert calls == [list("23232323"), list("245")]
        assert rewards(plane, 11) == [1.0, 0.0] * 4 + [-1.0] * 3
        s = role.stats()
        assert (s["reward_calls"], s["reward_batches"], s["reward_wrong_length"]) == (11, 2, 3)
        assert s["score_format"] == 1.0
    finally:
        role.close()
        rf.close()


# ---------------------------------------------------------------- GroupScorer (rewards in rollout)
def drain_groups(scorer, n, timeout=5.0):
    """Every (key, rewards) back from ``scorer`` until ``n`` groups came, in arrival order."""
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n:
        assert time.monotonic() < deadline, f"only {len(out)} of {n} groups back"
        out += scorer.ready(0.01)
    return out


def group(*pairs):
    return [(encode("1+1="), encode(resp), encode_text(ans)) for ans, resp in pairs]


@pytest.mark.parametrize("latency", [None, (5.0, 30.0)])
def test_group_scorer_returns_each_group_once_with_its_rewards(latency):
    from asyncflow.workflow.roles.reward import GroupScorer

    role = RewardRole(DataPlane(SCHEMA), exact, decode, concurrency=3, latency_ms=latency)
    scorer = GroupScorer(role)
    try:
        scorer.submit("g0", group(("2", "2"), ("2", "3")))
        scorer.submit("g1", group(("11", "11"), ("11", "1"), ("11", "11")))
        scorer.submit("g2", group(("7", "")))  # an empty answer scores 0
        assert scorer.waiting == 3
        back = dict(drain_groups(scorer, 3))
        assert back == {"g0": [1.0, 0.0], "g1": [1.0, 0.0, 1.0], "g2": [0.0]}
        assert scorer.waiting == 0 and scorer.ready(0) == []  # nothing comes back twice
        assert role.remote is None or role.remote.inflight == 0
    finally:
        scorer.close()


def test_group_scorer_keeps_concurrency_and_counts_errors():
    from asyncflow.workflow.roles.reward import GroupScorer

    def broken(prompt, response, answer):
        if response == "boom":
            raise ValueError("verifier down")
        return 1.0

    role = RewardRole(DataPlane(SCHEMA), broken, lambda ids: "boom" if ids[0] == 0 else "ok",
                      concurrency=2, latency_ms=(20.0, 20.0))
    scorer = GroupScorer(role)
    try:
        items = [(np.asarray([1]), np.asarray([i % 2]), encode_text("a")) for i in range(4)]
        scorer.submit("g", items)
        assert role.remote.inflight == 2 and len(scorer.backlog) == 2  # the rest wait their turn
        assert drain_groups(scorer, 1) == [("g", [0.0, 1.0, 0.0, 1.0])]  # failures score 0
        assert role.errors == 2
    finally:
        scorer.close()


def test_group_scorer_sends_each_answer_as_it_finishes_and_forgets_cancelled_groups():
    from asyncflow.workflow.roles.reward import GroupScorer

    role = RewardRole(DataPlane(SCHEMA), exact, decode, concurrency=2, latency_ms=(30.0, 30.0))
    scorer = GroupScorer(role)
    try:
        scorer.open("g", 3)
        scorer.add("g", 1, group(("5", "5"))[0])  # answers arrive in any order, by index
        assert role.remote.inflight == 1  # in flight before the group's other answers exist
        assert scorer.ready(0.05) == []  # its reward is back, but the group is not complete
        scorer.add("g", 0, group(("5", "4"))[0])
        scorer.add("g", 2, group(("5", "5"))[0])
        assert drain_groups(scorer, 1) == [("g", [0.0, 1.0, 1.0])]  # rewards in answer order

        scorer.open("x", 4)  # a group restarted or expired while its answers are scored
        for i in range(4):
            scorer.add("x", i, group(("5", "5"))[0])
        assert role.remote.inflight == 2 and len(scorer.backlog) == 2
        scorer.cancel("x")
        assert len(scorer.backlog) == 0 and scorer.waiting == 0  # queued calls are never sent
        scorer.submit("y", group(("6", "6")))
        assert drain_groups(scorer, 1) == [("y", [1.0])]  # results of "x" in flight are ignored
        time.sleep(0.05)
        assert scorer.ready(0.0) == [] and role.errors == 0
    finally:
        scorer.close()


def test_group_scorer_calls_a_batched_function_once_per_group_when_its_last_answer_is_added():
    from asyncflow.workflow.roles.reward import GroupScorer

    calls = []

    def fn(prompt, response, answer):
        return 1.0

    fn.batched = True
    role = RewardRole(DataPlane(SCHEMA), fn, decode)
    role._call_batch = lambda texts: calls.append(len(texts)) or [float(len(t[1])) for t in texts]
    scorer = GroupScorer(role)
    scorer.open("g", 2)
    scorer.add("g", 0, group(("1", "123"))[0])
    assert calls == [] and scorer.ready(0) == []
    scorer.add("g", 1, group(("1", "1"))[0])
    assert calls == [2] and scorer.ready(0) == [("g", [3.0, 1.0])]


def test_remote_calls_drain_early_wakes_at_the_first_result_or_another_ring():
    from asyncflow.workflow.roles.reward import RemoteCalls

    calls = RemoteCalls()
    try:
        calls.submit([("a", lambda: 1.0, (), 0.03), ("b", lambda: 2.0, (), 5.0)])
        t = time.monotonic()
        assert calls.drain(2.0, early=True) == [("a", 1.0)]  # not the whole 2 s window
        assert time.monotonic() - t < 1.0 and calls.inflight == 1
        threading.Timer(0.05, calls.bell.set).start()  # e.g. new weights staged meanwhile
        t = time.monotonic()
        assert calls.drain(2.0, early=True) == [] and time.monotonic() - t < 1.0
        t = time.monotonic()
        assert calls.drain(0.1) == [] and time.monotonic() - t >= 0.1  # default: the whole window
    finally:
        calls.close()


def test_a_staged_weight_version_rings_the_bell_rollout_idles_on():
    from asyncflow.weights.store import WeightStore, seal
    from asyncflow.weights.subscriber import WeightSubscriber

    store, bell = WeightStore(), threading.Event()
    sub = WeightSubscriber(store, lambda v, w: None, poll_s=0.05)
    sub.bell = bell
    try:
        store.publish(1, seal({"w": np.ones(3, dtype=np.float32)}))
        assert bell.wait(2.0) and sub.staged_version() == 1
    finally:
        sub.close()
