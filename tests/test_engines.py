"""Engines: the tiny tokenizer/model, the built-in inference engine (continuous batching,
partial rollout), the training engine's micro-batch accumulation, and the weight store.

The central property checked here is the one the RL loss relies on: the log-prob the
inference engine *records* for a sampled token equals the log-prob the training engine
*recomputes* with a full forward pass (to 1e-4), whatever the batching history was.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from asyncflow.algorithms.grpo import GRPOLoss
from asyncflow.engines.inference import (
    GenerationBatch,
    InferenceEngine,
    Request,
    SamplingParams,
    load_named_weights,
)
from asyncflow.engines.tiny import CHARSET, build_char_tokenizer, build_tiny_model
from asyncflow.engines.training import TokenBatch, TrainEngine
from asyncflow.engines.weights import WeightStore, WeightSubscriber, WeightTransferError, seal, verify

torch.set_num_threads(1)

PAD, BOS, EOS, UNK = 0, 1, 2, 3
ATOL = 1e-4


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _prompts(tok, texts):
    return [[BOS, *tok(t).input_ids] for t in texts]


# Deliberately different lengths (5, 7, 2, 8, 4 ids with bos) so left padding matters.
TEXTS = ["1+2=", "12+34=", "=", "123+45=", "9+9"]


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_recorded_match(train_engine, completions, atol=ATOL):
    """Every completion's recorded log-probs equal a full recompute."""
    recomputed = train_engine.logprobs([c.prompt_ids for c in completions], [c.response_ids for c in completions])
    for c, lp in zip(completions, recomputed):
        assert len(c.logprobs) == len(c.response_ids) == len(lp)
        np.testing.assert_allclose(np.asarray(c.logprobs), lp, atol=atol, rtol=0,
                                   err_msg=f"request {c.key}")


# --------------------------------------------------------------------------- tokenizer / model


def test_tokenizer_one_id_per_char_and_specials(tok):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    ids = tok("12+34=").input_ids
    # Hand-computed: specials take 0..3, then CHARSET order: '0'->4 ... '9'->13, '+'->14, '='->18.
    assert ids == [5, 6, 14, 7, 8, 18]
    assert len(tok) == 4 + len(CHARSET) == 52
    # No special tokens are ever added.
    assert tok("12", add_special_tokens=True).input_ids == [5, 6]
    # Unknown characters map to <unk>, not dropped.
    assert tok("1A2").input_ids == [5, UNK, 6]


def test_tokenizer_decode_round_trip(tok):
    s = "(3+5)*2=16, what? yes: ok. a-z/"
    assert tok.decode(tok(s).input_ids) == s
    assert tok.decode(tok(CHARSET).input_ids) == CHARSET
    assert tok.decode([BOS, 8, 10, EOS], skip_special_tokens=True) == "46"


def test_build_tiny_model_deterministic_and_small(tok):
    rng_before = torch.get_rng_state()
    a = build_tiny_model(tok, seed=0)
    assert torch.equal(torch.get_rng_state(), rng_before), "global RNG must be restored"
    b = build_tiny_model(tok, seed=0)
    c = build_tiny_model(tok, seed=1)
    sa, sb, sc = _snapshot(a), _snapshot(b), _snapshot(c)
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    n = sum(p.numel() for p in a.parameters())
    assert 300_000 <= n <= 700_000, n
    assert a.config.tie_word_embeddings
    assert (a.config.pad_token_id, a.config.bos_token_id, a.config.eos_token_id) == (0, 1, 2)


# --------------------------------------------------------------------------- inference engine


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generate_logprobs_match_full_recompute(tok, temperature):
    model = build_tiny_model(tok, seed=0)
    eng = InferenceEngine(model, eos_id=EOS, pad_id=PAD, max_batch=64, seed=0)
    reqs = [Request(i, p) for i, p in enumerate(_prompts(tok, TEXTS))]
    out = eng.generate(reqs, SamplingParams(temperature=temperature, max_new_tokens=8))
    assert sorted(c.key for c in out) == list(range(len(TEXTS)))
    for c in out:
        assert c.prompt_ids == reqs[c.key].prompt_ids
        assert 1 <= len(c.response_ids) <= 8
        assert c.finished_on_eos == (c.response_ids[-1] == EOS)
        assert len(c.response_ids) == 8 or c.finished_on_eos
        assert c.version == 0
    _assert_recorded_match(TrainEngine(model, pad_id=PAD, temperature=temperature), out)


