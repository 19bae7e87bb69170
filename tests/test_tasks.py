"""The addition task (split, reward) and the SFT warm-start with its on-disk cache."""

from __future__ import annotations

import pytest
import torch

from asyncflow.engines.tiny import build_char_tokenizer
from asyncflow.tasks.addition import AdditionTask, Problem
from asyncflow.tasks import warmstart
from asyncflow.tasks.warmstart import (
    SFTResult,
    decode_responses,
    encode_prompts,
    eval_due,
    evaluate,
    load_or_warm_start,
    sft_tensors,
    warmup_lr,
)

torch.set_num_threads(1)


# --------------------------------------------------------------------------- task


def test_two_digit_split_is_disjoint_and_covers_all_problems():
    task = AdditionTask(digits=2, holdout_frac=0.2, seed=0)
    assert len(task.train) == 8000 and len(task.heldout) == 2000
    train, held = set(task.train), set(task.heldout)
    assert len(train) == 8000 and len(held) == 2000  # no duplicates inside a split
    assert not train & held
    everything = {Problem(f"{a}+{b}=", str(a + b)) for a in range(100) for b in range(100)}
    assert len(everything) == 10_000
    assert train | held == everything
    assert task.max_answer_len == 3


def test_split_depends_only_on_seed():
    a = AdditionTask(digits=2, seed=0)
    b = AdditionTask(digits=2, seed=0)
    c = AdditionTask(digits=2, seed=1)
    assert a.heldout == b.heldout and a.train == b.train
    assert set(a.heldout) != set(c.heldout)


def test_one_digit_example_from_docstring():
    task = AdditionTask(digits=1, holdout_frac=0.2, seed=0)
    assert (len(task.train), len(task.heldout)) == (80, 20)
    p = next(p for p in task.train + task.heldout if p.prompt == "9+8=")
    assert p.answer == "17"


@pytest.mark.parametrize("kw", [{"digits": 0}, {"holdout_frac": 1.0}, {"holdout_frac": -0.1}])
def test_bad_task_arguments(kw):
    with pytest.raises(ValueError):
        AdditionTask(**kw)


@pytest.mark.parametrize(
    "response, expected",
    [("46", 1.0), (" 46\n", 1.0), ("46 ", 1.0), ("4 6", 0.0), ("046", 0.0), ("47", 0.0), ("", 0.0),
     ("46.0", 0.0), ("4", 0.0), ("466", 0.0)],
)
def test_reward_exact_match(response, expected):
    task = AdditionTask(digits=1)
    assert task.reward("12+34=", response, "46") == expected


# --------------------------------------------------------------------------- token layout


def test_sft_tensors_layout_hand_computed():
    tok = build_char_tokenizer()
    ids, labels = sft_tensors(tok, [Problem("1+2=", "3"), Problem("12+34=", "46")])
    # '0'->4 ... '9'->13, '+'->14, '='->18; bos=1, eos=2, pad=0.
    assert ids.tolist() == [
        [1, 5, 14, 6, 18, 7, 2, 0, 0, 0],
        [1, 5, 6, 14, 7, 8, 18, 8, 10, 2],
    ]
    assert labels.tolist() == [
        [-100, -100, -100, -100, -100, 7, 2, -100, -100, -100],
        [-100, -100, -100, -100, -100, -100, -100, 8, 10, 2],
    ]


def test_encode_prompts_left_pads_and_decode_cuts_at_eos():
    tok = build_char_tokenizer()
    ids, mask = encode_prompts(tok, ["1+2=", "12+34="])
    assert ids.tolist() == [[0, 0, 1, 5, 14, 6, 18], [1, 5, 6, 14, 7, 8, 18]]
    assert mask.tolist() == [[0, 0, 1, 1, 1, 1, 1], [1] * 7]
    gen = torch.tensor([[8, 10, 2, 9], [7, 0, 0, 0], [2, 5, 5, 5]])
    assert decode_responses(tok, gen) == ["46", "3", ""]


# --------------------------------------------------------------------------- warm-start


# lr 3e-3 without warmup (the first recipe) reaches 30% on one-digit addition in tens of steps
WARM = dict(target_acc=0.3, eval_every=10, max_steps=120, batch_size=256, eval_n=20, seed=0, lr=3e-3,
            warmup_steps=0, near_every=10, land_every=None)  # landing: tests/test_warmstart_landing.py


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    cache = tmp_path_factory.mktemp("warmstart")
    task = AdditionTask(digits=1, holdout_frac=0.2, seed=0)
    steps = []
    model, tok, info = load_or_warm_start(cache, task=task, progress=lambda s, a, l: steps.append((s, a, l)), **WARM)
    return cache, task, model, tok, info, steps


def test_sft_reaches_small_target_quickly(warm):
    _, task, model, tok, info, steps = warm
    assert info["cached"] is False
    assert info["accuracy"] >= WARM["target_acc"]
    # Stopped early, at an evaluation step, as soon as the target was reached.
    assert info["steps"] < WARM["max_steps"] and info["steps"] % WARM["eval_every"] == 0
    assert [s for s, _, _ in steps] == list(range(1, info["steps"] + 1))
    evals = [(s, a) for s, a, _ in steps if a is not None]
    assert [s for s, _ in evals] == list(range(10, info["steps"] + 1, 10))
    assert all(a < WARM["target_acc"] for _, a in evals[:-1]) and evals[-1][1] == info["accuracy"]
    assert steps[-1][2] < steps[0][2]  # the SFT loss went down
    # The returned model is the trained one, in eval mode, and scores the reported accuracy.
    assert not model.training
    assert evaluate(model, tok, task.heldout[: WARM["eval_n"]]) == pytest.approx(info["accuracy"])


