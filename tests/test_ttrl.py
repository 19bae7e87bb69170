"""Label-free RL (TTRL): the majority vote, its counters, the whole-group wait, test-time mode.

* the vote by hand: pseudo-label, ratio, ties (no label), unextractable and empty groups;
  an extractor that raises is counted, never raised; the reference never changes a reward;
* the per-step figures (``majority_ratio``, ``pseudo_label_acc``...) from the counters;
* property: a group is scored only once all its answers are in, both where groups are scored
  (inside rollout, every mode's default; and by a separate reward role, fed rows in any order);
* ``task.test_time``: the feeder draws the evaluation problems; config mistakes are one line.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncflow.algorithms.etmr import TreeShape
from asyncflow.config import ConfigError, load_config
from asyncflow.dataplane import DataPlane
from asyncflow.engines.fake import FakeEngine
from asyncflow.engines.types import SamplingParams
from asyncflow.observe.ttrl import VoteMeter, vote_summary
from asyncflow.tasks.majority import MajorityVote, majority_vote, stripped
from asyncflow.workflow.fields import SCHEMA, decode_text, encode_text
from asyncflow.workflow.roles.reward import GroupScorer, RewardRole
from asyncflow.workflow.rollout import RolloutRole
from asyncflow.workflow.tree_batch import TreeEngine

DIGITS = "0123456789"


def decode(ids) -> str:
    return "".join(DIGITS[i % 10] for i in ids if i != 2)  # (2: the fake engine's EOS)


# --------------------------------------------------------------------------- the vote by hand


@pytest.mark.parametrize("answers, label, ratio, rewards, tie, missing", [
    (["46", "46", "45", None], "46", 0.5, [1, 1, 0, 0], False, 1),  # unextractable: no vote, in the ratio
    (["1", "2"], None, 0.0, [0, 0], True, 0),  # a tie: no majority, no pseudo-label
    (["a", "b", "a", "b", "c"], None, 0.0, [0, 0, 0, 0, 0], True, 0),  # a tie for the top
    (["a", "b", "a", "b", "a"], "a", 0.6, [1, 0, 1, 0, 1], False, 0),
    ([None, "7", None], "7", 1 / 3, [0, 1, 0], False, 2),  # one vote is a majority of the votes
    ([None, None], None, 0.0, [0, 0], False, 2),  # nothing extractable
    ([], None, 0.0, [], False, 0),  # an empty group
])
def test_majority_vote_by_hand(answers, label, ratio, rewards, tie, missing):
    v = majority_vote(answers)
    assert (v.label, v.tie, v.unextractable, v.rewards) == (label, tie, missing, rewards)
    assert v.ratio == pytest.approx(ratio, rel=1e-12)


def test_default_extractor_is_the_stripped_response_and_empty_does_not_vote():
    assert stripped("  46 \n") == "46" and stripped("   ") is None
    rf = MajorityVote()
    assert rf.call_batch([("1+2=", " 3", "3"), ("1+2=", "3 ", "3"), ("1+2=", "", "3")]) == [1.0, 1.0, 0.0]
    s = rf.stats()
    assert (s["vote_groups"], s["vote_answers"], s["vote_unextractable"]) == (1, 3, 1)
    assert s["vote_ratio_sum"] == pytest.approx(2 / 3, rel=1e-12)


def test_an_extractor_that_raises_is_counted_and_its_answer_does_not_vote():
    def after_hashes(response: str) -> str | None:
        if "boom" in response:
            raise RuntimeError("cannot parse")
        return response.split("####")[-1] if "####" in response else None

    rf = MajorityVote(after_hashes)
    got = rf.call_batch([("q", "x #### 5", ""), ("q", "boom", ""), ("q", "#### 5", ""), ("q", "no marker", "")])
    assert got == [1.0, 0.0, 1.0, 0.0]
    s = rf.stats()
    assert (s["vote_extractor_errors"], s["vote_unextractable"], s["vote_labelled"]) == (1, 2, 0)
    assert s["failures"] == ["reward.extractor raised RuntimeError: cannot parse"]


def test_pseudo_label_accuracy_and_reward_accuracy_by_hand():
    rf = MajorityVote()
    # group 1: majority "46" = the reference; answers' true rewards 1,1,0 = pseudo-rewards: 3 hits
    rf.call_batch([("q", "46", "46"), ("q", "46", "46"), ("q", "45", "46")])
    # group 2: majority "9" (wrong, the reference is 8): pseudo 1,1,0 vs true 0,0,1: 0 hits
    rf.call_batch([("q", "9", "8"), ("q", "9", "8"), ("q", "8", "8")])
    # group 3: a tie, reference "5": no label (a miss); pseudo 0,0 vs true 1,0: 1 hit
    rf.call_batch([("q", "5", "5"), ("q", "6", "5")])
    # group 4: no reference: voted, not labelled
    rf.call_batch([("q", "1", ""), ("q", "1", "")])
    s = rf.stats()
    assert (s["vote_groups"], s["vote_labelled"], s["vote_label_hits"]) == (4, 3, 1)
    assert (s["vote_labelled_answers"], s["vote_reward_hits"], s["vote_ties"]) == (8, 4, 1)
    figures = vote_summary({"rollout": s})["majority_vote"]
    assert figures["pseudo_label_acc"] == pytest.approx(1 / 3, rel=1e-12)
    assert figures["reward_acc"] == pytest.approx(4 / 8, rel=1e-12)
    assert figures["majority_ratio"] == pytest.approx((2 / 3 + 2 / 3 + 0 + 1) / 4, rel=1e-12)


def test_a_gsm8k_reference_is_unwrapped_and_numbers_compare_numerically():
    rf = MajorityVote()
    rf.call_batch([("q", "72.0", "He has 72 apples.\n#### 72"), ("q", "72.0", "He has 72 apples.\n#### 72")])
    assert rf.stats()["vote_label_hits"] == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["1", "2", "3", " 2", ""]), min_size=1, max_size=8),
       st.lists(st.sampled_from(["1", "2", "", "zz"]), min_size=8, max_size=8))
def test_rewards_never_depend_on_the_reference(responses, refs):
    """The same responses with any references (or none) get the same rewards: labels are logged only."""
    base = MajorityVote().call_batch([("q", r, "") for r in responses])
    ref = random.Random(len(responses)).choice(refs)
    assert MajorityVote().call_batch([("q", r, ref) for r in responses]) == base
    assert all(x in (0.0, 1.0) for x in base)


def test_vote_meter_reports_each_steps_groups_only():
    meter = VoteMeter()
    rf = MajorityVote()
    rf.call_batch([("q", "1", "1"), ("q", "1", "1")])  # ratio 1, right
    step1 = meter.step({"rollout": rf.stats(), "actor": {"busy_s": 1.0}})
    rf.call_batch([("q", "2", "3"), ("q", "4", "3"), ("q", "2", "3"), ("q", "5", "3")])  # ratio 0.5, wrong
    step2 = meter.step({"rollout": rf.stats()})
    assert step1["majority_ratio"] == 1.0 and step1["pseudo_label_acc"] == 1.0 and step1["vote_groups"] == 1
    assert step2["majority_ratio"] == 0.5 and step2["pseudo_label_acc"] == 0.0 and step2["vote_groups"] == 1
    assert meter.step({"rollout": rf.stats()}) == {}  # no group voted: no figure, not a zero


# --------------------------------------------------------------------------- whole groups only


class SpyVote(MajorityVote):
    """Records every call; fails the test at once if a call is not one prompt's whole group."""

    def __init__(self, group_size: int):
        super().__init__()
        self.group_size, self.calls = group_size, []

    def call_batch(self, texts):
        assert len(texts) == self.group_size, f"scored {len(texts)} answers of a group of {self.group_size}"
        assert len({t[0] for t in texts}) == 1, "answers of different prompts scored as one group"
        self.calls.append([t[1] for t in texts])
        return super().call_batch(texts)


