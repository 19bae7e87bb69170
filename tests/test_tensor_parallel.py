"""Tensor parallelism (``train.tp``) on the CPU: gloo, forked processes, against one process.

* ``tp=2`` (2 processes) and ``tp=2 x dp=2`` (4 processes on a ``("dp", "tp")`` mesh) give the
  losses, the gradients (before the optimizer step, gathered whole; with dp, summed over the dp
  ranks) and the weights after 3 AdamW steps of one process training every row (float32: rel
  1e-5, abs 1e-5 of each tensor's largest value), and the same log-probs. Models: the built-in
  tiny Qwen2 (tied embeddings, vocabulary 308), a Qwen2 built in code with an untied LM head, a
  vocabulary of 311 (uneven shards: 156 + 155 rows) and random q/k/v biases, and an OPT model
  under a user's plan loaded by import path (``train.tp_plan``; its attention reshapes by its own
  ``num_heads``, which the plan halves). The loss has an entropy bonus, so the entropy's
  vocabulary-parallel gradient is checked too (a partial sum reading the reduced log-sum-exp
  would fail it).
* The weights reach rollout whole: rank 0 publishes them to a weight store in parts (buckets of
  4 KiB: many parts), every rank joining each bucket's all-gathers; the set verifies (CRC-32) and,
  loaded into a fresh model as rollout loads it, gives the one-process weights and log-probs.
* The vocabulary-parallel log-probs alone (every rank, first): values, entropy and gradients of
  ``Shard(-1)`` logits with uneven shards, against ``log_softmax`` of the whole logits.
* What needs no processes: a plan pattern that matches nothing, an unknown style and heads that
  do not divide are refused in one line; so are the configs tensor parallelism cannot run.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.tensor.parallel  # (imported once here: each forked rank inherits it)
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from transformers import OPTConfig, OPTForCausalLM, Qwen2ForCausalLM

from asyncflow.algorithms.algorithm import Algorithm
from asyncflow.config import AlgorithmConfig, ConfigError, load_config
from asyncflow.engines.collective import TorchGroup, free_address
from asyncflow.engines.inference import load_named_weights
from asyncflow.engines.tensor_parallel import MeshGroup, TensorParallel, check_heads, resolve_plan
from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model, tiny_config
from asyncflow.engines.training import TrainEngine
from asyncflow.engines.vocab_parallel import vocab_parallel_logprobs
from asyncflow.tasks.plugins import load_callable
from asyncflow.weights.store import WeightStore, publish_parts, verify
from asyncflow.workflow.roles.actor import publish_weights

B, STEPS, LR = 8, 3, 1e-4
ALGO = Algorithm.from_config(AlgorithmConfig(name="grpo", loss_agg="token-mean", entropy_coef=0.01), 8)
TOK = build_char_tokenizer()


def opt_plan(model: torch.nn.Module) -> dict[str, str]:
    """A user's plan for OPT (given by import path in the test, as ``train.tp_plan`` would be)."""
    layer = "model.decoder.layers.*"
    return {"model.decoder.embed_tokens": "vocab_embedding", f"{layer}.self_attn.[qkv]_proj": "colwise",
            f"{layer}.self_attn.out_proj": "rowwise", f"{layer}.fc1": "colwise", f"{layer}.fc2": "rowwise",
            "lm_head": "vocab_head"}


def build(name: str) -> torch.nn.Module:
    """One of the test's models, the same weights on every call. Biases are drawn, not zero: a bias
    that starts at 0 is made of Adam's steps alone, whose rounding (~1e-3 of a step, see ``close``)
    would then be a large part of its value."""
    torch.manual_seed(0)
    model = _model(name)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(std=0.05)
    return model


