"""Over-provisioning (``rollout.overprovision``): extra groups, completion order, strict bound.

Placer tests are hand-computed; the property test drives :class:`GroupPlacer` with random
start / complete / restart / drop / retry interleavings and a trainer that steps when it
can. The end-to-end tests run the real pipeline in process on the fake engine.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow.workflow.placement import GroupPlacer


def test_on_policy_extras_fill_the_step_then_restart_at_the_next_version():
    g = GroupPlacer(groups_per_step=2, staleness=0, extra=1)
    assert g.admits(0) == 3  # (0 + 0 + 1) x 2 + 1
    for gid in range(3):
        g.start(gid, 0)  # all soft, deadline 0
    assert g.complete(2) == 0 and g.complete(0) == 0  # the fastest two fill step 0
    assert g.expire() == [1]  # group 1 started at 0 cannot be trained at 1: stalled
    assert not g.retry(1, 0)  # version 0 + 0 < lowest step 1: wait for version 1
    assert g.retry(1, 1) and 1 not in g.soft  # restarted at 1, firm (step 1 has room)
    assert g.admits(1) == 2  # (1 + 1) x 2 + 1 - 3 live
    g.start(3, 1)
    g.start(4, 1)
    assert g.complete(3) == 1  # one free slot of step 1 is left, owed to firm group 1
    assert g.complete(4) is None  # so the soft group 4 finds none: stalled, not trained
    assert g.complete(1) == 1
    assert (g.stalls, g.carried, g.stalled) == (2, 0, {4})


def test_a_straggler_carries_over_within_the_bound():
    g = GroupPlacer(groups_per_step=1, staleness=1, extra=1)
    for gid in range(3):  # (0 + 1 + 1) x 1 + 1 = 3 admitted, deadline 1
        g.start(gid, 0)
    assert g.complete(2) == 0  # step 0 is done without groups 0 and 1
    assert g.complete(1) == 1  # group 1 ran across the boundary and lands in step 1 = its deadline
    assert g.carried == 1
    assert g.expire() == [0]  # steps 0 and 1 are full: group 0 would be trained at 2 > 0 + 1


def test_a_young_group_leaves_the_slot_an_older_one_needs():
    g = GroupPlacer(groups_per_step=2, staleness=1, extra=1)
    for gid in range(5):  # (0 + 2) x 2 + 1 = 5, deadline 1
        g.start(gid, 0)
    assert g.complete(0) == 0 and g.complete(1) == 0
    g.start(5, 1)  # trainer at version 1: deadline 2
    # step 1 would keep only one of groups 2, 3, 4 (deadline 1); step 2 keeps two of them
    assert g.complete(5) == 2
    assert g.complete(2) == 1 and g.complete(3) == 1
    assert g.expire() == [4]


def test_without_extras_nothing_changes():
    g = GroupPlacer(groups_per_step=1, staleness=1)
    g.start(0, 0)
    g.start(1, 0)
    assert g.soft == set() and g.admits(0) == 0
    assert g.complete(1) == 0 and g.complete(0) == 1 and g.expire() == []


def test_the_error_names_the_field():
    from asyncflow.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="rollout.overprovision"):
        load_config(None, ["rollout.overprovision=-1"])
    with pytest.raises(ValueError, match="extra"):
        GroupPlacer(2, 0, extra=-1)


@settings(max_examples=300, deadline=None)
@given(P=st.integers(1, 4), k=st.integers(0, 3), E=st.integers(1, 6), steps=st.integers(1, 6),
       seed=st.integers(0, 10**6), slots=st.integers(1, 12), restart_p=st.sampled_from([0.0, 0.2]),
       drop_p=st.sampled_from([0.0, 0.3]))
def test_random_interleavings_keep_the_bound(P, k, E, steps, seed, slots, restart_p, drop_p):
    """Every placed group lands in a step <= (its last start version) + k; no step is over
    full; every admitted group is placed once, dropped, running or stalled; firm groups stay
    feasible; the pipeline never jams."""
    rng = random.Random(seed)
    g, version, gid = GroupPlacer(P, k, E), 0, 0
    running: dict[int, int] = {}  # gid -> version of its current start
    stalled: list[int] = []
    full: dict[int, int] = {}
    placed: set[int] = set()
    dropped = 0
    for _ in range(100_000):
        if version >= steps:
            break
        while stalled and len(running) < slots and g.retry(stalled[0], version):
            running[stalled.pop(0)] = version
        while len(running) < slots and g.admits(version):
            g.start(gid, version)
            running[gid] = version
            gid += 1
        assert running or full.get(version, 0) == P, "jammed"
        if running:
            done = rng.choice(sorted(running))
            r = rng.random()
            if r < restart_p:  # on_swap=discard at the current version
                g.restart(done, version)
                running[done] = version
            elif r < restart_p + drop_p * (1 - restart_p):
                running.pop(done)
                g.drop(done)
                dropped += 1
            else:
                w = running.pop(done)
                step = g.complete(done)
                if step is None:
                    stalled.append(done)
                else:
                    assert 0 <= step - w <= k, (step, w)
                    assert done not in placed
                    placed.add(done)
                    full[step] = full.get(step, 0) + 1
                    assert full[step] <= P
        for s in g.expire():
            running.pop(s)
            stalled.append(s)
        assert g._feasible(None)  # every firm group can still meet its deadline
        assert set(running) == set(g.running) and set(stalled) == g.stalled
        while full.get(version, 0) == P and (rng.random() < 0.7 or not running):
            version += 1
    assert version >= steps
    assert all(full[v] == P for v in range(steps))
    assert g.started - g.dropped == len(placed) + len(running) + len(stalled)
    assert g.started == gid and g.dropped == dropped
