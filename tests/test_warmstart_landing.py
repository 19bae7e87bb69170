"""The warm-start lands close to its target: an overshooting evaluation rewinds to the
previous one and the same batches are replayed with finer checks
(``asyncflow/tasks/warmstart_landing.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model
from asyncflow.tasks.addition import AdditionTask
from asyncflow.tasks.warmstart import evaluate, sft
from asyncflow.tasks.warmstart_landing import SCREEN_MARGIN, Snapshot, Trainer, land


def _counter():
    """A 'model' whose one weight counts the steps taken, and a metric = weight / 100."""
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def step_fn(rows):
        with torch.no_grad():
            model.weight.add_(1.0)
        return 0.0

    calls = []

    def measure(n):
        calls.append(n)
        return float(model.weight.detach()) / 100

    return model, opt, step_fn, measure, calls


def test_land_replays_from_the_snapshot_and_stops_at_the_first_full_check_at_the_target():
    model, opt, step_fn, measure, calls = _counter()
    trainer = Trainer(model, opt, step_fn, lambda s: 0.0)
    snap = Snapshot.take(model, opt, 40)  # weight 0 at step 40
    for s in range(40, 50):  # 10 steps: weight 10 (metric 0.10)
        trainer.step(s, np.array([s]))
    assert float(model.weight.detach()) == 10
    acc, step = land(trainer, snap, measure, target=0.075, every=2, screen_n=100)
    # checks after replayed steps 2, 4, 6, 8 (weights 2, 4, 6, 8): the cheap check passes from
    # 0.075 - SCREEN_MARGIN = 0.025 on (weight 4), then a full one; 0.08 at step 48 is the first full >= 0.075
    assert SCREEN_MARGIN == 0.05
    assert calls == [100, 100, None, 100, None, 100, None]
    assert (acc, step) == (0.08, 48) and float(model.weight.detach()) == 8
    assert trainer.ran == 18 and trainer.since == [np.array([s]) for s in range(40, 48)]


def test_land_ends_at_the_replays_last_step_when_no_check_reaches_the_target():
    model, opt, step_fn, measure, calls = _counter()
    trainer = Trainer(model, opt, step_fn, lambda s: 0.0)
    snap = Snapshot.take(model, opt, 0)
    for s in range(5):
        trainer.step(s, np.array([s]))
    acc, step = land(trainer, snap, measure, target=0.5, every=2, screen_n=None)
    assert calls == [None, None, None]  # steps 2, 4 and the last (5), all full: no screening
    assert (acc, step) == (0.05, 5)


@pytest.mark.slow
def test_sft_lands_on_the_first_step_at_the_target_after_the_last_evaluation_below_it():
    """Hand-computed reference: the same SFT evaluated after every step gives the metric at
    each step. Evaluated every 10 steps with landing (every step, no tolerance), it must
    stop at the first step at or above the target after the last coarse evaluation below it,
    with that step's metric (replay is deterministic on one CPU thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        task = AdditionTask(digits=1, holdout_frac=0.2, seed=0)
        tok = build_char_tokenizer()
        common = dict(batch_size=256, eval_n=20, seed=0, lr=3e-3)
        curve = []  # the metric after every step, never stopping (target above 100%)
        sft(build_tiny_model(tok, seed=0), tok, task, target_acc=1.01, eval_every=1, land_every=None, max_steps=80,
            progress=lambda s, a, loss: curve.append(a), **common)
        seen = []
        model = build_tiny_model(tok, seed=0)
        landed = sft(model, tok, task, target_acc=TARGET, eval_every=10, land_every=1, land_tol=0.0, max_steps=80,
                     progress=lambda s, a, loss: seen.append(s), **common)
    finally:
        torch.set_num_threads(threads)
    at = dict(enumerate(curve, start=1))
    coarse = next(s for s in range(10, 81, 10) if at[s] >= TARGET)  # where the coarse evaluation stops
    first = next(s for s in range(coarse - 9, coarse + 1) if at[s] >= TARGET)  # where landing must stop
    assert (landed.steps, landed.accuracy) == (first, at[first])
    # the coarse evaluation overshot (no tolerance): its 10 steps were rewound and replayed up to `first`
    assert landed.replayed == 10 and landed.overshot == at[coarse]
    # progress counts the model's steps: up to the overshoot, then back to the rewind and on to the landing
    assert seen == [*range(1, coarse + 1), *range(coarse - 9, landed.steps + 1)]
    assert evaluate(model, tok, task.heldout[:20]) == pytest.approx(landed.accuracy)


TARGET = 0.28  # not a multiple of 1/20: no evaluation of 20 problems lands exactly on it
