"""Planner: the simulator on hand-computable cases, cost models, search and profile JSON."""

from __future__ import annotations

import pytest

from asyncflow.planner.sim import Allocation, ConstantCost, Workload, simulate

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