def test_recompute_check_has_power(tok):
    """Sanity: an off-by-one recompute differs by far more than the tolerance."""
    model = build_tiny_model(tok, seed=0)
    eng = InferenceEngine(model, eos_id=EOS, pad_id=PAD, seed=0)
    (c,) = eng.generate([Request(0, _prompts(tok, ["12+34="])[0])], SamplingParams(max_new_tokens=6))
    te = TrainEngine(model, pad_id=PAD)
    shifted = te.logprobs([c.prompt_ids[:-1]], [[c.prompt_ids[-1], *c.response_ids[:-1]]])[0]
    assert np.abs(shifted - np.asarray(c.logprobs)).max() > 100 * ATOL


def test_continuous_batching_refill_and_length_limits(tok):
    model = build_tiny_model(tok, seed=0)
    eng = InferenceEngine(model, eos_id=EOS, pad_id=PAD, max_batch=2, seed=3)
    prompts = _prompts(tok, TEXTS + ["5+5=", "77+1="])
    max_new = [3, 9, 1, 6, 4, 2, 7]
    reqs = [Request(i, p, max_new_tokens=m) for i, (p, m) in enumerate(zip(prompts, max_new))]
    seen = []
    out = eng.generate(reqs, SamplingParams(temperature=1.0, max_new_tokens=5), on_done=seen.append)
    assert [c.key for c in seen] == [c.key for c in out]
    assert sorted(c.key for c in out) == list(range(len(reqs)))
    for c in out:
        assert 1 <= len(c.response_ids) <= max_new[c.key]
        assert len(c.response_ids) == max_new[c.key] or c.finished_on_eos
        assert EOS not in c.response_ids[:-1]
    # Never more than max_batch rows at once: the slot counters add up.
    assert eng.busy_slots <= eng.total_slots
    # Rows were refilled: the first request to finish is the 1-token one (key 2) only after
    # keys 0 and 1 had slots, so completion order differs from request order.
    assert [c.key for c in out] != list(range(len(reqs)))
    _assert_recorded_match(TrainEngine(model, pad_id=PAD), out)


def test_continuous_batching_same_result_as_one_big_batch_greedy(tok):
    """Greedy decoding does not depend on batching history (max_batch 2 vs 64)."""
    model = build_tiny_model(tok, seed=0)
    reqs = lambda: [Request(i, p, max_new_tokens=3 + i) for i, p in enumerate(_prompts(tok, TEXTS))]
    sp = SamplingParams(temperature=0.0, max_new_tokens=8)
    small = InferenceEngine(model, EOS, PAD, max_batch=2).generate(reqs(), sp)
    big = InferenceEngine(model, EOS, PAD, max_batch=64).generate(reqs(), sp)
    assert {c.key: c.response_ids for c in small} == {c.key: c.response_ids for c in big}
    for c_small in small:
        c_big = next(c for c in big if c.key == c_small.key)
        np.testing.assert_allclose(c_small.logprobs, c_big.logprobs, atol=ATOL, rtol=0)


def test_drop_removes_only_the_chosen_rows(tok):
    """batch.drop (over-provisioned stragglers): the dropped rows leave, the others go on
    exactly as if they had decoded alone (greedy), with log-probs matching a recompute."""
    model = build_tiny_model(tok, seed=0)
    reqs = lambda: [Request(i, p, max_new_tokens=6, min_new_tokens=6) for i, p in enumerate(_prompts(tok, TEXTS))]
    sp = SamplingParams(temperature=0.0, max_new_tokens=8)
    alone = {c.key: c for c in InferenceEngine(model, EOS, PAD).generate([r for r in reqs() if r.key in (0, 2, 4)], sp)}
    batch = InferenceEngine(model, EOS, PAD).new_batch(sp)
    batch.add(reqs())
    batch.step()
    assert sorted(r.key for r in batch.drop(lambda r: r.key in (1, 3))) == [1, 3] and len(batch) == 3
    assert batch.drop(lambda r: False) == [] and len(batch) == 3
    out = []
    while len(batch):
        out += batch.step()
    assert sorted(c.key for c in out) == [0, 2, 4]
    for c in out:
        assert c.response_ids == alone[c.key].response_ids
        np.testing.assert_allclose(c.logprobs, alone[c.key].logprobs, atol=ATOL, rtol=0)
    _assert_recorded_match(TrainEngine(model, pad_id=PAD), out)


