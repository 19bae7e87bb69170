"""``rollout.engine=hf_paged``: transformers' continuous batching as an engine
(:mod:`asyncflow.engines.hf_paged`). The protocol itself is checked by
tests/test_contracts_inference.py; here, what is particular to it:

* the log-prob it records is the policy's ``log_softmax(logits / T)`` of the sampled token,
  equal to a full forward of the same weights (temperature, top-p: the library reports the
  truncated distribution's, the correction restores it), and greedy picks the argmax;
* ``min_new_tokens`` masks EOS (a model that almost always says EOS stops exactly there),
  and the masked tokens' log-probs are the unmasked policy's;
* ``load_weights`` really changes what the engine samples (in place, between steps);
* an ``async`` training run with it trains, and ``mode=sync`` is refused in one line.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from asyncflow.engines.hf_paged import HFPagedEngine
from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model
from asyncflow.engines.types import Request, SamplingParams

torch.set_num_threads(1)
EOS = 2
DIMS = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)


def _tiny(seed: int = 0):
    return build_tiny_model(build_char_tokenizer(), seed=seed, **DIMS)


def _requests(n: int, **kw) -> list[Request]:
    return [Request(f"r{i}", [1, 5 + i % 9, 6 + i % 4, 7 + i % 5], **kw) for i in range(n)]


def _policy_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> np.ndarray:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    t = temperature if temperature > 0 else 1.0
    lp = torch.log_softmax(logits / t, -1)[len(prompt) - 1: -1]
    return lp.gather(1, torch.tensor(response)[:, None])[:, 0].numpy()


@pytest.mark.parametrize("sampling", [SamplingParams(0.7, 1.0, 6), SamplingParams(1.0, 0.8, 6),
                                      SamplingParams(0.0, 1.0, 6)], ids=["t0.7", "top_p0.8", "greedy"])
def test_recorded_logprobs_are_the_policys_from_the_same_forward(sampling):
    engine = HFPagedEngine(_tiny(), eos_id=EOS, max_batch=4, seed=0)
    ref = _tiny()
    try:
        out = engine.generate(_requests(6), sampling)
    finally:
        engine.close()
    assert sorted(c.key for c in out) == [f"r{i}" for i in range(6)]
    for c in out:
        want = _policy_logprobs(ref, c.prompt_ids, c.response_ids, sampling.temperature)
        np.testing.assert_allclose(c.logprobs, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        if sampling.temperature == 0:  # greedy: every token the argmax of the full forward
            with torch.no_grad():
                logits = ref(input_ids=torch.tensor([c.prompt_ids + c.response_ids])).logits[0]
            assert c.response_ids == logits[len(c.prompt_ids) - 1: -1].argmax(-1).tolist()


def test_min_new_tokens_masks_eos_and_records_the_unmasked_logprob():
    """A head that puts ~all mass on EOS: EOS is masked until min_new_tokens (3) tokens are out
    (as the built-in engine and HF's MinNewTokens processor do), so answers are 3 tokens + EOS,
    and the masked tokens' log-probs are the unmasked policy's (about -16)."""
    model, ref = _tiny(), _tiny()
    for m in (model, ref):
        head = torch.nn.Linear(32, m.config.vocab_size, bias=True)
        with torch.no_grad():
            head.weight.zero_()
            head.bias.zero_()
            head.bias[EOS] = 16.0
        m.lm_head = head
    engine = HFPagedEngine(model, eos_id=EOS, max_batch=4, seed=0)
    try:
        out = engine.generate(_requests(4, min_new_tokens=3) + _requests(2, max_new_tokens=5), SamplingParams(1.0,
                                                                                                              1.0, 6))
    finally:
        engine.close()
    masked = [c for c in out if c.key in {"r0", "r1", "r2", "r3"} and len(c.response_ids) >= 3]
    assert len(out) == 6 and len(masked) == 4
    for c in masked:
        assert len(c.response_ids) == 4 and c.finished_on_eos and EOS not in c.response_ids[:3]
        want = _policy_logprobs(ref, c.prompt_ids, c.response_ids, 1.0)
        np.testing.assert_allclose(c.logprobs, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        assert c.logprobs[0] < -15.0 and c.logprobs[-1] > -1e-3  # the policy's own, not the masked one's
    free = [c for c in out if c not in masked]
    assert all(c.response_ids == [EOS] for c in free)  # without a minimum: EOS at once


def test_load_weights_changes_what_is_sampled_in_place():
    engine = HFPagedEngine(_tiny(0), eos_id=EOS, max_batch=4, seed=0)
    greedy = SamplingParams(0.0, 1.0, 5)
    other = _tiny(1)
    params = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    try:
        before = {c.key: c.response_ids for c in engine.generate(_requests(3), greedy)}
        engine.load_weights(7, {n: p.detach().numpy().copy() for n, p in other.named_parameters()})
        after = {c.key: c for c in engine.generate(_requests(3), greedy)}
    finally:
        engine.close()
    assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == params  # copied in place
    assert engine.version == 7 and all(c.version == 7 for c in after.values())
    for c in after.values():  # the new weights' greedy answers and log-probs, not the old ones'
        want = _policy_logprobs(other, c.prompt_ids, c.response_ids, 0.0)
        np.testing.assert_allclose(c.logprobs, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        old = _policy_logprobs(_tiny(0), c.prompt_ids, c.response_ids, 0.0)
        assert np.abs(old - want).max() > 1e-2
    assert set(before) == set(after)


def test_async_training_run_with_hf_paged_and_sync_is_refused(tmp_path):
    from asyncflow.config import ConfigError, load_config
    from asyncflow.launch.registry import get_launcher
    from asyncflow.workflow.driver import train

    with pytest.raises(ConfigError, match=r"rollout.engine=hf_paged needs mode=stream or async") as e:
        load_config(None, ["mode=sync", "rollout.engine=hf_paged"])
    assert "\n" not in str(e.value)
    cfg = load_config(None, ["mode=async", "rollout.engine=hf_paged", "launcher=local", "warmstart.enabled=false",
                             "train.steps=2", "train.prompts_per_step=2", "train.micro_prompts=2",
                             "rollout.group_size=2", "rollout.max_new_tokens=4", "train.eval_every=0",
                             "train.save_every=0", "task.eval_n=1", "progress=false", f"run_dir={tmp_path}"])
    launcher = get_launcher("local")
    try:
        summary = train(cfg, launcher=launcher, evaluate=False)
    finally:
        launcher.shutdown()
    assert summary["steady_samples_per_s"] > 0
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(np.isfinite(m["loss"]) and m["samples"] == 4 for m in lines)
