"""Contract of :class:`asyncflow.dataplane.core.samplers.Sampler`, run against every sampler.

``SAMPLERS`` lists the implementations (adding one is one line): each built-in sampler,
and the compositions the roles use (the actor's ``TokenBalancedSampler(world,
StalenessSampler(v - k, GroupSampler(g)))``). The contract (the module doc): ``sample(ready,
n, tags) -> (chosen, consumed)`` with ``chosen`` at most ``n`` rows, no row twice,
``chosen`` within ``consumed`` within ``ready``; a pure function of its arguments (the
controller may call it again for the same request); picklable, as it travels to a remote
controller. Checked as a property over random ready sets, tags and ``n`` (hypothesis), and
by :func:`~asyncflow.dataplane.core.samplers.check_sample`, which the data plane applies.
"""

from __future__ import annotations

import copy
import pickle

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from asyncflow.dataplane.core.samplers import (
    GroupSampler,
    Sampler,
    SequentialSampler,
    StalenessSampler,
    TokenBalancedSampler,
    check_sample,
)

SAMPLERS = {  # name -> (group_size) -> sampler; "group" in the name: it takes whole groups only
    "sequential": lambda g: SequentialSampler(),
    "group": lambda g: GroupSampler(g),
    "staleness": lambda g: StalenessSampler(2),
    "staleness-group": lambda g: StalenessSampler(2, GroupSampler(g)),
    "token-balanced": lambda g: TokenBalancedSampler(3),
    "token-balanced-group": lambda g: TokenBalancedSampler(2, GroupSampler(g)),
    "actor-group": lambda g: TokenBalancedSampler(2, StalenessSampler(1, GroupSampler(g))),
}


@st.composite
def requests(draw):
    """``(group_size, ready, tags, n)``: ready rows ascending, each group with at most
    ``group_size`` ready rows (as the rollout role puts them), tags on every row."""
    g = draw(st.integers(1, 4))
    counts = draw(st.lists(st.integers(0, g), max_size=8))
    groups = draw(st.permutations([gid for gid, c in enumerate(counts) for _ in range(c)]))
    ids = sorted(draw(st.sets(st.integers(0, 300), min_size=len(groups), max_size=len(groups))))
    version = {gid: draw(st.integers(0, 4)) for gid in range(len(counts))}  # a group shares its version
    tags = {"group": dict(zip(ids, groups)),
            "version": {row: version[gid] for row, gid in zip(ids, groups)},
            "tokens": {row: draw(st.integers(1, 50)) for row in ids}}
    n = draw(st.integers(1, 12))
    return g, ids, tags, n


@pytest.mark.parametrize("name", list(SAMPLERS))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(req=requests())
def test_sampler_contract(name, req):
    g, ready, tags, n = req
    if "group" in name:
        assume(n >= g)  # a request smaller than one group: see test_group_sampler_n_below_group_size
    sampler = SAMPLERS[name](g)
    assert isinstance(sampler, Sampler)
    ready_before, tags_before = list(ready), copy.deepcopy(tags)
    chosen, consumed = sampler.sample(ready, n, tags)
    assert ready == ready_before and tags == tags_before, "inputs are read-only"
    assert len(chosen) <= n
    assert len(set(chosen)) == len(chosen) and len(set(consumed)) == len(consumed), "no row twice"
    assert set(chosen) <= set(consumed) <= set(ready)
    assert check_sample(sampler, ready, n, chosen, consumed) == (list(chosen), list(consumed))
    assert sampler.sample(ready, n, tags) == (chosen, consumed), "a pure function of its arguments"
    clone = pickle.loads(pickle.dumps(sampler))
    assert clone == sampler and clone.sample(ready, n, tags) == (chosen, consumed)
    if "group" in name:  # whole groups only
        for gid in {tags["group"][r] for r in chosen}:
            assert sum(tags["group"][r] == gid for r in chosen) == g


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_missing_tags_raise_value_error(name):
    sampler = SAMPLERS[name](2)
    needs_tags = not isinstance(sampler, SequentialSampler)
    if needs_tags:
        with pytest.raises(ValueError, match="tag"):
            sampler.sample([0, 1, 2, 3], 4, {})
    else:
        assert sampler.sample([0, 1, 2, 3], 4, {}) == ([0, 1, 2, 3], [0, 1, 2, 3])


@pytest.mark.xfail(strict=True, raises=ValueError, reason=(
    "GroupSampler hands out max(1, n // group_size) whole groups, so a request for fewer rows than one "
    "group (n < group_size) gets group_size > n rows: the data plane's check_sample then fails the request "
    "with 'sampler ... broke the contract' instead of a clear error (tests/test_queue_properties.py pins "
    "the max(1, ...) rule)"))
def test_group_sampler_n_below_group_size():
    sampler = GroupSampler(4)
    ready, tags = [0, 1, 2, 3], {"group": {0: 0, 1: 0, 2: 0, 3: 0}}
    chosen, consumed = sampler.sample(ready, 2, tags)
    check_sample(sampler, ready, 2, chosen, consumed)