def _model(name: str) -> torch.nn.Module:
    if name == "tiny":
        return build_tiny_model(TOK, seed=0, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                intermediate_size=64)
    if name == "qwen2":
        cfg = tiny_config(TOK, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=48)
        cfg.tie_word_embeddings, cfg.vocab_size = False, 311
        return Qwen2ForCausalLM(cfg)
    return OPTForCausalLM(OPTConfig(vocab_size=len(TOK), hidden_size=32, num_hidden_layers=1, ffn_dim=64,
                                    num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
                                    dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0,
                                    pad_token_id=TOK.pad_token_id, bos_token_id=1, eos_token_id=2))


def batch(step: int, vocab: int = 300):
    rng = np.random.default_rng(step)
    prompts = [[1, *rng.integers(4, vocab, size=int(rng.integers(3, 7))).tolist()] for _ in range(B)]
    responses = [rng.integers(4, vocab, size=int(rng.integers(1, 6))).tolist() for _ in range(B)]
    old = [rng.normal(-2.0, 0.3, size=len(r)).astype(np.float32) for r in responses]
    return prompts, responses, old, rng.normal(size=B).astype(np.float32)


def _full(t: torch.Tensor) -> np.ndarray:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().numpy().copy()


def train(name: str, rows: slice, group: MeshGroup | None = None) -> dict[str, np.ndarray]:
    """Losses, first-step gradients, log-probs and weights after STEPS steps of ``rows`` of each step's
    batch; with a group also what rank 0 published (``pub/...``: the set a rollout would load)."""
    plan = load_callable(f"{__file__}:opt_plan", "train.tp_plan") if name == "opt" else None
    tp = TensorParallel(group.tp_mesh, plan) if group is not None else None
    engine = TrainEngine(build(name), TOK.pad_token_id, lr=LR, collective=group, tensor_parallel=tp)
    out: dict[str, np.ndarray] = {}
    for step in range(STEPS):
        prompts, responses, old, adv = batch(step)
        idx = list(range(B))[rows]
        m = engine.forward_backward([prompts[i] for i in idx], [responses[i] for i in idx],
                                    {"logprobs": [old[i] for i in idx], "advantages": adv[idx]}, ALGO.loss(B))
        out[f"loss/{step}"] = np.array(m["loss"])
        if step == 0:
            out.update({f"grad/{n}": _full(p.grad) for n, p in engine.model.named_parameters()})
        engine.optimizer_step(grad_scale=1.0 / sum(len(r) for r in responses))  # (token-mean: the step's tokens)
    out.update({f"lp/{i}": lp for i, lp in enumerate(engine.logprobs(*batch(9)[:2]))})
    out.update({f"w/{n}": w for n, w in engine.export_weights().items()})
    if group is not None:
        store = WeightStore()
        publish_weights(engine, partial(publish_parts, store) if group.rank == 0 else None, bucket_bytes=4096)
        if group.rank == 0:
            got = store.wait_newer(-1, 0)
            assert got is not None and got[0] == STEPS
            out.update({f"pub/{n}": w for n, w in verify(got[1]).items()})
    return out


def check_vocab_parallel(mesh) -> None:
    """:func:`vocab_parallel_logprobs` on ``Shard(-1)`` logits (a vocabulary of 311: shards of 156 and
    155) at temperature 0.7 gives ``log_softmax`` of the whole logits at the targets, its entropy,
    and the gradient of a loss of both for this rank's slice of the logits."""
    g = torch.Generator().manual_seed(1)
    whole = torch.randn(2, 6, 311, generator=g) * 3
    index, targets = torch.randint(0, 6, (2, 4), generator=g), torch.randint(0, 311, (2, 4), generator=g)
    w1, w2 = torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g)
    ref = whole.clone().requires_grad_()
    logp_all = torch.log_softmax(ref.gather(1, index[:, :, None].expand(-1, -1, 311)) / 0.7, -1)
    logp, ent = logp_all.gather(2, targets[:, :, None])[:, :, 0], -(logp_all.exp() * logp_all).sum(-1)
    ((logp * w1).sum() + (ent * w2).sum()).backward()
    mine = distribute_tensor(whole, mesh, [Shard(-1)]).to_local().clone().requires_grad_()
    logits = DTensor.from_local(mine, mesh, [Shard(-1)], run_check=False, shape=whole.shape, stride=whole.stride())
    got, got_ent = vocab_parallel_logprobs(logits, index, targets, 0.7, entropy=True)
    assert got_ent is not None
    ((got * w1).sum() + (got_ent * w2).sum()).backward()
    start = mesh.get_local_rank() * 156
    for a, b, what in [(got, logp, "log-probs"), (got_ent, ent, "entropy"),
                       (mine.grad, ref.grad[:, :, start:start + mine.shape[-1]], "gradient")]:
        close(a.detach().numpy(), b.detach().numpy(), f"vocabulary-parallel {what}")


