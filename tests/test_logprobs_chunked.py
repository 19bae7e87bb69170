"""Chunked log-probs (:mod:`asyncflow.engines.logprobs`): the same values and gradients as the
plain pass, and a forward+backward whose peak memory no longer grows with tokens x vocabulary.

* the autograd function against ``log_softmax(h W^T / T)`` computed whole, for chunk sizes
  that divide the token count and that do not (values, entropy, gradients w.r.t. the hidden
  states and the head weight; float32, relative 1e-5);
* ``token_logprobs`` / ``TrainEngine`` on a real (tiny, Qwen2) model, tied and untied head,
  temperature, entropy: every parameter's gradient, and the no-grad ``logprobs`` pass;
* the peak of a forward+backward on a 2-layer model with a 151,936-entry vocabulary,
  measured with ``torch.profiler`` (its allocator events; tracemalloc does not see torch):
  plain, it grows by more than the logits' bytes when the tokens grow; chunked, by a small
  fraction of that.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from asyncflow.algorithms.algorithm import Algorithm
from asyncflow.engines.logprobs import chunked_logprobs, head_parts
from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model
from asyncflow.engines.training import TokenBatch, TrainEngine, token_logprobs

torch.set_num_threads(1)
PAD = 0


def close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5, what: str = "") -> None:
    """Agreement relative to the tensor's magnitude (float32: 1e-5 of its largest entry)."""
    got, want = got.detach(), want.detach()
    scale = float(want.abs().max()) or 1.0
    err = float((got - want).abs().max())
    assert err <= rel * scale, f"{what}: max error {err:.3g} > {rel:g} x {scale:.3g}"


def plain(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The unchunked reference: whole logits, log_softmax, gather, entropy."""
    logp_all = torch.log_softmax((h @ w.t()) / temperature, -1)
    return logp_all.gather(1, t[:, None])[:, 0], -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_function_equals_the_whole_computation_values_and_gradients(temperature):
    gen = torch.Generator().manual_seed(0)
    N, H, V = 37, 16, 50
    h0, w0 = torch.randn(N, H, generator=gen), torch.randn(V, H, generator=gen)
    t = torch.randint(0, V, (N,), generator=gen)
    a, b = torch.randn(N, generator=gen), torch.randn(N, generator=gen)  # the loss weighs logp and entropy
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    ref_lp, ref_ent = plain(h, w, t, temperature)
    (a * ref_lp + b * ref_ent).sum().backward()
    for chunk in (1, 5, 8, 37, 64):  # 5 and 8 do not divide 37; 64 is one chunk
        hc, wc = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        lp, ent = chunked_logprobs(hc, wc, t, temperature, chunk)
        close(lp, ref_lp.detach(), what=f"logp chunk={chunk}")
        close(ent, ref_ent.detach(), what=f"entropy chunk={chunk}")
        (a * lp + b * ent).sum().backward()
        close(hc.grad, h.grad, what=f"d hidden chunk={chunk}")
        close(wc.grad, w.grad, what=f"d weight chunk={chunk}")
    # the log-probs alone (no entropy asked): zeros for it, and the same log-prob gradient
    hc, wc = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    lp, ent = chunked_logprobs(hc, wc, t, temperature, 5, entropy=False)
    assert float(ent.detach().abs().sum()) == 0.0
    lp.sum().backward()
    h2, w2 = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    plain(h2, w2, t, temperature)[0].sum().backward()
    close(hc.grad, h2.grad, what="d hidden, logp only")
    close(wc.grad, w2.grad, what="d weight, logp only")


def _rows(tok) -> tuple[list[list[int]], list[list[int]]]:
    rng = np.random.default_rng(3)
    prompts = [[1, *tok(f"{a}+{b}=").input_ids] for a, b in rng.integers(0, 1000, (6, 2))]
    responses = [list(rng.integers(4, 40, n)) + [2] for n in (1, 6, 2, 9, 4, 3)]
    return prompts, responses


def _mib(tokens: int, vocab: int) -> float:
    """The ``chunk_mib`` that makes chunks of ``tokens`` tokens at this vocabulary."""
    return (tokens + 0.5) * 4 * vocab / 2**20


@pytest.mark.parametrize("tied", [True, False])
def test_token_logprobs_chunked_equals_plain_on_a_real_model(tied):
    """Values, entropy and every parameter's gradient (embeddings and head included) of a loss
    over both, temperature 0.8, chunks of 3 and 7 tokens, against the plain pass."""
    tok = build_char_tokenizer()
    prompts, responses = _rows(tok)
    batch = TokenBatch.build(prompts, responses, PAD)
    weights = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(1))

    def run(chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
        model = build_tiny_model(tok, seed=0)
        if not tied:
            model.config.tie_word_embeddings = False
            model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 1.5)
        assert head_parts(model) is not None
        b = TokenBatch.build(prompts, responses, PAD)
        mib = _mib(chunk_tokens, model.config.vocab_size) if chunk_tokens else 0.0
        lp = token_logprobs(model, b, 0.8, entropy=True, chunk_mib=mib)
        ((lp * weights).sum() + 0.3 * b.entropy.sum()).backward()
        return lp.detach(), b.entropy.detach(), {n: p.grad for n, p in model.named_parameters()}

    ref_lp, ref_ent, ref_g = run(0)
    assert float(ref_lp[batch.mask == 0].abs().sum()) == 0.0
    for chunk in (3, 7):
        lp, ent, g = run(chunk)
        close(lp, ref_lp, what="logp")
        close(ent, ref_ent, what="entropy")
        assert float(lp[batch.mask == 0].abs().sum()) == 0.0 and float(ent[batch.mask == 0].abs().sum()) == 0.0
        assert g.keys() == ref_g.keys()
        for n in g:
            close(g[n], ref_g[n], what=n)


def test_train_engine_chunked_logprobs_and_step_equal_plain():
    """The engine's no-grad ``logprobs`` (reference / old log-probs) and a GRPO
    ``forward_backward`` with the entropy bonus: the same with chunks of 5 tokens as without."""
    tok = build_char_tokenizer()
    prompts, responses = _rows(tok)
    alg = Algorithm(loss_agg="token-mean", entropy_coef=0.01)
    extras = {"advantages": np.linspace(-1, 1, len(prompts)).astype(np.float32)}
    out = []
    for mib in (0.0, _mib(5, len(tok))):
        model = build_tiny_model(tok, seed=0)
        te = TrainEngine(model, pad_id=PAD, temperature=0.9, logprob_chunk_mib=mib)
        lps = te.logprobs(prompts, responses)
        loss = alg.loss(len(prompts), sum(map(len, responses)))
        assert getattr(loss, "needs_entropy", False)
        te.forward_backward(prompts, responses, {**extras, "logprobs": lps}, loss)
        out.append((np.concatenate(lps), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (lp0, g0), (lp1, g1) = out
    close(torch.from_numpy(lp1), torch.from_numpy(lp0), what="logprobs")
    for n in g0:
        close(g1[n], g0[n], what=n)


def test_bf16_chunked_close_to_plain_bf16():
    """Under bf16 autocast the chunks run the head's matmuls in bf16 like the autocast lm_head."""
    tok = build_char_tokenizer()
    prompts, responses = _rows(tok)
    model = build_tiny_model(tok, seed=0)
    got = [TrainEngine(model, pad_id=PAD, dtype="bfloat16", logprob_chunk_mib=mib).logprobs(prompts, responses)
           for mib in (0.0, _mib(4, len(tok)))]
    fp32 = TrainEngine(model, pad_id=PAD).logprobs(prompts, responses)
    diff = np.abs(np.concatenate(got[0]) - np.concatenate(got[1]))
    assert diff.max() < 0.01 and np.abs(np.concatenate(fp32) - np.concatenate(got[1])).max() > 1e-5


def test_models_that_cannot_be_taken_apart_take_the_plain_pass():
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, seed=0)
    assert head_parts(model) is not None
    model.config.final_logit_softcapping = 30.0  # the forward caps logits: not what the head alone gives
    assert head_parts(model) is None

    class Wrapper(torch.nn.Module):  # a wrapper (peft-style): its forward is not ours to split
        def __init__(self):
            super().__init__()
            self.inner = build_tiny_model(tok, seed=0)

        def forward(self, **kw):
            return self.inner(**kw)

    assert head_parts(Wrapper()) is None
    prompts, responses = _rows(tok)
    batch = TokenBatch.build(prompts, responses, PAD)
    w = Wrapper()
    close(token_logprobs(w, batch, chunk_mib=1e-3), token_logprobs(w.inner, batch), what="fallback")


