"""vLLM and SGLang adapters against stand-ins that keep the real engines' constraints.

Neither engine can be installed here (CUDA wheels), so each is replaced at its edge by a
fake read against its source: ``tests/fake_vllm.py`` mirrors vLLM 0.33.0 (the engine core
in another process, msgpack serialisation that refuses functions and sends tensors as
``(dtype, shape, buffer)``, a prefix-cache reset refused while requests hold blocks, pause
and resume, ``Worker.reload_weights``), ``tests/fake_sglang.py`` mirrors SGLang 0.5.23 (a
reader lock per live generation, control calls served only on the tokenizer manager's loop,
an update refused without a pause, aborts that match id prefixes). Both decode with the
tiny Hugging Face model and a real KV cache with a prefix cache, so stale KV after a weight
swap shows as log-probs that differ from a recompute. Each test names the source files it
mirrors. The real-engine test at the end needs the package and a CUDA GPU.
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest
import torch

from asyncflow.config import ConfigError, load_config
from asyncflow.engines.adapters import CHECKSUMS, hf_name, named_tensors, sampled_logprobs
from asyncflow.engines.types import Completion, Request, SamplingParams
from asyncflow.weights.store import CHECKSUMS as STORE_CHECKSUMS
from asyncflow.weights.store import seal

EOS = 2
DEADLINE_S = 120.0


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


def test_sampled_logprob_mapping():
    from fake_vllm import Logprob  # vllm/logprobs.py

    assert sampled_logprobs([7, 9], [{7: Logprob(-0.5), 3: Logprob(-2.0)}, {9: -1.25}]) == [-0.5, -1.25]
    with pytest.raises(ValueError, match="token 9 at position 1"):
        sampled_logprobs([7, 9], [{7: -0.5}, {4: -1.0}])
    with pytest.raises(ValueError, match="logprobs=0"):
        sampled_logprobs([7], None)


# --------------------------------------------------------------------------- shared checks


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _weights(model) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def _new_model(model_dir):
    """Different weights for the same architecture (the "trained" version)."""
    from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model

    return build_tiny_model(build_char_tokenizer(), seed=7, hidden_size=32, num_layers=1, num_heads=2,
                            num_kv_heads=1, intermediate_size=64).eval()


def _recompute(model, c: Completion, temperature: float) -> list[float]:
    from asyncflow.engines.training import TrainEngine

    return TrainEngine(model, pad_id=0, temperature=temperature).logprobs([c.prompt_ids], [c.response_ids])[0].tolist()


def _check_against_recompute(done: list[Completion], models: dict[int, torch.nn.Module], temperature: float) -> None:
    """Every token's recorded log-prob equals the trainer's recompute under the weights of
    the version that sampled it (float32, relative to its magnitude)."""
    for c in done:
        expected = {v: _recompute(m, c, temperature) for v, m in models.items()}
        for i, v in enumerate(c.token_versions):
            assert c.logprobs[i] == pytest.approx(expected[v][i], rel=1e-5), (c.key, i, v)


def _drain(batch, limit_s: float = DEADLINE_S) -> list[Completion]:
    done, deadline = [], time.monotonic() + limit_s
    while len(batch):
        assert time.monotonic() < deadline, f"{len(batch)} answers still live after {limit_s:.0f} s"
        done += batch.step()
    return done


REQS = [Request(f"r{i}", [1, 5 + i, 6], max_new_tokens=8) for i in range(3)]
BUILT: list = []  # adapters a test built: shut down after it


def _requests() -> list[Request]:
    return [Request(r.key, list(r.prompt_ids), r.max_new_tokens) for r in REQS]


# --------------------------------------------------------------------------- vLLM (tests/fake_vllm.py)


@pytest.fixture
def fake_vllm(monkeypatch):
    import fake_vllm

    monkeypatch.setitem(sys.modules, "vllm", fake_vllm.module())
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    yield fake_vllm
    while BUILT:
        BUILT.pop().shutdown()
    fake_vllm.shutdown_all()


def test_fake_vllm_keeps_the_serialisation_rules(fake_vllm, model_dir, monkeypatch):
    """Mirrors vllm/v1/serial_utils.py (0.33.0): a function is refused unless
    VLLM_ALLOW_INSECURE_SERIALIZATION=1, and even then a tensor argument reaches the engine
    core as a [dtype, shape, buffer] list (why a worker function sent with tensors fails)."""
    def probe(worker, weights):
        return [type(t).__name__ for _, t in weights]

    llm = fake_vllm.LLM(str(model_dir), max_num_seqs=2)
    with pytest.raises(TypeError, match="VLLM_ALLOW_INSECURE_SERIALIZATION"):
        llm.collective_rpc(probe, args=([("w", torch.ones(100))],))
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # read by both processes when they start
    llm = fake_vllm.LLM(str(model_dir), max_num_seqs=2)
    assert llm.collective_rpc(probe, args=([("w", torch.ones(100)), ("b", torch.ones(2))],)) == [["list", "list"]]


def _vllm(model_dir, **kw):
    from asyncflow.engines.vllm_engine import VLLMEngine

    BUILT.append(VLLMEngine(str(model_dir), eos_id=EOS, max_batch=4, dtype="float32", seed=3,
                            weights_dir=str(model_dir.parent / "weights"), **kw))
    return BUILT[-1]


def test_vllm_generates_with_the_sampled_tokens_logprobs(fake_vllm, model_dir):
    """Mirrors vllm/outputs.py, vllm/logprobs.py, vllm/v1/engine/llm_engine.py (0.33.0): the
    engine is built with processed log-probs; cumulative RequestOutputs map to answers whose
    log-probs equal the trainer's recompute (temperature 0.7)."""
    eng = _vllm(model_dir)
    llm = fake_vllm.LLM._built[-1]
    assert llm.kwargs["logprobs_mode"] == "processed_logprobs" and llm.kwargs["max_num_seqs"] == 4
    out = eng.generate(_requests(), SamplingParams(temperature=0.7, max_new_tokens=8))
    assert sorted(c.key for c in out) == ["r0", "r1", "r2"]
    assert all(c.token_versions == [0] * len(c.response_ids) for c in out)
    _check_against_recompute(out, {0: _model(model_dir)}, 0.7)


