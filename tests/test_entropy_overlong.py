"""Entropy bonus and DAPO overlong penalty against hand-computed values.

Entropy: a fake model with fixed logits gives distributions whose entropies are known in
closed form (uniform over 4: ln 4; (0.5, 0.5): ln 2; (0.2, 0.8): 0.500402); the bonus is a
per-token loss term aggregated like the others, so it must sum exactly over micro-batches.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from asyncflow.algorithms.algorithm import Algorithm
from asyncflow.algorithms.losses import PolicyLoss
from asyncflow.algorithms.shaping import overlong_penalty
from asyncflow.engines.training import TokenBatch, TrainEngine, token_logprobs

H_UNIFORM4, H_HALF, H_2080 = math.log(4), math.log(2), -(0.2 * math.log(0.2) + 0.8 * math.log(0.8))


class FixedLogits(torch.nn.Module):
    """Logits depend only on the position: row t of ``table`` (V = 4)."""

    def __init__(self, table):
        super().__init__()
        self.table = torch.nn.Parameter(torch.tensor(table, dtype=torch.float32))

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        B, L = input_ids.shape
        return SimpleNamespace(logits=self.table[:L][None].expand(B, L, -1))


NEG = -1e9  # effectively zero probability
TABLE = [[0.0, 0.0, 0.0, 0.0],  # position 0: uniform over 4
         [0.0, 0.0, NEG, NEG],  # position 1: (0.5, 0.5)
         [math.log(0.2), math.log(0.8), NEG, NEG],  # position 2: (0.2, 0.8)
         [0.0, 0.0, 0.0, 0.0]]


def test_token_entropy_hand_computed_with_ragged_rows():
    # row 0: prompt [1], response [0, 1] -> predicted at positions 0, 1; row 1: prompt [1, 1], response [1] -> position 1
    batch = TokenBatch.build([[1], [1, 1]], [[0, 1], [1]], pad_id=0)
    token_logprobs(FixedLogits(TABLE), batch, entropy=True)
    expected = [[H_UNIFORM4, H_HALF], [H_HALF, 0.0]]  # the padded slot is 0
    assert batch.entropy.detach().numpy() == pytest.approx(np.array(expected), rel=1e-5, abs=1e-5)
    batch2 = TokenBatch.build([[1, 1]], [[1, 1]], pad_id=0)
    token_logprobs(FixedLogits(TABLE), batch2, entropy=True)
    assert batch2.entropy.detach().numpy()[0] == pytest.approx([H_HALF, H_2080], rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("agg, expected", [
    ("token-mean", (H_UNIFORM4 + H_HALF + H_HALF) / 3),
    ("seq-mean-token-mean", ((H_UNIFORM4 + H_HALF) / 2 + H_HALF) / 2),
    ("seq-mean-token-sum", (H_UNIFORM4 + H_HALF + H_HALF) / 2),
])
def test_entropy_bonus_in_the_loss_and_additive_over_micro_batches(agg, expected):
    coef = 0.1
    prompts, responses = [[1], [1, 1]], [[0, 1], [1]]

    def loss_of(rows, total_tokens):
        model = FixedLogits(TABLE)
        batch = TokenBatch.build([prompts[i] for i in rows], [responses[i] for i in rows], pad_id=0)
        logp = token_logprobs(model, batch, entropy=True)
        extras = {"logprobs": [logp[i, :len(responses[r])].detach().numpy() for i, r in enumerate(rows)],
                  "advantages": np.zeros(len(rows), dtype=np.float32)}  # no policy-gradient term
        fn = PolicyLoss(total_seqs=2, total_tokens=total_tokens, loss_agg=agg, entropy_coef=coef)
        loss, metrics = fn(logp, batch, extras)
        return float(loss.detach()), metrics

    whole, metrics = loss_of([0, 1], 3)
    assert whole == pytest.approx(-coef * expected, rel=1e-5, abs=1e-5)
    assert metrics["entropy"] == pytest.approx((H_UNIFORM4 + 2 * H_HALF) / 3, rel=1e-5, abs=1e-5)
    parts = loss_of([0], 3)[0] + loss_of([1], 3)[0]
    assert parts == pytest.approx(whole, rel=1e-5, abs=1e-6)


def test_engine_hands_entropy_to_the_loss_and_the_bonus_raises_entropy():
    model = FixedLogits([[0.0, 1.0, 2.0, 3.0]] * 4)
    engine = TrainEngine(model, pad_id=0, lr=0.1)
    loss = Algorithm(entropy_coef=1.0).loss(total_seqs=1)
    m = engine.forward_backward([[1]], [[0]], {"logprobs": [np.zeros(1, np.float32)],
                                               "advantages": np.zeros(1, np.float32)}, loss)
    assert "entropy" in m
    engine.optimizer_step()
    batch = TokenBatch.build([[1]], [[0]], 0)
    token_logprobs(model, batch, entropy=True)
    assert float(batch.entropy[0, 0].detach()) > float(m["entropy"])  # the bonus alone pushed entropy up


def test_no_entropy_coef_means_no_entropy_term():
    assert Algorithm().loss(total_seqs=1).entropy_coef == 0.0
    from asyncflow.config import load_config

    a = Algorithm.from_config(load_config(None, ["algorithm.entropy_coef=0.01"]).algorithm)
    assert a.loss(total_seqs=1).entropy_coef == 0.01


# --------------------------------------------------------------------------- overlong penalty


def test_overlong_penalty_hand_computed():
    # L = 10, buffer 4: free up to 6 tokens, then -0.25 x penalty per token, -penalty at 10
    got = overlong_penalty([3, 6, 7, 8, 9, 10], max_len=10, buffer=4, penalty=0.5)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.125, -0.25, -0.375, -0.5])
    assert overlong_penalty([10], max_len=10, buffer=0).tolist() == [0.0]  # off


def test_overlong_penalty_shapes_the_rewards_before_advantages():
    a = Algorithm(estimator="dr_grpo", max_new_tokens=8, overlong_buffer=2, overlong_penalty=1.0)
    # one group of 2 with equal raw rewards 1.0; lengths 6 (free) and 8 (truncated: -1.0)
    data = {"reward": np.array([1.0, 1.0], np.float32), "group": np.array([0, 0]),
            "response_ids": [np.zeros(6), np.zeros(8)]}
    assert a.shaped_rewards(data["reward"], [6, 8]).tolist() == [1.0, 0.0]
    adv = a.advantages(data)  # Dr.GRPO: reward - group mean (0.5)
    assert [float(np.asarray(x).ravel()[0]) for x in adv] == pytest.approx([0.5, -0.5])


def test_overlong_buffer_must_fit_in_max_new_tokens():
    from asyncflow.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="overlong_buffer") as e:
        load_config(None, ["algorithm.overlong_buffer=8", "rollout.max_new_tokens=8"])
    assert "\n" not in str(e.value)
