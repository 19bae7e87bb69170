"""The configured algorithm reaches the actor: real pipeline (in-process launcher, tiny random model).

Per-formula correctness is pinned in ``test_algorithms.py``; here each non-default choice runs
end to end through config -> worker -> actor -> engine and leaves its metrics in the run folder.
"""

from __future__ import annotations

import json
import math

import pytest

from asyncflow.algorithms.algorithm import Algorithm
from asyncflow.config import load_config
from asyncflow.launch.local import LocalLauncher
from asyncflow.api import train

BASE = ["mode=async", "staleness=1", "launcher=local", "warmstart.enabled=false", "progress=false",
        "train.steps=3", "train.prompts_per_step=4", "train.micro_prompts=2", "rollout.group_size=4",
        "rollout.max_batch=8"]


def test_default_config_is_the_original_grpo_loss():
    a = Algorithm.from_config(load_config().algorithm)
    assert a.estimator == "grpo" and not a.batch_level and not a.needs_reference
    assert a.loss(128) == Algorithm(clip_low=0.2, clip_high=0.2, kl_coef=0.0).loss(128)
    dr = Algorithm.from_config(load_config(None, ["algorithm.std_normalize=false"]).algorithm)
    assert dr.estimator == "dr_grpo"


@pytest.mark.parametrize("overrides, expect", [
    # RLOO, DAPO token-mean + clip-higher, dual clip, decoupled PPO (group-level: streamed)
    (["algorithm.name=rloo", "algorithm.loss_agg=token-mean", "algorithm.clip_high=0.28",
      "algorithm.dual_clip=3", "algorithm.correction=decoupled"], ["masked_frac", "is_weight_mean", "dual_clip_frac"]),
    # REINFORCE++-baseline (batch-level: collected), KL k1 in the reward, TIS at sequence level, GSPO ratio
    (["algorithm.name=reinforce_pp_baseline", "algorithm.kl_coef=0.01", "algorithm.kl_in_reward=true",
      "algorithm.kl_estimator=k1", "algorithm.correction=tis", "algorithm.correction_level=geo",
      "algorithm.ratio_level=sequence"], ["is_weight_max"]),
])
def test_algorithm_choices_train_end_to_end(tmp_path, overrides, expect):
    cfg = load_config(None, BASE + overrides + [f"run_dir={tmp_path}"])
    summary = train(cfg, launcher=LocalLauncher(), run_dir=tmp_path, evaluate=False)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and summary["max_staleness"] <= 1
    for m in rows:
        assert m["samples"] == 16
        for k in expect + ["loss", "clip_frac_high", "ratio_mean", "grad_norm"]:
            assert k in m and math.isfinite(m[k]), (k, m)
        assert "kl" not in m  # kl_in_reward: no loss term; rloo: no KL at all


def test_every_shipped_config_builds_its_algorithm():
    from pathlib import Path

    import asyncflow

    for path in sorted((Path(asyncflow.__file__).parent / "configs").glob("*.yaml")):
        a = Algorithm.from_config(load_config(path).algorithm)
        loss = a.loss(128)
        assert loss.total_seqs == 128 and loss.clip_high >= loss.clip_low, path.name
