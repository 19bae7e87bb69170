"""The simulator's dataflow pinned against real runs of the same config: counts, never timings.

Each test trains a tiny real job (threads of this process, answers of a fixed length so every
count is determined) and simulates the same config (:func:`asyncflow.planner.search.predict`,
hand-set costs: the structure does not depend on them), then compares what
:mod:`asyncflow.planner.terms` reads from both: the roles' tracks, the trainer's steps and
fetches, rollout's decode rounds and weight swaps, the evaluations due and where they run
(beside training or pausing it), the checkpoints. A change to the workflow that changes its
dataflow (a decode round more per answer, another role, a fetch per pass, a checkpoint or
evaluation schedule, rows moved differently between data-parallel ranks) without the
simulator following fails here. The run's summary also carries the planner's prediction for
its own config (``planner``) and the printed summary its line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncflow.config import load_config
from asyncflow.planner.costs import ConstantCost
from asyncflow.planner.search import predict
from asyncflow.planner.terms import sim_structure, step_terms, structure

L, STEPS = 3, 4  # every answer is L tokens (rollout.gen_len=longtail, no long ones)
TINY = ["launcher=local", "warmstart.enabled=false", "progress=false", f"train.steps={STEPS}",
        "train.prompts_per_step=4", "train.micro_prompts=4", "rollout.group_size=2", "rollout.max_batch=8",
        "rollout.gen_len=longtail", f"rollout.longtail_short={L}", "rollout.longtail_frac=0", "task.eval_n=4",
        "train.eval_every=2", "train.save_every=2", "model.hidden_size=32", "model.num_layers=1",
        "model.num_heads=2", "model.num_kv_heads=1", "model.intermediate_size=64"]
COST = ConstantCost(decode=0.01, prefill=0.01, train_per_row=0.001, step=0.005, transfer=0.002, evaluation=0.05,
                    checkpoint=(0.001, 0.002, 0.003), pieces=(0.001, 0.002, 0.003), overhead=0.004)


def _real(tmp_path: Path, *extra: str) -> tuple:
    from asyncflow.api import train

    cfg = load_config(None, [*TINY, f"run_dir={tmp_path}", *extra])
    s = train(cfg)
    lines = [json.loads(x) for x in (Path(s["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return cfg, s, structure(s["run_dir"], s, lines)


def _sim(cfg):
    r = predict(cfg, COST, {"prompt_len": 7.0, "lengths": {str(L): 1.0}}, 2, steps=cfg.train.steps)
    return r, sim_structure(r)


def test_sync_dataflow_matches_the_simulator(tmp_path):
    # sync: one colocated worker, STEPS steps of 8 answers started together: L - 1 decode rounds each
    # (the prefill samples the first token), one in-memory fetch and one step span a step, no swap;
    # evaluations pause training (due after steps 2, not after the last), checkpoints after 2 and 4
    from asyncflow.observe.report import format_summary

    cfg, s, real = _real(tmp_path, "mode=sync")
    r, sim = _sim(cfg)
    assert real == sim
    assert real["decode"] == STEPS * (L - 1) and real["swaps"] == 0 and real["eval_due"] == 1
    assert real["checkpoints"] == 2 and real["eval_beside"] is False
    p = s["planner"]  # the drift line: the built-in default profile (no profile in this run folder)
    assert p["predicted_samples_per_s"] > 0 and "built-in default" in p["profile"]
    assert p["error"] == pytest.approx(p["predicted_samples_per_s"] / s["steady_samples_per_s"] - 1, rel=1e-9)
    assert "planner            predicted" in format_summary(s)
    assert json.loads((Path(s["run_dir"]) / "summary.json").read_text())["planner"]["profile"] == p["profile"]


def test_stream_dataflow_matches_the_simulator(tmp_path):
    # stream: rollout waits for every version: a swap before each step but the first, and the
    # last version's after the last step (which the job may stop first), the step's 4 groups in one greedy fetch
    # (micro-batch = the step); evaluations beside training (the evaluator's track)
    cfg, s, real = _real(tmp_path, "mode=stream")
    r, sim = _sim(cfg)
    assert real["swaps"] in (sim["swaps"] - 1, sim["swaps"])
    real["swaps"] = sim["swaps"]
    assert real == sim
    assert sim["swaps"] == STEPS and real["eval_beside"] is True and real["fetches"] == STEPS
    # the trace names what the simulator names: every step has a train and a step span
    terms = step_terms(Path(s["run_dir"]) / "trace.json", "stream")
    assert {"transfer_s", "data_s", "train_s", "optimizer_s"} <= set(terms)
    assert set(terms) == set(step_terms(r, "stream"))


def test_data_parallel_sync_ranks_match_the_simulator(tmp_path):
    # train.dp=2 in sync: two colocated workers, each generating and training its own 2 prompts
    cfg, s, real = _real(tmp_path, "mode=sync", "train.dp=2", "train.save_every=0", "train.eval_every=0")
    r, sim = _sim(cfg)
    assert real == sim
    assert {"rollout", "actor", "rollout.1", "actor.1"} <= set(real["tracks"])


def test_plan_check_measures_each_mode_beside_its_prediction(tmp_path):
    # `asyncflow plan --check`'s table (planner.check.accuracy, given a profile: the built-in
    # default one): one short real run, its prediction for the same config, the error between
    # them, and the steady step term by term from the real trace and the simulated one
    from asyncflow.api import train
    from asyncflow.planner.check import DEFAULT_PROFILE, accuracy, format_accuracy

    cfg = load_config(None, [*TINY, f"run_dir={tmp_path}", "train.save_every=0", "train.eval_every=0"])
    report = accuracy(cfg, train, steps=4, modes=("stream",), profile=str(DEFAULT_PROFILE), log=lambda m: None,
                      run_root=str(tmp_path))
    (row,) = report["rows"]
    assert row["predicted"] > 0 and row["measured"] > 0
    assert row["error"] == pytest.approx(row["predicted"] / row["measured"] - 1, rel=1e-9)
    assert Path(row["run_dir"]).parent == tmp_path
    assert set(row["terms_real"]) == set(row["terms_sim"]) >= {"step_s", "transfer_s", "data_s"}
    text = format_accuracy(report)
    assert "stream" in text and "term" in text and f"{row['error']:+.1%}" in text
