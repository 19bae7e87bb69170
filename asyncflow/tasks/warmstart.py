"""SFT warm-start: the built-in tiny model or a model folder, on any task with reference
answers, stopped at a target held-out metric and cached on disk.

RL from a random init never sees a reward, and RL from a perfect model has nothing to
learn, so the pipeline starts from a model that is *partly* trained: SFT on the task's
training split stops as soon as the greedy held-out metric reaches ``target_acc`` (~0.65
by default), leaving room for RL to improve. The metric often jumps by tens of points
within a few dozen steps, so an evaluation that overshoots the target rewinds to the one
before and replays with a check every step (:mod:`asyncflow.tasks.warmstart_landing`):
the model lands a few points above the target instead of wherever the jump left it. The metric is the one RL's held-out
evaluation reports (:class:`EvalSpec`: exact match, the task's own score, the reward or
``eval.metric``). The result is cached under a key that hashes every input that changes
it (data, model, recipe: :mod:`asyncflow.tasks.warmstart_cache`), so repeated runs pay
for SFT once. The token layout is the one RL uses (:mod:`asyncflow.tasks.layout`).

Invariants
----------
* ``sft`` is deterministic given ``seed`` (and a fixed torch thread count): batches
  come from a seeded numpy Generator and the tiny model has no dropout.
* SFT loss covers answer tokens and ``eos`` only; prompt and padding are ``-100``.
* ``sft`` does not touch global state: it never calls ``torch.set_num_threads``, and
  callers choose the thread count.
* A cache entry is complete if its folder exists: it is written to a temp folder and
  moved into place with ``os.replace``. Both paths of ``load_or_warm_start`` return
  the model in eval mode.
* Options added later (warmup, near_every, landing) enter the cache key only when set, so
  turning one off gives back the key it had before it existed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from asyncflow.engines.tiny import CHARSET, build_char_tokenizer, build_tiny_model
from asyncflow.tasks.base import Task

# re-exported: the workers and benchmarks import these from here
from asyncflow.tasks.layout import (
    bos_ids,
    decode_responses,
    encode_prompts,
    evaluate,
    greedy_responses,
    load_tokenizer,
    prompt_ids,
    sft_tensors,
)
from asyncflow.tasks.warmstart_cache import cache_key, folder_digest, load_entry, resolved_dims, save_entry
from asyncflow.tasks.warmstart_landing import SCREEN_N, Snapshot, Trainer, epoch_batches, land

__all__ = ["bos_ids", "decode_responses", "encode_prompts", "evaluate", "greedy_responses", "prompt_ids",
           "sft_tensors", "EvalSpec", "SFTResult", "sft", "has_answers", "load_or_warm_start", "eval_due", "warmup_lr"]

# Bump when the token layout, the SFT recipe or the saved files change: old cache
# entries then stop matching instead of being loaded with the wrong meaning.
CACHE_FORMAT_VERSION = 2  # 2: the tiny tokenizer got byte fallback (vocab 52 -> 308)

# The SFT recipe. lr 1e-3 (3e-3 until 2026-11-25): at 3e-3 the metric sat on a plateau for
# hundreds of steps at a seed- and machine-dependent length (addition 550-4,800 steps to
# 65%, the word-order example 1,600 to 40%); at 1e-3 far fewer (docs/benchmarks.md, "The
# warm-start's recipe"; measured with ``benchmarks/warmstart_seeds.py``). Warmup and
# ``near_every`` stay options, off by default. Landing (LAND_*) is on: an evaluation more
# than LAND_TOL past the target is rewound and replayed with a check every LAND_EVERY steps.
LR, WARMUP_STEPS, EVAL_EVERY, NEAR_EVERY = 1e-3, 0, 50, None
LAND_EVERY, LAND_TOL = 1, 0.03

ProgressFn = Callable[[int, "float | None", float], None]
"""``progress(step, acc, loss)``: called after every SFT step; ``acc`` is None between evals."""


@dataclass(frozen=True)
class SFTResult:
    """Outcome of :func:`sft`: last held-out accuracy, optimizer steps the model has taken
    (replayed steps not counted twice), wall seconds."""

    accuracy: float
    steps: int
    seconds: float
    replayed: int = 0  # steps run beyond the model's own: rewound to land close to the target
    overshot: float | None = None  # the evaluation that overshot the target and was rewound


@dataclass(frozen=True)
class EvalSpec:
    """What SFT's held-out evaluation measures: the same as RL's (``heldout_metric``).

    ``score(prompt, response, answer)``: None = the task's ``eval_score`` if it has one,
    else exact match. ``max_new_tokens``: None = the longest answer + 1. ``chat``: wrap
    prompts with the tokenizer's chat template. ``key``: names the metric in the cache key
    (None for the default).
    """

    score: Callable[[str, str, str], float] | None = None
    max_new_tokens: int | None = None
    chat: bool = False
    key: str | None = None
    run: Callable[[PreTrainedModel, PreTrainedTokenizerBase, Sequence[Any]], float] | None = None  # episodes

    def recipe(self) -> dict[str, Any]:
        """The fields that differ from the default (the cache key of a default spec is unchanged)."""
        return {k: v for k, v in (("metric", self.key), ("max_new_tokens", self.max_new_tokens),
                                  ("chat", self.chat)) if v}


# --------------------------------------------------------------------------- SFT


def sft(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    target_acc: float = 0.65,
    lr: float = LR,
    batch_size: int = 256,
    eval_every: int = EVAL_EVERY,
    eval_n: int = 500,
    max_steps: int = 5000,
    seed: int = 0,
    progress: ProgressFn | None = None,
    warmup_steps: int = WARMUP_STEPS,
    near_every: int | None = NEAR_EVERY,
    spec: EvalSpec = EvalSpec(),
    land_every: int | None = LAND_EVERY,
    land_tol: float = LAND_TOL,
    note: Callable[[str], None] | None = None,
    data: tuple[torch.Tensor, torch.Tensor] | None = None,  # (ids, labels) instead of task.train's
) -> SFTResult:
    """Teacher-forced SFT on ``task.train`` until the held-out greedy metric >= ``target_acc``.

    The metric is ``spec``'s: exact match, or ``task.eval_score`` where the task has one (countdown).

    Accuracy is measured on the first ``eval_n`` problems of ``task.heldout`` every
    ``eval_every`` steps (``near_every``: every that many once an evaluation reached half
    the target) and after the last step. Stops at the target, else after ``max_steps``.
    With ``land_every``, an evaluation more than ``land_tol`` past the target rewinds to the
    one before and replays, checking every ``land_every`` steps (``warmstart_landing``).
    ``warmup_steps`` > 0 ramps the learning rate linearly up to ``lr``. ``progress`` is told the
    model's step (back at a rewind, which ``note`` announces). The model is left in train mode.
    """
    started = time.perf_counter()
    eval_set = task.heldout[:eval_n]
    measure = _measure(model, tokenizer, task, eval_set, spec)
    batches = epoch_batches(len(task.train), batch_size, np.random.default_rng(seed))
    trainer = _trainer(model, tokenizer, task, spec.chat, lr, warmup_steps, progress, note, data)
    snap = Snapshot.take(model, trainer.optimizer, 0) if land_every else None
    acc, step, overshot = 0.0, 0, None
    while step < max_steps:
        loss = trainer.step(step, next(batches))
        step += 1
        step_acc = None
        if eval_due(step, acc, target_acc, eval_every, near_every) or step == max_steps:
            acc = step_acc = measure(None)
        trainer.report(step, step_acc, loss)
        if step_acc is None:
            continue
        if step_acc >= target_acc:
            if snap is not None and land_every and step_acc > target_acc + land_tol and step - snap.step > 1:
                overshot, screen = step_acc, SCREEN_N if SCREEN_N < len(eval_set) else None
                acc, step = land(trainer, snap, measure, target_acc, land_every, screen)
                snap = None  # at most one replay; one that is not bit-identical (a GPU) may fall short: train on
                if acc < target_acc:
                    continue
            break
        if snap is not None:
            snap, trainer.since = Snapshot.take(model, trainer.optimizer, step), []
    return SFTResult(accuracy=acc, steps=step, seconds=time.perf_counter() - started,
                     replayed=trainer.ran - step, overshot=overshot)


def _trainer(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, task: Task, chat: bool, lr: float,
             warmup_steps: int, progress: ProgressFn | None, note: Callable[[str], None] | None = None,
             data: tuple[torch.Tensor, torch.Tensor] | None = None) -> Trainer:
    """AdamW on teacher-forced ``task.train`` or ``data`` (the model is put in train mode)."""
    ids, labels = data if data is not None else sft_tensors(tokenizer, task.train, chat)
    ids, labels = ids.to(model.device), labels.to(model.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    return Trainer(model, optimizer, lambda rows: _sft_step(model, optimizer, ids, labels, rows),
                   lambda step: warmup_lr(lr, step, warmup_steps), progress, note)


def _measure(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, task: Task, eval_set: Sequence[Any],
             spec: EvalSpec) -> Callable[[int | None], float]:
    """``measure(n)``: the held-out metric on the first ``n`` problems of ``eval_set`` (None: all)."""
    if spec.run is not None:  # (multi-turn: greedy episodes, asyncflow.tasks.environments)
        run = spec.run
        return lambda n: run(model, tokenizer, eval_set[:n])
    score = spec.score or getattr(task, "eval_score", None)
    longest = spec.max_new_tokens  # a subset decodes as far as the whole set does
    if longest is None and eval_set:
        longest = max(len(p.answer) for p in eval_set) + 1

    def measure(n: int | None) -> float:
        return evaluate(model, tokenizer, eval_set[:n], max_new_tokens=longest, score=score, chat=spec.chat)

    return measure


def eval_due(step: int, last_acc: float, target_acc: float, every: int, near_every: int | None) -> bool:
    """Evaluate after SFT step ``step`` (1-based)? Every ``every`` steps; with
    ``near_every``, every ``near_every`` once the last evaluation reached half of ``target_acc``."""
    near = near_every is not None and last_acc >= target_acc / 2
    return step % (near_every if near and near_every is not None else every) == 0


def warmup_lr(lr: float, step: int, warmup_steps: int) -> float:
    """Learning rate of SFT step ``step`` (0-based): ``lr * (step + 1) / warmup_steps``
    during the warmup, then ``lr``."""
    return lr * min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else lr


def _sft_step(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    ids: torch.Tensor,
    labels: torch.Tensor,
    rows: np.ndarray,
) -> float:
    index = torch.as_tensor(rows, device=ids.device)
    # No attention mask: padding is only on the right and attention is causal, so no
    # labelled position can attend to a pad; this keeps SDPA on its fast causal path.
    out = model(input_ids=ids[index], labels=labels[index], use_cache=False)
    optimizer.zero_grad(set_to_none=True)
    out.loss.backward()
    optimizer.step()
    return float(out.loss.detach())


# --------------------------------------------------------------------------- cache


def has_answers(task: Task) -> bool:
    """Whether the task's training split has reference answers to SFT on (any non-empty one)."""
    return any(str(p.answer).strip() for p in task.train)