def _prompts(plane, n: int, partition: int) -> None:
    plane.put({"query_ids": [np.array([1, 3, 5 + i + 10 * partition]) for i in range(n)],
               "answer": [encode_text("1")] * n, "gen_len": np.zeros(n, np.int64),
               "prompt_id": np.arange(n, dtype=np.int64) + n * partition}, partition=partition)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(group=st.integers(2, 4), prompts=st.integers(1, 3), staleness=st.sampled_from([0, 1]),
       etmr=st.booleans(), seed=st.integers(0, 99))
def test_rollout_scores_a_group_only_once_all_its_answers_finished(group, prompts, staleness, etmr, seed):
    """reward.placement=rollout (sync, stream and async alike; plain groups, or ETMR's trees whose
    branches start after their roots finish): answers of one group finish at different decode
    steps; the vote is called once per group, with all of them."""
    rng = random.Random(seed)

    def answer(req, sp):  # 6 drawn digits with an EOS at a drawn place: answers end at different steps
        script = [rng.choice([5, 6]) for _ in range(6)]
        script[rng.randrange(6)] = 2
        return script

    plane, spy = DataPlane(SCHEMA), SpyVote(group)
    scorer = GroupScorer(RewardRole(plane, spy, decode, group_size=group))
    engine = FakeEngine(answer=answer, max_batch=group * 2)
    if etmr:  # one root, one round, one fork point with the rest of the group as branches
        engine = TreeEngine(engine, TreeShape(roots=1, forks=1, branches=group - 1, rounds=1), group)
    role = RolloutRole(engine, plane, SamplingParams(max_new_tokens=6), group, prompts, staleness,
                       scorer=scorer, by_prompt_id=True)
    for p in range(staleness + 1):
        _prompts(plane, prompts, p)
    for _ in range(400):
        role.poll(0.01)
        if sum(role.state.produced.values()) == group * prompts * (staleness + 1):
            break
    assert len(spy.calls) == prompts * (staleness + 1)
    for part in range(staleness + 1):
        meta, data = plane.get_batch("check", ["response_ids", "reward", "group"], n=group * prompts,
                                     partition=part)
        by_group: dict[int, list] = {}
        for i, g in enumerate(data["group"].tolist()):
            by_group.setdefault(g, []).append((decode(data["response_ids"][i].tolist()), float(data["reward"][i])))
        for rows in by_group.values():  # each row's reward is its own group's vote
            assert [r for _, r in rows] == majority_vote([stripped(t) for t, _ in rows]).rewards


