"""The built-in engine's slot path (:mod:`asyncflow.engines.slot_batch`) against the reference path
(:class:`~asyncflow.engines.reference.GenerationBatch`, right-aligned ``DynamicCache``) and a full
forward.

* same tokens, per-token versions and log-probs (float32, rel 1e-5) as the reference under one
  seed, greedy and sampled (top-p too), across slot refills, a prefix-shared group, a weight swap
  with partial rollout (with and without recompute) and a restart (``partials``/``resume``);
* recorded log-probs equal a full forward of prompt + answer (rel 1e-5); a model configured for
  eager attention is driven too, and keeps its setting;
* a group with one prompt is prefilled once (its keys/values forked into the other slots); a
  live row forked (``fork``, the tree-rollout primitive) continues as independent rows;
* the draw rule of the CUDA graphs (uniform numbers drawn ahead, inverse CDF inside the step)
  gives the CPU draw's tokens;
* multi-turn: ``extend`` prefills only what the cache lacks, its turn's log-probs equal a full
  forward of the whole history, also after its cache was evicted, after a weight swap and after
  the cache grew; ``min_new_tokens`` bars stop ids;
* on a CUDA GPU (skipped elsewhere): the graph replay equals the eager step, across an in-place
  weight swap that does not recapture.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import Qwen2ForCausalLM

from asyncflow.engines.inference import InferenceEngine, Request, SamplingParams, load_named_weights
from asyncflow.engines.slot_batch import SlotBatch, SlotPool
from asyncflow.engines.slot_graphs import bucket, columns
from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model, tiny_config
from asyncflow.engines.training import TrainEngine

torch.set_num_threads(1)
PAD, BOS, EOS = 0, 1, 2
RTOL, ATOL = 1e-5, 1e-6  # float32 log-probs of magnitude ~1-10 (atol only for the rare value near 0)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def prompt(tok, text: str) -> list[int]:
    return [BOS, *tok(text).input_ids]


def drive(path: str, model, ops: list, sp: SamplingParams, max_batch: int = 6, seed: int = 0):
    """Run ``ops`` on a new batch of ``path``: ('add', requests), ('step', n), ('swap', (weights,
    recompute)); drain; return (completions by key, the batch)."""
    eng = InferenceEngine(model, EOS, PAD, max_batch=max_batch, seed=seed, path=path)
    batch, done = eng.new_batch(sp), []
    for op, arg in ops:
        if op == "add":
            done += batch.add(copy.deepcopy(arg))
        elif op == "step":
            for _ in range(arg):
                done += batch.step()
        elif op == "swap":
            load_named_weights(model, arg[0])
            batch.version += 1
            if arg[1]:
                batch.recompute_cache()
    while len(batch):
        done += batch.step()
    assert len(done) == len({c.key for c in done}), "every request once"
    return {c.key: c for c in done}, batch


def assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert b[k].response_ids == a[k].response_ids, k
        assert b[k].token_versions == a[k].token_versions and b[k].version == a[k].version, k
        assert b[k].prompt_ids == a[k].prompt_ids and b[k].stop_reason == a[k].stop_reason, k
        np.testing.assert_allclose(b[k].logprobs, a[k].logprobs, rtol=RTOL, atol=ATOL, err_msg=str(k))


def assert_full_forward(model, completions, temperature: float = 1.0) -> None:
    """Recorded log-probs equal a full forward of prompt + answer."""
    cs = list(completions)
    te = TrainEngine(model, pad_id=PAD, temperature=temperature if temperature > 0 else 1.0)
    for c, lp in zip(cs, te.logprobs([c.prompt_ids for c in cs], [c.response_ids for c in cs])):
        np.testing.assert_allclose(c.logprobs, lp, rtol=RTOL, atol=ATOL, err_msg=str(c.key))


def schedule(tok) -> list:
    group = [Request(f"g{i}", prompt(tok, "12+34="), max_new_tokens=5) for i in range(3)]
    return [("add", [Request("r0", prompt(tok, "="), max_new_tokens=2),
                     Request("r1", prompt(tok, "123+45="), min_new_tokens=3, max_new_tokens=6),
                     Request("r2", prompt(tok, "1+2="), max_new_tokens=9)]),
            ("step", 2),  # r0 is done: slot 0 is free
            ("add", group),  # a prefix-shared group, g0 in slot 0: draws in admission order, not slot order
            ("step", 2),
            ("add", [Request("r3", prompt(tok, "9+9"), min_new_tokens=2, max_new_tokens=4)])]


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (1.0, 1.0), (0.7, 0.9)])
def test_slots_equal_the_reference_across_refills_and_a_shared_group(tok, temperature, top_p):
    """One seed, one schedule (refills, a group of three, min/max lengths): the slot path's tokens,
    versions and log-probs are the reference path's, and its log-probs a full forward's."""
    sp = SamplingParams(temperature, top_p, max_new_tokens=8)
    ref, _ = drive("reference", build_tiny_model(tok, seed=0), schedule(tok), sp)
    model = build_tiny_model(tok, seed=0)
    out, batch = drive("slots", model, schedule(tok), sp)
    assert_same(ref, out)
    assert_full_forward(model, out.values(), temperature)
    assert isinstance(batch, SlotBatch) and batch.pool.slots == 6


def test_a_model_configured_for_eager_attention_is_driven_and_keeps_its_setting(tok):
    """Our attention function is selected for the slot path's forwards only: an ``eager`` model
    decodes like the reference and still says ``eager`` afterwards (training, save_pretrained)."""
    sp = SamplingParams(1.0, max_new_tokens=8)
    ref, _ = drive("reference", build_tiny_model(tok, seed=0), schedule(tok), sp)
    model = build_tiny_model(tok, seed=0)
    model.config._attn_implementation = "eager"
    out, _ = drive("slots", model, schedule(tok), sp)
    assert_same(ref, out)
    assert model.config._attn_implementation == "eager"


def test_a_refill_takes_the_freed_slot_and_moves_no_other_row(tok):
    """A finished row's slot goes to the next request; the other rows' cached keys stay where
    they were, bit for bit (no re-allocation, no re-padding)."""
    model = build_tiny_model(tok, seed=0)
    batch = InferenceEngine(model, EOS, PAD, max_batch=3).new_batch(SamplingParams(1.0, max_new_tokens=8))
    batch.add([Request(k, prompt(tok, t), max_new_tokens=m, min_new_tokens=m)
               for k, t, m in [("a", "1+2=", 6), ("b", "=", 2), ("c", "12+3=", 6)]])
    slots = {batch.rows[s].req.key: s for s in batch.order}
    keys_before = batch.pool.cache.keys[0][[slots["a"], slots["c"]]].clone()
    assert [c.key for c in batch.step()] == ["b"]
    batch.add([Request("d", prompt(tok, "77+1="), max_new_tokens=3)])
    now = {batch.rows[s].req.key: s for s in batch.order}
    assert now == {"a": slots["a"], "c": slots["c"], "d": slots["b"]}
    after = batch.pool.cache.keys[0][[slots["a"], slots["c"]]]
    for i, n in enumerate((5, 6)):  # the other rows' cached prompts are untouched (not moved, not re-padded)
        assert torch.equal(after[i, :, :n], keys_before[i, :, :n]) and after[i, :, :n].abs().sum() > 0


@pytest.mark.parametrize("recompute", [True, False])
def test_partial_rollout_across_a_weight_swap_equals_the_reference(tok, recompute):
    """Weights swapped mid-flight (with recompute_cache, or continuing on the stale cache as the
    reference does): the same answers as the reference; with recompute, each token's log-prob is
    the full forward of the weights that sampled it."""
    sp = SamplingParams(1.0, max_new_tokens=9)
    new = {n: p.detach().clone() for n, p in build_tiny_model(tok, seed=1).named_parameters()}
    ops = [*schedule(tok)[:4], ("swap", (new, recompute)),
           ("add", [Request("late", prompt(tok, "5+5="), max_new_tokens=6)])]
    ref, _ = drive("reference", build_tiny_model(tok, seed=0), ops, sp)
    out, _ = drive("slots", build_tiny_model(tok, seed=0), ops, sp)
    assert_same(ref, out)
    straddled = [c for c in out.values() if len(set(c.token_versions)) == 2]
    assert len(straddled) >= 2 and out["late"].token_versions[0] == 1
    if recompute:  # each token's log-prob is its own weights' full forward
        old_te, new_te = (TrainEngine(build_tiny_model(tok, seed=s), PAD) for s in (0, 1))
        for c in out.values():
            lp_old = old_te.logprobs([c.prompt_ids], [c.response_ids])[0]
            lp_new = new_te.logprobs([c.prompt_ids], [c.response_ids])[0]
            want = np.where(np.asarray(c.token_versions) == 0, lp_old, lp_new)
            np.testing.assert_allclose(c.logprobs, want, rtol=RTOL, atol=ATOL, err_msg=str(c.key))


def test_a_group_is_prefilled_once_and_forked(tok):
    """Five requests, two distinct prompts, one ``add``: one prefill row per prompt, the group's
    other slots hold copies of its keys/values."""
    model = build_tiny_model(tok, seed=0)
    fed: list[tuple[int, ...]] = []
    model.model.embed_tokens.register_forward_hook(lambda m, i, o: fed.append(tuple(i[0].shape)))
    batch = InferenceEngine(model, EOS, PAD, max_batch=8).new_batch(SamplingParams(1.0, max_new_tokens=4))
    p, q = prompt(tok, "12+34="), prompt(tok, "9+9")
    batch.add([Request(f"g{i}", p, min_new_tokens=4) for i in range(4)] + [Request("x", q, min_new_tokens=4)])
    assert fed == [(2, len(p))]  # two distinct prompts, one row each (not five)
    k = batch.pool.cache.keys[1]
    assert all(torch.equal(k[s, :, :len(p)], k[0, :, :len(p)]) for s in (1, 2, 3))  # forked into 1..3
    assert not torch.equal(k[4, :, :len(q)], k[0, :, :len(q)])


def test_a_restart_continues_like_the_reference(tok):
    """``partials`` at version 3, ``resume`` in a fresh engine at version 5 (another seed): the
    same tokens, versions and log-probs as the reference path doing the same."""
    sp = SamplingParams(1.0, max_new_tokens=10)
    reqs = [Request(i, prompt(tok, t), min_new_tokens=6) for i, t in enumerate(["1+2=", "12+34=", "=", "8+8"])]
    results = {}
    for path in ("reference", "slots"):
        first = InferenceEngine(build_tiny_model(tok, seed=0), EOS, PAD, seed=0, path=path)
        first.version = 3
        batch = first.new_batch(sp)
        batch.add(copy.deepcopy(reqs))
        for _ in range(3):
            batch.step()
        saved = batch.partials()
        model = build_tiny_model(tok, seed=0)
        second = InferenceEngine(model, EOS, PAD, seed=1, path=path)
        second.version = 5
        again = second.new_batch(sp)
        assert again.resume(saved) == [] and len(again) == 4
        done = []
        while len(again):
            done += again.step()
        results[path] = {c.key: c for c in done}
        assert all(c.token_versions[:4] == [3] * 4 and set(c.token_versions[4:]) == {5} for c in done)
    assert_same(results["reference"], results["slots"])
    assert_full_forward(build_tiny_model(tok, seed=0), results["slots"].values())


def test_the_graphs_draw_rule_gives_the_cpu_draws(tok):
    """Uniform numbers drawn ahead on the host + inverse CDF in the step (what a CUDA graph runs)
    = the CPU's ``draw`` (inverse CDF from 4,096 entries) = the reference path's tokens."""
    config = tiny_config(tok, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    config.vocab_size = 5000
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).eval()
    sp = SamplingParams(1.0, max_new_tokens=8)
    ref, _ = drive("reference", model, schedule(tok), sp)
    outs = []
    for uniform in (False, True):
        pool = SlotPool(model, 6, EOS, PAD, "float32", torch.Generator().manual_seed(0), uniform=uniform)
        assert pool.step.uniform is uniform
        batch, done = SlotBatch(pool, sp), []
        for op, arg in schedule(tok):
            done += batch.add(copy.deepcopy(arg)) if op == "add" else [c for _ in range(arg) for c in batch.step()]
        while len(batch):
            done += batch.step()
        outs.append({c.key: c for c in done})
    assert_same(ref, outs[0])
    assert_same(outs[0], outs[1])


def test_a_forked_live_row_continues_as_independent_rows_without_recompute(tok):
    """``fork`` (the tree-rollout primitive): the copies share the row's tokens so far and its
    cache (no forward); greedy, they continue exactly as the row does; sampled, each one's
    log-probs equal a full forward of its own answer."""
    model = build_tiny_model(tok, seed=0)
    fed: list[int] = []
    model.model.embed_tokens.register_forward_hook(lambda m, i, o: fed.append(i[0].numel()))
    for temperature in (0.0, 1.0):
        batch = InferenceEngine(model, EOS, PAD, max_batch=4).new_batch(SamplingParams(temperature, max_new_tokens=9))
        batch.add([Request("t", prompt(tok, "12+34="), min_new_tokens=9)])
        batch.step()
        fed.clear()
        batch.fork("t", ["t1", "t2"])
        assert fed == [] and len(batch) == 3
        done = []
        while len(batch):
            done += batch.step()
        out = {c.key: c for c in done}
        assert all(out[k].response_ids[:2] == out["t"].response_ids[:2] for k in ("t1", "t2"))
        if temperature == 0.0:
            assert out["t1"].response_ids == out["t2"].response_ids == out["t"].response_ids
        else:
            assert len({tuple(c.response_ids) for c in done}) > 1  # they sampled on their own
        assert_full_forward(model, done, temperature)
    with pytest.raises(KeyError, match="'gone'"):
        batch.fork("gone", ["x"])


# --------------------------------------------------------------------------- multi-turn


def test_extend_matches_a_full_forward_fresh_evicted_stale_and_grown(tok):
    """Four continued turns of one kept row: on its cache (only 1 + observation tokens fed), after
    its slot was taken (history re-prefilled), after a weight swap (re-prefilled, new weights)
    and with a history longer than the cache (it grows): each turn's log-probs are a full
    forward's under the weights that sampled it."""
    model = build_tiny_model(tok, seed=0)
    fed: list[int] = []
    model.model.embed_tokens.register_forward_hook(lambda m, i, o: fed.append(i[0].numel()))
    eng = InferenceEngine(model, EOS, PAD, max_batch=2, seed=0)
    batch = eng.new_batch(SamplingParams(1.0, max_new_tokens=8))

    def turn(obs: list[int], n: int):
        fed.clear()
        done = batch.extend("a", obs, max_new_tokens=n, min_new_tokens=n)
        while len(batch):
            done += batch.step()
        (c,) = done
        assert len(c.response_ids) == n and c.stop_reason == "length"
        return c, fed[0]

    done = batch.add([Request("a", prompt(tok, "1+2="), max_new_tokens=4, min_new_tokens=4, keep=True)])
    while len(batch):
        done += batch.step()
    (c1,) = done
    c2, prefilled = turn(prompt(tok, "ok")[1:], 5)  # fresh cache: only the last token + the observation
    assert prefilled == 1 + 2 and c2.prompt_ids == c1.prompt_ids + c1.response_ids + prompt(tok, "ok")[1:]
    batch.add([Request("x", prompt(tok, "5+5="), max_new_tokens=2), Request("y", prompt(tok, "6="), max_new_tokens=2)])
    while len(batch):  # two new rows need both slots: "a" lost its cache
        batch.step()
    c3, prefilled = turn([5, 6, 7], 3)
    assert prefilled == len(c3.prompt_ids)  # rebuilt from the whole history
    old = build_tiny_model(tok, seed=0)
    load_named_weights(model, {n: p.detach() for n, p in build_tiny_model(tok, seed=1).named_parameters()})
    batch.version = 1  # a swap: the kept cache is stale
    c4, prefilled = turn([8], 3)
    assert prefilled == len(c4.prompt_ids) and c4.token_versions == [1, 1, 1]
    capacity = batch.pool.cache.capacity
    c5, _ = turn(prompt(tok, "(3+5)*2=16, " * 7)[1:], 4)  # a long observation: the cache grows
    assert batch.pool.cache.capacity > capacity >= 64
    assert_full_forward(model, [c4, c5])
    assert_full_forward(old, [c1, c2, c3])
    stale = TrainEngine(old, PAD).logprobs([c4.prompt_ids], [c4.response_ids])[0]
    assert np.abs(stale - np.asarray(c4.logprobs)).max() > 1e-3  # (the check has power)