class _EosBias(torch.nn.Module):
    """Wraps a causal LM and adds a large bias to the EOS logit (an EOS-happy model)."""

    def __init__(self, model, bias: float):
        super().__init__()
        self.inner, self.bias = model, bias

    def forward(self, **kw):
        out = self.inner(**kw)
        logits = out.logits.clone()
        logits[..., EOS] += self.bias
        out.logits = logits
        return out


def test_min_new_tokens_masks_eos(tok):
    model = _EosBias(build_tiny_model(tok, seed=0), bias=30.0)
    eng = InferenceEngine(model, eos_id=EOS, pad_id=PAD, max_batch=3, seed=0)
    prompts = _prompts(tok, TEXTS)
    mins = [0, 1, 4, 2, 6]
    reqs = [Request(i, p, min_new_tokens=m, max_new_tokens=10) for i, (p, m) in enumerate(zip(prompts, mins))]
    out = {c.key: c for c in eng.generate(reqs, SamplingParams(temperature=1.0, max_new_tokens=10))}
    for k, m in enumerate(mins):
        c = out[k]
        # EOS is ~certain once allowed, impossible before: exactly m non-EOS tokens then EOS.
        assert c.finished_on_eos
        assert len(c.response_ids) == m + 1, (k, c.response_ids)
        assert EOS not in c.response_ids[:-1]


def test_min_equals_max_new_tokens_forces_exact_length(tok):
    """The long-tail workload emulation: min = max = L gives exactly L tokens, no EOS."""
    model = _EosBias(build_tiny_model(tok, seed=0), bias=30.0)
    eng = InferenceEngine(model, eos_id=EOS, pad_id=PAD, max_batch=2, seed=0)
    lens = [1, 5, 3]
    reqs = [Request(i, p, min_new_tokens=L, max_new_tokens=L) for i, (p, L) in enumerate(zip(_prompts(tok, TEXTS), lens))]
    out = {c.key: c for c in eng.generate(reqs, SamplingParams(temperature=1.0, max_new_tokens=8))}
    for k, L in enumerate(lens):
        assert len(out[k].response_ids) == L
        assert EOS not in out[k].response_ids
        assert not out[k].finished_on_eos


def test_min_new_tokens_recorded_logprobs_match_recompute(tok):
    model = build_tiny_model(tok, seed=0)
    eng = InferenceEngine(model, eos_id=EOS, pad_id=PAD, max_batch=2, seed=0)
    reqs = [Request(i, p, min_new_tokens=4, max_new_tokens=4) for i, p in enumerate(_prompts(tok, TEXTS))]
    out = eng.generate(reqs, SamplingParams(temperature=1.0, max_new_tokens=8))
    _assert_recorded_match(TrainEngine(model, pad_id=PAD), out)


def test_greedy_generation_equals_hf_generate(tok):
    model = build_tiny_model(tok, seed=0).eval()
    prompts = _prompts(tok, TEXTS)
    n_new = 10
    eng = InferenceEngine(model, eos_id=EOS, pad_id=PAD, max_batch=3)
    out = {c.key: c for c in eng.generate([Request(i, p) for i, p in enumerate(prompts)],
                                          SamplingParams(temperature=0.0, max_new_tokens=n_new))}
    # HF reference: left-padded batch, greedy.
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n_new,
                             min_new_tokens=0, eos_token_id=EOS, pad_token_id=PAD)[:, width:].tolist()
    for i, row in enumerate(ref):
        expected = row[: row.index(EOS) + 1] if EOS in row else row
        assert out[i].response_ids == expected, i
    # Greedy log-probs are recorded at T=1 and also match the recompute.
    _assert_recorded_match(TrainEngine(model, pad_id=PAD), list(out.values()))


# --------------------------------------------------------------------------- partial rollout


