"""PPO: GAE targets, the clipped value loss, the critic engine and role, end to end.

Hand-computed case (two answers, ragged: 3 and 1 tokens), ``gamma = 0.9``, ``lam = 0.8``,
KL in the reward with ``kl_coef = 0.1`` and k1 (``logp - ref``)::

    reward = [1, 0]   logp - ref = [[1, 0, 2], [0.5]]  ->  penalties [[0.1, 0, 0.2], [0.05]]
    token rewards  [[-0.1, 0, 0.8], [-0.05]]
    values         [[0.5, 0.6, 0.7], [0.2]]
    row 0: delta_2 = 0.8 - 0.7 = 0.1                      A_2 = 0.1
           delta_1 = 0 + 0.9 * 0.7 - 0.6 = 0.03           A_1 = 0.03 + 0.72 * 0.1 = 0.102
           delta_0 = -0.1 + 0.9 * 0.6 - 0.5 = -0.06       A_0 = -0.06 + 0.72 * 0.102 = 0.01344
           returns = A + V = [0.51344, 0.702, 0.8]
    row 1: A = -0.05 - 0.2 = -0.25, return = -0.05
"""

from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from asyncflow.algorithms.algorithm import Algorithm
from asyncflow.algorithms.value import ValueLoss, explained_variance
from asyncflow.config import ConfigError, load_config

PAD = 9.9


def _ppo(**kw) -> Algorithm:
    return Algorithm(estimator="gae", **kw)


