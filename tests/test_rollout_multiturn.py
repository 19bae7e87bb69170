"""The rollout role running multi-turn episodes (fake engine, real role, real data plane).

Episodes span decode steps and weight swaps: every generated token keeps the version that sampled
it, the row's version is its oldest, and placement keeps each row within the staleness bound; a
checkpoint taken mid-episode and resumed in a fresh role continues the episodes to exactly the
samples an uninterrupted run makes; an environment that raises on some steps ends those episodes
(counted) and every group still reaches the trainer whole.
"""

from __future__ import annotations

import random

import numpy as np
from agents_helpers import Echo, tool_tokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncflow.agents import EpisodeRunner, Limits
from asyncflow.agents.calls import EnvCalls
from asyncflow.agents.chat import tokens
from asyncflow.dataplane import DataPlane
from asyncflow.engines.fake import FakeEngine
from asyncflow.engines.types import SamplingParams
from asyncflow.workflow.fields import SCHEMA, encode_text
from asyncflow.workflow.rollout import RolloutRole, inflight

TOK = tool_tokenizer()
EOS = TOK.eos_token_id
OBS = " obs "
FIELDS = ["prompt_ids", "response_ids", "logprobs", "token_versions", "loss_mask", "group", "version", "reward"]


class Staged:
    """The weight-subscriber edge by hand: ``stage(v)`` = the trainer published v."""

    def __init__(self, engine):
        self.engine, self.version, self.staged, self.bell = engine, 0, 0, None
        self.swap_seconds, self.swaps, self.rejected = 0.0, 0, 0

    def stage(self, v):
        self.staged = v

    def staged_version(self):
        return self.staged

    def swap_if_ready(self):
        if self.staged > self.version:
            self.engine.load_weights(self.staged, {})
            self.version, self.swaps = self.staged, self.swaps + 1

    def wait_staged(self, timeout):
        return False


def _prompts(plane, part, n, start=0):
    ids = range(start, start + n)
    plane.put({"query_ids": [np.asarray([1, 5 + i % 9], dtype=np.int64) for i in ids],
               "prompt": [encode_text(f"q{i}") for i in ids], "answer": [encode_text("a")] * n,
               "gen_len": np.zeros(n, dtype=np.int64), "prompt_id": np.asarray(list(ids), dtype=np.int64)},
              partition=part)


def _role(plane, make_env, k=1, P=2, G=2, limits=None, keep=False):
    engine = FakeEngine(eos_id=EOS, logprob=lambda v, pos: -1.0 - v, max_batch=16, keep=keep)
    runner = EpisodeRunner(TOK, make_env, limits or Limits(max_turns=3, max_tokens=60, turn_tokens=4), EnvCalls(8, 5))
    weights = Staged(engine)
    role = RolloutRole(engine, plane, SamplingParams(max_new_tokens=4), G, P, k, weights, by_prompt_id=True,
                       episodes=runner)
    role.collector.flush_s = 0.0
    return role, weights


def _poll_until(role, cond, limit=3000):
    for _ in range(limit):
        if cond():
            return
        role.poll(0.01)
    raise AssertionError(f"not reached; produced {dict(role.state.produced)}, stats {role.stats()}")


def _rows(plane, part):
    return plane.get_batch("check", FIELDS, n=64, partition=part, min_n=1, block=False)[1]


class Uneven(Echo):
    """Prompt ``q<i>``: 1 + i % 3 turns (groups finish at different decode steps: steps fill with the
    fast ones while slow ones are still in flight)."""

    def reset(self, sample):
        self.turns = 1 + int(sample["prompt"][1:]) % 3
        return super().reset(sample)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(k=st.integers(1, 2), swap_at=st.integers(0, 3), second=st.integers(0, 3))
def test_episodes_across_weight_swaps_keep_per_token_versions_within_the_bound(k, swap_at, second):
    """Property: versions 1 and 2 are published at random decode steps while episodes are in flight
    (version v once step v - 1 is full: the trainer trains a step only then); every row stays within
    the bound of its oldest token, and its tokens' versions only grow."""
    plane = DataPlane(SCHEMA)
    for p in range(4):
        _prompts(plane, p, 2, start=2 * p)
    role, weights = _role(plane, lambda: Uneven(obs=OBS, sleep_s=0.01), k=k)
    _poll_until(role, lambda: role.state.produced[0] == 4)
    for _ in range(swap_at):
        role.poll(0.01)
    weights.stage(1)  # the trainer trained step 0 and published version 1: slow episodes are mid-way
    _poll_until(role, lambda: role.state.produced[1] == 4)
    for _ in range(second):
        role.poll(0.01)
    weights.stage(2)
    _poll_until(role, lambda: all(role.state.produced[p] == 4 for p in range(4)))
    mixed = 0
    for part in range(4):
        data = _rows(plane, part)
        for i in range(len(data["version"])):
            tv, lp = data["token_versions"][i].tolist(), data["logprobs"][i].tolist()
            mask, ids = data["loss_mask"][i].tolist(), data["response_ids"][i].tolist()
            gen = [v for v, m in zip(tv, mask) if m]
            assert int(data["version"][i]) == min(gen) and 0 <= part - min(gen) <= k  # the bound, per row
            assert tv == sorted(tv)  # versions only move forward along an episode
            assert [x for x, m in zip(lp, mask) if m] == [-1.0 - v for v in gen]  # each from its version
            obs = [j for j, m in enumerate(mask) if not m]
            assert all(tv[j] == tv[j - 1] and lp[j] == 0.0 for j in obs)  # an observation: the turn's version
            turns = round(float(data["reward"][i]))  # (a reward of 1 a turn)
            assert [ids[j] for j in obs] == tokens(TOK, OBS) * (turns - 1)
            mixed += len(set(gen)) > 1
    assert mixed > 0, "no episode crossed a swap"


