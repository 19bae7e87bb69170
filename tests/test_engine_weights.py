"""Weights in and out of the engines: loading named weights into a model (atomic), the
training engine's step (micro-batch accumulation = one batch, version bump, export, LR
schedule), and the weight store / subscriber that carry versions from trainer to rollout
(ordering, background staging, checksums).
(The inference engine itself: ``test_inference_engine.py``.)
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from asyncflow.algorithms.algorithm import Algorithm
from asyncflow.engines.inference import InferenceEngine, SamplingParams, load_named_weights
from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model
from asyncflow.engines.training import TokenBatch, TrainEngine
from asyncflow.weights.store import WeightStore, WeightTransferError, seal, verify
from asyncflow.weights.subscriber import WeightSubscriber

torch.set_num_threads(1)

PAD, BOS, EOS, UNK = 0, 1, 2, 3


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _prompts(tok, texts):
    return [[BOS, *tok(t).input_ids] for t in texts]


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# --------------------------------------------------------------------------- load_named_weights


def test_load_named_weights_copies_numpy_and_torch(tok):
    model = build_tiny_model(tok, seed=0)
    other = build_tiny_model(tok, seed=1)
    weights = {n: p.detach().numpy().copy() for n, p in other.named_parameters()}
    weights["model.norm.weight"] = torch.full_like(other.model.norm.weight, 2.5)  # torch accepted too
    load_named_weights(model, weights)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), torch.as_tensor(weights[n])), n
    # Tied head follows the embedding.
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_load_named_weights_rejects_missing_parameter(tok):
    model = build_tiny_model(tok, seed=0)
    before = _snapshot(model)
    weights = _snapshot(build_tiny_model(tok, seed=1))
    del weights["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(ValueError, match="missing"):
        load_named_weights(model, weights)
    after = _snapshot(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_load_named_weights_rejects_wrong_shape_atomically(tok):
    model = build_tiny_model(tok, seed=0)
    before = _snapshot(model)
    weights = _snapshot(build_tiny_model(tok, seed=1))
    last = list(weights)[-1]  # every other tensor is valid and comes first
    weights[last] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="shape"):
        load_named_weights(model, weights)
    after = _snapshot(model)
    assert all(torch.equal(before[k], after[k]) for k in before), "nothing may change on error"


def test_inference_engine_load_weights_sets_version(tok):
    model = build_tiny_model(tok, seed=0)
    eng = InferenceEngine(model, EOS, PAD)
    new = {n: p.detach().numpy().copy() for n, p in build_tiny_model(tok, seed=1).named_parameters()}
    eng.load_weights(5, new)
    assert eng.version == 5
    assert eng.new_batch(SamplingParams()).version == 5
    assert np.array_equal(model.model.embed_tokens.weight.detach().numpy(), new["model.embed_tokens.weight"])


# --------------------------------------------------------------------------- training engine


def test_token_batch_layout_hand_computed():
    b = TokenBatch.build([[1, 5], [1, 5, 6, 7]], [[8, 9, 2], [4]], pad_id=0)
    # a row's last token is a target only: the input is prompt + response[:-1], L = max(p + r - 1) = 4
    assert b.input_ids.tolist() == [[1, 5, 8, 9], [1, 5, 6, 7]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert b.targets.tolist() == [[8, 9, 2], [4, 0, 0]]
    assert b.mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    # Logits at position t predict token t+1: response token j of row i is predicted at plen-1+j.
    assert b.gather_index()[0].tolist() == [1, 2, 3]
    assert b.gather_index()[1, 0].item() == 3


def _rl_batch(tok):
    prompts = _prompts(tok, ["1+2=", "12+34=", "=", "123+45=", "9+9", "5+5="])
    responses = [[6, EOS], [9, 4, 7, 11, EOS], [5], [8, 8, 8], [13, 14, 5, 6, 7, EOS], [EOS]]
    advantages = np.array([1.0, -0.5, 0.3, -1.2, 0.8, -0.4], dtype=np.float32)
    return prompts, responses, advantages


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_forward_backward_micro_batches_equal_one_batch(tok, kl_coef):
    model = build_tiny_model(tok, seed=0)
    te = TrainEngine(model, pad_id=PAD)
    prompts, responses, adv = _rl_batch(tok)
    cur = te.logprobs(prompts, responses)
    rng = np.random.default_rng(0)
    # Behaviour log-probs off by up to +-0.3 so some tokens are clipped, some not.
    old = [lp + rng.uniform(-0.3, 0.3, size=lp.shape).astype(np.float32) for lp in cur]
    ref = [lp + rng.uniform(-0.2, 0.2, size=lp.shape).astype(np.float32) for lp in cur]
    B = len(prompts)
    loss = Algorithm(clip_low=0.2, clip_high=0.2, kl_coef=kl_coef).loss(B)

    def extras(sl):
        return {"logprobs": old[sl], "advantages": adv[sl], "ref_logprobs": ref[sl]}

    model.zero_grad(set_to_none=True)
    m_full = te.forward_backward(prompts, responses, extras(slice(0, B)), loss)
    g_full = _grads(model)
    assert m_full["clip_frac"] > 0  # the clipped branch is exercised

    model.zero_grad(set_to_none=True)
    for sl in (slice(0, 2), slice(2, B)):  # ragged: micro-batches pad to different widths
        te.forward_backward(prompts[sl], responses[sl], extras(sl), loss)
    g_micro = _grads(model)

    assert g_full.keys() == g_micro.keys() and len(g_full) == len(list(model.parameters()))
    for n in g_full:
        torch.testing.assert_close(g_micro[n], g_full[n], atol=1e-6, rtol=1e-5, msg=n)
    assert max(float(g.abs().max()) for g in g_full.values()) > 1e-4  # non-trivial gradient

    # Power check: normalising by the micro-batch size instead gives a different gradient.
    model.zero_grad(set_to_none=True)
    for sl in (slice(0, 2), slice(2, B)):
        te.forward_backward(prompts[sl], responses[sl], extras(sl), Algorithm(kl_coef=kl_coef).loss(sl.stop - sl.start))
    g_wrong = _grads(model)
    assert any(not torch.allclose(g_wrong[n], g_full[n], atol=1e-6) for n in g_full)


def test_optimizer_step_bumps_version_and_changes_export(tok):
    model = build_tiny_model(tok, seed=0)
    te = TrainEngine(model, pad_id=PAD, lr=1e-2)
    before = te.export_weights()
    assert set(before) == {n for n, _ in model.named_parameters()}
    assert all(isinstance(v, np.ndarray) for v in before.values())
    prompts, responses, adv = _rl_batch(tok)
    old = te.logprobs(prompts, responses)
    te.forward_backward(prompts, responses, {"logprobs": old, "advantages": adv}, Algorithm().loss(len(prompts)))
    m = te.optimizer_step()
    assert te.version == 1 and m["grad_norm"] > 0
    assert all(p.grad is None for p in model.parameters())
    after = te.export_weights()
    assert any(not np.array_equal(before[k], after[k]) for k in before)
    # export is a copy, not a view of the live parameters
    after["model.norm.weight"][:] = 123.0
    assert float(model.model.norm.weight[0].detach()) != 123.0


# --------------------------------------------------------------------------- weight store


def test_weight_store_versions_only_grow():
    store = WeightStore()
    assert store.latest_version() == -1
    assert store.wait_newer(-1, timeout=0.01) is None
    assert store.publish(1, {"w": np.ones(2)}) is True
    assert store.publish(0, {"w": np.zeros(2)}) is False  # older: ignored
    assert store.publish(1, {"w": np.zeros(2)}) is False  # equal: ignored
    assert store.latest_version() == 1
    v, bufs = store.wait_newer(0, timeout=0.01)
    assert v == 1 and np.array_equal(bufs["w"], np.ones(2))
    assert store.wait_newer(1, timeout=0.01) is None
    assert store.publish(3, {"w": np.full(2, 3.0)}) is True
    assert store.wait_newer(1, timeout=0.01)[0] == 3


def test_weight_store_wait_newer_wakes_on_publish_and_close():
    store = WeightStore()
    got = []
    t = threading.Thread(target=lambda: got.append(store.wait_newer(0, timeout=5.0)))
    t.start()
    time.sleep(0.05)
    store.publish(2, {"w": np.arange(3)})
    t.join(2.0)
    assert not t.is_alive() and got[0][0] == 2
    store2 = WeightStore()
    t2 = threading.Thread(target=lambda: got.append(store2.wait_newer(0, timeout=5.0)))
    t2.start()
    time.sleep(0.05)
    store2.close()
    t2.join(2.0)
    assert not t2.is_alive() and got[1] is None


def test_weight_subscriber_stages_in_background_and_swaps_once():
    store = WeightStore()
    applied = []
    sub = WeightSubscriber(store, lambda v, bufs: applied.append((v, {k: b.copy() for k, b in bufs.items()})),
                           start_version=0, poll_s=0.02)
    try:
        assert sub.swap_if_ready() is False and applied == []
        w = np.arange(4, dtype=np.float32)
        store.publish(1, seal({"w": w}))
        assert sub.wait_staged(timeout=5.0)
        assert sub.staged_version() == 1
        assert sub.version == 0 and applied == []  # staged, not applied: nothing exposed yet
        w[:] = -1  # the staged copy is the subscriber's own
        assert sub.swap_if_ready() is True
        assert sub.swap_if_ready() is False  # exactly once
        assert sub.version == 1 and sub.swaps == 1
        assert [v for v, _ in applied] == [1]
        assert np.array_equal(applied[0][1]["w"], np.arange(4, dtype=np.float32))

        # An older publish is ignored by the store and never reaches the model.
        assert store.publish(0, {"w": np.zeros(4, dtype=np.float32)}) is False
        assert not sub.wait_staged(timeout=0.1)
        assert sub.swap_if_ready() is False and len(applied) == 1

        # Two publishes before the boundary: only the newest is applied.
        store.publish(2, seal({"w": np.full(4, 2.0, dtype=np.float32)}))
        store.publish(3, seal({"w": np.full(4, 3.0, dtype=np.float32)}))
        deadline = time.monotonic() + 5.0
        while sub.staged_version() != 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sub.staged_version() == 3
        assert sub.swap_if_ready() is True and sub.swap_if_ready() is False
        assert [v for v, _ in applied] == [1, 3]
        assert np.array_equal(applied[1][1]["w"], np.full(4, 3.0, dtype=np.float32))
    finally:
        sub.close()
        store.close()


def test_sealed_weights_verify_and_damage_is_named():
    w = {"a": np.arange(4, dtype=np.float32), "b": np.ones((2, 2), dtype=np.float32)}
    sealed = seal(w)
    assert set(verify(sealed)) == {"a", "b"}
    bad = dict(sealed, b=sealed["b"].copy())
    bad["b"][0, 0] = 7.0
    with pytest.raises(WeightTransferError, match="tensor 'b'"):
        verify(bad)
    with pytest.raises(WeightTransferError, match="partial"):
        verify({k: v for k, v in sealed.items() if k != "a"})
    with pytest.raises(WeightTransferError, match="without checksums"):
        verify(w)


def test_subscriber_rejects_a_corrupted_version_and_keeps_its_weights():
    store = WeightStore()
    applied = []
    sub = WeightSubscriber(store, lambda v, bufs: applied.append(v), start_version=0, poll_s=0.02)
    try:
        good = seal({"w": np.zeros(3, dtype=np.float32)})
        corrupted = dict(good, w=np.ones(3, dtype=np.float32))
        store.publish(1, corrupted)
        deadline = time.monotonic() + 5.0
        while sub.rejected == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sub.rejected == 1
        assert sub.swap_if_ready() is False and applied == [] and sub.version == 0
        store.publish(2, seal({"w": np.full(3, 2.0, dtype=np.float32)}))
        assert sub.wait_staged(timeout=5.0)
        assert sub.swap_if_ready() is True and applied == [2]
    finally:
        sub.close()


def test_lr_schedule_warmup_then_cosine():
    from asyncflow.engines.training import lr_multiplier

    # warmup 2 of 10 steps: 1/2, 2/2, then cos from 1 to min_ratio over steps 2..10
    assert [lr_multiplier(s, 10, warmup=2) for s in (0, 1, 5, 9)] == [0.5, 1.0, 1.0, 1.0]
    got = [lr_multiplier(s, 10, warmup=2, schedule="cosine", min_ratio=0.1) for s in (2, 6, 10)]
    assert got == pytest.approx([1.0, 0.1 + 0.9 * 0.5, 0.1])


def test_engine_applies_the_schedule(tok):
    from functools import partial

    from asyncflow.engines.training import lr_multiplier

    model = build_tiny_model(tok, seed=0, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=64)
    te = TrainEngine(model, tok.pad_token_id, lr=1.0, schedule=partial(lr_multiplier, total=4, warmup=2))
    assert [te.optimizer_step()["lr"] for _ in range(3)] == [0.5, 1.0, 1.0]
