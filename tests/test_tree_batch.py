"""ETMR's trees on an engine (asyncflow/workflow/tree_batch.py): every request comes back once,
branches share their parent's prefix (its tokens, log-probs and versions), the token counts are
exact, a dropped group goes whole, and on the tiny model each answer's recorded log-probs equal
a full forward of it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncflow.algorithms.etmr import TreeShape
from asyncflow.dataplane import DataPlane
from asyncflow.engines.fake import FakeEngine
from asyncflow.engines.types import Request, SamplingParams
from asyncflow.tasks.majority import MajorityVote
from asyncflow.workflow.fields import SCHEMA, encode_text
from asyncflow.workflow.roles.reward import GroupScorer, RewardRole
from asyncflow.workflow.rollout import RolloutRole
from asyncflow.workflow.tree_batch import TreeEngine

torch.set_num_threads(1)
SHAPE = TreeShape(roots=2, forks=1, branches=3, rounds=1)  # 8 answers a group
SP = SamplingParams(temperature=1.0, max_new_tokens=4)


def group(gid: int, n: int = 8) -> list[Request]:
    return [Request(key=(gid, b"7"), prompt_ids=[1, 5, 6 + gid]) for _ in range(n)]


def drain(batch, limit: int = 100) -> list:
    done = []
    for _ in range(limit):
        if not len(batch):
            return done
        done += batch.step()
    raise AssertionError(f"{len(batch)} still live")


def test_a_group_grows_as_trees_and_every_request_comes_back_once():
    # surprisal grows with the position: each root forks at its last token (the EOS), index 3
    engine = TreeEngine(FakeEngine(logprob=lambda version, pos: -0.1 * (pos + 1)), SHAPE, 8)
    batch = engine.new_batch(SP)
    reqs = group(0) + group(1)
    assert batch.add(reqs) == [] and len(batch) == 16  # 4 roots live + 12 branches owed
    done = drain(batch)
    assert len(done) == 16 and [c.key[0] for c in done].count(0) == 8  # each request's answer, once
    for c in done:  # the fake's script: 4, 5, 6, EOS; a branch resampled the EOS after [4, 5, 6]
        assert c.response_ids == [4, 5, 6, 2] and c.logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4])
        assert c.token_versions == [0, 0, 0, 0] and c.version == 0
    # generated: per group 2 roots x 4 + 6 branches x 1 = 14; independent 8 x 4 = 32
    assert engine.stats() == {"etmr_groups": 2, "etmr_generated": 28, "etmr_independent": 64,
                              "etmr_fallbacks": 0, "etmr_over_budget": 0}


def test_branches_inherit_the_prefix_versions_and_sample_the_rest_at_the_batchs():
    engine = TreeEngine(FakeEngine(logprob=lambda version, pos: -1.0 if pos == 1 else -0.5), SHAPE, 8)
    batch = engine.new_batch(SP)
    batch.add(group(3))
    done = []
    while len(done) < 2:  # the roots (version 0) finish; their branches start at index 1
        done += batch.step()
    batch.version = 1  # a swap (on_swap=continue): the branches' own tokens are of version 1
    done += drain(batch)
    branches = [c for c in done if c.token_versions != [0, 0, 0, 0]]
    assert len(branches) == 6
    for c in branches:
        assert c.token_versions == [0, 1, 1, 1] and c.version == 0 and c.logprobs[0] == -0.5


def test_dropping_a_group_mid_tree_returns_its_requests_not_returned_yet():
    engine = TreeEngine(FakeEngine(), SHAPE, 8)
    batch = engine.new_batch(SP)
    a, b = group(0), group(1)
    batch.add(a + b)
    out = []
    while not out:
        out = batch.step()  # the roots finish together; 6 branches each start
    assert len(out) == 4 and len(batch) == 12
    dropped = batch.drop(lambda r: r.key[0] == 0)
    assert {id(r) for r in dropped} == {id(r) for r in a} - {id(r) for r in a[:2]} and len(batch) == 6
    rest = batch.drop_all()
    assert len(rest) == 6 and len(batch) == 0 and batch.step() == []


def test_plain_requests_decode_as_they_would_without_trees():
    engine = TreeEngine(FakeEngine(), SHAPE, 8)
    batch = engine.new_batch(SP)
    reqs = [Request(key=f"r{i}", prompt_ids=[1, 5]) for i in range(3)]
    batch.add(reqs)
    assert sorted(c.key for c in drain(batch)) == ["r0", "r1", "r2"] and engine.stats()["etmr_groups"] == 0


def test_the_shape_must_fit_the_group():
    with pytest.raises(ValueError, match="8 answers for groups of 4"):
        TreeEngine(FakeEngine(), SHAPE, 4)


def test_rollout_places_whole_tree_groups_scored_by_the_vote():
    """Rollout is unchanged: with TreeEngine its groups come back whole, voted once each."""
    plane = DataPlane(SCHEMA)
    plane.put({"query_ids": [np.array([1, 5 + i]) for i in range(2)], "answer": [encode_text("456")] * 2,
               "gen_len": np.zeros(2, np.int64), "prompt_id": np.arange(2, dtype=np.int64)}, partition=0)
    decode = lambda ids: "".join(str(i) for i in ids if i != 2)  # noqa: E731
    scorer = GroupScorer(RewardRole(plane, MajorityVote(), decode, group_size=8))
    engine = TreeEngine(FakeEngine(max_batch=16), SHAPE, 8)
    role = RolloutRole(engine, plane, SP, 8, 2, 0, scorer=scorer, by_prompt_id=True)
    for _ in range(50):
        role.poll(0.01)
        if role.state.produced[0] == 16:
            break
    _, data = plane.get_batch("check", ["response_ids", "reward", "group"], n=16, partition=0)
    assert sorted(data["group"].tolist()) == [0] * 8 + [1] * 8 and data["reward"].tolist() == [1.0] * 16
    s = role.stats()
    assert s["etmr_groups"] == 2 and s["etmr_generated"] < s["etmr_independent"] == 64 and s["vote_groups"] == 2


def test_each_answers_recorded_logprobs_equal_a_full_forward_on_the_tiny_model():
    from asyncflow.engines.inference import InferenceEngine
    from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model

    model = build_tiny_model(build_char_tokenizer(), seed=0, hidden_size=32, num_layers=1, num_heads=2,
                             num_kv_heads=1, intermediate_size=64).eval()
    shape = TreeShape(roots=1, forks=2, branches=2, rounds=1)
    engine = TreeEngine(InferenceEngine(model, eos_id=2, pad_id=0, max_batch=8, seed=0), shape, 5)
    batch = engine.new_batch(SamplingParams(temperature=1.0, max_new_tokens=6))
    resumed, resume = [], batch.inner.resume
    batch.inner.resume = lambda parts: (resumed.append(len(parts)), resume(parts))[1]
    reqs = group(0, 5)
    for r in reqs:
        r.min_new_tokens = 4  # (a root of >= 4 tokens has the 2 distinct fork points asked for)
    done = batch.add(reqs) + drain(batch)
    assert len(done) == 5
    assert sum(resumed) == 2  # one rebuilt cache per fork point; its sibling copies it (the slot fork)
    s = engine.stats()
    assert s["etmr_independent"] == sum(len(c.response_ids) for c in done) and s["etmr_generated"] < s[
        "etmr_independent"]
    for c in done:
        ids = torch.tensor([c.prompt_ids + c.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)
        n = len(c.prompt_ids)
        want = [float(logp[n - 1 + t, tok]) for t, tok in enumerate(c.response_ids)]
        assert c.logprobs == pytest.approx(want, rel=1e-4, abs=1e-5)