def load_or_warm_start(
    cache_dir: Path,
    *,
    task: Task,
    model_dims: dict[str, int] | None = None,
    target_acc: float = 0.65,
    seed: int = 0,
    lr: float = LR,
    batch_size: int = 256,
    eval_every: int = EVAL_EVERY,
    eval_n: int = 500,
    max_steps: int = 5000,
    warmup_steps: int = WARMUP_STEPS,
    near_every: int | None = NEAR_EVERY,
    land_every: int | None = LAND_EVERY,
    progress: ProgressFn | None = None,
    note: Callable[[str], None] | None = None,
    device: str = "cpu",
    model_dir: str | None = None,
    spec: EvalSpec = EvalSpec(),
    traces: Callable[[PreTrainedTokenizerBase], tuple[torch.Tensor, torch.Tensor]] | None = None,
    traces_key: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, dict[str, Any]]:
    """Return a warm-started (model, tokenizer, info), from ``cache_dir`` when possible.

    Starts from the model folder ``model_dir`` (its tokenizer and chat template too), or
    from the built-in tiny model of ``model_dims``. ``device`` is where SFT runs (the model
    comes back on the CPU). It is not part of the cache key: a model warm-started on a GPU
    serves CPU runs too, and the other way round.

    ``traces(tokenizer) -> (ids, labels)``: multi-turn SFT rows instead of the task's answers,
    named in the cache key by ``traces_key``. ``info`` holds ``accuracy``, ``steps``, ``seconds``
    (of the original SFT run), the cache ``key`` and ``path``, and ``cached`` (True when loaded).
    """
    sft_keys = {"target_acc": target_acc, "seed": seed, "lr": lr, "batch_size": batch_size,
                "eval_every": eval_every, "eval_n": eval_n, "max_steps": max_steps}
    # options added later enter the key only when on, so the entries cached before them stay valid
    sft_keys.update({k: v for k, v in (("warmup_steps", warmup_steps), ("near_every", near_every),
                                       ("land_every", land_every)) if v})
    sft_keys.update({"land_tol": LAND_TOL} if land_every else {})
    recipe = _recipe(task, model_dims, sft_keys, spec, model_dir)
    recipe.update({"traces": traces_key} if traces is not None else {})
    folder = Path(cache_dir) / cache_key(recipe)
    if (folder / "info.json").exists():
        return load_entry(folder)
    model, tokenizer = _initial(model_dir, seed, recipe["model_dims"])
    model = model.to(device)  # type: ignore[arg-type]  # (transformers' .to loses the self binding)
    result = sft(
        model, tokenizer, task, target_acc=target_acc, lr=lr, batch_size=batch_size,
        eval_every=eval_every, eval_n=eval_n, max_steps=max_steps, seed=seed, progress=progress,
        warmup_steps=warmup_steps, near_every=near_every, spec=spec, land_every=land_every, note=note,
        data=traces(tokenizer) if traces is not None else None,
    )
    info = {**asdict(result), "key": folder.name, "recipe": recipe}
    model.cpu()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the run's roles get the GPU memory back
    save_entry(folder, model, tokenizer, info)
    return model.eval(), tokenizer, {**info, "path": str(folder), "cached": False}