@settings(max_examples=30, deadline=None)
@given(group=st.integers(2, 4), groups=st.integers(1, 4), data=st.data())
def test_separate_reward_role_scores_only_whole_groups_whatever_the_arrival_order(group, groups, data):
    """reward.placement=separate (sync polls after rollout, stream/async while it runs): rows of
    the groups arrive in any order and in chunks, with polls in between; each group is voted
    once, with all its answers, and every row gets exactly its group's reward."""
    rows = [(g, i) for g in range(groups) for i in range(group)]
    order = data.draw(st.permutations(rows))
    cuts = sorted(data.draw(st.sets(st.integers(1, max(len(rows) - 1, 1)), max_size=4)))
    texts = {(g, i): data.draw(st.sampled_from(["5", "6", "56", ""])) for g, i in rows}
    plane, spy = DataPlane(SCHEMA), SpyVote(group)
    role = RewardRole(plane, spy, lambda ids: "".join(chr(48 + i) for i in ids), micro=3, group_size=group)
    for chunk in np.split(np.array(order), cuts):
        if len(chunk):
            plane.put({"prompt_ids": [np.array([1, g]) for g, _ in chunk],
                       "response_ids": [np.array([ord(c) - 48 for c in texts[(g, i)]], dtype=np.int64)
                                        for g, i in chunk],
                       "answer": [encode_text("5")] * len(chunk)}, partition=0,
                      tags={"group": [int(g) for g, _ in chunk]})
        while role.poll(0.0):  # poll until nothing more is ready
            pass
    assert len(spy.calls) == groups and role.items == len(rows)
    meta, got = plane.get_batch("check", ["prompt_ids", "response_ids", "reward"], n=len(rows), partition=0)
    for g in range(groups):
        mine = [j for j in range(len(rows)) if int(got["prompt_ids"][j][1]) == g]
        answers = ["".join(chr(48 + x) for x in got["response_ids"][j].tolist()) for j in mine]
        assert [float(got["reward"][j]) for j in mine] == majority_vote([stripped(a) for a in answers]).rewards


