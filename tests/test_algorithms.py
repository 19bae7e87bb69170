"""Algorithm library against hand-computed values: estimators, aggregation, clips, KL, corrections.

Shared case unless stated: five answers, ragged lengths, two groups::

    reward  = [1,   0, 0.5, 2, 0]
    group   = [0,   0, 0,   1, 1]
    lengths = [2,   1, 3,   1, 2]

Padding positions of every ``[B, R]`` tensor hold junk (``PAD``) that must never matter.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from asyncflow.algorithms.advantages import (
    compute_advantages, gae, returns_to_go, rloo_advantages, token_rewards, whiten_tokens)
from asyncflow.algorithms.algorithm import Algorithm
from asyncflow.algorithms.corrections import Correction, off_policy
from asyncflow.algorithms.kl import kl_estimate
from asyncflow.algorithms.losses import PolicyLoss, aggregate, clipped_pg
from asyncflow.engines.training import TokenBatch

R = np.array([1.0, 0.0, 0.5, 2.0, 0.0])
G = np.array([0, 0, 0, 1, 1])
LENS = [2, 1, 3, 1, 2]
PAD = 7.0


def _check_rows(got, want_per_seq, lens=LENS):
    assert [len(g) for g in got] == lens
    for g, w, n in zip(got, want_per_seq, lens):
        np.testing.assert_allclose(g, np.full(n, w) if np.ndim(w) == 0 else w, atol=1e-5, rtol=1e-5)


def _batch(lens):
    return TokenBatch.build([[1, 5]] * len(lens), [[7] * n for n in lens], pad_id=0)


def _tensor(rows, width, pad=PAD, grad=False):
    t = torch.full((len(rows), width), pad, dtype=torch.float32)
    for i, r in enumerate(rows):
        t[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return t.requires_grad_(grad)


# --------------------------------------------------------------------------- advantage estimators


def test_grpo_group_mean_std_broadcast_to_ragged_rows():
    # group 0: r = (1, 0, .5), mean .5, dev (.5, -.5, 0), pop std sqrt((.25 + .25 + 0) / 3) = 0.4082483
    #   -> (1.2247449, -1.2247449, 0); group 1: (2, 0), mean 1, std 1 -> (1, -1).
    _check_rows(compute_advantages("grpo", R, G, LENS), [1.2247449, -1.2247449, 0, 1, -1])


def test_dr_grpo_group_mean_only():
    _check_rows(compute_advantages("dr_grpo", R, G, LENS), [0.5, -0.5, 0, 1, -1])


def test_rloo_leave_one_out_baseline():
    # answer 0: 1 - mean(0, .5) = .75; answer 1: 0 - mean(1, .5) = -.75; answer 2: .5 - mean(1, 0) = 0;
    # answer 3: 2 - 0 = 2; answer 4: 0 - 2 = -2.
    _check_rows(compute_advantages("rloo", R, G, LENS), [0.75, -0.75, 0, 2, -2])
    # a group of one answer has no baseline: advantage 0
    np.testing.assert_allclose(rloo_advantages([3.0, 1.0, 2.0], np.array([0, 1, 1])), [0, -1, 1])


def test_reinforce_pp_whitens_over_every_token_of_the_step():
    # Returns-to-go (gamma 1, reward on the last token) = r on every token:
    # tokens 1,1 | 0 | .5,.5,.5 | 2 | 0,0 -> n = 9, sum 5.5, mean 0.6111111,
    # E[x^2] = (1 + 1 + .75 + 4) / 9 = .75, var = .75 - 0.6111111^2 = 0.3765432, std = 0.6136312.
    mu, sd = 5.5 / 9, math.sqrt(0.75 - (5.5 / 9) ** 2)
    got = compute_advantages("reinforce_pp", R, G, LENS)
    _check_rows(got, [(r - mu) / sd for r in R])
    assert abs(np.concatenate(got).mean()) < 1e-6  # token-weighted: zero mean over tokens


def test_reinforce_pp_baseline_centres_on_group_then_whitens():
    # centred r = (.5, -.5, 0, 1, -1); tokens .5,.5 | -.5 | 0,0,0 | 1 | -1,-1: n 9, sum -.5,
    # mean -0.0555556, E[x^2] = (.25 * 3 + 1 + 1 + 1) / 9 = 0.4166667, std = sqrt(0.4166667 - 0.0030864) = 0.6431021
    c = np.array([0.5, -0.5, 0, 1, -1])
    mu, sd = -0.5 / 9, math.sqrt(3.75 / 9 - (0.5 / 9) ** 2)
    _check_rows(compute_advantages("reinforce_pp_baseline", R, G, LENS), [(x - mu) / sd for x in c])


def test_token_rewards_and_returns_with_kl_penalty():
    # answer of 2 tokens, r = 1, penalties (.1, .2): rewards (-.1, 1 - .2) = (-.1, .8);
    # returns gamma 1: (.7, .8); gamma .5: (-.1 + .5 * .8, .8) = (.3, .8). Padding beyond a row is ignored.
    rows = token_rewards([1.0, 3.0], [2, 1], [np.array([0.1, 0.2]), np.array([0.5, 99.0])])
    _check_rows(rows, [[-0.1, 0.8], [2.5]], [2, 1])
    _check_rows(returns_to_go(rows), [[0.7, 0.8], [2.5]], [2, 1])
    _check_rows(returns_to_go(rows, 0.5), [[0.3, 0.8], [2.5]], [2, 1])


def test_kl_penalty_in_reward_lowers_group_scores():
    # Group estimators score s_i = r_i - sum_t pen: answer 0 (r 1, pen .1 + .2) -> .7, answer 1 (r 0) -> 0.
    # dr_grpo: mean .35 -> (.35, -.35).
    got = compute_advantages("dr_grpo", [1.0, 0.0], np.array([0, 0]), [2, 1], [np.array([0.1, 0.2]), np.array([0.0])])
    _check_rows(got, [0.35, -0.35], [2, 1])


def test_whiten_of_constant_is_zero():
    _check_rows(whiten_tokens([np.ones(2), np.ones(1)]), [0, 0], [2, 1])


def test_gae_hand_computed_ragged():
    # Row 0: rew (0, 0, 1), V (.5, .6, .7).
    #   gamma = lam = 1: deltas (.6 - .5, .7 - .6, 1 - .7) = (.1, .1, .3) -> A = (.5, .4, .3), returns (1, 1, 1).
    #   gamma .9, lam .5: delta2 = 1 - .7 = .3, A2 = .3; delta1 = .9 * .7 - .6 = .03, A1 = .03 + .45 * .3 = .165;
    #   delta0 = .9 * .6 - .5 = .04, A0 = .04 + .45 * .165 = .11425.
    # Row 1: rew (2,), V (1,): A = 2 - 1 = 1, return 2.
    rew, val = [np.array([0, 0, 1.0]), np.array([2.0])], [np.array([0.5, 0.6, 0.7]), np.array([1.0])]
    adv, ret = gae(rew, val)
    _check_rows(adv, [[0.5, 0.4, 0.3], [1.0]], [3, 1])
    _check_rows(ret, [[1, 1, 1], [2.0]], [3, 1])
    adv, ret = gae(rew, val, gamma=0.9, lam=0.5)
    _check_rows(adv, [[0.11425, 0.165, 0.3], [1.0]], [3, 1])
    _check_rows(ret, [[0.61425, 0.765, 1.0], [2.0]], [3, 1])


def test_unknown_estimator_names_the_choices():
    with pytest.raises(ValueError, match="rloo"):
        compute_advantages("ppo", R, G, LENS)


# --------------------------------------------------------------------------- aggregation

VALS = [[1.0, 2.0], [3.0], [4.0, 5.0, 6.0]]  # lengths 2, 1, 3; padding PAD


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", 21 / 6),                        # (1 + ... + 6) / 6 tokens = 3.5
    ("seq-mean-token-mean", (1.5 + 3 + 5) / 3),    # token means 1.5, 3, 5 over 3 sequences
    ("seq-mean-token-sum", (3 + 3 + 15) / 3),      # token sums 3, 3, 15 over 3 sequences = 7
])
def test_aggregation_modes_hand_computed(mode, expected):
    b = _batch([2, 1, 3])
    v = _tensor(VALS, 3)
    assert aggregate(v, b.mask, mode, total_seqs=3, total_tokens=6).item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_aggregation_is_additive_over_micro_batches(mode):
    # Step totals (3 sequences, 6 tokens) passed to each micro-batch: rows {0, 1} + row {2} = all.
    whole = aggregate(_tensor(VALS, 3), _batch([2, 1, 3]).mask, mode, 3, 6)
    parts = (aggregate(_tensor(VALS[:2], 2), _batch([2, 1]).mask, mode, 3, 6)
             + aggregate(_tensor(VALS[2:], 3), _batch([3]).mask, mode, 3, 6))
    assert parts.item() == pytest.approx(whole.item(), rel=1e-5, abs=1e-6)


def test_token_mean_without_total_is_a_token_sum():
    assert aggregate(_tensor(VALS, 3), _batch([2, 1, 3]).mask, "token-mean", 3, None).item() == pytest.approx(21.0)


# --------------------------------------------------------------------------- clipping


def test_symmetric_clip_each_branch():
    # eps .2: (rho 1.5, A 1): max(-1.5, -1.2) = -1.2 high-clipped; (.5, -1): max(.5, .8) = .8 low-clipped;
    # (1.1, 1): -1.1 inside; (.5, 1): max(-.5, -.8) = -.5 unclipped (pessimistic side).
    ratio, adv = torch.tensor([1.5, 0.5, 1.1, 0.5]), torch.tensor([1.0, -1.0, 1.0, 1.0])
    pg, f = clipped_pg(ratio, adv, 0.2, 0.2)
    torch.testing.assert_close(pg, torch.tensor([-1.2, 0.8, -1.1, -0.5]))
    assert f["clip_high"].tolist() == [True, False, False, False]
    assert f["clip_low"].tolist() == [False, True, False, False]


def test_clip_higher_asymmetric():
    # DAPO eps_low .2, eps_high .28: rho 1.25 A 1 -> -1.25 (inside, symmetric would give -1.2);
    # rho 1.5 A 1 -> -1.28; rho .7 A -1 -> max(.7, .8) = .8 (low clip unchanged).
    ratio, adv = torch.tensor([1.25, 1.5, 0.7]), torch.tensor([1.0, 1.0, -1.0])
    pg, f = clipped_pg(ratio, adv, 0.2, 0.28)
    torch.testing.assert_close(pg, torch.tensor([-1.25, -1.28, 0.8]))
    assert f["clip_high"].tolist() == [False, True, False] and f["clip_low"].tolist() == [False, False, True]


def test_dual_clip_bounds_negative_advantage_loss():
    # c = 3: (rho 5, A -1): PPO max(5, .8) = 5 -> min(5, 3) = 3 with no gradient;
    # (rho 2, A -1): 2 < 3 unchanged; (rho 5, A 1): max(-5, -1.2) = -1.2 (dual clip only for A < 0).
    ratio = torch.tensor([5.0, 2.0, 5.0], requires_grad=True)
    pg, f = clipped_pg(ratio, torch.tensor([-1.0, -1.0, 1.0]), 0.2, 0.2, dual_clip=3.0)
    torch.testing.assert_close(pg.detach(), torch.tensor([3.0, 2.0, -1.2]))
    assert f["dual"].tolist() == [True, False, False]
    pg.sum().backward()
    torch.testing.assert_close(ratio.grad, torch.tensor([0.0, 1.0, 0.0]))


def test_policy_loss_clip_higher_and_dual_clip_metrics_with_padding():
    # rows: (2 tokens: rho 1.25, 1.5; A 1), (1 token: rho 5; A -1); low .2, high .28, dual 3.
    # per token: -1.25, -1.28 | 3  -> seq-mean-token-mean over 2: ((-2.53) / 2 + 3) / 2 = 0.8675
    b = _batch([2, 1])
    old = [np.zeros(2), np.zeros(1)]
    logp = _tensor([[math.log(1.25), math.log(1.5)], [math.log(5.0)]], 2, grad=True)
    loss, m = PolicyLoss(total_seqs=2, clip_low=0.2, clip_high=0.28, dual_clip=3.0)(
        logp, b, {"logprobs": old, "advantages": np.array([1.0, -1.0])})
    assert loss.item() == pytest.approx(0.8675, rel=1e-5, abs=1e-5)
    assert m["clip_frac_high"] == pytest.approx(1 / 3) and m["clip_frac_low"] == 0.0
    assert m["dual_clip_frac"] == pytest.approx(1 / 3)
    assert m["ratio_max"] == pytest.approx(5.0, rel=1e-5) and m["ratio_min"] == pytest.approx(1.25, rel=1e-5)
    assert m["ratio_mean"] == pytest.approx((1.25 + 1.5 + 5) / 3, rel=1e-5)


def test_gspo_sequence_ratio_and_gradient():
    # row 0: log-ratios (.2, -.1) -> mean .05 -> s = e^.05 = 1.0512711; row 1: (.3,) -> e^.3 = 1.3498588 > 1.2.
    # A = (1, 1), eps .2: per token -1.0512711 (both tokens) | -1.2 (clipped).
    # seq-mean-token-mean over 2: (-1.0512711 - 1.2) / 2 = -1.1256355.
    # d/dlogp_t of row 0 = -s * (1/2 from the mean in s) * (1/2 token mean... summed over 2 tokens = 1) / 2 seqs
    #   = -s / 4 = -0.2628178 per token; row 1 is clipped -> 0.
    b = _batch([2, 1])
    old = [np.array([-1.0, -1.0]), np.array([-2.0])]
    logp = _tensor([[-0.8, -1.1], [-1.7]], 2, grad=True)
    loss, m = PolicyLoss(total_seqs=2, ratio_level="sequence")(logp, b, {"logprobs": old, "advantages": np.array([1.0, 1.0])})
    s = math.exp(0.05)
    assert loss.item() == pytest.approx((-s - 1.2) / 2, rel=1e-5, abs=1e-6)
    assert m["clip_frac_high"] == pytest.approx(1 / 3)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-s / 4, -s / 4], [0.0, 0.0]]), atol=1e-6, rtol=1e-5)


def test_per_token_advantage_rows_and_loss_aggregations():
    # ratio 1, per-token advantages (1, 3) | (2,): per-token loss -1, -3 | -2.
    # token-mean over 3 tokens: -6 / 3 = -2; seq-mean-token-mean: (-2 + -2) / 2 = -2; seq-mean-token-sum: (-4 - 2) / 2 = -3.
    b = _batch([2, 1])
    old = [np.array([-1.0, -1.0]), np.array([-1.0])]
    ex = {"logprobs": old, "advantages": [np.array([1.0, 3.0]), np.array([2.0])]}
    for agg, want in [("token-mean", -2.0), ("seq-mean-token-mean", -2.0), ("seq-mean-token-sum", -3.0)]:
        loss, _ = PolicyLoss(total_seqs=2, total_tokens=3, loss_agg=agg)(_tensor([[-1, -1], [-1]], 2), b, ex)
        assert loss.item() == pytest.approx(want, rel=1e-5, abs=1e-6), agg


# --------------------------------------------------------------------------- KL estimators


def test_kl_estimators_hand_computed_numpy_and_torch():
    # logp (-1, -2), ref (-1.5, -1): d = ref - logp = (-.5, 1).
    # k1 = logp - ref = (.5, -1); k2 = (logp - ref)^2 / 2 = (.125, .5);
    # k3 = e^d - d - 1 = (e^-.5 + .5 - 1, e - 2) = (0.1065307, 0.7182818).
    lp, ref = np.array([-1.0, -2.0]), np.array([-1.5, -1.0])
    want = {"k1": [0.5, -1.0], "k2": [0.125, 0.5], "k3": [math.exp(-0.5) - 0.5, math.e - 2]}
    for name, w in want.items():
        np.testing.assert_allclose(kl_estimate(name, lp, ref), w, atol=1e-7, rtol=1e-5)
        t = kl_estimate(name, torch.tensor(lp), torch.tensor(ref))
        np.testing.assert_allclose(t.numpy(), w, atol=1e-7, rtol=1e-5)
    with pytest.raises(ValueError, match="k3"):
        kl_estimate("k4", lp, ref)


@pytest.mark.parametrize("est, per_tok, grad, grad1", [
    # grads d/dlogp: k1 -> 1 (even where logp == ref); k2 -> logp - ref = (.5, -1) and 0;
    # k3 -> 1 - e^d = (1 - e^-.5, 1 - e) and 0
    ("k1", [0.5, -1.0], [1.0, 1.0], 1.0),
    ("k2", [0.125, 0.5], [0.5, -1.0], 0.0),
    ("k3", [math.exp(-0.5) - 0.5, math.e - 2], [1 - math.exp(-0.5), 1 - math.e], 0.0),
])
def test_kl_loss_term_with_padding(est, per_tok, grad, grad1):
    # Row 0 (2 tokens) has the KL above, row 1 (1 token) logp == ref -> 0; A = 0, ratio 1.
    # seq-mean-token-mean over 2 seqs, coef .5: .5 * ((k_a + k_b) / 2 + 0) / 2;
    # grad row 0: .5 * g / 2 tokens / 2 seqs = g / 8; row 1: .5 * g1 / 1 token / 2 seqs = g1 / 4; padding 0.
    b = _batch([2, 1])
    logp = _tensor([[-1.0, -2.0], [-1.0]], 2, grad=True)
    ex = {"logprobs": [np.array([-1.0, -2.0]), np.array([-1.0])], "advantages": np.zeros(2),
          "ref_logprobs": [np.array([-1.5, -1.0]), np.array([-1.0])]}
    loss, m = PolicyLoss(total_seqs=2, kl_coef=0.5, kl_estimator=est)(logp, b, ex)
    assert loss.item() == pytest.approx(0.5 * sum(per_tok) / 4, rel=1e-5, abs=1e-6)
    assert m["kl"] == pytest.approx(sum(per_tok) / 3, rel=1e-5, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[g / 8 for g in grad], [grad1 / 4, 0.0]]), atol=1e-6, rtol=1e-5)


def test_kl_in_reward_replaces_the_loss_term():
    # Algorithm with kl_in_reward: penalty k1 * coef folded into scores, loss has no KL term.
    alg = Algorithm(estimator="dr_grpo", kl_coef=0.5, kl_estimator="k1", kl_in_reward=True)
    data = {"reward": np.array([1.0, 0.0]), "group": np.array([0, 0]),
            "response_ids": [np.array([3, 4]), np.array([5])],
            "logprobs": [np.array([-1.0, -2.0]), np.array([-1.0])],
            "ref_logprobs": [np.array([-1.5, -1.0]), np.array([-1.0])]}
    # k1 row 0 = (.5, -1), sum -.5, x .5 = -.25 -> score 1.25; row 1 -> 0; dr_grpo: (.625, -.625)
    _check_rows(alg.advantages(data), [0.625, -0.625], [2, 1])
    assert alg.loss(2).kl_coef == 0.0


# --------------------------------------------------------------------------- off-policy corrections

# logp (= proximal policy) and behaviour log-probs such that pi_prox / mu = (3, .25) | (1.5,)
LOGP = [[-1.0, -1.0], [-2.0]]
LOGW = [[math.log(3.0), math.log(0.25)], [math.log(1.5)]]
BEHAV = [[a - w for a, w in zip(r, lw)] for r, lw in zip(LOGP, LOGW)]


def _off(corr):
    b = _batch([2, 1])
    return off_policy(_tensor(LOGP, 2), _tensor(BEHAV, 2), b.mask, corr)


def test_correction_none_uses_behaviour_as_ratio_base():
    base, w, keep, m = _off(Correction("none"))
    torch.testing.assert_close(base[0], torch.tensor(BEHAV[0], dtype=torch.float32))
    assert w.tolist() == [[1, 1], [1, 1]] and keep.tolist() == [[1, 1], [1, 0]] and m == {}


def test_tis_truncates_weights_at_cap():
    base, w, keep, m = _off(Correction("tis", cap=2.0))
    torch.testing.assert_close(w * keep, torch.tensor([[2.0, 0.25], [1.5, 0.0]]))  # min(3, 2), .25, 1.5
    assert keep.tolist() == [[1, 1], [1, 0]]
    assert m["is_weight_max"] == pytest.approx(3.0, rel=1e-5)
    assert m["is_weight_mean"] == pytest.approx((3 + 0.25 + 1.5) / 3, rel=1e-5)
    torch.testing.assert_close(base[0], torch.tensor(LOGP[0]))  # proximal = logp.detach()


def test_mask_drops_extreme_ratios_token_and_geo():
    _, w, keep, m = _off(Correction("mask", low=0.5, high=2.0))
    assert keep.tolist() == [[0, 0], [1, 0]] and m["masked_frac"] == pytest.approx(2 / 3)  # 3 > 2, .25 < .5
    # geo: row 0 geometric mean sqrt(3 * .25) = 0.8660254 -> kept; row 1: 1.5 kept.
    _, w, keep, m = _off(Correction("mask", level="geo", low=0.5, high=2.0))
    assert keep.tolist() == [[1, 1], [1, 0]] and m["masked_frac"] == 0.0
    _, w, keep, _ = _off(Correction("tis", level="geo", cap=2.0))
    torch.testing.assert_close(w[0], torch.tensor([0.8660254, 0.8660254]))


def test_decoupled_ppo_loss_and_gradient():
    # weight pi_prox / mu = (3, .25) | (1.5); cap 2 drops the 3. Update ratio pi / pi_prox = 1.
    # A = (1, 2): per token -A * w * keep = (0, -.25) | (-3).
    # seq-mean-token-mean over 2: ((0 - .25) / 2 - 3) / 2 = -1.5625; grad = -A w keep / (n_i * 2):
    # (0, -.25 / 4) | (-3 / 2).
    b = _batch([2, 1])
    logp = _tensor(LOGP, 2, grad=True)
    loss, m = PolicyLoss(total_seqs=2, correction=Correction("decoupled", cap=2.0))(
        logp, b, {"logprobs": BEHAV, "advantages": np.array([1.0, 2.0])})
    assert loss.item() == pytest.approx(-1.5625, rel=1e-5, abs=1e-6)
    assert m["masked_frac"] == pytest.approx(1 / 3) and m["clip_frac"] == 0.0
    assert m["ratio_max"] == pytest.approx(3.0, rel=1e-5) and m["ratio_min"] == pytest.approx(0.25, rel=1e-5)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.0625], [-1.5, 0.0]]), atol=1e-6, rtol=1e-5)


def test_explicit_proximal_logprobs_clip_the_update_ratio():
    # prox given (a previous epoch): pi / pi_prox = 1.5 > 1.2 with A 1 -> clipped to -1.2, weight pi_prox / mu = 1.
    b = _batch([1])
    logp = _tensor([[math.log(1.5)]], 1, grad=True)
    loss, m = PolicyLoss(total_seqs=1, correction=Correction("tis", cap=2.0))(
        logp, b, {"logprobs": [np.zeros(1)], "prox_logprobs": [np.zeros(1)], "advantages": np.array([1.0])})
    assert loss.item() == pytest.approx(-1.2, rel=1e-5, abs=1e-6) and m["clip_frac_high"] == 1.0


# --------------------------------------------------------------------------- engine: token-mean accumulation


def test_token_mean_streamed_with_grad_scale_equals_one_big_batch():
    from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model
    from asyncflow.engines.training import TrainEngine

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, seed=0, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=64)
    prompts = [[1, 10, 11], [1, 12], [1, 13, 14, 15]]
    responses = [[20, 21, 22], [23], [24, 25]]
    lp = TrainEngine(model, pad_id=tok.pad_token_id).logprobs(prompts, responses)
    adv = np.array([1.0, -0.5, 2.0])
    ex = lambda sl: {"logprobs": lp[sl], "advantages": adv[sl]}  # noqa: E731

    def grads_after(micro_batches, total_tokens):
        eng = TrainEngine(copy.deepcopy(model), pad_id=tok.pad_token_id, grad_clip=1e9)
        seen = {}
        eng.opt.step = lambda: seen.update({n: p.grad.clone() for n, p in eng.model.named_parameters()})
        loss = PolicyLoss(total_seqs=3, total_tokens=total_tokens, loss_agg="token-mean")
        for sl in micro_batches:
            eng.forward_backward(prompts[sl], responses[sl], ex(sl), loss)
        eng.optimizer_step(grad_scale=1.0 if total_tokens else 1 / 6)
        return seen

    big = grads_after([slice(0, 3)], total_tokens=6)
    streamed = grads_after([slice(0, 1), slice(1, 3)], total_tokens=None)
    for n in big:
        torch.testing.assert_close(streamed[n], big[n], atol=1e-6, rtol=1e-5)