def test_load_or_warm_start_second_call_is_cached(warm):
    cache, task, model, _, info, _ = warm
    called = []
    model2, tok2, info2 = load_or_warm_start(cache, task=task, progress=lambda *a: called.append(a), **WARM)
    assert info2["cached"] is True
    assert called == []  # no SFT step ran
    assert info2["key"] == info["key"] and info2["path"] == info["path"]
    assert (info2["accuracy"], info2["steps"]) == (info["accuracy"], info["steps"])
    assert not model2.training
    sd1, sd2 = model.state_dict(), model2.state_dict()
    assert sd1.keys() == sd2.keys()
    assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    assert tok2("12+34=").input_ids == [5, 6, 14, 7, 8, 18]
    assert (tok2.pad_token_id, tok2.bos_token_id, tok2.eos_token_id, tok2.unk_token_id) == (0, 1, 2, 3)
    # Exactly one entry in the cache: no temp folders left behind.
    assert [p.name for p in cache.iterdir()] == [info["key"]]


def test_explicit_default_dims_hit_the_same_cache_entry(warm):
    cache, task, _, _, info, _ = warm
    _, _, info3 = load_or_warm_start(cache, task=task, model_dims={"hidden_size": 128}, **WARM)
    assert info3["cached"] is True and info3["key"] == info["key"]


def test_warmup_lr_ramps_linearly_then_holds():
    assert [warmup_lr(1e-3, s, 4) for s in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert warmup_lr(1e-3, 0, 100) == pytest.approx(1e-5)
    assert warmup_lr(1e-3, 49, 100) == pytest.approx(5e-4)
    assert warmup_lr(3e-3, 0, 0) == 3e-3  # no warmup: the full rate from the first step


def test_evaluations_come_every_near_every_steps_once_half_the_target_is_reached():
    # every 25 steps, every 5 from an accuracy of 0.325 (half of 0.65) on
    assert [s for s in range(1, 60) if eval_due(s, 0.3, 0.65, 25, 5)] == [25, 50]
    assert [s for s in range(1, 30) if eval_due(s, 0.325, 0.65, 25, 5)] == [5, 10, 15, 20, 25]
    assert [s for s in range(1, 60) if eval_due(s, 0.6, 0.65, 25, None)] == [25, 50]  # off (the default)


def test_warmup_is_part_of_the_cache_key(warm, monkeypatch, tmp_path):
    _, task, _, _, info, _ = warm
    ran = []
    monkeypatch.setattr(warmstart, "sft", lambda *a, **k: ran.append(k["warmup_steps"]) or SFTResult(0.5, 1, 0.0))
    _, _, other = load_or_warm_start(tmp_path, task=task, **{**WARM, "warmup_steps": 10})
    assert ran == [10] and other["cached"] is False and other["key"] != info["key"]
    assert other["recipe"]["sft"]["warmup_steps"] == 10
    # the options are off by default and then stay out of the key; landing is on by default
    _, _, plain = load_or_warm_start(tmp_path / "plain", task=task)
    assert set(plain["recipe"]["sft"]) == {"target_acc", "seed", "lr", "batch_size", "eval_every", "eval_n",
                                           "max_steps", "land_every", "land_tol"}
    assert (plain["recipe"]["sft"]["lr"], plain["recipe"]["sft"]["land_every"]) == (1e-3, 1)
    _, _, coarse = load_or_warm_start(tmp_path / "coarse", task=task, land_every=None)
    assert set(coarse["recipe"]["sft"]) == {"target_acc", "seed", "lr", "batch_size", "eval_every", "eval_n",
                                            "max_steps"} and coarse["key"] != plain["key"]


def test_unknown_model_dims_rejected(tmp_path):
    with pytest.raises(ValueError, match="hidden"):
        load_or_warm_start(tmp_path, task=AdditionTask(digits=1), model_dims={"hiden_size": 64}, **WARM)


def test_prepare_model_passes_the_warmstart_options(monkeypatch, tmp_path):
    from asyncflow.config import ConfigError, load_config
    from asyncflow.tasks.models import prepare_model

    seen = {}

    def fake(cache_dir, **kw):
        seen.update(kw)
        return None, None, {"path": "p", "accuracy": 0.7, "steps": 1, "seconds": 0.0, "cached": True}

    monkeypatch.setattr(warmstart, "load_or_warm_start", fake)
    prepare_model(load_config(None, [f"warmstart.cache_dir={tmp_path}"]), tmp_path)
    assert (seen["warmup_steps"], seen["near_every"], seen["land_every"]) == (0, None, 1)  # the shipped recipe
    assert seen["lr"] == warmstart.LR == 1e-3
    prepare_model(load_config(None, [f"warmstart.cache_dir={tmp_path}", "warmstart.warmup_steps=200",
                                     "warmstart.near_every=5", "warmstart.land_every=null",
                                     "warmstart.lr=3e-3"]), tmp_path)
    assert (seen["warmup_steps"], seen["near_every"], seen["land_every"], seen["lr"]) == (200, 5, None, 3e-3)
    with pytest.raises(ConfigError, match="warmstart.near_every"):
        load_config(None, ["warmstart.near_every=0"])
