"""vLLM and SGLang adapters: the pure-Python parts run here with the library faked at its
edge (a stand-in ``vllm`` module, a stand-in SGLang engine); the real-engine tests need
the package and a CUDA GPU and skip cleanly otherwise."""

from __future__ import annotations

import asyncio
import sys
import time
import types
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from asyncflow.config import ConfigError, load_config
from asyncflow.engines.adapters import CHECKSUMS, hf_name, named_tensors, sampled_logprobs
from asyncflow.engines.types import Request, SamplingParams
from asyncflow.weights.store import CHECKSUMS as STORE_CHECKSUMS, seal

EOS = 2


def test_checksum_key_matches_the_weight_store():
    assert CHECKSUMS == STORE_CHECKSUMS


def test_weight_name_mapping():
    assert hf_name("model.norm.weight") == "model.norm.weight"
    assert hf_name("_orig_mod.module.lm_head.weight") == "lm_head.weight"
    bufs = seal({"module.model.b": np.arange(3, dtype=np.float32), "model.a": np.ones((2, 2), np.float16)})
    got = named_tensors(bufs)
    assert [n for n, _ in got] == ["model.a", "model.b"]  # checksums dropped, sorted, prefix stripped
    assert got[0][1].dtype == torch.float16 and got[1][1].tolist() == [0.0, 1.0, 2.0]
    assert np.shares_memory(got[1][1].numpy(), bufs["module.model.b"])  # no copy on the host


@dataclass
class Logprob:  # vLLM's record of one log-prob
    logprob: float


def test_sampled_logprob_mapping():
    assert sampled_logprobs([7, 9], [{7: Logprob(-0.5), 3: Logprob(-2.0)}, {9: -1.25}]) == [-0.5, -1.25]
    with pytest.raises(ValueError, match="token 9 at position 1"):
        sampled_logprobs([7, 9], [{7: -0.5}, {4: -1.0}])
    with pytest.raises(ValueError, match="logprobs=0"):
        sampled_logprobs([7], None)


# --------------------------------------------------------------------------- a stand-in vllm


def scripted(total_len: int) -> tuple[int, float]:
    """The stand-in engine's token and log-prob at sequence position ``total_len``."""
    return 4 + total_len % 10, -0.1 * (1 + total_len % 7)


class FakeLLMEngine:
    def __init__(self):
        self.active, self.submitted, self.aborted = {}, [], []

    def add_request(self, rid, prompt, params):
        self.submitted.append((rid, list(prompt["prompt_token_ids"]), params.kw))
        self.active[rid] = (list(prompt["prompt_token_ids"]), params.kw, [])

    def step(self):
        outs = []
        for rid, (prompt, kw, out) in list(self.active.items()):
            tok, lp = scripted(len(prompt) + len(out))
            out.append((tok, lp))
            done = len(out) >= kw["max_tokens"]
            comp = types.SimpleNamespace(token_ids=[t for t, _ in out], logprobs=[{t: Logprob(v)} for t, v in out],
                                         finish_reason="length" if done else None)
            outs.append(types.SimpleNamespace(request_id=rid, finished=done, outputs=[comp]))
            if done:
                del self.active[rid]
        return outs

    def abort_request(self, rids):
        self.aborted += rids
        for r in rids:
            self.active.pop(r, None)


class FakeLLM:
    def __init__(self, rpc=True, **kw):
        self.kw, self.llm_engine, self.resets = kw, FakeLLMEngine(), 0
        self.worker_model = types.SimpleNamespace(loaded=[], parameters=lambda: iter([torch.zeros(1)]),
                                                  load_weights=lambda ws: self.worker_model.loaded.extend(ws))
        worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(model=self.worker_model))
        if rpc:
            self.collective_rpc = lambda fn, args=(): [fn(worker, *args)]
        else:
            self.llm_engine.model_executor = types.SimpleNamespace(driver_worker=worker)

    def reset_prefix_cache(self):
        self.resets += 1


@pytest.fixture
def fake_vllm(monkeypatch):
    mod = types.ModuleType("vllm")
    mod.built = []
    mod.LLM = lambda **kw: mod.built.append(FakeLLM(**kw)) or mod.built[-1]
    mod.SamplingParams = lambda **kw: types.SimpleNamespace(kw=kw)
    monkeypatch.setitem(sys.modules, "vllm", mod)
    return mod


