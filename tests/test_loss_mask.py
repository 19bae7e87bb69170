"""The loss mask of multi-turn samples: an observation token is never in the loss.

Hand-computed values, plus a property: whatever the policy's log-probs, the behaviour log-probs,
the reference or the advantages are at observation positions, the loss, its gradient and its
metrics do not change, and the gradient there is exactly zero; a row's masked loss equals the
loss of the same row with its observation tokens cut out (where a token's position does not
matter to the loss).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow.algorithms.losses import PolicyLoss
from asyncflow.engines.training import TokenBatch


def _batch(lens):
    return TokenBatch.build([[1, 5]] * len(lens), [[7] * n for n in lens], pad_id=0)


def test_hand_computed_masked_loss():
    # one row of 3 tokens, the middle one an observation; ratio e^.1 and e^-.2 on the two generated
    # tokens, A = 1, no clipping active at eps .3: seq-mean-token-mean = -(e^.1 + e^-.2) / 2 over 1 row.
    b = _batch([3])
    logp = torch.tensor([[-0.9, 5.0, -1.2]], requires_grad=True)
    ex = {"logprobs": [np.array([-1.0, 0.0, -1.0])], "advantages": np.array([1.0]),
          "loss_mask": [np.array([1, 0, 1], dtype=np.uint8)]}
    loss, m = PolicyLoss(total_seqs=1, clip_low=0.3, clip_high=0.3)(logp, b, ex)
    assert loss.item() == pytest.approx(-(math.exp(0.1) + math.exp(-0.2)) / 2, rel=1e-6)
    assert m["ratio_max"] == pytest.approx(math.exp(0.1), rel=1e-6)  # the observation's ratio e^5 is not seen
    loss.backward()
    assert logp.grad[0, 1].item() == 0.0 and logp.grad[0, 0].item() == pytest.approx(-math.exp(0.1) / 2, rel=1e-6)


AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@settings(max_examples=40, deadline=None)
@given(masks=st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=6), min_size=1, max_size=4),
       seed=st.integers(0, 2**16), agg=st.sampled_from(AGGS), kl=st.sampled_from([0.0, 0.1]))
def test_observation_positions_never_reach_the_loss(masks, seed, agg, kl):
    masks = [m if any(m) else [1] + m[1:] for m in masks]  # (every sample has a generated token)
    rng = np.random.default_rng(seed)
    lens = [len(m) for m in masks]
    b = _batch(lens)
    R = max(lens)

    def draw(scale=0.3):
        return torch.tensor(rng.normal(-1.0, scale, (len(lens), R)), dtype=torch.float32)

    logp, old, ref = draw(), draw(), draw()
    adv = rng.normal(0, 1, len(lens))
    loss_fn = PolicyLoss(total_seqs=len(lens), total_tokens=sum(map(sum, masks)), loss_agg=agg, kl_coef=kl)

    def run(lp, behav, reference):
        lp = lp.clone().requires_grad_(True)
        ex = {"logprobs": [behav[i, :n].numpy() for i, n in enumerate(lens)], "advantages": adv,
              "ref_logprobs": [reference[i, :n].numpy() for i, n in enumerate(lens)],
              "loss_mask": [np.array(m, dtype=np.uint8) for m in masks]}
        loss, metrics = loss_fn(lp, b, ex)
        loss.backward()
        return loss.item(), lp.grad, metrics

    base, grad, metrics = run(logp, old, ref)
    obs = torch.zeros(len(lens), R, dtype=torch.bool)
    for i, m in enumerate(masks):
        obs[i, : len(m)] = torch.tensor([x == 0 for x in m])
    noise = torch.where(obs, torch.tensor(rng.normal(0, 3, (len(lens), R)), dtype=torch.float32), torch.zeros(1))
    moved, grad2, metrics2 = run(logp + noise, old - noise, ref + noise)
    assert moved == pytest.approx(base, rel=1e-5, abs=1e-7)
    assert torch.all(grad[obs] == 0) and torch.allclose(grad, grad2, rtol=1e-5, atol=1e-7)
    for k in ("loss", "ratio_mean", "ratio_max", "clip_frac"):
        assert metrics2[k] == pytest.approx(metrics[k], rel=1e-5, abs=1e-7), k
