"""LoRA through peft, engine by engine (asyncflow/engines/lora.py, lora_merge.py; whole runs:
tests/test_lora_runs.py).

* the trainer trains and exports the adapters only, the base stays bit for bit;
* rollout's merge of a published set gives the trainer's log-probs and peft's own merge, each
  version from the kept base (swapping back and forth drifts by no bit), all or nothing, and
  is computed on the weight subscriber's thread: the swap only copies it in;
* the KL reference is the base with the adapters off, sharing the actor's parameters;
* the adapter folder loads with ``PeftModel.from_pretrained`` (and the merged folder with
  ``AutoModelForCausalLM``) and gives the trainer's log-probs, as does the folder written from
  the published adapters alone (the evaluator's best);
* a checkpoint holds the adapters and their AdamW state and continues the same steps;
* the config's checks are one line each.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from asyncflow.config import ConfigError, load_config
from asyncflow.engines.inference import InferenceEngine
from asyncflow.engines.lora import (
    BaseView,
    LoraSpec,
    LoraTrainEngine,
    attach,
    save_adapter,
    save_merged,
    write_adapter_folder,
)
from asyncflow.engines.lora_merge import AdapterLoader, AdapterMerger
from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model
from asyncflow.engines.training import TrainEngine
from asyncflow.weights.store import WeightStore, seal
from asyncflow.weights.subscriber import WeightSubscriber
from asyncflow.workflow import checkpoint as C

torch.set_num_threads(1)

PROMPTS = [[1, 5, 14, 6, 18], [1, 7, 18], [1, 9, 14, 9, 14, 8, 18]]
RESPONSES = [[8, 2], [9, 10, 11, 2], [5]]
SPEC = LoraSpec(r=4, alpha=8)


def _base(seed: int = 0) -> torch.nn.Module:
    return build_tiny_model(build_char_tokenizer(), seed=seed, hidden_size=32, num_layers=1, num_heads=2,
                            num_kv_heads=1, intermediate_size=64)


def _lora(spec: LoraSpec = SPEC, model: torch.nn.Module | None = None) -> LoraTrainEngine:
    return LoraTrainEngine(attach(model if model is not None else _base(), spec), pad_id=0, lr=1e-2)


def _loss(out, batch, extras):
    adv = torch.tensor([1.0, -1.0, 0.5])[: out.shape[0], None]
    loss = -(out * batch.mask * adv).sum() / 3
    return loss, {"loss": float(loss.detach())}


def _train(engine: TrainEngine, steps: int) -> None:
    for _ in range(steps):
        engine.forward_backward(PROMPTS, RESPONSES, {}, _loss)
        engine.optimizer_step()


def _close(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)  # (float32 log-probs of magnitude ~5)


def test_only_the_adapters_train_and_only_they_are_exported():
    engine = _lora()
    frozen = {n: p.detach().clone() for n, p in engine.model.named_parameters() if not p.requires_grad}
    adapters = [n for n, p in engine.model.named_parameters() if p.requires_grad]
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters) and len(adapters) == 2 * 7
    assert sum(len(g["params"]) for g in engine.opt.param_groups) == len(adapters)
    _train(engine, 2)
    for n, p in engine.model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n  # the base did not move
    out = engine.export_weights()
    assert sorted(out) == sorted(f"base_model.model.{n.replace('.default', '')}" for n in adapters)
    assert all(v.dtype == np.float32 for v in out.values())
    assert any(np.abs(v).max() > 0 for k, v in out.items() if k.endswith("lora_B.weight"))  # B moved from 0
    next(iter(out.values()))[...] = 7.0  # a host copy: the engine is untouched
    assert not np.array_equal(next(iter(engine.export_weights().values())), next(iter(out.values())))


def test_merged_adapters_give_the_trainers_logprobs_and_peft_merge():
    engine = _lora()
    _train(engine, 3)
    fresh = _base()
    AdapterMerger(fresh, SPEC.scale).apply(engine.export_weights())
    _close(TrainEngine(fresh, pad_id=0).logprobs(PROMPTS, RESPONSES), engine.logprobs(PROMPTS, RESPONSES))
    merged = dict(copy.deepcopy(engine.peft).merge_and_unload().named_parameters())
    for n, p in fresh.named_parameters():
        torch.testing.assert_close(p, merged[n], rtol=1e-5, atol=1e-7, msg=n)
    assert any(not torch.equal(p, q) for p, q in zip(fresh.parameters(), _base().parameters()))


def test_each_version_is_merged_from_the_kept_base_so_swaps_do_not_drift():
    engine = _lora()
    _train(engine, 1)
    v1 = engine.export_weights()
    _train(engine, 2)
    v2 = engine.export_weights()
    model = _base()
    merger = AdapterMerger(model, SPEC.scale)
    merger.apply(v1)
    first = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(20):
        merger.apply(v2)
        merger.apply(v1)
    for n, p in model.named_parameters():
        assert torch.equal(p, first[n]), n  # bit for bit: every version comes from W0
    base = dict(_base().named_parameters())
    assert torch.equal(dict(model.named_parameters())["model.embed_tokens.weight"], base["model.embed_tokens.weight"])


@pytest.mark.parametrize("damage,match", [
    (lambda w: w.pop(next(k for k in sorted(w) if k.endswith("lora_B.weight"))), "has lora_A but no lora_B"),
    (lambda w: w.update({next(iter(sorted(w))): np.zeros((3, 3), np.float32)}), "do not fit its weight"),
    (lambda w: w.update({"model.norm.weight": np.ones(32, np.float32)}), "is not a LoRA adapter tensor"),
    (lambda w: w.update({"base_model.model.model.nope.lora_A.weight": np.zeros((4, 32), np.float32),
                         "base_model.model.model.nope.lora_B.weight": np.zeros((32, 4), np.float32)}),
     "changes the adapted modules"),
    (lambda w: [w.pop(k) for k in sorted(w) if ".q_proj." in k], "changes the adapted modules"),
], ids=["unpaired", "shape", "stray", "unknown-module", "fewer-modules"])
def test_a_bad_adapter_set_is_refused_whole(damage, match):
    engine = _lora()
    _train(engine, 1)
    model = _base()
    merger = AdapterMerger(model, SPEC.scale)
    merger.apply(engine.export_weights())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _train(engine, 1)
    bad = engine.export_weights()
    damage(bad)
    with pytest.raises(ValueError, match=match):
        merger.apply(bad)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # nothing changed


def test_rollout_merges_on_the_subscribers_thread_and_the_swap_only_copies_it_in():
    trainer = _lora()
    _train(trainer, 2)
    engine = InferenceEngine(_base(), eos_id=2, pad_id=0)
    loader = AdapterLoader(engine, SPEC.scale)
    store = WeightStore()
    sub = WeightSubscriber(store, loader.load, start_version=0, poll_s=0.02, prepare=loader.prepare)
    base = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    try:
        store.publish(1, seal(trainer.export_weights()))
        assert sub.wait_staged(30) and sub.staged_version() == 1
        assert all(torch.equal(p, base[n]) for n, p in engine.model.named_parameters())  # merged, not swapped yet
        assert sub.swap_if_ready() and engine.version == 1
        _close(TrainEngine(engine.model, pad_id=0).logprobs(PROMPTS, RESPONSES), trainer.logprobs(PROMPTS, RESPONSES))
        merged = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
        bad = trainer.export_weights()
        bad.pop(next(k for k in sorted(bad) if k.endswith("lora_B.weight")))
        store.publish(2, seal(bad))  # (sealed as it is: it verifies, and the merger refuses it)
        deadline = time.monotonic() + 30
        while sub.rejected == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        _train(trainer, 1)
        store.publish(3, seal(trainer.export_weights()))
        assert sub.wait_staged(30) and sub.staged_version() == 3 and sub.rejected == 1
        assert all(torch.equal(p, merged[n]) for n, p in engine.model.named_parameters())
        assert sub.swap_if_ready() and engine.version == 3
    finally:
        sub.close()


def test_the_reference_is_the_base_with_the_adapters_off_without_a_copy():
    engine = _lora()
    _train(engine, 2)
    policy = engine.logprobs(PROMPTS, RESPONSES)
    view = BaseView(engine.peft)
    reference = TrainEngine(view, pad_id=0)
    base = TrainEngine(_base(), pad_id=0).logprobs(PROMPTS, RESPONSES)
    _close(reference.logprobs(PROMPTS, RESPONSES), base)
    assert all(np.array_equal(a, b) for a, b in zip(engine.logprobs(PROMPTS, RESPONSES), policy))  # back on
    assert any(not np.allclose(a, b) for a, b in zip(policy, base))
    own = {p.data_ptr() for p in engine.model.parameters()}
    assert {p.data_ptr() for p in view.parameters()} <= own  # the actor's own tensors: no copy


def test_the_adapter_folder_loads_with_peft_and_gives_the_trainers_logprobs(tmp_path):
    _base().save_pretrained(tmp_path / "base")
    engine = _lora(model=AutoModelForCausalLM.from_pretrained(tmp_path / "base"))
    _train(engine, 3)
    want = engine.logprobs(PROMPTS, RESPONSES)
    save_adapter(engine.peft, tmp_path / "adapter")
    save_merged(engine.peft, tmp_path / "merged")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "base") and config["r"] == SPEC.r
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    _close(TrainEngine(loaded, pad_id=0).logprobs(PROMPTS, RESPONSES), want)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    _close(TrainEngine(merged, pad_id=0).logprobs(PROMPTS, RESPONSES), want)
    # the evaluator's best (train.keep_best): a folder written from the published adapters alone
    write_adapter_folder(tmp_path / "published", engine.export_weights(), SPEC, str(tmp_path / "base"))
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "published")
    _close(TrainEngine(loaded, pad_id=0).logprobs(PROMPTS, RESPONSES), want)
    assert all(np.array_equal(a, b) for a, b in zip(engine.logprobs(PROMPTS, RESPONSES), want))  # still adapted


def test_a_checkpoint_holds_the_adapters_and_adamw_and_continues_the_same_steps(tmp_path):
    a = _lora()
    _train(a, 2)
    writer = C.CheckpointWriter(tmp_path / "checkpoints", keep=1)
    writer.write(2, C.capture(a.model, a, None))
    writer.close()
    tensors, meta = C.read(C.latest(tmp_path))
    weights = [k for k in tensors if k.startswith("model/")]
    assert len(weights) == 14 and all(".lora_" in k for k in weights)  # no frozen base in it
    assert {k.split("/")[1] for k in tensors if k.startswith("optim/")} == {str(i) for i in range(14)}
    _train(a, 3)
    b = _lora()  # a fresh trainer of the same config (same base, same initial adapters)
    C.restore(b.model, b, None, (tensors, meta))
    assert b.version == 2
    _train(b, 3)
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), n
    other = _lora(LoraSpec(r=4, alpha=8, target_modules=("q_proj", "v_proj")))
    with pytest.raises(ValueError, match="not this model's adapters"):
        C.restore(other.model, other, None, (tensors, meta))


def test_every_rank_starts_from_the_same_adapters_whatever_the_global_rng():
    torch.manual_seed(1)
    a = dict(attach(_base(), SPEC).named_parameters())
    torch.manual_seed(2)
    b = dict(attach(_base(), SPEC).named_parameters())
    c = dict(attach(_base(), LoraSpec(r=4, alpha=8, seed=1)).named_parameters())
    adapters = [n for n in a if ".lora_" in n]
    assert all(torch.equal(a[n], b[n]) for n in adapters)
    assert all(not a[n].any() for n in adapters if ".lora_B." in n)  # B = 0: the first policy is the base
    assert any(not torch.equal(a[n], c[n]) for n in adapters if ".lora_A." in n)


@pytest.mark.parametrize("overrides,match", [
    (["mode=async", "rollout.engine=vllm"], "model.lora with rollout.engine=vllm"),
    (["launcher=ray", "train.dp=2", "train.strategy=fsdp"], "model.lora with train.strategy=fsdp"),
    (["algorithm.name=ppo"], "model.lora with algorithm.name=ppo"),
    (["launcher=ray", "mode=async", "train.tp=2"], "model.lora with train.tp=2"),
    (["model.lora.target_modules=[]"], "target_modules is empty"),
])
def test_a_lora_config_that_cannot_run_is_one_line(overrides, match, monkeypatch):
    import asyncflow.config.rollout

    monkeypatch.setattr(asyncflow.config.rollout, "engine_installed", lambda name: True)  # (vllm: not here)
    with pytest.raises(ConfigError, match=match) as e:
        load_config(None, ["model.lora.r=8", *overrides])
    assert "\n" not in str(e.value)


def test_lora_is_off_by_default_and_on_with_a_rank():
    assert not load_config(None, []).model.lora.on and not load_config(None, ["model.lora.r=null"]).model.lora.on
    cfg = load_config(None, ["model.lora.r=8", "model.lora.target_modules=[q_proj, v_proj]"])
    assert cfg.model.lora.on and cfg.model.lora.target_modules == ["q_proj", "v_proj"]


def test_the_sync_benchmark_ships_only_the_adapters_of_the_tiny_model(monkeypatch):
    """benchmarks/lora_sync.py through the real path, one round: the bytes are the hand-counted ones
    (tiny model: 532,096 float32 parameters in 26 tensors; r=8 on 7 linear layers x 2 blocks:
    8 x (256 + 192 + 192 + 256 + 640 + 640 + 640) x 2 = 45,056 in 28 tensors; + 8 bytes of CRC a tensor)."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    import lora_sync

    got = lora_sync.main(["--model", "tiny", "--rounds", "1"])["sync"]
    assert got["full"][0]["bytes"] == 4 * 532_096 + 8 * 26
    assert got["lora"][0]["bytes"] == 4 * 45_056 + 8 * 28
    assert all(m["swap_s"] > 0 and m["total_s"] >= m["swap_s"] for runs in got.values() for m in runs)
