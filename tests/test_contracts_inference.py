"""Contract of the inference engine protocol (:class:`asyncflow.engines.types.Engine` and
:class:`~asyncflow.engines.types.EngineBatch`), run against every engine.

The multi-turn capability (:class:`~asyncflow.engines.types.MultiTurnBatch`: ``stop_ids``,
``keep``, ``extend``, ``release``) is checked on the engines that offer it.

``ENGINES`` lists the implementations (adding one is one line): the built-in engine on the
tiny model, transformers' continuous batching (``hf_paged``) on it, the deterministic
``FakeEngine``, the adapters' shared ``StepEngine`` over a scripted backend, the vLLM adapter over ``tests/fake_vllm.py`` (vLLM 0.33.0's engine core
in another process, its serialisation, prefix cache and pause; the tiny model decoding),
and the real vLLM and SGLang engines, which need their package and a CUDA GPU and skip
cleanly otherwise. (The SGLang adapter's fake returns an answer only when it finishes or is
aborted, so "one step gives every request a token" cannot hold for it; its behaviour is
tested in ``tests/test_engine_adapters.py``.) Each case gives an engine and a weight set
its ``load_weights`` accepts.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from asyncflow.engines.adapters import Loaded, StepEngine, Update
from asyncflow.engines.types import (
    STOP_REASONS,
    Completion,
    Engine,
    EngineBatch,
    MultiTurnBatch,
    Request,
    SamplingParams,
)

torch.set_num_threads(1)

EOS = 2
MAX_BATCH = 4
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=5)


def _tiny(seed: int):
    from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model

    return build_tiny_model(build_char_tokenizer(), seed=seed, hidden_size=32, num_layers=1, num_heads=2,
                            num_kv_heads=1, intermediate_size=64)


def _named(model) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


class ScriptedBackend:
    """A stand-in external engine (the adapters' ``Backend``): one token per poll per live
    submission, cumulative updates, an answer length scripted from the prompt."""

    def __init__(self):
        self.live: dict[str, tuple] = {}
        self.loads = 0

    def submit(self, rid, prompt_ids, max_tokens, min_tokens, sampling):
        length = min(max_tokens, max(min_tokens, 1 + sum(prompt_ids) % 4))
        self.live[rid] = (list(prompt_ids), length, min_tokens, [], [])

    def poll(self) -> list[Update]:
        out = []
        for rid, (prompt, length, min_tokens, toks, lps) in list(self.live.items()):
            pos = len(prompt) + len(toks)
            last = len(toks) + 1 == length
            toks.append(EOS if last and length > min_tokens else 4 + pos % 10)
            lps.append(-0.1 * (1 + pos % 7))
            if last:
                del self.live[rid]
            reason = ("stop" if toks[-1] == EOS else "length") if last else None
            out.append(Update(rid, list(toks), list(lps), last, reason))
        return out

    def abort(self, rids):
        for rid in rids:
            self.live.pop(rid, None)

    def load(self, weights):
        self.loads += 1
        return Loaded("scripted")


def _builtin(tmp_path, monkeypatch):
    from asyncflow.engines.inference import InferenceEngine

    return InferenceEngine(_tiny(0), eos_id=EOS, pad_id=0, max_batch=MAX_BATCH, seed=0), _named(_tiny(1))


def _hf_paged(tmp_path, monkeypatch):
    from asyncflow.engines.hf_paged import HFPagedEngine

    return HFPagedEngine(_tiny(0), eos_id=EOS, pad_id=0, max_batch=MAX_BATCH, seed=0), _named(_tiny(1))


def _fake(tmp_path, monkeypatch):
    from asyncflow.engines.fake import FakeEngine

    return FakeEngine(eos_id=EOS, max_batch=MAX_BATCH), {"w": np.zeros(2, np.float32)}


def _adapter(tmp_path, monkeypatch):
    return StepEngine(ScriptedBackend(), EOS, MAX_BATCH), {"model.w": np.zeros(2, np.float32)}


def _saved_tiny(tmp_path):
    from asyncflow.engines.tiny import build_char_tokenizer

    _tiny(0).save_pretrained(tmp_path / "m")
    build_char_tokenizer().save_pretrained(tmp_path / "m")
    return str(tmp_path / "m")


def _vllm_fake(tmp_path, monkeypatch):
    import sys

    import fake_vllm

    from asyncflow.engines.vllm_engine import VLLMEngine

    monkeypatch.setitem(sys.modules, "vllm", fake_vllm.module())
    engine = VLLMEngine(_saved_tiny(tmp_path), EOS, max_batch=MAX_BATCH, dtype="float32",
                        weights_dir=str(tmp_path / "w"), fake_knobs={"first_batch": 3})
    return engine, _named(_tiny(1))


def _real(lib: str, module: str, cls: str):
    def make(tmp_path, monkeypatch):
        pytest.importorskip(lib)
        if not torch.cuda.is_available():
            pytest.skip(f"{lib} needs a CUDA GPU")
        import importlib

        engine_cls = getattr(importlib.import_module(f"asyncflow.engines.{module}"), cls)
        return engine_cls(_saved_tiny(tmp_path), EOS, max_batch=MAX_BATCH, dtype="float32"), _named(_tiny(1))

    return make


ENGINES = {
    "builtin": _builtin,
    "hf_paged": _hf_paged,
    "fake": _fake,
    "adapter": _adapter,
    "vllm-fake": _vllm_fake,
    "vllm": _real("vllm", "vllm_engine", "VLLMEngine"),
    "sglang": _real("sglang", "sglang_engine", "SGLangEngine"),
}


@pytest.fixture(params=list(ENGINES))
def case(request, tmp_path, monkeypatch):
    engine, weights = ENGINES[request.param](tmp_path, monkeypatch)
    yield engine, weights
    for name in ("shutdown", "close"):
        close = getattr(engine, name, None)
        if callable(close):
            close()


def requests(n: int, **kw) -> list[Request]:
    return [Request(key=f"r{i}", prompt_ids=[1, 5 + i % 7, 6 + i % 3], **kw) for i in range(n)]


def drain(batch: EngineBatch, limit: int = 200) -> list[Completion]:
    done = []
    for _ in range(limit):
        if not len(batch):
            return done
        done += batch.step()
    raise AssertionError(f"{len(batch)} requests still live after {limit} steps")


def check_completion(c: Completion, req: Request, versions: set[int]) -> None:
    limit = req.max_new_tokens or SAMPLING.max_new_tokens
    assert list(c.prompt_ids) == req.prompt_ids
    assert 1 <= len(c.response_ids) <= limit
    assert len(c.logprobs) == len(c.response_ids) == len(c.token_versions)
    assert all(math.isfinite(x) and x <= 0.0 for x in c.logprobs), c.logprobs
    assert set(c.token_versions) <= versions and c.version == min(c.token_versions)
    assert list(c.token_versions) == sorted(c.token_versions)
    assert c.finished_on_eos == (c.response_ids[-1] == EOS)
    assert c.stop_reason in STOP_REASONS and (c.stop_reason == "eos") == c.finished_on_eos


# --------------------------------------------------------------------------- the contract


def test_is_an_engine(case):
    engine, _ = case
    assert isinstance(engine, Engine)
    assert isinstance(engine.max_batch, int) and engine.max_batch >= 1 and engine.version == 0
    batch = engine.new_batch(SAMPLING)
    assert isinstance(batch, EngineBatch) and len(batch) == 0 and batch.version == 0
    assert batch.step() == [] and batch.drop_all() == []


def test_every_request_comes_back_exactly_once(case):
    """Continuous batching as the rollout role drives it: refill free slots, step."""
    engine, _ = case
    pending = requests(7) + requests(3, max_new_tokens=2)
    for i, r in enumerate(pending[7:]):
        r.key = f"short{i}"
    by_key = {r.key: r for r in pending}
    batch, done = engine.new_batch(SAMPLING), []
    todo = list(pending)
    for _ in range(200):
        free = engine.max_batch - len(batch)
        if free and todo:
            done += batch.add([todo.pop(0) for _ in range(min(free, len(todo)))])
        if not todo and not len(batch):
            break
        assert len(batch) <= engine.max_batch
        done += batch.step()
    keys = [c.key for c in done]
    assert sorted(keys) == sorted(by_key), "every request once, none twice"
    for c in done:
        check_completion(c, by_key[c.key], {0})
        assert by_key[c.key].version == 0  # add stamps the batch's version


def test_version_bumps_after_load_weights(case):
    engine, weights = case
    batch = engine.new_batch(SAMPLING)
    reqs = requests(3, min_new_tokens=4)
    done = batch.add(reqs)
    done += batch.step()
    assert not done and len(batch) == 3  # all live: none may stop before 4 tokens
    engine.load_weights(1, weights)
    assert engine.version == 1
    batch.version = engine.version  # as the rollout role does at a swap
    batch.recompute_cache()
    assert len(batch) == 3  # partial rollout: every live request continues
    done = drain(batch)
    assert sorted(c.key for c in done) == ["r0", "r1", "r2"]
    for c in done:
        check_completion(c, next(r for r in reqs if r.key == c.key), {0, 1})
        assert c.version == 0 and c.token_versions[0] == 0 and c.token_versions[-1] == 1
    fresh = engine.new_batch(SAMPLING)
    assert fresh.version == 1
    new = requests(2)
    out = fresh.add(new) + drain(fresh)
    assert all(set(c.token_versions) == {1} and c.version == 1 for c in out) and len(out) == 2
    assert all(r.version == 1 for r in new)


def test_drop_all_returns_the_live_requests(case):
    engine, _ = case
    batch = engine.new_batch(SAMPLING)
    reqs = requests(3, min_new_tokens=3)
    assert batch.add(reqs) == [] and len(batch) == 3
    assert batch.step() == []
    dropped = batch.drop_all()
    assert sorted(r.key for r in dropped) == ["r0", "r1", "r2"] and all(isinstance(r, Request) for r in dropped)
    assert len(batch) == 0 and batch.step() == [] and batch.drop_all() == []
    reqs = requests(3, min_new_tokens=3)
    batch.add(reqs)
    assert [r.key for r in batch.drop(lambda r: r.key == "r1")] == ["r1"] and len(batch) == 2
    assert batch.drop(lambda r: False) == []
    assert sorted(c.key for c in drain(batch)) == ["r0", "r2"]  # the rest go on, once each


def test_saved_answers_continue_in_a_fresh_batch_or_the_engine_does_not_offer_it(case):
    """``partials()``/``resume()`` (optional: an engine without them has its answers restarted on
    resume): the saved rows stay live, and in a new batch at a newer version they come back once
    each, with their saved tokens, log-probs and versions first."""
    engine, _ = case
    batch = engine.new_batch(SAMPLING)
    if not hasattr(batch, "partials"):
        assert not hasattr(batch, "resume")
        return
    reqs = requests(3, min_new_tokens=4)
    batch.add(reqs)
    batch.step()
    saved = batch.partials()
    assert sorted(p.req.key for p in saved) == ["r0", "r1", "r2"] and len(batch) == 3
    assert all(len(p.response_ids) == len(p.logprobs) == len(p.token_versions) == 2 for p in saved)
    engine.version = 4  # (a restarted run's version)
    again = engine.new_batch(SAMPLING)
    assert again.resume(saved) == [] and len(again) == 3
    done = drain(again)
    assert sorted(c.key for c in done) == ["r0", "r1", "r2"]
    for c in done:
        p = next(p for p in saved if p.req.key == c.key)
        check_completion(c, p.req, {0, 4})
        assert list(c.response_ids[:2]) == p.response_ids and list(c.logprobs[:2]) == p.logprobs
        assert c.token_versions[:2] == [0, 0] and c.token_versions[2:] == [4] * (len(c.response_ids) - 2)
        assert c.version == 0


# --------------------------------------------------------------------------- multi-turn (optional)

STOPS = tuple(range(3, 300))  # nearly every token: an answer ends on a stop id at its first chance


def multi_turn(engine) -> MultiTurnBatch | None:
    """A new batch if the engine offers the multi-turn capability (else it has neither method)."""
    batch = engine.new_batch(SAMPLING)
    if not isinstance(batch, MultiTurnBatch):
        assert not hasattr(batch, "extend") and not hasattr(batch, "release")
        return None
    return batch


def test_stop_ids_end_an_answer_on_the_stop_token(case):
    """A stop id ends the answer (included, ``stop_reason="stop"``), never within ``min_new_tokens``."""
    engine, _ = case
    batch = multi_turn(engine)
    if batch is None:
        return
    reqs = requests(2, stop_ids=STOPS) + requests(2, stop_ids=STOPS, min_new_tokens=2)
    for i, r in enumerate(reqs[2:]):
        r.key = f"m{i}"
    done = batch.add(reqs) + drain(batch)
    assert sorted(c.key for c in done) == sorted(r.key for r in reqs)
    for c in done:
        req = next(r for r in reqs if r.key == c.key)
        check_completion(c, req, {0})
        ends = set(STOPS) | {EOS}
        assert not ends & set(c.response_ids[req.min_new_tokens:-1]), c.response_ids  # only the last may stop
        after_min = len(c.response_ids) > req.min_new_tokens
        assert (c.stop_reason == "stop") == (c.response_ids[-1] in STOPS and after_min), c
    assert sum(c.stop_reason == "stop" for c in done) >= 2  # (the first two at least: nothing bars them)


def test_a_kept_answer_continues_with_extend_and_is_released(case):
    """``keep`` parks a finished answer; ``extend`` appends an observation and generates the next
    turn (its own tokens only, the whole history as prompt); ``release`` forgets it; unknown keys
    raise KeyError naming them."""
    engine, _ = case
    batch = multi_turn(engine)
    if batch is None:
        return
    first = Request("a", [1, 5, 6], max_new_tokens=3, keep=True)
    done = batch.add([first, *requests(2)]) + drain(batch)
    assert len(batch) == 0  # a kept answer is not live
    (one,) = [c for c in done if c.key == "a"]
    history = one.prompt_ids + one.response_ids
    done = batch.extend("a", [7, 8], max_new_tokens=4)
    assert len(batch) == (0 if done else 1)  # live again, unless it finished at its first token
    done += drain(batch)
    (two,) = done
    assert two.key == "a" and list(two.prompt_ids) == history + [7, 8]
    check_completion(two, Request("a", list(two.prompt_ids), max_new_tokens=4), {0})
    three = batch.extend("a", [9], max_new_tokens=2) + drain(batch)  # still kept: continue again
    assert list(three[0].prompt_ids) == list(two.prompt_ids) + list(two.response_ids) + [9]
    batch.release("a")
    with pytest.raises(KeyError, match="'a'"):
        batch.extend("a", [5], max_new_tokens=2)
    with pytest.raises(KeyError, match="'nope'"):
        batch.release("nope")
    with pytest.raises(KeyError, match="'r0'"):  # finished, but not added with keep=True
        batch.extend("r0", [5], max_new_tokens=2)


def test_a_kept_answer_continues_under_new_weights(case):
    """After a weight swap a kept answer's next turn is sampled (every token) at the new version."""
    engine, weights = case
    batch = multi_turn(engine)
    if batch is None:
        return
    batch.add([Request("k", [1, 5, 6], max_new_tokens=2, min_new_tokens=2, keep=True)])
    drain(batch)
    engine.load_weights(1, weights)
    batch.version = 1
    batch.recompute_cache()
    done = batch.extend("k", [5, 5], max_new_tokens=3, min_new_tokens=3) + drain(batch)
    assert [len(c.response_ids) for c in done] == [3]
    assert done[0].token_versions == [1, 1, 1] and done[0].version == 1