# --------------------------------------------------------------------------- memory


def _peak_bytes(fn) -> int:
    """Peak of live bytes the CPU allocator handed out while ``fn`` ran (torch.profiler's memory events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak


def test_peak_memory_of_forward_backward_no_longer_grows_with_tokens_times_vocabulary():
    """2 layers, hidden 32, vocabulary 151,936: 32 then 128 response tokens. Plain, the peak grows
    by more than the extra float32 logits (96 x 151,936 x 4 = 58 MB); in chunks of 8 MiB
    (13 tokens) it grows by less than a fifth of that, and stays under a quarter of the plain peak."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    V = 151936
    config = Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=160,
                         tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    rng = np.random.default_rng(0)

    def peak(tokens: int, mib: float) -> int:
        prompts = [list(rng.integers(3, V, 4)) for _ in range(4)]
        responses = [list(rng.integers(3, V, tokens // 4)) for _ in range(4)]
        batch = TokenBatch.build(prompts, responses, PAD)

        def step() -> None:
            token_logprobs(model, batch, chunk_mib=mib).sum().backward()
            model.zero_grad(set_to_none=True)

        return _peak_bytes(step)

    extra_logits = (128 - 32) * V * 4
    plain_small, plain_big = peak(32, 0.0), peak(128, 0.0)
    chunk_small, chunk_big = peak(32, 8.0), peak(128, 8.0)
    print(f"peak MB plain {plain_small / 1e6:.0f} -> {plain_big / 1e6:.0f}, "
          f"chunked {chunk_small / 1e6:.0f} -> {chunk_big / 1e6:.0f}")
    assert plain_big - plain_small > extra_logits  # the measurement sees the logits (fails without chunks)
    assert chunk_big - chunk_small < 0.2 * extra_logits
    assert chunk_big < plain_big / 4