def test_vllm_swap_mid_generation_continues_every_answer_under_the_new_weights(fake_vllm, model_dir):
    """Mirrors vllm/v1/serial_utils.py (no function, tensors as buffers across the process
    boundary), vllm/v1/core/sched/scheduler.py + block_pool.py (prefix cache kept after a
    request, reset refused while requests hold blocks) and vllm/v1/worker/gpu_worker.py
    (reload_weights) of 0.33.0. Three answers hold 3 tokens each when the weights change;
    each continues, and every token's log-prob equals a recompute under the weights that
    sampled it: a stale prefix-cache hit would show here."""
    eng = _vllm(model_dir, fake_knobs={"hold": 3})
    llm = fake_vllm.LLM._built[-1]
    batch = eng.new_batch(SamplingParams(temperature=1.0, max_new_tokens=8))
    batch.add(_requests())
    deadline = time.monotonic() + DEADLINE_S
    while sum(len(r.out) for r in batch.rows.values()) < 9:  # the engine holds each answer at 3 tokens
        assert time.monotonic() < deadline and batch.step() == []
    new = _new_model(model_dir)
    eng.load_weights(1, seal(_weights(new)))
    batch.version = eng.version
    batch.recompute_cache()
    done = _drain(batch)
    assert sorted(c.key for c in done) == ["r0", "r1", "r2"]
    for c in done:
        assert c.token_versions == [0, 0, 0, 1, 1, 1, 1, 1] and c.version == 0, c
    _check_against_recompute(done, {0: _model(model_dir), 1: new}, 1.0)
    assert llm.llm_engine.threads == {threading.get_ident()}  # aborts and steps on one thread


def test_vllm_refused_prefix_cache_reset_is_an_error(fake_vllm, model_dir):
    """Mirrors vllm/v1/core/sched/scheduler.py reset_prefix_cache (0.33.0): it returns False
    when it cannot reset (here: a KV connector that refuses); the weight update fails with one
    line naming vLLM and the step, instead of going on with KV of the old weights."""
    eng = _vllm(model_dir, fake_knobs={"reset": "refuse", "hold": 2})
    batch = eng.new_batch(SamplingParams(max_new_tokens=8))
    batch.add(_requests())
    batch.step()
    with pytest.raises(RuntimeError, match=r"^vllm: reset_prefix_cache\(reset_running_requests=True\) .*refused") as e:
        eng.load_weights(1, seal(_weights(_new_model(model_dir))))
    assert "\n" not in str(e.value) and eng.version == 0