def _rollout_with_swap(tok, recompute: bool):
    """Decode with seed-0 weights, swap in seed-1 weights mid-flight, finish.

    Returns (completions by key, tokens generated under the old weights per key).
    """
    model = build_tiny_model(tok, seed=0).eval()
    new_weights = _snapshot(build_tiny_model(tok, seed=1))
    g = torch.Generator().manual_seed(0)
    batch = GenerationBatch(model, eos_id=EOS, pad_id=PAD, sampling=SamplingParams(1.0, max_new_tokens=9), generator=g)
    prompts = _prompts(tok, TEXTS)
    done = []
    # Row 2 stops after 2 tokens, i.e. before the swap (exercises _keep trimming columns).
    done += batch.add([Request(0, prompts[0]), Request(1, prompts[1]), Request(2, prompts[2], max_new_tokens=2)])
    done += batch.step()
    done += batch.add([Request(3, prompts[4])])  # joins mid-flight, shorter: its cache is left-padded
    done += batch.step()
    done += batch.step()
    old_counts = {r.req.key: len(r.out) for r in batch.rows}
    old_counts.update({c.key: len(c.response_ids) for c in done})
    assert len(batch) >= 2, "need live rows at the swap"
    load_named_weights(model, new_weights)
    batch.version = 1
    if recompute:
        batch.recompute_cache()
    done += batch.add([Request(4, prompts[3])])  # started entirely under the new weights
    old_counts[4] = 0
    while len(batch):
        done += batch.step()
    return {c.key: c for c in done}, old_counts


def test_partial_rollout_logprobs_follow_the_weights_that_produced_them(tok):
    out, n_old = _rollout_with_swap(tok, recompute=True)
    assert sorted(out) == [0, 1, 2, 3, 4]
    old_te = TrainEngine(build_tiny_model(tok, seed=0), pad_id=PAD)
    new_te = TrainEngine(build_tiny_model(tok, seed=1), pad_id=PAD)
    straddled = 0
    for k, c in out.items():
        lp_old = old_te.logprobs([c.prompt_ids], [c.response_ids])[0]
        lp_new = new_te.logprobs([c.prompt_ids], [c.response_ids])[0]
        rec = np.asarray(c.logprobs)
        n = n_old[k]
        # Each token records the version that sampled it: n tokens of version 0, then 1s.
        assert c.token_versions == [0] * n + [1] * (len(rec) - n), k
        np.testing.assert_allclose(rec[:n], lp_old[:n], atol=ATOL, rtol=0, err_msg=f"key {k} before swap")
        np.testing.assert_allclose(rec[n:], lp_new[n:], atol=ATOL, rtol=0, err_msg=f"key {k} after swap")
        # The same check driven by the recorded versions alone (what a trainer can see).
        by_version = np.where(np.asarray(c.token_versions) == 0, lp_old, lp_new)
        np.testing.assert_allclose(rec, by_version, atol=ATOL, rtol=0, err_msg=f"key {k}")
        # The two weight sets really differ on these tokens (the check has power).
        assert np.abs(lp_old - lp_new).max() > 100 * ATOL
        straddled += 0 < n < len(rec)
    assert straddled >= 2, "at least two answers must straddle the swap"
    # Version tags: the oldest policy that produced any token.
    assert {k: c.version for k, c in out.items()} == {0: 0, 1: 0, 2: 0, 3: 0, 4: 1}


def test_partial_rollout_without_recompute_keeps_stale_cache(tok):
    """Without recompute_cache the post-swap tokens attend to old-weight keys/values, so
    their recorded log-probs do NOT match a recompute under the new weights."""
    out, n_old = _rollout_with_swap(tok, recompute=False)
    new_te = TrainEngine(build_tiny_model(tok, seed=1), pad_id=PAD)
    worst = 0.0
    for k, c in out.items():
        n = n_old[k]
        if 0 < n < len(c.response_ids):
            lp_new = new_te.logprobs([c.prompt_ids], [c.response_ids])[0]
            worst = max(worst, float(np.abs(np.asarray(c.logprobs)[n:] - lp_new[n:]).max()))
    assert worst > 100 * ATOL


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
    assert b.input_ids.tolist() == [[1, 5, 8, 9, 2], [1, 5, 6, 7, 4]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
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
    loss = GRPOLoss(batch_size=B, clip_eps=0.2, kl_coef=kl_coef)

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
        te.forward_backward(prompts[sl], responses[sl], extras(sl), GRPOLoss(batch_size=sl.stop - sl.start, kl_coef=kl_coef))
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
    te.forward_backward(prompts, responses, {"logprobs": old, "advantages": adv}, GRPOLoss(batch_size=len(prompts)))
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