def _recipe(task: Task, model_dims: dict[str, int] | None, sft_keys: dict[str, Any], spec: EvalSpec,
            model_dir: str | None) -> dict[str, Any]:
    """Every input that changes the warm-started model: what the cache key hashes."""
    recipe: dict[str, Any] = {
        "format": CACHE_FORMAT_VERSION,
        "charset": CHARSET,
        "model_dims": resolved_dims(model_dims or {}),
        # addition's key is unchanged from before other tasks existed (its cache stays valid)
        # (every built-in task but addition has cache_key; a dataset task's hashes its rows)
        "task": task.cache_key() if hasattr(task, "cache_key") else
        {"digits": task.digits, "holdout_frac": task.holdout_frac, "seed": task.seed},  # type: ignore[attr-defined]
        "sft": sft_keys,
    }
    recipe.update({"eval": spec.recipe()} if spec.recipe() else {})
    if model_dir is not None:
        recipe.update(model_dims=None, model=folder_digest(Path(model_dir)))
    return recipe


def _initial(model_dir: str | None, seed: int,
             dims: dict[str, int]) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model SFT starts from: the folder's (in float32), or a fresh built-in tiny model."""
    if model_dir is not None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
        return model, load_tokenizer(model_dir)
    tokenizer = build_char_tokenizer()
    return build_tiny_model(tokenizer, seed=seed, **dims), tokenizer