def test_min_new_tokens_bars_stop_ids_like_eos(tok):
    """Before ``min_new_tokens`` neither EOS nor a stop id is drawn; after it they end the answer."""
    stops = tuple(range(3, 300))  # every token but <pad>, <bos>, EOS and the last eight bytes
    model = build_tiny_model(tok, seed=0)
    out = InferenceEngine(model, EOS, PAD, seed=0).generate(
        [Request(i, prompt(tok, "1+2="), min_new_tokens=3, max_new_tokens=8, stop_ids=stops) for i in range(6)],
        SamplingParams(1.0, max_new_tokens=8))
    for c in out:
        assert not set(c.response_ids[:3]) & {EOS, *stops}, c.response_ids
        assert c.stop_reason in ("stop", "eos") or len(c.response_ids) == 8
    assert sum(c.stop_reason == "stop" for c in out) >= 4
    assert_full_forward(model, out)


def test_graph_buckets_are_coarse_for_rows_and_finer_for_long_columns():
    assert [bucket(n, 64) for n in (1, 2, 3, 33, 64, 65)] == [1, 2, 4, 64, 64, 64]
    assert bucket(3, 100, least=16) == 16 and bucket(70, 100, least=16) == 100
    assert [columns(n, 4096) for n in (1, 17, 512, 513, 1056, 4000)] == [16, 32, 512, 768, 1280, 4096]
    assert columns(1056, 1024) == 1024


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_equal_the_eager_step_across_an_in_place_swap(tok):
    """float32 on the GPU: the replayed graphs give the eager step's tokens and log-probs; the
    in-place weight swap keeps the captured graphs; log-probs equal a full forward."""
    sp = SamplingParams(1.0, max_new_tokens=9)
    new = {n: p.detach().clone() for n, p in build_tiny_model(tok, seed=1).named_parameters()}
    runs = {}
    for graphs in (False, True):
        model = build_tiny_model(tok, seed=0).cuda()
        eng = InferenceEngine(model, EOS, PAD, max_batch=6, seed=0, cuda_graphs=graphs)
        batch, done = eng.new_batch(sp), []
        for op, arg in schedule(tok):
            done += batch.add(copy.deepcopy(arg)) if op == "add" else [c for _ in range(arg) for c in batch.step()]
        captured = set(batch.pool.graphs.graphs) if graphs else set()
        eng.load_weights(1, new)
        batch.version = 1
        batch.recompute_cache()
        while len(batch):
            done += batch.step()
        if graphs:
            assert captured and captured <= set(batch.pool.graphs.graphs)  # the swap kept the graphs
        runs[graphs] = {c.key: c for c in done}
    assert_same(runs[False], runs[True])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_in_bf16_match_a_bf16_recompute(tok):
    model = build_tiny_model(tok, seed=0).cuda()
    eng = InferenceEngine(model, EOS, PAD, max_batch=6, seed=0, dtype="bfloat16")
    out = eng.generate([Request(i, prompt(tok, t)) for i, t in enumerate(["1+2=", "12+34=", "=", "9+9"] * 3)],
                       SamplingParams(1.0, max_new_tokens=8))
    rec = TrainEngine(model, pad_id=PAD, dtype="bfloat16").logprobs([c.prompt_ids for c in out],
                                                                   [c.response_ids for c in out])
    for c, lp in zip(out, rec):
        np.testing.assert_allclose(c.logprobs, lp, atol=0.1, rtol=0)  # bf16: a few ulps of ~6
