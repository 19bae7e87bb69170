"""ETMR's fork planner (asyncflow/algorithms/etmr.py): the fork rule by hand, the group size it
keeps, the token budget, and exact accounting (a shared prefix counted once) as a property."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow.algorithms.etmr import Branch, TreePlan, TreeShape


def test_leaves_of_a_shape():
    assert TreeShape(roots=2, forks=1, branches=3, rounds=1).leaves == 8
    assert TreeShape(roots=1, forks=2, branches=2, rounds=2).leaves == 9
    assert TreeShape(roots=4, rounds=0).leaves == 4
    with pytest.raises(ValueError, match="budget"):
        TreeShape(budget=1.5)


def test_one_round_forks_each_tree_at_its_most_uncertain_token_by_hand():
    plan = TreePlan(TreeShape(roots=2, forks=1, branches=3, rounds=1))
    assert plan.start() == [Branch(0, 0), Branch(1, 1)]
    # root 0: the highest score is at index 0 (not eligible: it would share nothing), then index 1
    got = plan.finish(0, [10, 11, 12, 2], [2.0, 0.9, 0.5, 0.2])
    assert got == [Branch(2, 0, 0, 1), Branch(3, 0, 0, 1), Branch(4, 0, 0, 1)]
    assert plan.retained() == [] and plan.answer(3) == ([10], [2.0])  # (tree 0 has no round left)
    got = plan.finish(1, [20, 21, 22], [0.1, 0.3, 0.4])
    assert got == [Branch(5, 1, 1, 2), Branch(6, 1, 1, 2), Branch(7, 1, 1, 2)]
    for cid, own in ((2, [13, 2]), (3, [11, 12, 2]), (4, [2]), (5, [23]), (6, [22]), (7, [24, 25])):
        assert plan.finish(cid, own, [0.5] * len(own)) == []
    assert plan.done
    assert plan.answer(2)[0] == [10, 13, 2] and plan.answer(5)[0] == [20, 21, 23]
    # generated: 4 + 3 + (2 + 3 + 1) + (1 + 1 + 2) = 17; independent: 4 + 3 + (3 + 4 + 2) + (3 + 3 + 4) = 26
    assert (plan.generated, plan.independent) == (17, 26)


def test_a_second_round_forks_among_every_chain_of_the_tree_but_not_twice_at_a_point():
    plan = TreePlan(TreeShape(roots=1, forks=1, branches=1, rounds=2))
    plan.start()
    assert plan.finish(0, [5, 6, 7, 2], [0.0, 0.8, 0.1, 0.1]) == [Branch(1, 0, 0, 1)]
    assert plan.retained() == [0]  # a round is left: root 0's cache must be kept
    # the branch scored 0.9 at its own index 1 (full position 2): better than root 0's remaining 0.1s
    assert plan.finish(1, [9, 8, 2], [3.0, 0.9, 0.2]) == [Branch(2, 0, 1, 2)]
    assert plan.answer(2) == ([5, 9], [0.0, 3.0]) and plan.retained() == []
    plan.finish(2, [4, 2], [0.1, 0.1])
    assert plan.done and plan.independent - plan.generated == 1 + 2  # shared prefixes: 1 and 2 tokens


def test_too_few_fork_points_spread_the_branches_and_none_falls_back_to_the_prompt():
    plan = TreePlan(TreeShape(roots=2, forks=2, branches=2, rounds=1))
    plan.start()
    # root 0 has one eligible point (index 1): all 4 branches fork there, the group keeps its size
    assert [b.at for b in plan.finish(0, [3, 4], [0.1, 0.2])] == [1, 1, 1, 1]
    # root 1 is a bare EOS: nothing to share, its branches start from the prompt (counted)
    got = plan.finish(1, [2], [0.5])
    assert got == [Branch(c, 1) for c in range(6, 10)] and plan.fallbacks == 4


def test_the_budget_skips_an_expensive_fork_point_for_an_affordable_one():
    # leaves 4, root of 10 tokens: cap = 0.7 * 4 * 10 = 28 tokens; the root spent 10.
    # index 1 (score 0.9): 3 branches x 9 tokens = 27 -> 37 > 28; index 8 (0.5): 3 x 2 = 6 -> 16 fits
    plan = TreePlan(TreeShape(roots=1, forks=1, branches=3, rounds=1, budget=0.7))
    plan.start()
    scores = [0.0, 0.9, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.5, 0.1]
    assert [b.at for b in plan.finish(0, list(range(10)), scores)] == [8, 8, 8]
    assert plan.over_budget == 0
    # a budget nothing fits: the cheapest point is taken, and counted
    tight = TreePlan(TreeShape(roots=1, forks=1, branches=3, rounds=1, budget=0.25))
    tight.start()
    assert [b.at for b in tight.finish(0, list(range(10)), scores)] == [9, 9, 9] and tight.over_budget == 1


def test_misuse_is_an_error():
    plan = TreePlan(TreeShape(roots=1, rounds=0))
    plan.start()
    with pytest.raises(ValueError, match="scores"):
        plan.finish(0, [1, 2], [0.1])
    plan.finish(0, [1], [0.1])
    with pytest.raises(ValueError, match="twice"):
        plan.finish(0, [1], [0.1])


@settings(max_examples=60, deadline=None)
@given(roots=st.integers(1, 3), forks=st.integers(1, 3), branches=st.integers(1, 3), rounds=st.integers(0, 2),
       budget=st.sampled_from([None, 0.5, 0.9]), seed=st.integers(0, 10_000))
def test_every_group_has_its_leaves_and_the_accounting_is_exact(roots, forks, branches, rounds, budget, seed):
    """Chains finish in random order with random lengths: the group always ends with ``leaves``
    answers; each branch's answer starts with its parent's first ``at`` tokens; generated tokens =
    what the chains sampled themselves; independent - generated = the shared prefixes, each once."""
    rng = random.Random(seed)
    shape = TreeShape(roots, forks, branches, rounds, budget)
    plan = TreePlan(shape)
    live, parents = list(plan.start()), {}
    while live:
        b = live.pop(rng.randrange(len(live)))
        parents[b.chain] = b
        n = rng.randint(1, 6)
        live += plan.finish(b.chain, [rng.randint(3, 20) for _ in range(n)], [rng.random() for _ in range(n)])
    assert plan.done and len(plan.chains) == shape.leaves
    shared = 0
    for cid, b in parents.items():
        if b.parent is not None:
            assert plan.answer(cid)[0][: b.at] == plan.answer(b.parent)[0][: b.at]
            shared += b.at
    assert plan.generated == sum(len(c.own) for c in plan.chains.values())
    assert plan.independent - plan.generated == shared
