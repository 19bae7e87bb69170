"""Over-provisioning and dynamic sampling across a restart (``stream``/``async``).

* the self-feeding feeder (dynamic sampling): its checkpoint position, hand-computed, and a
  resumed feeder that feeds the pending prompts that did not continue, once, never a dropped one;
* the rollout role with over-provisioning on the fake engine, "killed" at random step
  boundaries (its in-flight snapshot round-tripped through safetensors/JSON, resumed in a fresh
  role and data plane): every prompt group trained exactly once, every step full, the bound
  held per row, no prompt thrown away twice (a stalled straggler stays stalled across the
  restart, then restarts as a firm group), the counters continue;
* the rollout role with dynamic sampling (a scorer whose rewards are constant for every third
  prompt, a self-feeding feeder) resumed likewise: no dropped prompt is fed again, a prompt
  pending at the checkpoint that did not continue is fed once more, only groups with signal
  are trained, each once, every step full, the bound held; the run meter counts a resumed
  run's first step from the checkpoint's counters;
* end to end (``launcher=local``, tiny random model): an ``async`` run of each feature killed
  with ``kill -9`` after a checkpoint and resumed with ``--resume``: every step once and full,
  every prompt group trained at most once (exactly once without drops), the bound held (the
  actor raises otherwise), the counters continue from the checkpoint's, and with dynamic
  sampling every trained group has non-constant rewards (a spy, installed in the subprocess by
  importing this module as its ``reward.fn``, records the rows the trainer's advantages saw).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest

SPY = "ASYNCFLOW_TEST_SPY"  # (set: this module records the trainer's rows in that file when imported)


def first_is_digit(prompt, response, sample) -> float:
    return float(response[:1].isdigit())


def _install_spy(path: str) -> None:
    from asyncflow.algorithms.algorithm import Algorithm

    advantages = Algorithm.advantages

    def spy(self, data):
        with open(path, "a") as fh:  # (one line per micro-batch the trainer takes: its groups and rewards)
            fh.write(json.dumps({"pid": os.getpid(), "group": [int(g) for g in data["group"]],
                                 "reward": [float(r) for r in data["reward"]]}) + "\n")
        return advantages(self, data)

    Algorithm.advantages = spy


if os.environ.get(SPY):
    _install_spy(os.environ[SPY])


def test_both_features_are_resumable_in_every_mode_but_sync_dp_overprovision():
    from asyncflow.config import load_config
    from asyncflow.workflow.checkpoint import not_resumable

    for mode in ("stream", "async", "sync"):  # (sync: tests/test_resume_sync_features.py)
        for extra in ("rollout.overprovision=2", "algorithm.dynamic_sampling=true"):
            assert not_resumable(load_config(None, [f"mode={mode}", extra])) is None, (mode, extra)
    dp = ["mode=sync", "train.dp=2", "train.prompts_per_step=4", "rollout.overprovision=2"]
    assert not_resumable(load_config(None, dp)) == "rollout.overprovision > 0 in mode=sync with train.dp > 1"
    assert not_resumable(load_config(None, dp[:-1])) is None


# ---------------------------------------------------------------- the self-feeding feeder


class Puts:
    def __init__(self) -> None:
        self.parts: dict[int, list[int]] = {}

    def put(self, data: dict, partition: int, tags: dict | None = None) -> None:
        self.parts[partition] = [int(q) for q in data["prompt_id"]]


def _feeder(plane):
    from asyncflow.config import load_config
    from asyncflow.engines.tiny import build_char_tokenizer
    from asyncflow.tasks.registry import build_task
    from asyncflow.workflow.feeder import PromptFeeder

    cfg = load_config(None, ["train.steps=3", "train.prompts_per_step=2", "train.micro_prompts=1", "seed=3"])
    return PromptFeeder(cfg, build_char_tokenizer(), build_task(cfg), plane, unlimited=True)


def test_the_self_feeding_position_feeds_pending_prompts_once_and_never_a_dropped_one():
    first = _feeder(Puts())
    first.fill(4)  # ids 0..7, beyond train.steps: it is unlimited
    for q, step in {0: 0, 1: None, 2: 1, 3: None, 4: 2, 6: None, 7: 1}.items():
        first.settle(q, step)  # (5 still running; 4 placed in step 2, not trained by a checkpoint of 2 steps)
    pos = first.position(2)
    assert pos == {"below": 4, "next": 8, "pending": [4, 5]}
    assert first.position(2) == pos and set(first.settled) == {4, 6, 7}  # (ids below 4 folded away)
    again = Puts()
    resumed = _feeder(again)
    resumed.settle(4, 2)  # (placed again in its step: it continues, keeping its prompt slot)
    resumed.resume_position(2, json.loads(json.dumps(pos)), held=[4])
    resumed.fill(5)
    assert again.parts == {2: [5], 3: [8, 9], 4: [10, 11]}  # 5 re-fed once (after 4's slot), 6 and 7 never
    for q, step in {5: None, 8: 2, 9: 3}.items():
        resumed.settle(q, step)
    assert resumed.position(3) == {"below": 9, "next": 12, "pending": [9, 10, 11]}


def test_a_resumed_runs_first_step_counts_its_groups_from_the_checkpoints_counters():
    from asyncflow.observe.report import RunMeter

    now = {"rollout": {"groups_scored": 9, "groups_dropped": 5, "groups_carried": 3, "groups_restarted": 2}}
    saved = {"discarded": 4, "carried": 2, "stalls": 1, "scored": 7, "dropped": 4}  # (at the checkpoint)
    meter = RunMeter(lambda: now, drops=True, stragglers=True, since=saved)
    m = meter.step({"samples": 8, "tokens": 80})
    assert (m["groups_dropped"], m["drop_rate"], m["groups_carried"], m["groups_restarted"]) == (1, 0.5, 1, 1)
    fresh = RunMeter(lambda: now, drops=True, stragglers=True).step({"samples": 8, "tokens": 80})
    assert (fresh["groups_dropped"], fresh["groups_carried"], fresh["groups_restarted"]) == (5, 3, 2)  # from 0


# ---------------------------------------------------------------- the rollout role, over-provisioning

N, P, G = 12, 4, 2


def _lengths(req, sp):
    """Answer lengths by prompt id: one group in 3 is long (a straggler), the others short."""
    gid = req.key[0]
    n = 20 if random.Random(gid).random() < 1 / 3 else 2 + gid % 3
    return [4 + j % 10 for j in range(n)]


def _role(plane, k, extra, stalls):
    from test_fake_engine import StagedWeights

    from asyncflow.engines.fake import FakeEngine
    from asyncflow.engines.types import SamplingParams
    from asyncflow.workflow.rollout import RolloutRole

    eng = FakeEngine(answer=_lengths, max_batch=64)
    role = RolloutRole(eng, plane, SamplingParams(max_new_tokens=32), group_size=G, prompts_per_step=P, staleness=k,
                       weights=StagedWeights(eng), overprovision=extra, by_prompt_id=True)
    role.collector.flush_s = 0.0
    stall = role.placer._stall
    role.placer._stall = lambda gid: (stalls.append(gid), stall(gid))[1]  # (every stall, of every incarnation)
    return role


def _train(role, plane, feeder, steps, rows, ahead, polls_after=0):
    for v in steps:
        feeder.fill(v + ahead)
        for _ in range(3000):
            if role.state.produced[v] >= P * G:
                break
            role.poll(0.001)
        _, data = plane.get_batch("actor", ["group", "version", "token_versions"], n=P * G, partition=v)
        assert len(data["group"]) == P * G, f"step {v} not full"
        rows[v] = [(int(g), int(w), t.tolist()) for g, w, t in zip(data["group"], data["version"],
                                                                   data["token_versions"])]
        role.weights.stage(v + 1)
    for _ in range(polls_after):
        role.poll(0.001)


@pytest.mark.parametrize("seed", range(6))
def test_an_overprovisioned_rollout_resumed_at_random_boundaries_keeps_its_guarantees(seed):
    from safetensors.numpy import load, save

    from asyncflow.config import load_config
    from asyncflow.dataplane import DataPlane
    from asyncflow.engines.tiny import build_char_tokenizer
    from asyncflow.tasks.registry import build_task
    from asyncflow.workflow.rollout import inflight
    from asyncflow.workflow.feeder import PromptFeeder
    from asyncflow.workflow.fields import SCHEMA

    rng = random.Random(seed)
    k, extra = [(0, 2), (1, 3), (2, 2)][seed % 3]
    cfg = load_config(None, [f"train.steps={N}", f"train.prompts_per_step={P}", "train.micro_prompts=1", "seed=3"])
    tok, task, ahead = build_char_tokenizer(), build_task(cfg), k + 3 + -(-extra // P)
    plane, stalls, rows, done = DataPlane(SCHEMA), [], {}, 0
    feeder, role = PromptFeeder(cfg, tok, task, plane), _role(plane, k, extra, stalls)
    kept_stalled = soft = 0
    for kill in sorted(rng.sample(range(2, N - 1), 3)):
        _train(role, plane, feeder, range(done, kill), rows, ahead, polls_after=rng.randrange(0, 12))
        tensors, meta = inflight.capture(role, kill)
        counters = meta["counters"]
        assert counters == {"discarded": role.state.discarded, "carried": role.placer.carried,
                            "stalls": role.placer.stalls, "scored": 0, "dropped": 0, "decode_steps": role.state.steps}
        stalled = {r["group"] for r in meta["answers"] if r.get("stalled")}
        assert stalled == set(role.state.stale)
        soft += sum(1 for r in meta["answers"] if r.get("soft"))
        trained = {g for v in range(kill) for g, *_ in rows[v]}
        plane = DataPlane(SCHEMA)  # the restarted run: a fresh data plane, engine and role
        role = _role(plane, k, extra, stalls)
        role.weights.stage(kill)
        kept = role.resume(kill, kill, 1.0, (load(save(tensors)), json.loads(json.dumps(meta))))
        assert not set(kept) & trained and stalled <= set(kept) and set(role.state.stale) >= stalled
        assert role.placer.stalled >= stalled and role.placer.started == kill * P + len(kept)
        assert (role.state.discarded, role.placer.carried, role.placer.stalls) == \
            (counters["discarded"], counters["carried"], counters["stalls"])  # the counters continue
        kept_stalled += len(stalled)
        feeder = PromptFeeder(cfg, tok, task, plane)
        feeder.resume(kill, trained | set(kept), len(kept))
        done = kill
    _train(role, plane, feeder, range(done, N), rows, ahead)
    trained = [g for v in range(N) for g, *_ in rows[v]]
    assert sorted(set(trained)) == list(range(N * P)) and len(trained) == N * P * G  # every group once, whole
    for v in range(N):
        for g, w, tv in rows[v]:
            assert 0 <= v - w <= k and min(tv) >= w and max(tv) <= v, (v, g, w, tv)
    assert max(Counter(stalls).values(), default=0) <= 1, Counter(stalls)  # a prompt thrown away at most once
    print(f"seed {seed}: k {k} extra {extra}: {len(stalls)} stalls, {kept_stalled} kept stalled, {soft} soft saved")


def test_a_stalled_straggler_is_saved_and_stalled_again_and_soft_groups_rejoin_soft():
    from asyncflow.dataplane import DataPlane
    from asyncflow.workflow.rollout import inflight
    from asyncflow.workflow.fields import SCHEMA
    from asyncflow.workflow.placement import GroupPlacer

    placer = GroupPlacer(2, 0, extra=2)  # hand-made: step 0 full but for one slot; k = 0
    placer.refill(0)
    assert placer.adopt(7, 0, soft=True, crossed=True) and 7 in placer.soft and 7 in placer.crossed
    assert placer.adopt(8, 0) and 8 not in placer.soft  # a firm one: the last slot of step 0 is its
    assert not placer.adopt(9, 0)  # a second firm group of deadline 0: no slot left, restart it instead
    assert placer.adopt(9, 0, soft=True)  # soft: no guarantee asked
    placer.adopt_stalled(11)
    assert placer.started == 5 and placer.stalled == {11} and placer.stalls == 0
    assert placer.complete(8) == 0 and placer.complete(7) is None and placer.stalled == {7, 11}
    assert placer.stalls == 1 and not placer.retry(11, 0) and placer.retry(11, 1)

    plane, stalls = DataPlane(SCHEMA), []
    role = _role(plane, 0, 2, stalls)
    role.state.stale.append(5)  # (a straggler stalled at version 0: its requests kept for its restart)
    role.placer.started, role.placer.stalled, role.placer.stalls = 1, {5}, 1
    from asyncflow.engines.types import Request

    role.state.groups[5] = [Request((5, np.frombuffer(b"7", dtype=np.uint8)), [1, 5, 6], 9, 3) for _ in range(G)]
    tensors, meta = inflight.capture(role, 0)
    assert [(r["group"], r["stalled"], r["finished"]) for r in meta["answers"]] == [(5, True, False)] * G
    fresh = _role(DataPlane(SCHEMA), 0, 2, stalls)
    fresh.weights.stage(1)
    assert fresh.resume(1, 1, 1.0, (tensors, meta)) == [5]
    assert list(fresh.state.stale) == [5] and fresh.placer.stalled == {5} and fresh.placer.stalls == 1
    assert [(r.prompt_ids, r.max_new_tokens, r.min_new_tokens) for r in fresh.state.groups[5]] == [([1, 5, 6], 9, 3)] * G
    assert fresh.placer.retry(5, 1) and fresh.placer.running == {5: 1}  # firm now: it is trained by step 1


# ---------------------------------------------------------------- the rollout role, dynamic sampling


class FlatScorer:
    """Rewards by prompt id: constant (no signal: dropped) for every third prompt, else 0, 1, 0, ..."""

    bell = None

    def __init__(self) -> None:
        self.n: dict = {}
        self.got: dict = {}

    def open(self, key, n) -> None:
        self.n[key], self.got[key] = n, 0

    def add(self, key, i, item) -> None:
        self.got[key] += 1

    def ready(self, wait_s):
        out = [(key, [1.0] * n if key[0] % 3 == 0 else [float(j % 2) for j in range(n)])
               for key, n in self.n.items() if self.got[key] == n]
        for key, _ in out:
            self.cancel(key)
        return out

    def cancel(self, key) -> None:
        self.n.pop(key, None)
        self.got.pop(key, None)


class Fed:
    """The data plane as the self-feeding feeder sees it: every prompt id it puts, recorded."""

    def __init__(self, plane, fed: list) -> None:
        self.plane, self.fed = plane, fed

    def put(self, data, partition, tags=None):
        self.fed.extend(int(q) for q in data["prompt_id"])
        return self.plane.put(data, partition=partition, tags=tags)


def _sampling_role(plane, k, fed):
    from test_fake_engine import StagedWeights

    from asyncflow.config import load_config
    from asyncflow.engines.fake import FakeEngine
    from asyncflow.engines.tiny import build_char_tokenizer
    from asyncflow.engines.types import SamplingParams
    from asyncflow.tasks.registry import build_task
    from asyncflow.workflow.feeder import PromptFeeder
    from asyncflow.workflow.rollout import RolloutRole

    cfg = load_config(None, [f"train.steps={N}", f"train.prompts_per_step={P}", "train.micro_prompts=1", "seed=3"])
    feed = PromptFeeder(cfg, build_char_tokenizer(), build_task(cfg), Fed(plane, fed), unlimited=True)
    eng = FakeEngine(answer=_lengths, max_batch=64)
    role = RolloutRole(eng, plane, SamplingParams(max_new_tokens=32), group_size=G, prompts_per_step=P, staleness=k,
                       weights=StagedWeights(eng), scorer=FlatScorer(), feed=feed, drop_flat=True,
                       by_prompt_id=True)
    role.collector.flush_s = 0.0
    return role


@pytest.mark.parametrize("seed", range(4))
def test_a_dynamic_sampling_rollout_resumed_at_random_boundaries_feeds_no_dropped_prompt_again(seed):
    from safetensors.numpy import load, save

    from asyncflow.dataplane import DataPlane
    from asyncflow.workflow.rollout import inflight
    from asyncflow.workflow.fields import SCHEMA

    rng = random.Random(seed)
    k = seed % 3
    plane, fed, rows, done, dropped = DataPlane(SCHEMA), [], {}, 0, set()
    role, runs = _sampling_role(plane, k, fed), [(0, set())]  # per run: where its feeding starts, what may be fed again
    noop = type("NoFeeder", (), {"fill": lambda self, upto: None})()
    for kill in sorted(rng.sample(range(2, N - 1), 3)):
        _train(role, plane, noop, range(done, kill), rows, 0, polls_after=rng.randrange(0, 12))
        dropped |= {q for q, s in role.feed.settled.items() if s is None}  # (before the position folds them)
        tensors, meta = inflight.capture(role, kill)
        counters, pos = meta["counters"], meta["prompts"]
        assert (counters["scored"], counters["dropped"]) == (role.state.groups_scored, role.state.groups_dropped) != (0, 0)
        trained = {g for v in range(kill) for g, *_ in rows[v]}
        assert not set(pos["pending"]) & (trained | dropped) and all(q < pos["next"] for q in pos["pending"])
        assert trained | dropped >= set(range(pos["below"]))  # (folded: every id below settled)
        plane = DataPlane(SCHEMA)  # the restarted run: a fresh data plane, engine, role and feeder
        role = _sampling_role(plane, k, fed)
        role.weights.stage(kill)
        kept = role.resume(kill, kill, 1.0, (load(save(tensors)), json.loads(json.dumps(meta))))
        assert (role.state.groups_scored, role.state.groups_dropped) == (counters["scored"], counters["dropped"])
        runs.append((len(fed), set(pos["pending"]) - set(kept)))  # (neither trained, dropped nor continued)
        done = kill
    _train(role, plane, noop, range(done, N), rows, 0)
    trained = [g for v in range(N) for g, *_ in rows[v]]
    assert len(trained) == N * P * G and len(set(trained)) == N * P  # every step full, every group once, whole
    assert all(g % 3 for g in trained)  # only groups with signal
    refed = 0
    for (a, may), (b, _) in zip(runs, runs[1:] + [(len(fed), set())]):
        mine, earlier = fed[a:b], set(fed[:a])
        assert len(mine) == len(set(mine)) and set(mine) & earlier <= may, (set(mine) & earlier, may)
        refed += len(set(mine) & earlier)
    for v in range(N):
        for g, w, tv in rows[v]:
            assert 0 <= v - w <= k and min(tv) >= w and max(tv) <= v, (v, g, w, tv)
    print(f"seed {seed}: k {k}: {len(set(fed))} prompts fed, {refed} fed again, {role.state.groups_dropped} dropped")


# ---------------------------------------------------------------- end to end, kill -9 and --resume


def _start(args: list[str], spy: Path | None = None) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    if spy is not None:
        env[SPY] = str(spy)
    return subprocess.Popen([sys.executable, "-m", "asyncflow.cli", "train", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env)


def _killed_and_resumed(tmp_path: Path, args: list[str], spy: Path | None = None) -> tuple[Path, dict, dict]:
    """Run ``args``, ``kill -9`` it soon after its first checkpoint, resume it to the end: the run
    folder, the checkpoint resumed from (JSON) and the summary."""
    import time

    from test_resume_async import kill_after_checkpoint

    from asyncflow.workflow import checkpoint as C

    runs, seed = tmp_path / "runs", random.randrange(10**6)
    proc = _start([*args, f"run_dir={runs}"], spy)
    t = time.time()
    while not runs.exists() or not any(runs.iterdir()):
        assert proc.poll() is None and time.time() - t < 120
        time.sleep(0.01)
    run = next(runs.iterdir())
    assert kill_after_checkpoint(proc, run, 0, random.Random(seed).uniform(0, 0.2)), "the run ended first"
    first = C.read(C.latest(run))[1]
    again = _start(["--resume", str(run)], spy)
    assert again.wait(timeout=240) == 0, (run / "error.log").read_text() if (run / "error.log").exists() else ""
    return run, first, json.loads((run / "summary.json").read_text())


def _steps(run: Path) -> list[dict]:
    import test_resume_async as A

    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, A.N + 1))  # every step once
    assert all(len(m["groups"]) == A.P for m in lines), [m["groups"] for m in lines]  # every step full
    trained = [g for m in lines for g in m["groups"]]
    assert len(trained) == len(set(trained)), trained  # no group trained twice
    assert all(0 <= m["max_staleness"] <= A.K for m in lines)
    return lines


@pytest.mark.slow
def test_an_overprovisioned_async_run_killed_and_resumed_trains_every_group_once(tmp_path):
    from test_resume_async import TINY, check_every_group_once

    run, first, summary = _killed_and_resumed(tmp_path, [*TINY, "rollout.overprovision=2"])
    check_every_group_once(run)
    _steps(run)
    saved, o = first["rollout"]["counters"], summary["overprovision"]
    assert summary["resumed_from"] == first["driver"]["step"] >= 2
    assert o["groups_carried"] >= saved["carried"] and o["groups_restarted"] >= saved["stalls"]
    assert o["answers_discarded"] >= saved["discarded"]  # (continued, not counted from zero)
    print(f"resumed from {first['driver']['step']}: saved {saved}, at the end {o}, {summary['in_flight_answers']}")


@pytest.mark.slow
def test_a_dynamic_sampling_async_run_killed_and_resumed_trains_only_groups_with_signal_once(tmp_path):
    from test_resume_async import TINY

    spy = tmp_path / "spy.jsonl"
    args = [*TINY, "algorithm.dynamic_sampling=true", "reward.fn=test_resume_overprovision:first_is_digit",
            "reward.timeout_s=null", "rollout.group_size=4"]
    run, first, summary = _killed_and_resumed(tmp_path, args, spy)
    lines = _steps(run)
    seen: dict[tuple[int, int], list[float]] = defaultdict(list)  # (process, group) -> rewards trained
    for rec in map(json.loads, spy.read_text().splitlines()):
        for g, r in zip(rec["group"], rec["reward"]):
            seen[(rec["pid"], g)].append(r)
    for m in lines:
        for g in m["groups"]:
            got = [r for (_, gg), r in seen.items() if gg == g]
            assert got and all(len(r) == 4 and max(r) > min(r) for r in got), (g, got)  # signal, whole group
    saved, d = first["rollout"]["counters"], summary["dynamic_sampling"]
    assert d["groups_scored"] >= saved["scored"] > 0 and d["groups_dropped"] >= saved["dropped"]
    assert sum(m["groups_dropped"] for m in lines) <= d["groups_dropped"]
    assert "prompts" in first["rollout"]
    print(f"resumed from {first['driver']['step']}: saved {saved} {first['rollout']['prompts']}, at the end {d}")
