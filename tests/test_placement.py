"""Completion-order placement never breaks the per-sample staleness bound, and never jams."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow.workflow.placement import GroupPlacer


def simulate(P: int, k: int, steps: int, seed: int, slots: int) -> list[tuple[int, int]]:
    """Rollout with ``slots`` concurrent groups finishing in random order; the trainer trains
    step v as soon as it is full (version v + 1). Returns (step, start version) per group."""
    rng = random.Random(seed)
    placer, version, gid = GroupPlacer(P, k), 0, 0
    running: dict[int, int] = {}  # gid -> start version
    placed: list[tuple[int, int]] = []
    full: dict[int, int] = {}
    while version < steps:
        while len(running) < slots and placer.admits(version) and gid < (steps + k) * P:
            placer.start(gid, version)
            running[gid] = version
            gid += 1
        if not running:
            raise AssertionError("jammed: nothing running and the trainer cannot step")
        done = rng.choice(list(running))
        start_version = running.pop(done)
        step = placer.complete(done)
        placed.append((step, start_version))
        full[step] = full.get(step, 0) + 1
        while full.get(version, 0) == P and rng.random() < 0.7:  # the trainer is sometimes late
            version += 1
        if not running and full.get(version, 0) == P:
            version += 1
    return placed


@settings(max_examples=200, deadline=None)
@given(P=st.integers(1, 5), k=st.integers(0, 3), steps=st.integers(1, 8), seed=st.integers(0, 10**6),
       slots=st.integers(1, 12))
def test_every_group_is_trained_within_the_bound(P, k, steps, seed, slots):
    placed = simulate(P, k, steps, seed, slots)
    for step, w in placed:
        assert 0 <= step - w <= k, (step, w)
    counts: dict[int, int] = {}
    for step, _ in placed:
        counts[step] = counts.get(step, 0) + 1
    assert all(n <= P for n in counts.values())
    assert all(counts.get(v) == P for v in range(steps))  # every trained step was full


def test_on_policy_is_step_by_step():
    placed = simulate(P=3, k=0, steps=4, seed=1, slots=8)
    assert all(step == w for step, w in placed)


def test_a_slow_group_moves_to_the_next_step_instead_of_stalling():
    g = GroupPlacer(groups_per_step=2, staleness=1)
    for gid in range(4):  # version 0 admits (0 + 1 + 1) * 2 = 4 groups
        g.start(gid, 0)
    assert g.admits(0) == 0
    assert g.complete(1) == 0 and g.complete(2) == 0  # group 0 is slow: step 0 fills without it
    assert g.complete(3) == 1 and g.complete(0) == 1  # it lands in step 1 = its deadline


def test_a_group_that_would_steal_an_older_deadline_waits_its_turn():
    g = GroupPlacer(groups_per_step=1, staleness=1)
    g.start(0, 0)  # A: deadline 1
    g.start(1, 0)  # B: deadline 1
    assert g.complete(1) == 0
    g.start(2, 1)  # C: deadline 2 (trainer at version 1)
    assert g.complete(2) == 2  # step 1 is A's last chance: C goes to step 2
    assert g.complete(0) == 1


def test_admission_is_enforced():
    g = GroupPlacer(groups_per_step=1, staleness=0)
    g.start(0, 0)
    with pytest.raises(RuntimeError, match="admission"):
        g.start(1, 0)


def test_restart_keeps_admission_and_moves_the_deadline():
    """on_swap=discard: a restarted group is not a new admission; its deadline moves later."""
    p = GroupPlacer(groups_per_step=1, staleness=1)
    p.start(10, version=0)  # deadline 1
    p.start(11, version=0)  # deadline 1; admission at v0 is now exhausted: (0 + 1 + 1) x 1
    assert p.admits(0) == 0
    p.restart(11, version=1)
    assert p.started == 2 and p.running == {10: 1, 11: 2} and p.admits(1) == 1
    assert p.complete(11) == 0 and p.complete(10) == 1  # EDF still places both within deadlines
    with pytest.raises(RuntimeError, match="not running"):
        p.restart(12, version=1)


# --------------------------------------------------------------------------- dynamic sampling


def test_a_dropped_group_gives_its_admission_back_and_takes_no_slot():
    g = GroupPlacer(groups_per_step=2, staleness=0)
    g.start(0, 0)
    g.start(1, 0)
    assert g.admits(0) == 0
    g.drop(0)  # all rewards equal: not trained
    assert g.admits(0) == 1  # live = 2 started - 1 dropped
    g.start(2, 0)
    assert g.complete(1) == 0 and g.complete(2) == 0  # step 0 is full with the two kept groups
    assert g.admits(0) == 0 and g.admits(1) == 2


@settings(max_examples=200, deadline=None)
@given(P=st.integers(1, 4), k=st.integers(0, 3), steps=st.integers(1, 6), seed=st.integers(0, 10**6),
       slots=st.integers(1, 10), drop_p=st.sampled_from([0.0, 0.3, 0.7]))
def test_dropping_groups_keeps_the_bound_and_fills_every_step(P, k, steps, seed, slots, drop_p):
    """Random drops (dynamic sampling) with unlimited prompts: every placed group is within
    the bound, every trained step is full, and the pipeline never jams."""
    rng = random.Random(seed)
    placer, version, gid = GroupPlacer(P, k), 0, 0
    running: dict[int, int] = {}
    full: dict[int, int] = {}
    dropped = 0
    for _ in range(100_000):
        if version >= steps:
            break
        while len(running) < slots and placer.admits(version):
            placer.start(gid, version)
            running[gid] = version
            gid += 1
        assert running, "jammed: nothing running and the trainer cannot step"
        done = rng.choice(list(running))
        w = running.pop(done)
        if rng.random() < drop_p:
            placer.drop(done)
            dropped += 1
            continue
        step = placer.complete(done)
        assert 0 <= step - w <= k, (step, w)
        full[step] = full.get(step, 0) + 1
        assert full[step] <= P
        while full.get(version, 0) == P and (rng.random() < 0.7 or not running):
            version += 1
    assert version >= steps
    assert all(full[v] == P for v in range(steps))
    assert placer.started - placer.dropped == sum(full.values()) + len(running)
