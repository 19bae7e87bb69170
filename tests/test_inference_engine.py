"""Inference side of the engines: the tiny tokenizer/model and the built-in inference
engine (continuous batching, min/max lengths, greedy = HF generate, partial rollout).

The central property checked here is the one the RL loss relies on: the log-prob the
inference engine *records* for a sampled token equals the log-prob the training engine
*recomputes* with a full forward pass (to 1e-4), whatever the batching history was.
(Weights in and out of the engines: ``test_engine_weights.py``.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncflow.engines.inference import (
    GenerationBatch,
    InferenceEngine,
    Request,
    SamplingParams,
    load_named_weights,
)
from asyncflow.engines.tiny import CHARSET, build_char_tokenizer, build_tiny_model
from asyncflow.engines.training import TrainEngine

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
        np.testing.assert_allclose(np.asarray(c.logprobs), lp, atol=atol, rtol=1e-5,
                                   err_msg=f"request {c.key}")


# --------------------------------------------------------------------------- tokenizer / model


def test_tokenizer_one_id_per_char_and_specials(tok):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    ids = tok("12+34=").input_ids
    # Hand-computed: specials take 0..3, then CHARSET order: '0'->4 ... '9'->13, '+'->14, '='->18.
    assert ids == [5, 6, 14, 7, 8, 18]
    assert len(tok) == 4 + len(CHARSET) + 256 == 308
    # No special tokens are ever added.
    assert tok("12", add_special_tokens=True).input_ids == [5, 6]
    # Other characters fall back to their UTF-8 bytes (<0xXX> has id 52 + byte), never <unk>:
    # 'A' = 0x41 -> 117; 'é' = 0xC3 0xA9 -> 247, 221.
    assert tok("1A2").input_ids == [5, 117, 6]
    assert tok("é").input_ids == [247, 221]
    assert UNK not in tok("ABC <eos> ☃ \x00").input_ids


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
def test_generate_logprobs_match_full_recompute(tok, temperature, device):
    model = build_tiny_model(tok, seed=0).to(device)
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
        np.testing.assert_allclose(c_small.logprobs, c_big.logprobs, atol=ATOL, rtol=1e-5)


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
        np.testing.assert_allclose(c.logprobs, alone[c.key].logprobs, atol=ATOL, rtol=1e-5)
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


def _rollout_with_swap(tok, recompute: bool, device: str = "cpu"):
    """Decode with seed-0 weights, swap in seed-1 weights mid-flight, finish.

    Returns (completions by key, tokens generated under the old weights per key).
    """
    model = build_tiny_model(tok, seed=0).eval().to(device)
    new_weights = _snapshot(build_tiny_model(tok, seed=1))  # host tensors, as the weight store holds them
    g = torch.Generator(device).manual_seed(0)
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


def test_partial_rollout_logprobs_follow_the_weights_that_produced_them(tok, device):
    out, n_old = _rollout_with_swap(tok, recompute=True, device=device)
    assert sorted(out) == [0, 1, 2, 3, 4]
    old_te = TrainEngine(build_tiny_model(tok, seed=0).to(device), pad_id=PAD)
    new_te = TrainEngine(build_tiny_model(tok, seed=1).to(device), pad_id=PAD)
    straddled = 0
    for k, c in out.items():
        lp_old = old_te.logprobs([c.prompt_ids], [c.response_ids])[0]
        lp_new = new_te.logprobs([c.prompt_ids], [c.response_ids])[0]
        rec = np.asarray(c.logprobs)
        n = n_old[k]
        # Each token records the version that sampled it: n tokens of version 0, then 1s.
        assert c.token_versions == [0] * n + [1] * (len(rec) - n), k
        np.testing.assert_allclose(rec[:n], lp_old[:n], atol=ATOL, rtol=1e-5, err_msg=f"key {k} before swap")
        np.testing.assert_allclose(rec[n:], lp_new[n:], atol=ATOL, rtol=1e-5, err_msg=f"key {k} after swap")
        # The same check driven by the recorded versions alone (what a trainer can see).
        by_version = np.where(np.asarray(c.token_versions) == 0, lp_old, lp_new)
        np.testing.assert_allclose(rec, by_version, atol=ATOL, rtol=1e-5, err_msg=f"key {k}")
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
