"""GRPO advantages and the clipped token-level loss, against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from asyncflow.algorithms.advantages import dr_grpo_advantages, grpo_advantages
from asyncflow.algorithms.algorithm import Algorithm
from asyncflow.engines.inference import SamplingParams, sample_tokens
from asyncflow.engines.training import TokenBatch


# --------------------------------------------------------------------------- advantages


def test_group_advantages_hand_computed():
    rewards = np.array([1, 0, 0, 1, 1, 1, 1, 1], dtype=np.float32)
    groups = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    adv = grpo_advantages(rewards, groups)
    # group 0: mean 0.5, population std 0.5 -> (r - 0.5) / 0.5 = +-1; group 1: all equal -> 0.
    np.testing.assert_allclose(adv, [1, -1, -1, 1, 0, 0, 0, 0], atol=1e-5, rtol=1e-5)
    assert adv.dtype == np.float32 and adv.shape == (8,)


def test_group_advantages_without_std_normalisation():
    rewards = np.array([1, 0, 0, 1, 1, 1, 1, 1], dtype=np.float32)
    groups = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    adv = dr_grpo_advantages(rewards, groups)
    np.testing.assert_allclose(adv, [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0], atol=1e-7, rtol=1e-5)


def test_group_advantages_three_values_and_interleaved_groups():
    # One group [0, 1, 2]: mean 1, std sqrt(2/3) -> (-1, 0, 1) / 0.81650 = (-1.22474, 0, 1.22474).
    # Interleaved with group 7 = [3, 5]: mean 4, std 1 -> (-1, 1).
    rewards = np.array([0.0, 3.0, 1.0, 5.0, 2.0])
    groups = np.array([4, 7, 4, 7, 4])
    adv = grpo_advantages(rewards, groups)
    np.testing.assert_allclose(adv, [-1.2247449, -1.0, 0.0, 1.0, 1.2247449], atol=1e-5, rtol=1e-5)
    adv_dr = dr_grpo_advantages(rewards, groups)
    np.testing.assert_allclose(adv_dr, [-1, -1, 0, 1, 1], atol=1e-7, rtol=1e-5)


def test_group_advantages_sum_to_zero_per_group():
    rng = np.random.default_rng(0)
    rewards = rng.random(24)
    groups = np.repeat(np.arange(3), 8)
    adv = grpo_advantages(rewards, groups)
    for g in range(3):
        assert abs(adv[groups == g].sum()) < 1e-4
        np.testing.assert_allclose(adv[groups == g].std(), 1.0, atol=1e-4, rtol=1e-5)


# --------------------------------------------------------------------------- loss


def _batch(resp_lens):
    """A TokenBatch whose response rows have the given lengths (token ids irrelevant)."""
    prompts = [[1, 5]] * len(resp_lens)
    responses = [[7] * n for n in resp_lens]
    return TokenBatch.build(prompts, responses, pad_id=0)


def _logp_tensor(rows, width, pad_value=0.0):
    t = torch.full((len(rows), width), pad_value, dtype=torch.float32)
    for i, r in enumerate(rows):
        t[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return t.requires_grad_(True)


def test_loss_at_ratio_one_is_minus_mean_advantage_ragged():
    lens = [1, 3, 2]
    batch = _batch(lens)
    assert batch.mask.tolist() == [[1, 0, 0], [1, 1, 1], [1, 1, 0]]
    old = [np.array([-0.5]), np.array([-1.0, -2.0, -0.1]), np.array([-3.0, -0.7])]
    # Padding positions carry junk; they must be masked out.
    logp = _logp_tensor(old, 3, pad_value=0.25)
    adv = np.array([1.0, -2.0, 0.5], dtype=np.float32)
    loss, metrics = Algorithm().loss(3)(logp, batch, {"logprobs": old, "advantages": adv})
    # ratio 1: per-token -A, token mean per sequence -A_i, sum / 3 = -(1 - 2 + 0.5) / 3 = 1/6.
    assert loss.item() == pytest.approx(1 / 6, rel=1e-5, abs=1e-6)
    assert metrics["clip_frac"] == 0.0
    assert metrics["ratio_max"] == pytest.approx(1.0, rel=1e-5, abs=1e-6)
    # Normaliser is the step's batch size, not the rows present.
    loss6, _ = Algorithm().loss(6)(logp, batch, {"logprobs": old, "advantages": adv})
    assert loss6.item() == pytest.approx(1 / 12, rel=1e-5, abs=1e-6)
    # Gradient w.r.t. each valid token = -A_i / (n_i * batch_size); zero at padding.
    loss.backward()
    expected = torch.tensor([[-1.0 / 3, 0, 0], [2.0 / 9, 2.0 / 9, 2.0 / 9], [-0.5 / 6, -0.5 / 6, 0]])
    torch.testing.assert_close(logp.grad, expected, atol=1e-6, rtol=1e-5)


def test_loss_is_token_mean_per_sequence_not_token_sum():
    # Row 0: 1 token at ratio 1; row 1: 3 tokens, the first at ratio 1.1 (inside the clip range).
    batch = _batch([1, 3])
    old = [np.array([0.0]), np.array([0.0, 0.0, 0.0])]
    logp = _logp_tensor([[0.0], [math.log(1.1), 0.0, 0.0]], 3)
    adv = np.array([2.0, 1.0], dtype=np.float32)
    loss, _ = Algorithm().loss(4)(logp, batch, {"logprobs": old, "advantages": adv})
    # row 0: -2; row 1: mean(-1.1, -1, -1) = -3.1/3; total / 4.
    expected = (-2.0 - 3.1 / 3) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_clipping_positive_advantage_caps_objective_and_zeroes_gradient():
    batch = _batch([1])
    old = [np.array([-1.0])]
    logp = _logp_tensor([[-1.0 + math.log(1.5)]], 1)  # ratio 1.5
    A = 2.0
    loss, metrics = Algorithm(clip_low=0.2, clip_high=0.2).loss(1)(logp, batch, {"logprobs": old, "advantages": np.array([A])})
    # min(1.5 * 2, 1.2 * 2) = 2.4 -> loss -2.4, and the clipped branch has no gradient.
    assert loss.item() == pytest.approx(-2.4, rel=1e-5, abs=1e-5)
    assert metrics["clip_frac"] == 1.0
    assert metrics["ratio_max"] == pytest.approx(1.5, rel=1e-5, abs=1e-5)
    loss.backward()
    assert logp.grad.tolist() == [[0.0]]


def test_clipping_negative_advantage_keeps_unclipped_gradient():
    batch = _batch([1])
    old = [np.array([-1.0])]
    logp = _logp_tensor([[-1.0 + math.log(1.5)]], 1)  # ratio 1.5
    A = -2.0
    loss, metrics = Algorithm(clip_low=0.2, clip_high=0.2).loss(1)(logp, batch, {"logprobs": old, "advantages": np.array([A])})
    # min(1.5 * -2, 1.2 * -2) = -3 (unclipped) -> loss 3; d(-rho A)/dlogp = -rho A = 3.
    assert loss.item() == pytest.approx(3.0, rel=1e-5, abs=1e-5)
    assert metrics["clip_frac"] == 0.0
    loss.backward()
    assert logp.grad.item() == pytest.approx(3.0, rel=1e-5, abs=1e-5)


def test_clipping_lower_side():
    batch = _batch([1])
    old = [np.array([0.0])]
    logp = _logp_tensor([[math.log(0.5)]], 1)  # ratio 0.5 < 1 - eps
    # A < 0: min(0.5 * -1, 0.8 * -1) = -0.8 (clipped) -> loss 0.8, zero gradient.
    loss, m = Algorithm().loss(1)(logp, batch, {"logprobs": old, "advantages": np.array([-1.0])})
    assert loss.item() == pytest.approx(0.8, rel=1e-5, abs=1e-6) and m["clip_frac"] == 1.0
    loss.backward()
    assert logp.grad.item() == 0.0


def test_kl_k3_term_hand_computed():
    batch = _batch([1])
    logp = _logp_tensor([[-1.0]], 1)
    old = [np.array([-1.0])]  # ratio 1
    ref = [np.array([-0.5])]  # d = ref - logp = 0.5
    beta = 0.1
    loss, metrics = Algorithm(kl_coef=beta).loss(1)(
        logp, batch, {"logprobs": old, "advantages": np.array([0.0]), "ref_logprobs": ref})
    k3 = math.exp(0.5) - 0.5 - 1  # 0.1487212707
    assert metrics["kl"] == pytest.approx(k3, rel=1e-5, abs=1e-6)
    assert loss.item() == pytest.approx(beta * k3, rel=1e-5, abs=1e-6)
    loss.backward()
    # d k3 / d logp = 1 - exp(ref - logp); the pg term with A = 0 contributes nothing.
    assert logp.grad.item() == pytest.approx(beta * (1 - math.exp(0.5)), rel=1e-5, abs=1e-6)


def test_kl_is_zero_and_ignored_when_coef_zero():
    batch = _batch([2])
    logp = _logp_tensor([[-1.0, -2.0]], 2)
    old = [np.array([-1.0, -2.0])]
    loss, metrics = Algorithm().loss(1)(logp, batch, {"logprobs": old, "advantages": np.array([0.0])})
    assert loss.item() == 0.0 and "kl" not in metrics


# --------------------------------------------------------------------------- sampling


def test_sample_tokens_greedy_logprob_at_unit_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 5.0]])
    tok, logp = sample_tokens(logits, SamplingParams(temperature=0.0))
    assert tok.tolist() == [0, 2]
    lse0 = math.log(math.exp(2) + math.exp(1) + 1)
    lse1 = math.log(2 + math.exp(5))
    np.testing.assert_allclose(logp.numpy(), [2 - lse0, 5 - lse1], atol=1e-6, rtol=1e-5)


def test_sample_tokens_top_p_truncates_sampling_but_not_logprob():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().repeat(400, 1)
    g = torch.Generator().manual_seed(0)
    # top_p 0.5: only the 0.6 token is in the nucleus.
    tok, logp = sample_tokens(logits, SamplingParams(temperature=1.0, top_p=0.5), g)
    assert set(tok.tolist()) == {0}
    np.testing.assert_allclose(logp.numpy(), math.log(0.6), atol=1e-6, rtol=1e-5)
    # top_p 0.7: {0, 1}; recorded log-probs are the untruncated ones.
    tok, logp = sample_tokens(logits, SamplingParams(temperature=1.0, top_p=0.7), g)
    assert set(tok.tolist()) == {0, 1}
    np.testing.assert_allclose(logp.numpy(), np.log(probs.numpy())[tok.numpy()], atol=1e-6, rtol=1e-5)
    # temperature 2 flattens: log-prob of token t is log_softmax(log p / 2)[t].
    tok, logp = sample_tokens(logits, SamplingParams(temperature=2.0), g)
    expected = torch.log_softmax(probs.log() / 2, -1).numpy()[tok.numpy()]
    np.testing.assert_allclose(logp.numpy(), expected, atol=1e-6, rtol=1e-5)
    assert set(tok.tolist()) == {0, 1, 2}
