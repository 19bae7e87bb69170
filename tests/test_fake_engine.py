"""The deterministic fake engine, and role tests that use it (rollout + reward, no model).

The rollout role is the real one; only the engine (and the weight delivery) is faked, so
these tests check the role's logic (admission, placement, the swap policy, per-token
versions) in milliseconds.
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np
import pytest

from asyncflow.engines.fake import EOS, FakeEngine
from asyncflow.engines.types import Request, SamplingParams
from asyncflow.dataplane import DataPlane
from asyncflow.workflow.fields import SCHEMA, encode_text
from asyncflow.workflow.roles.reward import RewardRole
from asyncflow.workflow.rollout import RolloutRole


def test_fake_generate_is_scripted_and_continuously_batched():
    eng = FakeEngine(max_batch=2)
    reqs = [Request(0, [1, 5], max_new_tokens=3), Request(1, [1], max_new_tokens=1),
            Request(2, [1, 6, 7], max_new_tokens=2)]
    out = eng.generate(reqs, SamplingParams(max_new_tokens=8))
    # Hand-traced: add(0, 1) -> 1 ends on its first token (EOS); step -> 0 has 2 tokens;
    # add(2) -> first token; step -> 0 and 2 end on EOS together.
    assert [c.key for c in out] == [1, 0, 2]
    got = {c.key: c for c in out}
    assert got[0].response_ids == [4, 5, EOS] and got[1].response_ids == [EOS] and got[2].response_ids == [4, EOS]
    assert all(c.finished_on_eos and c.logprobs == [-1.0] * len(c.response_ids) for c in out)
    assert got[0].token_versions == [0, 0, 0]
    assert (eng.busy_slots, eng.total_slots) == (3, 4)  # two steps: 1 then 2 live rows of 2 slots
    # A forced length: exactly min_new_tokens digits, no EOS.
    (c,) = FakeEngine().generate([Request(9, [1], max_new_tokens=4, min_new_tokens=4)], SamplingParams())
    assert c.response_ids == [4, 5, 6, 7] and not c.finished_on_eos


class StagedWeights:
    """The weight-subscriber edge, driven by hand: ``stage(v)`` = the trainer published v."""

    def __init__(self, engine):
        self.engine, self.version, self.staged = engine, 0, 0
        self.swap_seconds, self.swaps, self.rejected = 0.0, 0, 0

    def stage(self, v):
        self.staged = v

    def staged_version(self):
        return self.staged

    def swap_if_ready(self):
        if self.staged <= self.version:
            return False
        self.engine.load_weights(self.staged, {"w": np.zeros(1)})
        self.version, self.swaps = self.staged, self.swaps + 1
        return True

    def wait_staged(self, timeout):
        return False


def _answers():
    """Forced lengths, except that the 2nd answer of each group is 2 tokens: groups whose
    length is > 2 then have a finished and an unfinished answer at once."""
    seen = defaultdict(int)

    def answer(req, sp):
        n, seen[req.key[0]] = seen[req.key[0]], seen[req.key[0]] + 1
        return [4 + j % 10 for j in range(req.min_new_tokens if n % 2 == 0 else 2)]
    return answer


def _put_prompts(plane, partition, lens):
    plane.put({"query_ids": [np.asarray([1, 5 + i], dtype=np.int64) for i in range(len(lens))],
            "answer": [encode_text("7")] * len(lens), "gen_len": np.asarray(lens, dtype=np.int64)},
           partition=partition)


def _poll_until(role, cond, limit=200):
    for _ in range(limit):
        if cond():
            return
        role.poll(0.01)
    raise AssertionError("condition not reached")


@pytest.mark.parametrize("on_swap", ["continue", "discard"])
def test_rollout_swap_policy_with_the_fake_engine(on_swap):
    t0 = time.perf_counter()
    plane = DataPlane(SCHEMA)
    _put_prompts(plane, 0, [1, 1])  # step 0: two one-token groups
    _put_prompts(plane, 1, [2, 6])  # step 1: a short group (C) and a long one (D)
    eng = FakeEngine(answer=_answers(), logprob=lambda version, pos: -1.0 - version, max_batch=8)
    weights = StagedWeights(eng)
    role = RolloutRole(eng, plane, SamplingParams(max_new_tokens=8), group_size=2, prompts_per_step=2,
                       staleness=1, weights=weights, on_swap=on_swap)
    role.collector.flush_s = 0.0  # send each placed group at once (the default batches for 20 ms)
    _poll_until(role, lambda: role.state.produced[0] == 4 and role.state.produced[1] == 2)  # step 0 full, C placed
    assert role.placer.started == 4 and len(role.batch) == 1  # D's long answer is still decoding
    live = role.batch.rows[0]
    n_old = len(live.out)
    assert 2 <= n_old < 6
    weights.stage(1)  # the trainer consumed step 0 and published version 1
    _poll_until(role, lambda: role.state.produced[1] == 4)
    assert role.placer.started == 4  # a restart is not a new admission
    meta, data = plane.get_batch("check", ["group", "version", "token_versions", "logprobs", "response_ids"],
                              n=4, partition=1)
    by_group = defaultdict(list)
    for i, g in enumerate(data["group"].tolist()):
        by_group[g].append(i)
    d_group = max(by_group, key=lambda g: max(len(data["response_ids"][i]) for i in by_group[g]))
    for i in by_group[d_group]:
        tv, lp = data["token_versions"][i].tolist(), data["logprobs"][i].tolist()
        assert lp == [-1.0 - v for v in tv]  # each log-prob came from the version it records
        if on_swap == "discard":  # the whole group restarted under version 1
            assert tv == [1] * len(tv) and int(data["version"][i]) == 1
    long_row = max(by_group[d_group], key=lambda i: len(data["response_ids"][i]))
    tv = data["token_versions"][long_row].tolist()
    if on_swap == "continue":
        assert tv == [0] * n_old + [1] * (6 - n_old)  # the continued answer shows both versions
        assert data["version"][by_group[d_group]].tolist() == [0, 0] and role.state.discarded == 0
    else:
        assert role.state.discarded == 2  # the live answer and its finished sibling
    # Version tags stay within the staleness bound of the step they landed in (step 1, k = 1).
    assert all(0 <= 1 - v <= 1 for v in data["version"].tolist())

    # The reward role scores the streamed samples (answer "7": the fake's digits never match).
    reward = RewardRole(plane, lambda p, r, a: float(r == a), lambda ids: "".join(map(str, ids)), micro=8)
    try:
        _poll_until(reward, lambda: reward.items == 8)
    finally:
        reward.close()
    assert plane.get_batch("check2", ["reward"], n=4, partition=1)[1]["reward"].tolist() == [0.0] * 4
    assert time.perf_counter() - t0 < 2.0  # no model: the whole pipeline is milliseconds of work