def test_vllm_failed_update_is_an_error(fake_vllm, model_dir):
    """Mirrors vllm/v1/engine/core.py (a failed utility call comes back as "Call to
    collective_rpc method failed: ...") and the model's load_weights (0.33.0): a weight of the
    wrong shape fails the update with an error naming vLLM and the step."""
    eng = _vllm(model_dir)
    weights = _weights(_model(model_dir))
    weights["model.norm.weight"] = np.ones(3, np.float32)
    with pytest.raises(RuntimeError, match=r"^vllm: .*reload_weights.* failed: .*model\.norm\.weight") as e:
        eng.load_weights(1, seal(weights))
    assert "\n" not in str(e.value) and eng.version == 0


def test_vllm_drop_aborts_on_the_stepping_thread(fake_vllm, model_dir):
    """Mirrors vllm/v1/engine/llm_engine.py abort_request (0.33.0; the engine's sockets are not
    thread-safe): dropped answers are aborted from the thread that steps, the rest finish."""
    eng = _vllm(model_dir, fake_knobs={"hold": 2})
    llm = fake_vllm.LLM._built[-1]
    batch = eng.new_batch(SamplingParams(max_new_tokens=8))
    batch.add(_requests())
    batch.step()
    assert [r.key for r in batch.drop(lambda r: r.key == "r1")] == ["r1"]
    assert sorted(r.key for r in batch.drop_all()) == ["r0", "r2"] and len(batch) == 0
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.threads == {threading.get_ident()}


# --------------------------------------------------------------------------- SGLang (tests/fake_sglang.py)


@pytest.fixture
def fake_sglang(monkeypatch):
    import fake_sglang

    for name, mod in fake_sglang.modules().items():
        monkeypatch.setitem(sys.modules, name, mod)
    yield fake_sglang
    while BUILT:
        BUILT.pop().shutdown()
    fake_sglang.shutdown_all()


def _sglang(model_dir, **kw):
    from asyncflow.engines.sglang_engine import SGLangEngine

    BUILT.append(SGLangEngine(str(model_dir), eos_id=EOS, max_batch=4, dtype="float32", seed=3, **kw))
    return BUILT[-1]


def _wait_held(fake, n: int, tokens: int, batch) -> None:
    """Until the fake engine holds ``n`` live generations at ``tokens`` tokens each."""
    sched, deadline = fake.Engine._built[-1].tokenizer_manager.scheduler, time.monotonic() + DEADLINE_S
    while not (len(sched.running) == n and all(s.n_out == tokens for s in sched.running)):
        assert time.monotonic() < deadline, "the fake SGLang engine did not reach the hold"
        assert batch.step() == []


def test_sglang_result_mapping():
    """Mirrors sglang/srt/managers/tokenizer_manager.py (0.5.23): meta_info's
    output_token_logprobs are (logprob, token_id, text); an abort is not a finish."""
    from asyncflow.engines.sglang_engine import update_from_result

    u = update_from_result("r", {"meta_info": {"output_token_logprobs": [(-0.5, 7, "x"), (-1.0, EOS, None)],
                                               "finish_reason": {"type": "stop"}}})
    assert (u.token_ids, u.logprobs, u.finished, u.stop_reason) == ([7, EOS], [-0.5, -1.0], True, "stop")
    with pytest.raises(ValueError, match="return_logprob"):
        update_from_result("r", {"meta_info": {}})
    cut = update_from_result("r", {"meta_info": {"output_token_logprobs": [(-0.5, 7, None)],
                                                 "finish_reason": {"type": "abort", "message": "Aborted"}}})
    assert cut.token_ids == [7] and not cut.finished


def test_sglang_generates_with_the_sampled_tokens_logprobs(fake_sglang, model_dir):
    """Mirrors sglang/srt/entrypoints/engine.py async_generate (0.5.23): log-probs equal the
    trainer's recompute (temperature 0.7)."""
    eng = _sglang(model_dir)
    out = eng.generate(_requests(), SamplingParams(temperature=0.7, max_new_tokens=8))
    assert sorted(c.key for c in out) == ["r0", "r1", "r2"]
    _check_against_recompute(out, {0: _model(model_dir)}, 0.7)