def test_gae_targets_by_hand_ragged_with_kl_in_reward():
    a = _ppo(gamma=0.9, lam=0.8, kl_coef=0.1, kl_estimator="k1", kl_in_reward=True)
    ref = [np.array([0.0, 0.0, 0.0]), np.array([0.0])]
    data = {"reward": np.array([1.0, 0.0], np.float32), "logprobs": [np.array([1.0, 0.0, 2.0]), np.array([0.5])],
            "ref_logprobs": ref}
    adv, ret = a.critic_targets(data, [np.array([0.5, 0.6, 0.7]), np.array([0.2])])
    np.testing.assert_allclose(adv[0], [0.01344, 0.102, 0.1], atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(ret[0], [0.51344, 0.702, 0.8], atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(adv[1], [-0.25], atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(ret[1], [-0.05], atol=1e-6, rtol=1e-5)
    # without the KL penalty, gamma = lam = 1: A_t = r - V_t (Monte-Carlo return minus value)
    adv, ret = _ppo().critic_targets(data, [np.array([0.5, 0.6, 0.7]), np.array([0.2])])
    np.testing.assert_allclose(adv[0], [0.5, 0.4, 0.3], atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(ret[1], [0.0], atol=1e-6, rtol=1e-5)


def test_actor_reads_the_critics_advantages():
    a = Algorithm.from_config(load_config(None, ["algorithm.name=ppo"]).algorithm)
    assert a.estimator == "gae" and a.needs_critic and not a.batch_level and not a.needs_reference
    rows = a.advantages({"advantages": [np.array([0.5, -1.0]), np.array([2.0])], "reward": np.zeros(2)})
    assert [r.tolist() for r in rows] == [[0.5, -1.0], [2.0]]


def _value_case():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    vpred = torch.tensor([[0.5, 1.0], [0.0, PAD]], requires_grad=True)
    extras = {"values": [np.array([0.2, 0.9]), np.array([0.3])],
              "returns": [np.array([1.0, 0.0]), np.array([0.0])]}
    return vpred, SimpleNamespace(mask=mask), extras


def test_clipped_value_loss_by_hand_ignores_padding():
    # (0,0): V 0.5, old 0.2 -> clipped 0.4; max((0.5-1)^2, (0.4-1)^2) = 0.36 -> 0.18 (clip active)
    # (0,1): V 1.0, old 0.9 -> inside the clip; (1-0)^2 = 1 -> 0.5
    # (1,0): V 0.0, old 0.3 -> clipped 0.1; max(0, 0.01) -> 0.005 (clip active)
    vpred, batch, extras = _value_case()
    loss, m = ValueLoss(total_tokens=3, clip=0.2, vf_coef=0.5)(vpred, batch, extras)
    assert float(loss.detach()) == pytest.approx(0.5 * 0.685 / 3)
    assert m["value_loss"] == pytest.approx(0.685 / 3) and m["vf_clip_frac"] == pytest.approx(2 / 3)
    loss.backward()
    assert vpred.grad[1, 1] == 0  # padding
    # the clipped branch carries no gradient: only token (0,1) moves
    np.testing.assert_allclose(vpred.grad.numpy(), [[0, 0.5 * 1.0 / 3], [0, 0]], atol=1e-7, rtol=1e-5)
    vpred, batch, extras = _value_case()
    loss, m = ValueLoss(total_tokens=3, clip=None, vf_coef=1.0)(vpred, batch, extras)
    assert float(loss.detach()) == pytest.approx((0.125 + 0.5 + 0.0) / 3) and m["vf_clip_frac"] == 0


def test_value_loss_micro_batches_sum_to_the_big_batch():
    vpred, batch, extras = _value_case()
    full, _ = ValueLoss(3, 0.2, 0.5)(vpred, batch, extras)
    parts = 0.0
    for i in range(2):
        sub = SimpleNamespace(mask=batch.mask[i: i + 1])
        ex = {k: v[i: i + 1] for k, v in extras.items()}
        parts += float(ValueLoss(3, 0.2, 0.5)(vpred[i: i + 1], sub, ex)[0].detach())
    assert parts == pytest.approx(float(full.detach()))


def test_explained_variance_by_hand():
    # R = [1, 3, 5]: Var 8/3; R - V = [0, 1, 2]: Var 2/3 -> 1 - 1/4
    assert explained_variance([np.array([1.0, 2.0]), np.array([3.0])],
                              [np.array([1.0, 3.0]), np.array([5.0])]) == pytest.approx(0.75)
    assert explained_variance([np.array([0.3])], [np.array([1.0])]) == 0.0  # Var(R) = 0


def test_ppo_config_fields_and_errors():
    cfg = load_config(None, ["algorithm.name=ppo", "algorithm.gamma=0.99", "algorithm.lam=0.95",
                             "algorithm.value_clip=0.5", "algorithm.critic_lr=1e-3"])
    a = Algorithm.from_config(cfg.algorithm)
    assert (a.gamma, a.lam, a.value_clip) == (0.99, 0.95, 0.5)
    with pytest.raises(ConfigError, match=r"algorithm\.lam = 1\.5.*lambda"):
        load_config(None, ["algorithm.name=ppo", "algorithm.lam=1.5"])
    from asyncflow.workflow.plan import plan_workers

    specs = plan_workers(load_config(None, ["algorithm.name=ppo", "algorithm.kl_coef=0.01"]), ncpu=2)
    assert {s.name for s in specs} == {"rollout", "reference", "critic", "actor"}  # rewards inside rollout
    separate = plan_workers(load_config(None, ["algorithm.name=ppo", "reward.placement=separate"]), ncpu=2)
    assert {s.name for s in separate} == {"rollout", "reward", "critic", "actor"}
    assert sum(s.cpus for s in specs) <= 2  # fractional shares never oversubscribe
    sync = plan_workers(load_config(None, ["algorithm.name=ppo", "mode=sync"]), ncpu=2)
    assert len(sync) == 1 and "critic" in sync[0].roles


# ------------------------------------------------------------------------ critic engine


@pytest.fixture
def tiny():
    from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model

    torch.manual_seed(0)
    tok = build_char_tokenizer()
    return tok, build_tiny_model(tok, seed=0, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                 intermediate_size=64)


def test_critic_starts_at_zero_and_values_see_only_the_prefix(tiny):
    from asyncflow.engines.critic import CriticEngine

    tok, lm = tiny
    eng = CriticEngine(copy.deepcopy(lm), tok.pad_token_id, lr=1e-2)
    p = tok("12+34=").input_ids
    assert all((v == 0).all() for v in eng.values([p], [[5, 6, 7]]))  # zero-initialised head
    torch.nn.init.normal_(eng.model.head.weight)
    a, b = eng.values([p, p[:3]], [[5, 6, 7], [5, 9]])
    assert a[1] != a[2]
    c = eng.values([p], [[5, 9]])[0]
    # V_t is the value before token t: changing token t leaves V_t, changes V_{t+1}
    # float32 values of magnitude ~10: compare relative to the value (float32 eps ~1.2e-7, kernels differ by CPU)
    assert c[0] == pytest.approx(a[0], rel=1e-5, abs=1e-6) and c[1] == pytest.approx(a[1], rel=1e-5, abs=1e-6)
    assert b[0] != pytest.approx(a[0])  # a different prompt
    # the backbone starts as the policy's weights (an independent copy)
    for n, w in lm.base_model.named_parameters():
        assert torch.equal(w, dict(eng.model.backbone.named_parameters())[n])


def test_critic_update_lowers_the_value_loss_on_a_fixed_batch(tiny):
    from asyncflow.engines.critic import CriticEngine

    tok, lm = tiny
    eng = CriticEngine(lm, tok.pad_token_id, lr=3e-3)
    prompts = [tok("12+34=").input_ids, tok("5+5=").input_ids, tok("70+1=").input_ids]
    responses = [[5, 6], [7, 8, 9], [4]]
    returns = [np.array([1.0, 1.0]), np.array([-1.0, -0.5, 0.0]), np.array([0.5])]
    losses = []
    for _ in range(6):
        values = eng.values(prompts, responses)
        m = eng.forward_backward(prompts, responses, {"values": values, "returns": returns},
                                 ValueLoss(total_tokens=6, clip=0.2))
        eng.optimizer_step()
        losses.append(m["value_loss"])
    assert eng.version == 6
    assert losses[0] == pytest.approx(0.5 * (1 + 1 + 1 + 0.25 + 0 + 0.25) / 6)  # values start at 0
    assert losses[-1] < 0.5 * losses[0], losses


def test_critic_role_values_with_the_steps_critic_and_writes_advantages(tiny):
    from asyncflow.engines.critic import CriticEngine
    from asyncflow.dataplane import DataPlane
    from asyncflow.workflow.roles.critic import CriticRole
    from asyncflow.workflow.fields import SCHEMA

    tok, lm = tiny
    plane = DataPlane(SCHEMA)
    role = CriticRole(CriticEngine(lm, tok.pad_token_id, lr=1e-2), plane, _ppo(), batch_size=3, micro=2, epochs=2)
    p = np.array(tok("1+2=").input_ids)
    for v in (0, 1):
        plane.put({"prompt_ids": [p] * 3, "response_ids": [np.array([5, 6]), np.array([7]), np.array([4, 4, 4])],
                "reward": np.array([1.0, 0.0, 0.5], np.float32)}, partition=v)
    assert role.poll(0.1) == 2 and role.step == 0 and role.engine.version == 0
    assert role.poll(0.1) == 1 and role.step == 1 and role.engine.version == 2  # two epochs on step 0
    m = role.wait_step(0, 0)
    assert m["value_mean"] == 0 and m["return_mean"] == pytest.approx((2 * 1.0 + 0 + 3 * 0.5) / 6)
    assert m["value_loss"] == pytest.approx(0.5 * (2 * 1 + 0 + 3 * 0.25) / 6)
    assert math.isfinite(m["explained_var"]) and "vf_clip_frac" in m
    _, got = plane.get_batch("t", ["advantages"], n=3, partition=0)
    # zero-initialised critic, gamma = lam = 1: A_t = reward at every token
    assert [r.tolist() for r in got["advantages"]] == [[1.0, 1.0], [0.0], [0.5, 0.5, 0.5]]
    role.poll(0.1), role.poll(0.1)  # step 1: valued by the critic trained on step 0
    _, got = plane.get_batch("t", ["advantages"], n=3, partition=1)
    assert role.engine.version == 4 and got["advantages"][0][0] != 1.0
    assert role.wait_step(5, 0) is None


# ------------------------------------------------------------------------ end to end


def length_reward(prompt: str, response: str, sample: dict) -> float:
    """A signal even a random model gets: longer answers score more."""
    return len(response) / 8


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_ppo_trains_end_to_end(tmp_path, mode):
    from asyncflow.launch.local import LocalLauncher
    from asyncflow.api import train

    cfg = load_config(None, [f"mode={mode}", "staleness=1", "launcher=local", "warmstart.enabled=false",
                             "progress=false", "train.steps=3", "train.prompts_per_step=4", "train.micro_prompts=2",
                             "rollout.group_size=4", "rollout.max_batch=8", "algorithm.name=ppo",
                             "algorithm.critic_lr=1e-3", "algorithm.critic_epochs=2",
                             "reward.fn=test_ppo:length_reward", f"run_dir={tmp_path}"])
    summary = train(cfg, launcher=LocalLauncher(), run_dir=tmp_path, evaluate=False)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and summary["max_staleness"] <= cfg.effective_staleness
    assert summary["dropped_stale"] == 0 and "critic" in summary["busy"]
    for m in rows:
        assert m["samples"] == 16
        for k in ["loss", "value_loss", "explained_var", "vf_clip_frac", "value_mean", "return_mean",
                  "critic_grad_norm", "grad_norm"]:
            assert k in m and math.isfinite(m[k]), (k, m)
    assert rows[0]["value_mean"] == 0 and rows[0]["value_loss"] > 0  # a fresh critic: zero values
    assert rows[-1]["value_mean"] != 0


def test_bench_refuses_ppo_with_one_line():
    from asyncflow.bench.run import run_bench

    with pytest.raises(ConfigError, match="PPO critic"):
        run_bench(load_config(None, ["algorithm.name=ppo", "launcher=local"]), workloads=["a"])
