"""Contract of :class:`asyncflow.engines.training.TrainingEngine`, run against every training engine.

``ENGINES`` lists the implementations (adding one is one line): the built-in
``TrainEngine`` in each way it runs its passes (one pass, token-budget micro-batches,
padding split, bfloat16 mixed precision), on the tiny model. The critic's
``CriticEngine`` is not one: it has values, not log-probs (see the engine's module doc).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncflow.engines.inference import load_named_weights
from asyncflow.engines.training import TrainEngine, TrainingEngine

torch.set_num_threads(1)

PROMPTS = [[1, 5, 14, 6, 18], [1, 7, 18], [1, 9, 14, 9, 14, 8, 18]]
RESPONSES = [[8, 2], [9, 10, 11, 2], [5]]


def _tiny(seed: int):
    from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model

    return build_tiny_model(build_char_tokenizer(), seed=seed, hidden_size=32, num_layers=1, num_heads=2,
                            num_kv_heads=1, intermediate_size=64)


ENGINES = {  # name -> keyword arguments of a TrainEngine on the tiny model
    "train": {},
    "token-budget": {"max_tokens_per_micro": 16},  # lengths 7, 7, 8: two chunks
    "padding-split": {"split_padding": 1},  # lengths 7, 7, 8: two passes
    "bfloat16": {"dtype": "bfloat16"},
}


def make(name: str, seed: int = 0) -> TrainingEngine:
    return TrainEngine(_tiny(seed), pad_id=0, lr=1e-2, **ENGINES[name])


@pytest.fixture(params=list(ENGINES))
def name(request) -> str:
    return request.param


def policy_loss(out, batch, extras):
    """A REINFORCE-style loss normalised by the whole step's rows (``extras['rows']``)."""
    adv = torch.as_tensor(np.asarray(extras["advantages"], dtype=np.float32), device=out.device)
    loss = -(out * batch.mask * adv[:, None]).sum() / extras["rows"]
    return loss, {"loss": float(loss.detach())}


def snapshot(engine) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in engine.export_weights().items()}


# --------------------------------------------------------------------------- the contract


def test_is_a_training_engine(name):
    engine = make(name)
    assert isinstance(engine, TrainingEngine) and engine.version == 0


def test_logprobs_match_the_responses(name):
    engine = make(name)
    before = snapshot(engine)
    out = engine.logprobs(PROMPTS, RESPONSES)
    assert len(out) == len(RESPONSES)
    for lp, r in zip(out, RESPONSES):
        assert isinstance(lp, np.ndarray) and lp.dtype == np.float32 and lp.shape == (len(r),)
        assert np.isfinite(lp).all() and (lp <= 0).all()
    again = engine.logprobs(PROMPTS, RESPONSES)
    assert all(np.array_equal(a, b) for a, b in zip(out, again))  # no state change
    after = engine.export_weights()
    assert all(np.array_equal(before[k], after[k]) for k in before) and engine.version == 0


def test_a_step_changes_the_weights(name):
    engine = make(name)
    before = snapshot(engine)
    lp_before = engine.logprobs(PROMPTS, RESPONSES)
    extras = {"advantages": [1.0, -1.0, 0.5], "rows": len(PROMPTS)}
    metrics = engine.forward_backward(PROMPTS, RESPONSES, extras, policy_loss)
    assert isinstance(metrics, dict) and np.isfinite(metrics["loss"])
    mid = engine.export_weights()
    assert all(np.array_equal(before[k], mid[k]) for k in before), "forward_backward only accumulates"
    step = engine.optimizer_step()
    assert engine.version == 1 and step["grad_norm"] > 0 and step["lr"] > 0
    after = engine.export_weights()
    assert any(not np.array_equal(before[k], after[k]) for k in before)
    lp_after = engine.logprobs(PROMPTS, RESPONSES)
    assert any(not np.allclose(a, b) for a, b in zip(lp_before, lp_after))


def test_exported_weights_load_into_a_fresh_model(name):
    engine = make(name)
    engine.forward_backward(PROMPTS, RESPONSES, {"advantages": [1.0, 0.0, -1.0], "rows": 3}, policy_loss)
    engine.optimizer_step()
    weights = engine.export_weights()
    params = dict(engine.model.named_parameters())
    assert set(weights) == set(params)
    for k, v in weights.items():
        assert isinstance(v, np.ndarray) and v.shape == tuple(params[k].shape)
    next(iter(weights.values()))[...] = 0.0  # a host copy: the engine is not touched
    assert any(not np.array_equal(a, b) for a, b in zip(engine.logprobs(PROMPTS, RESPONSES),
                                                         make(name).logprobs(PROMPTS, RESPONSES)))
    fresh_model = _tiny(seed=7)  # another initialisation, same architecture
    load_named_weights(fresh_model, engine.export_weights())
    fresh = TrainEngine(fresh_model, pad_id=0, **ENGINES[name])
    for a, b in zip(engine.logprobs(PROMPTS, RESPONSES), fresh.logprobs(PROMPTS, RESPONSES)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