def test_vllm_generate_maps_tokens_and_logprobs(fake_vllm):
    from asyncflow.engines.vllm_engine import VLLMEngine

    eng = VLLMEngine("/models/x", eos_id=EOS, max_batch=8, seed=3)
    llm = fake_vllm.built[0]
    assert llm.kw["logprobs_mode"] == "processed_logprobs" and llm.kw["max_num_seqs"] == 8
    out = eng.generate([Request("a", [1, 5, 6], max_new_tokens=3), Request("b", [1], max_new_tokens=1)],
                       SamplingParams(temperature=0.7, max_new_tokens=8))
    assert [c.key for c in out] == ["b", "a"]  # completion order
    a = out[1]
    # positions 3, 4, 5 of the sequence: tokens 7, 8, 9; log-probs -0.4, -0.5, -0.6
    assert a.response_ids == [7, 8, 9] and a.logprobs == pytest.approx([-0.4, -0.5, -0.6])
    assert a.token_versions == [0, 0, 0] and not a.finished_on_eos
    kw = llm.llm_engine.submitted[0][2]
    assert (kw["logprobs"], kw["temperature"], kw["max_tokens"]) == (0, 0.7, 3)


@pytest.mark.parametrize("rpc", [True, False])
def test_vllm_resume_across_a_weight_swap(fake_vllm, rpc):
    from asyncflow.engines import vllm_engine

    fake_vllm.LLM = lambda **kw: fake_vllm.built.append(FakeLLM(rpc=rpc, **kw)) or fake_vllm.built[-1]
    eng = vllm_engine.VLLMEngine("/models/x", eos_id=EOS)
    llm = fake_vllm.built[0]
    batch = eng.new_batch(SamplingParams(max_new_tokens=5))
    batch.add([Request("a", [1, 5])])
    assert batch.step() == [] and batch.step() == []  # two tokens under version 0
    eng.load_weights(1, seal({"module.model.w": np.ones(2, np.float32)}))
    assert eng.load_path == ("collective_rpc" if rpc else "driver_worker") and llm.resets == 1
    assert [n for n, _ in llm.worker_model.loaded] == ["model.w"]
    batch.version = eng.version
    batch.recompute_cache()  # re-submitted: prompt + 2 generated tokens, 3 tokens left
    assert llm.llm_engine.aborted == [llm.llm_engine.submitted[0][0]]
    rid, prompt, kw = llm.llm_engine.submitted[1]
    assert prompt == [1, 5, 4 + 2, 4 + 3] and kw["max_tokens"] == 3
    done = []
    while len(batch):
        done += batch.step()
    (c,) = done
    # The same tokens and log-probs as an uninterrupted run; versions show the swap.
    assert c.response_ids == [scripted(n)[0] for n in range(2, 7)]
    assert c.logprobs == pytest.approx([scripted(n)[1] for n in range(2, 7)])
    assert c.token_versions == [0, 0, 1, 1, 1] and c.version == 0


def test_vllm_drop_all_aborts(fake_vllm):
    from asyncflow.engines.vllm_engine import VLLMEngine

    eng = VLLMEngine("/models/x", eos_id=EOS)
    batch = eng.new_batch(SamplingParams(max_new_tokens=5))
    batch.add([Request("a", [1]), Request("b", [1, 2])])
    batch.step()
    reqs = batch.drop_all()
    assert [r.key for r in reqs] == ["a", "b"] and len(batch) == 0
    assert fake_vllm.built[0].llm_engine.active == {}


# --------------------------------------------------------------------------- a stand-in SGLang engine


class FakeSGLang:
    def __init__(self):
        self.updates, self.aborted = [], []
        self.tokenizer_manager = types.SimpleNamespace(abort_request=self.aborted.append)

    async def async_generate(self, input_ids, sampling_params, return_logprob, rid):
        assert return_logprob
        await asyncio.sleep(0.001)
        n = sampling_params["max_new_tokens"]
        items = [(scripted(len(input_ids) + j)[1], scripted(len(input_ids) + j)[0], None) for j in range(n)]
        return {"meta_info": {"output_token_logprobs": items, "finish_reason": {"type": "length"}}}

    def update_weights_from_tensor(self, named_tensors, flush_cache=True):
        self.updates.append(([n for n, _ in named_tensors], flush_cache))


