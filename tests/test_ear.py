"""EAR (entropy-based advantage reshaping) by hand-computed values, and its invariants.

A' = A + clip(alpha * (H - mean_group H), -|A| / kappa, |A| / kappa), H = -mean(logprobs).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow.algorithms.advantages import compute_advantages
from asyncflow.algorithms.algorithm import Algorithm
from asyncflow.algorithms.ear import EAR, answer_entropy
from asyncflow.config import load_config

# one group of four answers: rewards 1, 1, 0, 0 -> Dr.GRPO advantages 0.5, 0.5, -0.5, -0.5
LOGPROBS = [np.array([-0.1, -0.3]), np.array([-1.0]), np.array([-0.2, -0.2, -0.2]), np.array([-0.6])]
# H = 0.2, 1.0, 0.2, 0.6 (mean 0.5) -> d = -0.3, 0.5, -0.3, 0.1


def test_answer_entropy_is_the_mean_surprisal():
    assert answer_entropy(LOGPROBS + [np.array([])]) == pytest.approx([0.2, 1.0, 0.2, 0.6, 0.0], rel=1e-12)


@pytest.mark.parametrize("alpha, want", [
    # bound |A| / 2 = 0.25: psi = clip(d) = -0.25, 0.25, -0.25, 0.1
    (1.0, [0.25, 0.75, -0.75, -0.4]),
    # alpha 0.5: psi = -0.15, 0.25 (clipped), -0.15, 0.05
    (0.5, [0.35, 0.75, -0.65, -0.45]),
])
def test_ear_by_hand(alpha, want):
    got = EAR(alpha=alpha, kappa=2.0).reshape(np.array([0.5, 0.5, -0.5, -0.5]), answer_entropy(LOGPROBS),
                                              np.zeros(4, np.int64))
    assert got == pytest.approx(want, rel=1e-6)


def test_ear_is_relative_to_each_group_and_keeps_a_zero_advantage_zero():
    # group 7: the hand case; group 9: all agree (A = 0), its entropies differ: stays 0
    adv = np.array([0.5, 0.5, -0.5, -0.5, 0.0, 0.0])
    h = np.concatenate([answer_entropy(LOGPROBS), [0.1, 2.0]])
    got = EAR(1.0, 2.0).reshape(adv, h, np.array([7, 7, 7, 7, 9, 9]))
    assert got == pytest.approx([0.25, 0.75, -0.75, -0.4, 0.0, 0.0], rel=1e-6)


def test_compute_advantages_with_ear_broadcasts_the_reshaped_value_to_every_token():
    rows = compute_advantages("dr_grpo", [1, 1, 0, 0], [3, 3, 3, 3], [2, 1, 3, 1], ear=EAR(1.0, 2.0),
                              logprobs=LOGPROBS)
    assert [r.tolist() for r in rows] == [[0.25, 0.25], [0.75], [-0.75, -0.75, -0.75], [pytest.approx(-0.4)]]
    # GRPO: A = +-a, a = 0.5 / (0.5 + 1e-6); the bound a / 2 now clips only answer 1's 0.5
    a = 0.5 / (0.5 + 1e-6)
    grpo = compute_advantages("grpo", [1, 1, 0, 0], [3] * 4, [2, 1, 3, 1], ear=EAR(1.0, 2.0), logprobs=LOGPROBS)
    assert [r[0] for r in grpo] == pytest.approx([a - 0.3, 1.5 * a, -a - 0.3, -a + 0.1], rel=1e-6)


def test_ear_applies_to_group_estimators_only():
    with pytest.raises(ValueError, match="group estimator"):
        compute_advantages("reinforce_pp", [1, 0], [0, 0], [1, 1], ear=EAR(), logprobs=LOGPROBS[:2])
    with pytest.raises(ValueError, match="alpha > 0 and kappa > 1"):
        EAR(alpha=1.0, kappa=1.0)


def test_the_config_switch_reaches_the_actors_advantages():
    a = Algorithm.from_config(load_config(None, ["algorithm.ear=true", "algorithm.ear_alpha=0.5",
                                                 "algorithm.std_normalize=false"]).algorithm)
    data = {"reward": np.array([1, 1, 0, 0], np.float32), "group": np.array([3] * 4),
            "response_ids": [np.zeros(len(r)) for r in LOGPROBS], "logprobs": LOGPROBS}
    assert [r[0] for r in a.advantages(data)] == pytest.approx([0.35, 0.75, -0.65, -0.45], rel=1e-6)
    off = Algorithm.from_config(load_config(None, ["algorithm.std_normalize=false"]).algorithm)
    assert [r[0] for r in off.advantages(data)] == pytest.approx([0.5, 0.5, -0.5, -0.5], rel=1e-6)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(-3, 3), st.floats(0, 5), st.integers(0, 2)), min_size=1, max_size=12),
       st.floats(0.01, 5), st.floats(1.01, 10))
def test_ear_keeps_the_sign_and_stays_within_the_bound(rows, alpha, kappa):
    adv, h, g = (np.array(x, dtype=np.float64) for x in zip(*rows))
    got = EAR(alpha, kappa).reshape(adv, h, g).astype(np.float64)
    assert np.all(np.sign(got) == np.sign(adv.astype(np.float32)))
    assert np.all(np.abs(got - adv) <= np.abs(adv) / kappa * (1 + 1e-6) + 1e-6)