def _rank(rank: int, address: str, dp: int, tp: int, names: list[str], out: str) -> None:
    try:
        torch.set_num_threads(1)
        group = MeshGroup(TorchGroup(address, rank, dp * tp, timeout_s=120), dp, tp)
        check_vocab_parallel(group.tp_mesh)
        share = B // dp
        for name in names:
            np.savez(f"{out}/{name}.{rank}.npz", **train(name, slice(group.shard * share, (group.shard + 1) * share),
                                                         group))
        group.barrier()  # (nobody tears gloo down while another rank is still in a collective)
        group.abort()
    except BaseException:
        traceback.print_exc()
        os._exit(1)


def run_ranks(target, n: int, *args, deadline_s: float = 300.0) -> None:
    """``target(rank, address, *args)`` in ``n`` forked processes; all must exit 0 within ``deadline_s``
    (the ones left are killed first, so a hung collective fails the test instead of hanging it)."""
    ctx, address = mp.get_context("fork"), free_address()
    procs = [ctx.Process(target=target, args=(r, address, *args)) for r in range(n)]
    for p in procs:
        p.start()
    until = time.monotonic() + deadline_s
    try:
        for p in procs:
            p.join(max(0.0, until - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    assert [p.exitcode for p in procs] == [0] * n, f"rank exit codes {[p.exitcode for p in procs]}"


def close(got: np.ndarray, want: np.ndarray, what: str, floor: float = 0.0) -> None:
    """Float32 agreement: rel 1e-5, abs 1e-5 of the tensor's largest value. Row-parallel layers sum
    their products in another order than one process (last-bit differences), and AdamW divides
    each gradient by its own running magnitude, so an element with a small gradient can move ~1e-3
    of a step (``LR``) differently: ``LR = 1e-4`` keeps that under the 1e-5 of the weights. ``floor``:
    the least abs tolerance (a gradient that is 0 in exact arithmetic is rounding noise: OPT's key
    bias, as softmax ignores a shift common to every key)."""
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=max(1e-5 * float(np.abs(want).max()), floor), err_msg=what)


def check(single: dict, ranks: list[dict], dp: int, tp: int, name: str) -> None:
    for r, got in enumerate(ranks):
        ws = [k for k in single if k.startswith("w/")]
        assert {k for k in got if k.startswith("w/")} == set(ws), f"{name} rank {r}: other parameter names"
        for k in ws + [k for k in single if k.startswith("lp/")]:
            close(got[k], single[k], f"{name} rank {r} {k}")
    share = B // dp
    for s in range(STEPS):  # the loss metric is a token mean over a rank's rows: the dp ranks' weighted by tokens
        tokens = [sum(len(r) for r in batch(s)[1][d * share:(d + 1) * share]) for d in range(dp)]
        mean = sum(n * ranks[d * tp][f"loss/{s}"] for d, n in enumerate(tokens)) / sum(tokens)
        close(mean, single[f"loss/{s}"], f"{name} loss {s}")
    grads = [k for k in single if k.startswith("grad/")]
    largest = max(float(np.abs(single[k]).max()) for k in grads)  # (1e-8 of it: far above float32's noise of 0)
    for k in grads:
        close(np.sum([ranks[d * tp][k] for d in range(dp)], axis=0), single[k], f"{name} {k}", 1e-8 * largest)
    published = {k[4:]: v for k, v in ranks[0].items() if k.startswith("pub/")}
    assert published.keys() == {k[2:] for k in single if k.startswith("w/")}
    fresh = build(name)  # rollout's copy: loaded by name, as the subscriber's engine does
    load_named_weights(fresh, published)
    rollout = TrainEngine(fresh, TOK.pad_token_id)
    for i, lp in enumerate(rollout.logprobs(*batch(9)[:2])):
        close(lp, single[f"lp/{i}"], f"{name} rollout log-probs {i}")
    moved = max(np.abs(single[f"w/{k[2:]}"] - w).max() for k, w in build_weights(name).items())
    # not vacuous: AdamW moves a weight by about LR a step, 300x the tolerance of the largest weight (1)
    assert moved > 2 * LR, f"{name}: {STEPS} steps moved no weight by more than {moved}"


def build_weights(name: str) -> dict[str, np.ndarray]:
    return {f"w/{n}": p.detach().numpy() for n, p in build(name).named_parameters()}


@pytest.mark.parametrize("dp,tp,names", [(1, 2, ["tiny", "qwen2", "opt"]), (2, 2, ["tiny"])],
                         ids=["tp2", "dp2xtp2"])
def test_tensor_parallel_ranks_take_the_steps_of_one_process(tmp_path: Path, dp, tp, names):
    run_ranks(_rank, dp * tp, dp, tp, names, str(tmp_path))
    for name in names:
        single = train(name, slice(0, B))
        ranks = [dict(np.load(tmp_path / f"{name}.{r}.npz")) for r in range(dp * tp)]
        check(single, ranks, dp, tp, name)


# --------------------------------------------------------------------------- refused in one line


def test_a_plan_that_matches_nothing_or_names_no_style_is_refused():
    model = build("tiny")
    with pytest.raises(ValueError, match=r"^train.tp plan: 'model.blocks.\*.attn' matches no module of "
                                         r"Qwen2ForCausalLM .*give train.tp_plan for this architecture$"):
        resolve_plan(model, {"model.blocks.*.attn": "colwise"})
    with pytest.raises(ValueError, match=r"^train.tp plan: 'lm_head': unknown style 'columnwise' \(known: colwise"):
        resolve_plan(model, {"lm_head": "columnwise"})
    assert set(resolve_plan(model, {"model.layers.*.mlp.up_proj": "colwise"})) == {"model.layers.0.mlp.up_proj",
                                                                                "model.layers.1.mlp.up_proj"}


def test_heads_that_do_not_divide_among_the_ranks_are_refused():
    one_kv = build_tiny_model(TOK, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    with pytest.raises(ValueError, match=r"^train.tp=2: the model's num_key_value_heads \(1\) is not divisible by "
                                         r"it; choose a train.tp that divides 1$"):
        check_heads(one_kv, 2)
    check_heads(build("tiny"), 2)  # 4 heads, 2 key/value heads


@pytest.mark.parametrize("args,match", [
    (["launcher=local"], r"train.tp=2 needs the trainer's ranks as processes .* set launcher=ray, or train.tp=1"),
    (["mode=sync"], r"mode=sync with train.tp=2: .* set mode=async \(or stream\), or train.tp=1"),
    (["train.dp=2", "train.strategy=fsdp"], r"train.tp=2 with train.strategy=fsdp: .* set train.strategy=ddp"),
    (["resources.device=cuda"], r"resources.device=cuda with train.tp=2: .* set resources.device=cpu"),
    (["model.num_kv_heads=1", "model.num_heads=2"], r"train.tp=2 must divide model.num_kv_heads \(1\): "),
])
def test_configs_tensor_parallelism_cannot_run_are_refused_in_one_line(args, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(None, ["launcher=ray", "mode=async", "train.tp=2", *args])
    assert "\n" not in str(e.value)