def test_sglang_swap_mid_generation_continues_every_answer_under_the_new_weights(fake_sglang, model_dir):
    """Mirrors sglang/srt/managers/tokenizer_manager.py + tokenizer_control_mixin.py (0.5.23):
    generations hold the reader lock, control calls are served on the manager's loop only,
    an update needs a pause, the radix cache keeps old KV until flushed. Three generations
    hold 3 tokens each when the weights change; each continues, and every token's log-prob
    equals a recompute under the weights that sampled it."""
    eng = _sglang(model_dir, fake_knobs={"hold": 3})
    batch = eng.new_batch(SamplingParams(temperature=1.0, max_new_tokens=8))
    batch.add(_requests())
    _wait_held(fake_sglang, 3, 3, batch)
    new = _new_model(model_dir)
    eng.load_weights(1, seal(_weights(new)))
    batch.version = eng.version
    batch.recompute_cache()
    done = _drain(batch)
    assert sorted(c.key for c in done) == ["r0", "r1", "r2"]
    for c in done:
        assert c.token_versions == [0, 0, 0, 1, 1, 1, 1, 1] and c.version == 0, c
    _check_against_recompute(done, {0: _model(model_dir), 1: new}, 1.0)
    assert fake_sglang.Engine._built[-1].updates == 1


def test_sglang_failed_update_or_flush_is_an_error(fake_sglang, model_dir):
    """Mirrors tokenizer_control_mixin.py (0.5.23): update_weights_from_tensor returns
    (success, message) and flush_cache FlushCacheReqOutput(success): a failure of either is an
    error naming SGLang and the step."""
    eng = _sglang(model_dir)
    weights = _weights(_model(model_dir))
    weights["model.norm.weight"] = np.ones(3, np.float32)
    with pytest.raises(RuntimeError, match=r"^sglang: update_weights_from_tensor.* failed: .*model\.norm\.weight"):
        eng.load_weights(1, seal(weights))
    eng2 = _sglang(model_dir, fake_knobs={"flush": "refuse"})
    with pytest.raises(RuntimeError, match=r"^sglang: flush_cache failed") as e:
        eng2.load_weights(1, seal(_weights(_model(model_dir))))
    assert "\n" not in str(e.value) and eng.version == eng2.version == 0


def test_sglang_aborts_run_on_the_engine_loop(fake_sglang, model_dir):
    """Mirrors tokenizer_manager.py abort_request (0.5.23; it sends on the manager loop's
    socket): dropping live generations works, and the others finish whole."""
    eng = _sglang(model_dir)
    batch = eng.new_batch(SamplingParams(max_new_tokens=60))
    batch.add(_requests())
    assert [r.key for r in batch.drop(lambda r: r.key == "r1")] == ["r1"]
    assert sorted(r.key for r in batch.drop_all()) == ["r0", "r2"] and len(batch) == 0
    batch.add(_requests()[:2])
    done = _drain(batch)
    assert sorted(c.key for c in done) == ["r0", "r1"] and all(len(c.response_ids) == 8 for c in done)


def test_request_ids_are_prefix_free():
    """SGLang's scheduler aborts every request whose id starts with the aborted one
    (sglang/srt/managers/scheduler.py abort_request, 0.5.23): no id may prefix another."""
    from asyncflow.engines.adapters import request_id

    ids = [request_id(n) for n in range(2000)]
    assert len(set(ids)) == len(ids)
    assert not any(b.startswith(a) for a in ids[:120] for b in ids if a != b)


# --------------------------------------------------------------------------- config switch


def test_engine_switch_config_errors(monkeypatch):
    import asyncflow.config.rollout as config

    for name in ("vllm", "sglang"):
        if not config.engine_installed(name):
            expect = (rf"^config error in the override rollout.engine={name}: rollout: rollout.engine={name} needs the {name} package, which is not "
                      rf"installed: pip install 'asyncflow\[{name}\]'")
            with pytest.raises(ConfigError, match=expect) as e:
                load_config(None, [f"rollout.engine={name}"])
            assert "\n" not in str(e.value)
    monkeypatch.setattr(config, "engine_installed", lambda name: True)
    assert load_config(None, ["rollout.engine=vllm"]).rollout.engine == "vllm"
    with pytest.raises(ConfigError, match="needs mode=stream or async"):
        load_config(None, ["rollout.engine=vllm", "mode=sync"])
    assert load_config(None, ["rollout.engine=sglang"]).rollout.on_swap == "continue"  # answers continue


# --------------------------------------------------------------------------- real engines (GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("lib,module,cls", [("vllm", "vllm_engine", "VLLMEngine"),
                                            ("sglang", "sglang_engine", "SGLangEngine")])
def test_real_engine(tmp_path, lib, module, cls):
    """The real engine (package and CUDA GPU): generation, a swap mid-generation, recompute
    (benchmarks/adapters_gpu.py runs the same check with timings)."""
    pytest.importorskip(lib)
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent / "benchmarks"))
    from adapters_gpu import check_adapter

    report = check_adapter(lib, tmp_path)
    assert report["max_abs_diff_before"] < 0.05 and report["max_abs_diff_after"] < 0.05, report
