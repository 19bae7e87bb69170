"""Planner: the simulator on hand-computable cases, cost models, search and profile JSON."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncflow.planner.costs import ConstantCost
from asyncflow.planner.sim import Allocation, Workload, simulate

# 2 prompts x 2 answers of 4 tokens; every answer decodes in 4 rounds of 1 s.
WL = dict(prompts_per_step=2, group_size=2, prompt_len=3, lengths={4: 1.0}, steps=6)
COST = ConstantCost(decode=1.0, train_per_row=0.5, step=1.0, reward=0.25)


def test_sync_step_is_the_sum_of_its_phases():
    r = simulate(Workload(**WL), Allocation("sync", micro_prompts=1, slots=4), COST)
    # generate 4 s + reward 4 x 0.25 s + train 4 x 0.5 s + optimizer step 1 s = 8 s per step of 4 samples
    assert r.samples_per_s == pytest.approx(4 / 8)
    assert r.step_end[0] == pytest.approx(8.0)


def test_stream_without_overlap_is_the_sum_of_phases():
    # whole-batch micro-batch, staleness 0: rollout of step v+1 waits for the weights of step v
    r = simulate(Workload(**WL), Allocation("stream", micro_prompts=2, slots=4), COST)
    assert r.samples_per_s == pytest.approx(4 / 8)
    assert r.max_staleness == 0


def test_async_with_a_large_bound_runs_at_the_slowest_role():
    wl = Workload(**{**WL, "steps": 12})
    r = simulate(wl, Allocation("async", micro_prompts=1, staleness=50, slots=4), COST)
    assert r.samples_per_s == pytest.approx(4 / 4)  # rollout: 4 s per step; actor 3 s
    slow_actor = ConstantCost(decode=1.0, train_per_row=2.0, step=1.0)
    r = simulate(wl, Allocation("async", micro_prompts=1, staleness=2, slots=4), slow_actor)
    assert r.samples_per_s == pytest.approx(4 / 9)  # actor: 4 x 2 s + 1 s (bound 2 keeps rollout in step)
    assert r.busy["actor"] == pytest.approx(1.0)
    # window = steps 1..11 = 99 s; rollout (2 partitions ahead) generates partitions 3..11 in it: 9 x 4 s
    assert r.idle["rollout"] == pytest.approx(1 - 36 / 99)


def test_async_staleness_one_overlaps_and_respects_the_bound():
    wl = Workload(**{**WL, "lengths": {2: 0.8, 12: 0.2}, "steps": 20, "prompts_per_step": 4})
    a1 = simulate(wl, Allocation("async", micro_prompts=1, staleness=1, slots=8), COST)
    s0 = simulate(wl, Allocation("stream", micro_prompts=1, slots=8), COST)
    assert a1.max_staleness <= 1 and s0.max_staleness == 0
    assert a1.samples_per_s > s0.samples_per_s


def test_shared_cores_stretch_concurrent_work():
    wl = Workload(**{**WL, "steps": 12})
    alloc = Allocation("async", micro_prompts=1, staleness=50, slots=4)
    free = simulate(wl, alloc, COST)
    shared = simulate(wl, alloc, COST, cores=1)
    assert shared.samples_per_s < free.samples_per_s
    assert shared.samples_per_s >= 4 / (4 + 3) - 1e-9  # never worse than running one at a time


def test_swap_cost_is_paid_by_rollout_once_per_step():
    wl = Workload(**{**WL, "steps": 12})
    alloc = Allocation("async", micro_prompts=1, staleness=50, slots=4)
    r = simulate(wl, alloc, ConstantCost(decode=1.0, swap=0.5))
    assert r.samples_per_s == pytest.approx(4 / 4.5)
    assert sum(1 for role, what, *_ in r.spans if what.startswith("swap")) == 11


# ---------------------------------------------------------------------------- cost models, search, CLI
PROFILE = {
    "cpus": 2, "prompt_len": 7.0, "lengths": {"4": 0.5, "8": 0.5}, "export_s": 0.001, "load_s": 0.001,
    "reward_s_per_sample": 1e-5, "param_bytes": 4000,
    "curves": {"1": {"decode": [0.002, 3e-5, 1e-7], "prefill": [0.005, 3e-5], "train": [0.006, 9e-5], "step_s": 5e-4},
               "2": {"decode": [0.0015, 2e-5, 1e-7], "prefill": [0.004, 2e-5], "train": [0.005, 5e-5], "step_s": 5e-4}},
    "calibration": {"1": {"rollout": 1.0, "actor": 1.0}, "2": {"rollout": 1.0, "actor": 1.0}},
    "pipeline": {"step_overhead_s": 0.01, "transfer_s": 0.002},
}


def test_profiled_cost_reads_the_curves_and_picks_thread_counts():
    from asyncflow.planner.costs import ProfiledCost

    c = ProfiledCost.from_dict(PROFILE)
    assert c.decode_s(10, 20, 1) == pytest.approx(0.002 + 3e-4 + 2e-5)
    assert c.train_s(8, 10, 2) == pytest.approx(0.005 + 5e-5 * 80)
    assert c.train_s(8, 10, 4) == c.train_s(8, 10, 2)  # 4 threads not profiled: 2 is used
    assert c.step_overhead_s() == 0.01 and c.transfer_s() == 0.002


def test_multi_thread_teams_take_their_own_sync_run_factors():
    """role_factor corrects one-thread work, role_factor_threads each team size (from a real
    sync run on that many threads); a team size without its own run keeps the curves."""
    from asyncflow.planner.costs import ProfiledCost

    pipe = {**PROFILE["pipeline"], "role_factor": {"actor": 1.5}, "role_factor_threads": {"2": {"actor": 1.25}}}
    c = ProfiledCost.from_dict({**PROFILE, "pipeline": pipe})
    assert c.train_s(8, 10, 1) == pytest.approx(1.5 * ProfiledCost.from_dict(PROFILE).train_s(8, 10, 1))
    assert c.train_s(8, 10, 2) == pytest.approx(1.25 * (0.005 + 5e-5 * 80))
    assert c.decode_s(10, 20, 2) == ProfiledCost.from_dict(PROFILE).decode_s(10, 20, 2)  # no rollout factor


def test_analytic_decode_is_memory_bound_at_small_batches_and_training_scales_with_devices():
    from asyncflow.planner.costs import DEVICES, MODELS, AnalyticCost

    c = AnalyticCost(MODELS["7b"], DEVICES["h100"], tp=1)
    weights_read = 2 * 7.6e9 / (3350e9 * 0.6)  # bf16 weights once per round at 60% of HBM bandwidth
    assert c.decode_s(1, 100, 1) == pytest.approx(weights_read + 0.012, rel=1e-3)
    assert c.train_s(64, 1000, 8) == pytest.approx(c.train_s(64, 1000, 16) * 2)


def test_search_ranks_every_mode_and_says_when_sync_wins():
    from asyncflow.config import load_config
    from asyncflow.planner.costs import ProfiledCost
    from asyncflow.planner.search import format_plan, search

    cfg = load_config(None, ["train.prompts_per_step=4", "rollout.max_batch=16"])
    ranked = search(cfg, ProfiledCost.from_dict(PROFILE), PROFILE, cpus=2, steps=6)
    assert {a.mode for a, _ in ranked} == {"sync", "stream", "async"}
    rest = ranked[1:]
    assert all(r1.samples_per_s >= r2.samples_per_s for (_, r1), (_, r2) in zip(rest, rest[1:]))
    best = max(r.samples_per_s for _, r in ranked)
    assert ranked[0][1].samples_per_s >= 0.97 * best  # the plan: the simplest within 3% of the best
    assert all(a.micro_prompts * 8 <= 32 for a, _ in ranked)  # PROFILE's curves: 8 and 32 rows
    text = format_plan(ranked, 2)
    assert "plan:" in text and "idle" in text
    sync_first = [(a, r) for a, r in ranked if a.mode == "sync"] + [(a, r) for a, r in ranked if a.mode != "sync"]
    assert "sync wins here" in format_plan(sync_first, 2)


def test_plan_warns_when_the_profile_was_disturbed():
    from asyncflow.planner.search import noisy_calibration

    assert noisy_calibration(PROFILE) == []
    bad = {**PROFILE, "calibration": {"2": {"rollout": 3.3, "actor": 1.0}}}
    assert noisy_calibration(bad) == ["rollout on 2 thread(s) x3.30"]


def test_plan_cli_and_simulated_trace(tmp_path, capsys):
    import json

    from asyncflow.cli import main

    prof, trace = tmp_path / "p.json", tmp_path / "t.json"
    prof.write_text(json.dumps(PROFILE))
    assert main(["plan", "train.prompts_per_step=4", "rollout.max_batch=16", "--profile", str(prof),
                 "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "predicted:" in out and "best of each mode" in out
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"rollout", "actor"} <= names
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")


def test_real_run_writes_a_trace_with_one_track_per_role(tmp_path):
    import json

    from asyncflow.config import load_config
    from asyncflow.api import train

    cfg = load_config(None, ["mode=stream", "launcher=local", "warmstart.enabled=false", "train.steps=2",
                             "train.prompts_per_step=4", "train.micro_prompts=2", "train.eval_every=0",
                             "progress=false", f"run_dir={tmp_path}", "reward.placement=separate"])
    s = train(cfg, evaluate=False)
    events = json.loads((Path(s["run_dir"]) / "trace.json").read_text())["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"rollout", "reward", "actor"} <= tracks
    assert min(e["ts"] for e in events if e["ph"] == "X") >= 0
    import importlib.util

    if importlib.util.find_spec("matplotlib"):  # the [plot] extra: the same timeline as a PNG beside it
        assert (Path(s["run_dir"]) / "gantt.png").read_bytes()[:4] == b"\x89PNG"


def test_whatif_at_small_scale_runs_and_async_beats_one_task_at_a_time():
    from asyncflow.planner.whatif import run_mode

    kw = dict(steps=3, prompts=32, splits=(0.5,), micro=8)
    base, _ = run_mode("7b", 32, "stream", **{**kw, "micro": 32})
    asyn, a = run_mode("7b", 32, "async", **kw)
    assert a.rollout_res == 16 and asyn > base


def test_profile_fit_never_returns_a_negative_cost_term():
    from asyncflow.planner.profile import _fit

    assert _fit([[1, 1], [1, 2], [1, 3]], [2, 4, 6]) == pytest.approx([0, 2], abs=1e-9)
    noisy = _fit([[1, 10], [1, 20], [1, 30]], [0.5, 0.2, 0.6])  # a load spike on the first point
    assert min(noisy) >= 0


def test_completion_order_placement_moves_a_long_group_to_a_later_step():
    # 2 prompts x 1 answer per step, staleness 1, decode 1 s per round, everything else free.
    # Groups in start order have lengths 4, 1, 1, 1, 1, 1 (group 0 is the long tail).
    # t=0: v0 admits (0+1+1)*2 = 4 groups; fetch g0, g1; round 1 ends at t=1: g1 -> step 0.
    # t=1: fetch g2, g3; round 2 ends at t=2: g2 -> step 0 (now full), g3 -> step 1.
    #      the trainer trains step 0 at t=2 and publishes v1 (no wait for g0).
    # t=2: rollout still on v0 (publish lands after its round), admits 0 more; round 3 ends at t=3.
    # t=3: swap to v1, admits (1+1+1)*2 - 4 = 2: g4, g5 start at v1; round 4 ends at t=4:
    #      g0 -> step 1 (deadline 0+1), g4, g5 -> step 2. Steps 1 and 2 both train at t=4.
    wl = Workload(prompts_per_step=2, group_size=1, prompt_len=1, steps=3, length_seq=[4, 1, 1, 1, 1, 1])
    r = simulate(wl, Allocation("async", micro_prompts=1, staleness=1, slots=8), ConstantCost(decode=1.0))
    assert r.placement == {0: 1, 1: 0, 2: 0, 3: 1, 4: 2, 5: 2}
    assert r.step_end == pytest.approx([2.0, 4.0, 4.0])
    assert r.max_staleness == 1
    # staleness 0 (stream): every group lands in its prompt's step, so step 0 waits for g0
    s = simulate(wl, Allocation("stream", micro_prompts=1, slots=8), ConstantCost(decode=1.0))
    assert s.placement == {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2}
    assert s.step_end == pytest.approx([4.0, 5.0, 6.0])


def test_prefill_samples_the_first_token_when_the_workload_says_so():
    # the real engines sample an answer's first token in its prefill: 4 tokens = prefill + 3 rounds
    cost = ConstantCost(decode=1.0, prefill=0.5, train_per_row=0.5, step=1.0, reward=0.25)
    r = simulate(Workload(**WL, prefill_token=True), Allocation("sync", micro_prompts=1, slots=4), cost)
    assert r.samples_per_s == pytest.approx(4 / (0.5 + 3 + 1 + 2 + 1))
    assert [w for role, w, s, _ in r.spans if role == "rollout" and s < 7] == ["prefill"] + ["decode"] * 3
    assert simulate(Workload(**WL), Allocation("sync", micro_prompts=1, slots=4), cost).samples_per_s \
        == pytest.approx(4 / (0.5 + 4 + 1 + 2 + 1))  # without it every token is a decode round


def test_measured_overheads_are_paid_where_each_mode_pays_them():
    # pieces = (rollout per partition, data latency per group, actor per step)
    cost = ConstantCost(decode=1.0, train_per_row=0.5, step=1.0, reward=0.25, overhead=0.0, pieces=(0.0, 0.5, 0.25))
    # stream, whole-batch micro-batch: the data latency is on the critical path, the actor's
    # step boundary overlaps the next rollout: 8 s + 0.5 s
    assert simulate(Workload(**WL), Allocation("stream", micro_prompts=2, slots=4), cost).samples_per_s \
        == pytest.approx(4 / 8.5)
    assert simulate(Workload(**WL), Allocation("sync", micro_prompts=2, slots=4), cost).samples_per_s \
        == pytest.approx(4 / 8)  # sync pays step_overhead_s only (0 here)
    # async, actor-bound (4 x 2 s + 1 s): the step boundary adds, the data latency hides
    slow = ConstantCost(decode=1.0, train_per_row=2.0, step=1.0, pieces=(0.0, 0.5, 0.25))
    r = simulate(Workload(**{**WL, "steps": 12}), Allocation("async", micro_prompts=1, staleness=2, slots=4), slow)
    assert r.samples_per_s == pytest.approx(4 / 9.25)


def _sync_tracks(steps: int, roll: list[float], actor: list[float], data_gap: float, boundary: float):
    """A sync run's trace: per step rollout (one span), reward 0.01 s, actor (two spans);
    ``data_gap`` from rollout to reward plus reward to actor, ``boundary`` from the actor
    to the next rollout."""
    t, out = 0.0, {"rollout": [], "reward": [], "actor": []}
    for v in range(steps):
        out["rollout"].append((t, roll[v]))
        t += roll[v] + data_gap / 2
        out["reward"].append((t, 0.01))
        t += 0.01 + data_gap / 2
        out["actor"] += [(t, actor[v] / 2), (t + actor[v] / 2, actor[v] / 2)]
        t += actor[v] + boundary
    return out


def test_sync_steps_and_fit_pipeline_use_per_step_medians():
    from asyncflow.config import load_config
    from asyncflow.planner.calib import fit_pipeline, sync_steps
    from asyncflow.planner.costs import ProfiledCost
    from asyncflow.planner.search import predict

    run = load_config(None, ["mode=sync", "resources.sync_threads=1", "train.prompts_per_step=4",
                             "rollout.max_batch=16", "train.steps=6"])
    prof = {**PROFILE, "pipeline": {"transfer_s": 0.002}}
    pred = predict(run, ProfiledCost.from_dict(prof), prof, 2, steps=6)
    per_step = pred.steady_s / 5
    r0, a0 = pred.busy["rollout"] * per_step, pred.busy["actor"] * per_step
    # rollout 2x the curves in every step; the actor at the curves' speed except one step
    # 3x slower (another job): a whole-run mean would say 1.4x, the median says 1
    roll, actor = [2 * r0] * 6, [a0, a0, a0, 3 * a0, a0, a0]
    tracks = _sync_tracks(6, roll, actor, data_gap=0.02, boundary=0.01)
    steps = sync_steps(tracks)
    assert len(steps) == 5  # steps 1..5, each from the end of the step before
    assert steps[0]["seconds"] == pytest.approx(0.01 + 2 * r0 + 0.02 + 0.01 + a0)
    assert steps[2]["busy"]["actor"] == pytest.approx(3 * a0)
    assert all(s["data_gap"] == pytest.approx(0.02) for s in steps)
    fit = fit_pipeline(run, prof, tracks, 2)
    assert fit["role_factor"]["rollout"] == pytest.approx(2.0) and fit["role_factor"]["actor"] == pytest.approx(1.0)
    assert fit["step_overhead_s"] == pytest.approx(0.03)  # data gap + boundary, the reward's 0.01 s is busy
    assert fit["data_latency_s"] == pytest.approx(0.02)
    c = ProfiledCost.from_dict({**PROFILE, "pipeline": fit})
    assert c.decode_s(10, 20, 1) == pytest.approx(2 * (0.002 + 3e-4 + 2e-5))  # one thread: corrected
    assert c.decode_s(10, 20, 2) == pytest.approx(0.0015 + 2e-4 + 2e-5)  # two threads: as profiled
    assert c.pipeline_overheads_s() == pytest.approx((0.015, 0.0, 0.015))  # no actor_overhead_s: split in two
    c = ProfiledCost.from_dict({**PROFILE, "pipeline": {**fit, "actor_overhead_s": 0.02}})
    assert c.pipeline_overheads_s() == pytest.approx((0.0, 0.02, 0.02))


def test_actor_steps_and_overlap_interference():
    from asyncflow.planner.calib import actor_steps, overlap_interference

    # 5 steps of 3 actor spans (0.1 s each, back to back), boundaries of 0.02, 0.03, 0.04, 0.05 s
    spans, t = [], 0.0
    for v in range(5):
        spans += [(t, 0.1), (t + 0.1, 0.1), (t + 0.2, 0.1)]
        t += 0.3 + 0.02 + 0.01 * v
    steps = actor_steps({"actor": spans}, 5)
    assert [s["gap"] for s in steps] == pytest.approx([0.03, 0.04, 0.05])  # steps 1..3
    assert [s["busy"] for s in steps] == pytest.approx([0.3] * 3)
    assert actor_steps({"actor": spans[:-1]}, 5) == []  # spans do not divide into steps

    # 6 steps of 2 micro-batches + 1 optimizer span. Alone a micro-batch takes 0.1 s; the
    # second of each step runs 3/4 beside rollout and takes 0.1 x (1 + 0.6 x 3/4) = 0.145 s:
    # interference 1.6. The optimizer spans (0.5 s, all beside rollout) are not micro-batches.
    actor, roll, t = [], [], 0.0
    for v in range(6):
        actor += [(t, 0.1), (t + 0.1, 0.145), (t + 0.245, 0.5)]
        roll += [(t + 0.1 + 0.145 / 4, 0.145 * 3 / 4 + 0.5)]
        t += 1.0
    assert overlap_interference({"actor": actor, "rollout": roll}, 6) == pytest.approx(1.6)
    slow_alone = [(s, 0.2 if i % 3 == 0 else d) for i, (s, d) in enumerate(actor)]  # beside is faster
    assert overlap_interference({"actor": slow_alone, "rollout": roll}, 6) == 1.0
    assert overlap_interference({"actor": actor, "rollout": []}, 6) == 1.0  # nothing ran beside it


def test_transfer_is_measured_through_a_subscriber():
    from asyncflow.launch.registry import get_launcher
    from asyncflow.planner.profile import _transfer

    assert 0.0 < _transfer(get_launcher("local"), 4000, reps=3, warm=1) < 1.0


def test_search_prefers_the_simplest_plan_within_three_percent_and_stays_in_profiled_rows():
    from asyncflow.planner.search import candidates, profiled_rows

    from asyncflow.config import load_config
    cfg = load_config(None, ["train.prompts_per_step=16"])
    assert profiled_rows(PROFILE) == 32
    assert profiled_rows({"curves": {"1": {"train_rows": [8, 32, 128]}, "2": {"train_rows": [8, 64]}}}) == 64
    assert {a.micro_prompts for a in candidates(cfg, 2, max_rows=32)} == {1, 2, 4}
    assert {a.micro_prompts for a in candidates(cfg, 2)} == {1, 2, 4, 8, 16}


def test_plan_ties_within_three_percent_go_to_the_freshest(monkeypatch):
    import asyncflow.planner.search as search_mod
    from asyncflow.config import load_config
    from asyncflow.planner.sim import SimResult

    speed = {1: 100.0, 2: 102.0, 3: 110.0}  # staleness -> simulated samples/s

    def fake(cfg, cost, prof, cpus, steps=None, alloc=None):
        s = speed[alloc.staleness] if alloc.mode == "async" else 50.0
        return SimResult(s, [], {"rollout": 0, "reward": 0, "actor": 0}, [], 0, 1.0)

    monkeypatch.setattr(search_mod, "predict", fake)
    cfg = load_config(None, ["train.prompts_per_step=4"])
    assert search_mod.search(cfg, None, PROFILE, cpus=1, modes=("async",))[0][0].staleness == 3  # 110 > 1.03 x 102
    speed[3] = 104.0
    assert search_mod.search(cfg, None, PROFILE, cpus=1, modes=("async",))[0][0].staleness == 2  # 102 within 3%


def test_thread_teams_are_limited_by_other_load_and_roles_never_oversubscribe(monkeypatch):
    from asyncflow.config import load_config
    from asyncflow.planner.search import candidates, team_limit

    monkeypatch.setattr("os.getloadavg", lambda: (0.2, 0.0, 0.0))
    assert team_limit(2) == 2
    monkeypatch.setattr("os.getloadavg", lambda: (1.6, 0.0, 0.0))
    assert team_limit(2) == 1 and team_limit(8) == 6
    cfg = load_config(None, ["train.prompts_per_step=4"])
    threads = {(a.mode, a.rollout_res) for a in candidates(cfg, 4, max_threads=3)}
    assert threads == {("sync", 1), ("sync", 2), ("sync", 3), ("stream", 1), ("stream", 2), ("async", 1), ("async", 2)}


def test_tensor_parallel_splits_each_training_pass_and_pays_four_all_reduces_a_layer():
    """``Allocation.tp``: each pass costs ``1 / tp`` of its compute plus ``4 x layers`` all-reduces
    (Megatron: two forward, two backward), the step ``1 / tp``; hand-computed on constant costs."""
    from asyncflow.planner.costs import ProfiledCost

    wl = Workload(prompts_per_step=2, group_size=2, prompt_len=3, lengths={4: 1.0}, steps=3, layers=3, hidden=8)
    cost = ConstantCost(decode=0.1, train_per_row=0.5, step=1.0, allreduce=0.01)
    spans = {tp: simulate(wl, Allocation("async", micro_prompts=1, staleness=1, slots=4, tp=tp), cost).spans
             for tp in (1, 2)}
    train = {tp: {round(d, 9) for role, what, _, d in s if role == "actor" and what == "train"}
             for tp, s in spans.items()}
    assert train == {1: {1.0}, 2: {0.5 + 4 * 3 * 0.01}}  # 2 rows x 0.5 s, halved, + 12 all-reduces of 10 ms
    steps = {tp: {d for role, what, _, d in s if what == "optimizer step"} for tp, s in spans.items()}
    assert steps == {1: {1.0}, 2: {0.5}}
    # the profiled (CPU) model: a ring all-reduce at the assumed gloo link (2 GB/s, 50 us a hop); 1 rank: none
    prof = ProfiledCost.from_dict(PROFILE)
    assert prof.allreduce_s(1e6, 2) == pytest.approx(1e6 / 2e9 + 2 * 50e-6)  # half sent, half received, twice
    assert prof.allreduce_s(1e6, 1) == 0.0


def test_plan_keeps_the_configs_tensor_parallelism_and_leaves_out_sync():
    from asyncflow.config import load_config
    from asyncflow.planner.search import allocation_for, candidates, model_dims, workload_from

    cfg = load_config(None, ["launcher=ray", "train.tp=2", "train.prompts_per_step=4", "model.num_layers=3"])
    cands = candidates(cfg, 6)
    assert cands and all(a.tp == 2 and a.mode != "sync" for a in cands)
    assert max(a.actor_res for a in cands) == 2  # rollout's threads + 2 ranks' threads within 6 cores
    assert "actor 1 x tp 2" in allocation_for(cfg, 6).describe()
    assert model_dims(cfg) == (3, 128)
    wl = workload_from(cfg, PROFILE)
    assert (wl.layers, wl.hidden) == (3, 128)
