"""DAPO dynamic sampling through the real pipeline (in-process launcher, tiny random model).

A spy data plane records every batch handed to the trainer: (trainer version = partition,
group id, reward, sample version). With dynamic sampling every trained group must have
non-constant rewards, every step must still be full, nothing may be trained twice, and the
staleness bound must hold per sample; the drop rate is reported per step and in the summary.
The reward (first character of the answer is a digit) gives a random model a mix of
constant and non-constant groups (~40% of groups of 4 score all zeros).
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from asyncflow.config import ConfigError, load_config
from asyncflow.api import train
from test_staleness import DelayedDataPlane, DelayLauncher, spy_in_memory


def first_is_digit(prompt, response, sample) -> float:
    return float(response[:1].isdigit())


class RewardSpy(DelayedDataPlane):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.batches: list[tuple[int, list[int], list[float], list[int]]] = []

    def saw(self, meta, data):
        super().saw(meta, data)
        if meta.rows:
            self.batches.append((meta.partition, data["group"].tolist(), data["reward"].tolist(),
                                 data["version"].tolist()))


class SpyLauncher(DelayLauncher):
    def data_plane(self, schema, kind="ray", storage_units=2, **limits):
        self.plane = RewardSpy(schema, self.rng, self.max_delay_s)
        return self.plane


@pytest.mark.parametrize("mode,k,latency", [("sync", 0, None), ("async", 1, None), ("async", 2, None),
                                              ("async", 1, "[5, 30]")])
def test_trained_groups_have_signal_and_steps_stay_full(tmp_path, monkeypatch, mode, k, latency):
    """The last case scores through emulated remote calls in flight inside rollout."""
    steps, prompts, group = 5, 4, 4
    cfg = load_config(None, [f"reward.latency_ms={latency or 'null'}",
        "launcher=local", "warmstart.enabled=false", "progress=false", f"train.prompts_per_step={prompts}",
        "train.micro_prompts=1", f"rollout.group_size={group}", "rollout.max_batch=8", f"run_dir={tmp_path}",
        f"mode={mode}", f"staleness={k}", f"train.steps={steps}", "algorithm.dynamic_sampling=true",
        "reward.fn=test_dynamic_sampling:first_is_digit", "reward.timeout_s=null",
        "resources.sync_threads=1"])  # sync: one thread (2 threads on a loaded 2-core machine crawl)
    launcher = SpyLauncher(seed=k, max_delay_s=0.005)
    spy_in_memory(monkeypatch, launcher)  # (sync: rollout hands the actor its rows in memory)
    summary = train(cfg, launcher=launcher, run_dir=tmp_path, evaluate=False)

    by_group: dict[tuple[int, int], list[float]] = defaultdict(list)
    per_step: dict[int, int] = defaultdict(int)
    for part, groups, rewards, versions in launcher.plane.batches:
        for g, r, w in zip(groups, rewards, versions):
            by_group[(part, g)].append(r)
            per_step[part] += 1
            assert 0 <= part - w <= cfg.effective_staleness
    assert dict(per_step) == {v: prompts * group for v in range(steps)}  # every step full
    assert len({g for _, g in by_group}) == steps * prompts  # no group trained twice
    for key, rewards in by_group.items():
        assert len(rewards) == group and max(rewards) > min(rewards), (key, rewards)

    d = summary["dynamic_sampling"]
    assert d["groups_scored"] - d["groups_dropped"] >= steps * prompts  # kept >= trained
    assert d["groups_dropped"] > 0 and 0 < d["drop_rate"] < 1
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all("drop_rate" in m and 0 <= m["drop_rate"] <= 1 for m in rows)
    assert sum(m["groups_dropped"] for m in rows) <= d["groups_dropped"]
    assert all(m["samples"] == prompts * group for m in rows)


def test_dynamic_sampling_needs_rewards_in_rollout():
    with pytest.raises(ConfigError, match="reward.placement=rollout"):
        load_config(None, ["algorithm.dynamic_sampling=true", "reward.placement=separate"])