def test_a_grouped_reward_needs_the_group_size():
    with pytest.raises(ValueError, match="group_size"):
        RewardRole(DataPlane(SCHEMA), MajorityVote(), decode)


# --------------------------------------------------------------------------- test-time mode, config


def test_test_time_feeds_the_evaluation_problems(tmp_path):
    from asyncflow.engines.tiny import build_char_tokenizer
    from asyncflow.tasks.registry import build_task
    from asyncflow.workflow.feeder import PromptFeeder

    cfg = load_config(None, ["task.test_time=true", "reward.mode=majority", "task.eval_n=40",
                             "train.prompts_per_step=8", "train.steps=6"])
    task, plane = build_task(cfg), DataPlane(SCHEMA)
    feeder = PromptFeeder(cfg, build_char_tokenizer(), task, plane)
    assert list(feeder.pool) == list(task.heldout[:40])
    feeder.fill(6)
    want = {p.answer for p in task.heldout[:40]}
    for part in range(6):
        _, data = plane.get_batch("check", ["answer"], n=8, partition=part)
        assert {decode_text(a) for a in data["answer"]} <= want
    plain = PromptFeeder(load_config(None, ["train.prompts_per_step=8"]), build_char_tokenizer(), task, plane)
    assert plain.pool is task.train


@pytest.mark.parametrize("overrides, says", [
    (["task.test_time=true"], "set reward.mode=majority"),
    (["task.test_time=true", "reward.mode=majority", "task.eval_n=8"], "train.prompts_per_step (16) must be <= it"),
    (["reward.mode=majority", "reward.fn=asyncflow.tasks.rewards:exact_match"], "remove reward.fn"),
    (["reward.extractor=asyncflow.tasks.rewards:extract_gsm8k"], "set reward.mode=majority"),
    (["reward.mode=majority", "reward.extractor=nocolon"], "is not an import path"),
    (["algorithm.name=ppo", "algorithm.ear=true"], "set algorithm.name=grpo or algorithm.ear=false"),
])
def test_ttrl_config_mistakes_are_one_line(overrides, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)


def test_label_free_run_logs_the_vote_each_step(tmp_path):
    """A tiny random model, 2 sync steps of TTRL on the evaluation problems, rewards in a separate
    reward role: every metrics line has the vote's figures; the summary has the run's."""
    from asyncflow.api import train
    from asyncflow.launch.local import LocalLauncher

    cfg = load_config(None, ["mode=sync", "launcher=local", "warmstart.enabled=false", "progress=false",
                             "train.steps=2", "train.prompts_per_step=4", "train.micro_prompts=2",
                             "rollout.group_size=4", "rollout.max_batch=16", "reward.mode=majority",
                             "reward.placement=separate", "task.test_time=true", "task.eval_n=16",
                             "algorithm.ear=true", f"run_dir={tmp_path}",
                             "resources.sync_threads=1"])  # (one thread: a busy CI machine's cores don't spin)
    summary = train(cfg, launcher=LocalLauncher(), run_dir=tmp_path, evaluate=False)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    for m in lines:
        assert m["vote_groups"] == 4 and 0 <= m["majority_ratio"] <= 1 and 0 <= m["pseudo_label_acc"] <= 1
    assert summary["majority_vote"]["vote_groups"] == 8