def test_sglang_backend_generates_loads_and_aborts():
    from asyncflow.engines.adapters import StepEngine
    from asyncflow.engines.sglang_engine import SGLangBackend, update_from_result

    u = update_from_result("r", {"meta_info": {"output_token_logprobs": [(-0.5, 7, "x"), (-1.0, EOS, None)],
                                               "finish_reason": {"type": "stop"}}})
    assert (u.token_ids, u.logprobs, u.finished, u.stop_reason) == ([7, EOS], [-0.5, -1.0], True, "stop")
    with pytest.raises(ValueError, match="return_logprob"):
        update_from_result("r", {"meta_info": {}})
    fake = FakeSGLang()
    backend = SGLangBackend(fake, bucket=2)
    eng = StepEngine(backend, EOS, max_batch=4)
    out = eng.generate([Request("a", [1, 5], max_new_tokens=3)], SamplingParams(max_new_tokens=8))
    assert out[0].response_ids == [6, 7, 8] and out[0].logprobs == pytest.approx([-0.3, -0.4, -0.5])
    assert backend.load(named_tensors({"c": np.zeros(1), "a": np.zeros(1), "b": np.zeros(1)})) == 2
    assert fake.updates == [(["a", "b"], False), (["c"], True)]  # flush the cache once, at the end
    batch = eng.new_batch(SamplingParams(max_new_tokens=3))
    batch.add([Request("z", [1])])
    assert [r.key for r in batch.drop_all()] == ["z"] and len(fake.aborted) == 1
    batch.add([Request("y", [1]), Request("x", [2])])
    assert [r.key for r in batch.drop(lambda r: r.key == "x")] == ["x"] and len(batch) == 1  # a straggler
    assert len(fake.aborted) == 2


# --------------------------------------------------------------------------- config switch


def test_engine_switch_config_errors(monkeypatch):
    import asyncflow.config.schema as config

    for name in ("vllm", "sglang"):
        if not config.engine_installed(name):
            with pytest.raises(ConfigError, match=rf"^config error: rollout: rollout.engine={name} needs the {name} "
                                                  rf"package, which is not installed: pip install 'asyncflow\[{name}\]'") as e:
                load_config(None, [f"rollout.engine={name}"])
            assert "\n" not in str(e.value)
    monkeypatch.setattr(config, "engine_installed", lambda name: True)
    assert load_config(None, ["rollout.engine=vllm"]).rollout.engine == "vllm"
    with pytest.raises(ConfigError, match="needs mode=stream or async"):
        load_config(None, ["rollout.engine=vllm", "mode=sync"])
    with pytest.raises(ConfigError, match="set rollout.on_swap=discard"):
        load_config(None, ["rollout.engine=sglang"])
    assert load_config(None, ["rollout.engine=sglang", "rollout.on_swap=discard"]).rollout.on_swap == "discard"


# --------------------------------------------------------------------------- real engines (GPU)


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def _tiny_folder(tmp_path):
    from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, seed=0)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    return tok, model


def _check_real_engine(eng, tok, model, tmp_path):
    from asyncflow.engines.training import TrainEngine

    prompts = [[1, *tok(t).input_ids] for t in ["1+2=", "12+34=", "9+9="]] * 22  # 66 requests
    t = time.perf_counter()
    out = eng.generate([Request(i, p) for i, p in enumerate(prompts)], SamplingParams(1.0, max_new_tokens=16))
    gen_s = time.perf_counter() - t
    rec = TrainEngine(model, pad_id=0).logprobs([c.prompt_ids for c in out], [c.response_ids for c in out])
    worst = max(float(np.abs(np.asarray(c.logprobs) - r).max()) for c, r in zip(out, rec))
    weights = {n: p.detach().numpy() for n, p in model.named_parameters()}
    t = time.perf_counter()
    eng.load_weights(1, weights)
    load_s = time.perf_counter() - t
    tokens = sum(len(c.response_ids) for c in out)
    print(f"\n{type(eng).__name__}: {tokens / gen_s:.0f} tokens/s, weight load {load_s * 1e3:.1f} ms, "
          f"max |logprob - recompute| {worst:.4f}")
    assert worst < 0.05


@pytest.mark.gpu
@pytest.mark.parametrize("lib,module,cls", [("vllm", "vllm_engine", "VLLMEngine"),
                                            ("sglang", "sglang_engine", "SGLangEngine")])
def test_real_engine(tmp_path, lib, module, cls):
    import importlib

    pytest.importorskip(lib)
    _cuda()
    engine_cls = getattr(importlib.import_module(f"asyncflow.engines.{module}"), cls)
    tok, model = _tiny_folder(tmp_path)
    _check_real_engine(engine_cls(str(tmp_path), EOS, dtype="float32"), tok, model, tmp_path)
