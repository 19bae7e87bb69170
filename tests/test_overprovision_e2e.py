"""Over-provisioning end to end: the rollout role on the fake engine, and the real pipeline.

Role tests drive :class:`RolloutRole` with a zero-cost trainer: it takes step ``v`` as soon
as its rows are in the data plane, then moves the version (sync: ``set_version``; async:
stages weights). Answer lengths are drawn per *attempt* of a group (a restarted group draws
again, as sampling does): 1 attempt in 8 is long (24 tokens), the rest 3 tokens. Pipeline
tests run ``train`` in process on the tiny random model with a spy on the data plane.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict

import numpy as np
import pytest

from asyncflow.engines.fake import FakeEngine
from asyncflow.engines.types import SamplingParams
from asyncflow.dataplane import DataPlane
from asyncflow.api import train
from asyncflow.workflow.fields import SCHEMA, encode_text
from asyncflow.workflow.rollout import RolloutRole
from test_fake_engine import StagedWeights
from test_staleness import DelayLauncher, small_job, spy_in_memory

P, GROUP, LONG, SHORT = 8, 2, 24, 3


def attempt_lengths():
    """answer(req, sp): the length of a group's n-th attempt is long with probability 1/8."""
    calls: dict[int, int] = defaultdict(int)
    draws: dict[tuple[int, int], int] = {}

    def answer(req, sp):
        gid = req.key[0]
        attempt, calls[gid] = calls[gid] // GROUP, calls[gid] + 1
        if (gid, attempt) not in draws:
            draws[(gid, attempt)] = LONG if random.Random(gid * 1000 + attempt).random() < 1 / 8 else SHORT
        return [4 + j % 10 for j in range(draws[(gid, attempt)])]
    return answer


def run_role(steps: int, k: int, extra: int, sync: bool):
    """Returns (rollout decode rounds per step, trained rows per step, the role)."""
    plane = DataPlane(SCHEMA)
    for part in range(steps + 3):
        plane.put({"query_ids": [np.asarray([1, 5 + i], dtype=np.int64) for i in range(P)],
                "answer": [encode_text("7")] * P, "gen_len": np.zeros(P, dtype=np.int64)}, partition=part)
    eng = FakeEngine(answer=attempt_lengths(), max_batch=64)
    weights = None if sync else StagedWeights(eng)
    role = RolloutRole(eng, plane, SamplingParams(max_new_tokens=32), group_size=GROUP, prompts_per_step=P,
                       staleness=k, weights=weights, overprovision=extra)
    role.collector.flush_s = 0.0
    rounds, trained = [], []
    for v in range(steps):
        start = role.state.steps
        for _ in range(1000):
            if role.state.produced[v] >= P * GROUP:
                break
            role.poll(0.001)
        rounds.append(role.state.steps - start)
        _, data = plane.get_batch("actor", ["group", "version", "token_versions"], n=P * GROUP, partition=v)
        trained.append([(g, int(w), t.tolist()) for g, w, t in
                        zip(data["group"].tolist(), data["version"].tolist(), data["token_versions"])])
        if sync:
            role.set_version(v + 1)
        else:
            weights.stage(v + 1)
    return rounds, trained, role


def check_bound(trained, k: int) -> None:
    seen = set()
    for v, rows in enumerate(trained):
        assert len(rows) == P * GROUP  # every step full
        for g, w, tv in rows:
            assert 0 <= v - w <= k, (v, g, w)  # the version that started the sample
            assert min(tv) >= w and max(tv) <= v  # tokens newer than the start, never older
        groups = {g for g, _, _ in rows}
        assert len(groups) == P and not groups & seen  # no group trained twice
        seen |= groups


def test_sync_overprovision_cuts_the_tail_and_stays_on_policy():
    steps = 40
    rounds0, trained0, role0 = run_role(steps, k=0, extra=0, sync=True)
    rounds2, trained2, role2 = run_role(steps, k=0, extra=2, sync=True)
    check_bound(trained0, 0)
    check_bound(trained2, 0)
    # (a group's first token comes with its start, so a length-L answer takes L - 1 rounds)
    assert set(rounds0) <= {SHORT - 1, LONG - 1}
    # a step of 8 fresh groups is long with probability 1 - (7/8)^8 = 0.66 (here 27 of 40);
    # with 10 groups for 8 slots it is long only if 3 of them are (or a restarted one redraws long)
    assert sum(rounds2) < 0.7 * sum(rounds0), (rounds0, rounds2)
    s = role2.stats()
    # k = 0: a straggler may not be trained one version late: each step's 2 slowest groups
    # are thrown away and restarted (firm) at the next version; none is carried over
    assert s["groups_carried"] == 0 and s["groups_restarted"] == 2 * steps
    assert role0.stats()["groups_restarted"] == 0 and role0.stats()["discarded"] == 0


@pytest.mark.parametrize("extra", [2, 8])
def test_async_stragglers_carry_over_within_the_bound(extra):
    rounds0, _, _ = run_role(steps=40, k=1, extra=0, sync=False)
    rounds, trained, role = run_role(steps=40, k=1, extra=extra, sync=False)
    check_bound(trained, 1)
    s = role.stats()
    assert s["groups_carried"] > 0  # stragglers went on into the next step, nothing thrown away
    assert 0 < s["groups_restarted"] < s["groups_carried"]  # only those past start + 1 restarted
    assert sum(rounds) < 0.75 * sum(rounds0), (rounds0, rounds)


@pytest.mark.parametrize("mode,k,latency", [("sync", 0, "null"), ("stream", 0, "null"), ("async", 1, "null"),
                                            ("async", 1, "[2, 40]")])
def test_pipeline_with_overprovision(tmp_path, monkeypatch, mode, k, latency):
    """The last case: remote rewards in flight inside rollout while stragglers expire."""
    steps = 4
    cfg = small_job(tmp_path, f"mode={mode}", f"staleness={k}", f"train.steps={steps}", "rollout.max_batch=24",
                    f"reward.latency_ms={latency}",
                    "rollout.overprovision=2", "rollout.gen_len=longtail", "rollout.longtail_long=8",
                    "rollout.longtail_short=2", "rollout.longtail_frac=0.25", "resources.sync_threads=1")
    launcher = DelayLauncher(7, max_delay_s=0.002)
    spy_in_memory(monkeypatch, launcher)  # (sync: rollout hands the actor its rows in memory)
    summary = train(cfg, launcher=launcher, run_dir=tmp_path, evaluate=False)
    trained = launcher.plane.trained
    assert len(trained) == steps * 4 * 4  # every step full
    assert all(0 <= v - w <= k for v, w in trained)
    o = summary["overprovision"]
    assert o["extra_groups"] == 2 and o["groups_carried"] + o["groups_restarted"] > 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["groups_restarted"] for m in rows) <= o["groups_restarted"]  # per step, up to the last
    assert sum(m["groups_carried"] for m in rows) <= o["groups_carried"]
    if mode == "sync":  # each step's 2 slowest of 6 groups restart; step 0 can fill before the
        # extras are fetched (all short) and the last step's extras have no prompts left
        assert o["groups_carried"] == 0 and o["groups_restarted"] >= 2 * (steps - 2)