def _tool_like_env():
    return Echo(obs=OBS, turns=3, sleep_s=0.01)


def _samples(plane, parts):
    out = []
    for p in parts:
        d = _rows(plane, p)
        out += [(int(d["group"][i]), d["response_ids"][i].tolist(), d["loss_mask"][i].tolist(),
                 d["token_versions"][i].tolist(), float(d["reward"][i])) for i in range(len(d["group"]))]
    return sorted(out)


def test_a_checkpoint_mid_episode_resumes_to_the_samples_of_a_run_never_stopped():
    whole = DataPlane(SCHEMA)
    _prompts(whole, 0, 2)
    _prompts(whole, 1, 2, start=2)
    ref, _ = _role(whole, _tool_like_env)
    _poll_until(ref, lambda: ref.state.produced[0] == 4 and ref.state.produced[1] == 4)

    plane = DataPlane(SCHEMA)
    _prompts(plane, 0, 2)
    _prompts(plane, 1, 2, start=2)
    first, _ = _role(plane, _tool_like_env)
    _poll_until(first, lambda: first.episodes.active >= 6 and any(e.ids for e in first.episodes.episodes.values()))
    tensors, meta = inflight.capture(first, 0)
    assert meta["episodes"] and {e["phase"] for g in meta["episodes"] for e in g["episodes"]} - {"done"}

    fresh = DataPlane(SCHEMA)  # a restarted job: the prompts fed again, the saved groups continued
    _prompts(fresh, 0, 2)
    _prompts(fresh, 1, 2, start=2)
    again, weights = _role(fresh, _tool_like_env)
    kept = again.resume(0, 0, 1.0, (tensors, meta))
    assert sorted(kept) == [0, 1, 2, 3]  # every group continues (rollout then reads prompts after them)
    _poll_until(again, lambda: again.state.produced[0] == 4 and again.state.produced[1] == 4)
    assert _samples(fresh, [0, 1]) == _samples(whole, [0, 1])


def test_an_environment_that_raises_on_some_steps_ends_those_episodes_counted():
    rng = random.Random(0)
    raised = []

    class Flaky(Echo):
        def _answer(self):
            if rng.random() < 0.1:
                raised.append(1)
                raise RuntimeError("flaky tool")
            return super()._answer()

    plane = DataPlane(SCHEMA)
    for p in range(4):
        _prompts(plane, p, 2, start=2 * p)
    role, weights = _role(plane, lambda: Flaky(obs=OBS, turns=3), k=3, limits=Limits(3, 60, 4, on_error=-1.0))
    _poll_until(role, lambda: all(role.state.produced[p] == 4 for p in range(4)))
    stats = role.stats()
    assert raised and stats["env_errors"] == stats["env_exception"] == len(raised) and stats["episodes"] == 16
    rewards = [float(r) for p in range(4) for r in _rows(plane, p)["reward"]]
    assert rewards.count(-1.0) == len(raised) and len(rewards) == 16  # every group whole, errors scored on_error
    assert "RuntimeError: flaky tool" in stats["env_failures"][0]


def test_a_tool_env_run_through_the_role_writes_its_loss_mask_and_reward():
    from agents_helpers import calc, calc_engine, exact

    from asyncflow.agents import ToolEnv

    plane = DataPlane(SCHEMA)
    plane.put({"query_ids": [np.asarray([1, 5], dtype=np.int64)], "prompt": [encode_text("12*34=")],
               "answer": [encode_text("408")], "gen_len": np.zeros(1, dtype=np.int64),
               "prompt_id": np.asarray([0], dtype=np.int64)}, partition=0)
    engine = calc_engine(TOK, keep=True)
    runner = EpisodeRunner(TOK, lambda: ToolEnv([calc], exact), Limits(3, 60, 30, (TOK.convert_tokens_to_ids(
        "</tool_call>"),)), EnvCalls(4, 5))
    role = RolloutRole(engine, plane, SamplingParams(max_new_tokens=30), 2, 1, 0, None, by_prompt_id=True,
                       episodes=runner)
    role.collector.flush_s = 0.0
    _poll_until(role, lambda: role.state.produced[0] == 2)
    d = _rows(plane, 0)
    assert d["reward"].tolist() == [1.0, 1.0] and role.batch.extended == 2  # the kept rows were extended
    for ids, mask in zip(d["response_ids"], d["loss_mask"]):
        text = TOK.decode([t for t, m in zip(ids.tolist(), mask.tolist()) if not m])
        assert text == "<tool_response>408</tool_response>"  # exactly the tool's answer is masked out
