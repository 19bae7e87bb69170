"""Landing the SFT warm-start close to its target: rewind and replay with finer checks.

Held-out accuracy of a small model under SFT often sits low for a while and then jumps by
tens of points within a few dozen steps (addition: under 65% at step 515, 76% at 520). An
evaluation every ``eval_every`` steps therefore stops well past the target (a 40% target
landed at 52%, a 65% one at 77.6% and 89.4%), which leaves RL little to do. Evaluating
every step would cost as much as training.

So :func:`asyncflow.tasks.warmstart.sft` keeps a :class:`Snapshot` (weights, optimizer
state, step) at each evaluation that is still below the target, and the batches drawn
since. When an evaluation overshoots the target by more than ``land_tol``, :func:`land`
restores the snapshot and replays the same batches, checking every ``land_every`` steps:
first on a subset of the held-out problems (cheap), then, where the subset is within
:data:`SCREEN_MARGIN` of the target, on all of them. It stops at the first full
evaluation that reaches the target.

Invariants
----------
* A replay costs at most the steps since the snapshot (``eval_every``) plus its checks,
  and never takes the model past the step where the overshoot was seen: the replay's last
  step is always evaluated in full, and reaching it ends the replay (the same model as
  before the rewind when training is deterministic, as it is on a CPU with a fixed thread
  count).
* The landed model has a full (not subset) evaluation >= the target: a subset only
  decides when to pay for a full one.
* The optimizer state is restored with the weights, so a replayed step is the step that
  was taken the first time.
* Memory: one snapshot at a time, on the model's device, about three times the model's
  size (weights and AdamW's two moments); ``warmstart.land_every=null`` saves it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel

SCREEN_N = 100  # held-out problems of a replay's cheap check
SCREEN_MARGIN = 0.05  # a cheap check this close to the target (or above) triggers a full one

ProgressFn = Callable[[int, "float | None", float], None]


@dataclass
class Snapshot:
    """The training state at an SFT step: weights, optimizer state and the step (0-based count)."""

    step: int
    weights: dict[str, torch.Tensor]
    optim: dict[str, Any]

    @classmethod
    def take(cls, model: PreTrainedModel, optimizer: torch.optim.Optimizer, step: int) -> Snapshot:
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return cls(step, weights, copy.deepcopy(optimizer.state_dict()))

    def restore(self, model: PreTrainedModel, optimizer: torch.optim.Optimizer) -> None:
        model.load_state_dict(self.weights)
        optimizer.load_state_dict(copy.deepcopy(self.optim))


@dataclass
class Trainer:
    """One SFT step at a time, with the learning-rate schedule; ``ran`` counts every step run
    (replays included), which is what ``progress`` is told."""

    model: PreTrainedModel
    optimizer: torch.optim.Optimizer
    step_fn: Callable[[np.ndarray], float]
    lr_at: Callable[[int], float]
    progress: ProgressFn | None = None
    note: Callable[[str], None] | None = None  # one line to the user (a rewind)
    ran: int = 0
    since: list[np.ndarray] = field(default_factory=list)

    def step(self, step: int, rows: np.ndarray) -> float:
        """Take SFT step ``step`` (0-based) on ``rows``; remember the rows for a replay."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(step)
        self.since.append(rows)
        self.ran += 1
        return self.step_fn(rows)

    def report(self, step: int, acc: float | None, loss: float) -> None:
        """Tell ``progress`` the model's step count (it goes back at a rewind), the held-out metric
        if measured at this step, and the loss."""
        if self.progress is not None:
            self.progress(step, acc, loss)


def land(trainer: Trainer, snap: Snapshot, measure: Callable[[int | None], float], target: float,
         every: int, screen_n: int | None = SCREEN_N) -> tuple[float, int]:
    """Replay the steps since ``snap`` with a check every ``every`` steps; returns the
    (full held-out metric, step) of the first full evaluation that reaches ``target``, or
    of the last replayed step. ``measure(n)`` evaluates on the first ``n`` held-out
    problems (None: all of them); ``screen_n`` None: every check is a full one. The rewind
    is announced through ``trainer.note`` (the progress line's step and loss go back)."""
    rows_since, trainer.since = trainer.since, []
    if trainer.note is not None:
        trainer.note(f"warm-start: the held-out metric passed the target {target:.3g} by more than the landing "
                     f"tolerance at step {snap.step + len(rows_since)}; rewinding to step {snap.step} and replaying "
                     f"its {len(rows_since)} steps with a check every {every} (warmstart.land_every) to stop closer "
                     "to the target")
    snap.restore(trainer.model, trainer.optimizer)
    trainer.model.train()
    acc, step = 0.0, snap.step
    for i, rows in enumerate(rows_since):
        loss = trainer.step(step, rows)
        step += 1
        acc_now = None
        last = i == len(rows_since) - 1
        if last or (i + 1) % every == 0:
            if last or screen_n is None or measure(screen_n) >= target - SCREEN_MARGIN:
                acc = acc_now = measure(None)
        trainer.report(step, acc_now, loss)
        if acc_now is not None and acc_now >= target:
            break
    return acc, step


def epoch_batches(n: int, batch_size: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Endless batches of row indices; each epoch is a fresh permutation (no repeats within)."""
    while True:
        order = rng.permutation(n)
        for start in range(0, n - batch_size + 1, batch_size):
            yield order[start : start + batch_size]
        if n < batch_size:  # tiny train sets: one short batch per epoch
            yield order
