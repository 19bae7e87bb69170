"""SFT warm-start for the tiny model, greedy evaluation, and an on-disk cache of both.

Design
------
RL from a random init never sees a reward on addition, and RL from a perfect model has
nothing to learn, so the pipeline starts from a model that is *partly* trained: SFT
stops as soon as greedy held-out accuracy reaches ``target_acc`` (~0.65 by default),
leaving room for RL to improve. The result is cached under a key that hashes every
input that changes it, so repeated runs (tests, examples) pay for SFT once.

Token layout, shared with RL
----------------------------
* prompt ids   = ``[bos] + chars(prompt)``           (left-padded for generation)
* SFT sequence = ``[bos] + chars(prompt) + chars(answer) + [eos]`` (right-padded)
* response     = generated ids up to (excluding) the first ``eos``, decoded.

Invariants
----------
* ``evaluate`` runs under ``torch.no_grad`` and restores ``model.training``.
* ``sft`` is deterministic given ``seed`` (and a fixed torch thread count): batches
  come from a seeded numpy Generator and the tiny model has no dropout.
* SFT loss covers answer tokens and ``eos`` only; prompt and padding are ``-100``.
* ``sft`` does not touch global state: it never calls ``torch.set_num_threads``, and
  callers choose the thread count.
* A cache entry is complete if its folder exists: it is written to a temp folder and
  moved into place with ``os.replace``. Both paths of ``load_or_warm_start`` return
  the model in eval mode.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from asyncflow.engines.tiny import CHARSET, build_char_tokenizer, build_tiny_model, tiny_config
from asyncflow.tasks.addition import AdditionTask, Problem

# Bump when the token layout, the SFT recipe or the saved files change: old cache
# entries then stop matching instead of being loaded with the wrong meaning.
CACHE_FORMAT_VERSION = 1

# The SFT recipe. Its length depends on the seed (550-3,950 steps over seeds 0-4 here); a
# warmup and finer evaluations near the target make it steadier but land models RL improves
# less, so they stay options, off by default (README, "The default run"; measured with
# ``benchmarks/warmstart_seeds.py`` and ``asyncflow train seed=N``).
LR, WARMUP_STEPS, EVAL_EVERY, NEAR_EVERY = 3e-3, 0, 50, None

ProgressFn = Callable[[int, "float | None", float], None]
"""``progress(step, acc, loss)``: called after every SFT step; ``acc`` is None between evals."""


@dataclass(frozen=True)
class SFTResult:
    """Outcome of :func:`sft`: last held-out accuracy, optimizer steps taken, wall seconds."""

    accuracy: float
    steps: int
    seconds: float


# --------------------------------------------------------------------------- evaluation


def bos_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """``[bos]`` for tokenizers that have one, ``[]`` for those that do not (e.g. Qwen's)."""
    return [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str], chat: bool = False) -> list[list[int]]:
    """Token ids of each prompt: ``[bos] + tokens(prompt)``, or with ``chat`` the tokenizer's
    chat template around one user message (generation prompt added). Shared by rollout and
    evaluation, so both see exactly the same prompt tokens."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("task.chat_template is on but the tokenizer has no chat template")
        out = []
        for p in prompts:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                tokenize=True)
            out.append(list(ids["input_ids"] if isinstance(ids, Mapping) else ids))
        return out
    return [[*bos_ids(tokenizer), *chars] for chars in _chars_to_ids(tokenizer, prompts)]


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str], chat: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded :func:`prompt_ids` and their attention mask, shape (B, T)."""
    rows = prompt_ids(tokenizer, prompts, chat)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return ids, mask


def decode_responses(tokenizer: PreTrainedTokenizerBase, generated: torch.Tensor) -> list[str]:
    """Decode each row of new tokens up to (excluding) its first ``eos``."""
    eos = tokenizer.eos_token_id
    out = []
    for row in generated.tolist():
        cut = row.index(eos) if eos in row else len(row)
        out.append(tokenizer.decode(row[:cut], skip_special_tokens=True))
    return out


def greedy_responses(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    max_new_tokens: int,
    chat: bool = False,
) -> list[str]:
    """Greedy completions of ``prompts`` in one batch (caller handles no_grad/eval)."""
    ids, mask = encode_prompts(tokenizer, prompts, chat)
    out = model.generate(
        input_ids=ids.to(model.device),
        attention_mask=mask.to(model.device),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return decode_responses(tokenizer, out[:, ids.shape[1] :].cpu())


def evaluate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    problems: Sequence[Problem],
    batch_size: int = 512,
    max_new_tokens: int | None = None,
    score: Callable[[str, str, str], float] | None = None,
    chat: bool = False,
) -> float:
    """Mean greedy score of ``model`` on ``problems`` (0.0 for an empty list).

    ``score(prompt, response, answer)`` defaults to exact match of the stripped response
    (accuracy). ``max_new_tokens`` defaults to the longest answer plus one for ``eos``.
    ``chat`` wraps each prompt with the tokenizer's chat template.
    """
    if not problems:
        return 0.0
    if max_new_tokens is None:
        max_new_tokens = max(len(p.answer) for p in problems) + 1
    was_training = model.training
    model.eval()
    correct = 0
    try:
        with torch.no_grad():
            for start in range(0, len(problems), batch_size):
                batch = problems[start : start + batch_size]
                responses = greedy_responses(model, tokenizer, [p.prompt for p in batch], max_new_tokens, chat)
                if score is None:
                    correct += sum(r.strip() == p.answer for r, p in zip(responses, batch))
                else:
                    correct += sum(float(score(p.prompt, r, p.answer)) for r, p in zip(responses, batch))
    finally:
        model.train(was_training)
    return correct / len(problems)


# --------------------------------------------------------------------------- SFT


def sft_tensors(
    tokenizer: PreTrainedTokenizerBase, problems: Sequence[Problem]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``[bos]+prompt+answer+[eos]`` ids and labels (answer + eos only)."""
    prompt_chars = _chars_to_ids(tokenizer, [p.prompt for p in problems])
    answer_chars = _chars_to_ids(tokenizer, [p.answer for p in problems])
    prompts = [[*bos_ids(tokenizer), *chars] for chars in prompt_chars]
    targets = [[*chars, tokenizer.eos_token_id] for chars in answer_chars]
    width = max(len(p) + len(t) for p, t in zip(prompts, targets))
    ids = torch.full((len(problems), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(problems), width), -100, dtype=torch.long)
    for i, (p, t) in enumerate(zip(prompts, targets)):
        ids[i, : len(p) + len(t)] = torch.tensor(p + t)
        labels[i, len(p) : len(p) + len(t)] = torch.tensor(t)
    return ids, labels


def sft(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: AdditionTask,
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
) -> SFTResult:
    """Teacher-forced SFT on ``task.train`` until held-out greedy accuracy >= ``target_acc``.

    Accuracy is exact match, or ``task.eval_score`` where the task has one (countdown: any
    correct expression counts, not only the reference answer SFT imitates).

    Accuracy is measured on the first ``eval_n`` problems of ``task.heldout`` (already a
    random sample) every ``eval_every`` steps (with ``near_every``: every ``near_every``
    steps once an evaluation has reached half the target, where accuracy jumps fast), and
    after the last step. Stops early at the target; otherwise runs ``max_steps`` and
    returns whatever accuracy it reached. ``warmup_steps`` > 0 ramps the learning rate
    linearly from ``lr / warmup_steps`` to ``lr`` over that many steps. The model is left
    in train mode.
    """
    started = time.perf_counter()
    ids, labels = sft_tensors(tokenizer, task.train)
    ids, labels = ids.to(model.device), labels.to(model.device)
    eval_set = task.heldout[:eval_n]
    batches = _epoch_batches(len(task.train), batch_size, np.random.default_rng(seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    acc, step = 0.0, 0
    while step < max_steps:
        for group in optimizer.param_groups:
            group["lr"] = warmup_lr(lr, step, warmup_steps)
        loss = _sft_step(model, optimizer, ids, labels, next(batches))
        step += 1
        step_acc = None
        if eval_due(step, acc, target_acc, eval_every, near_every) or step == max_steps:
            acc = step_acc = evaluate(model, tokenizer, eval_set, score=getattr(task, "eval_score", None))
        if progress is not None:
            progress(step, step_acc, loss)
        if step_acc is not None and step_acc >= target_acc:
            break
    return SFTResult(accuracy=acc, steps=step, seconds=time.perf_counter() - started)


def eval_due(step: int, last_acc: float, target_acc: float, every: int, near_every: int | None) -> bool:
    """Evaluate after SFT step ``step`` (1-based)? Every ``every`` steps; with
    ``near_every``, every ``near_every`` once the last evaluation reached half of ``target_acc``."""
    near = near_every is not None and last_acc >= target_acc / 2
    return step % (near_every if near else every) == 0


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


def _epoch_batches(n: int, batch_size: int, rng: np.random.Generator):
    """Endless batches of row indices; each epoch is a fresh permutation (no repeats within)."""
    while True:
        order = rng.permutation(n)
        for start in range(0, n - batch_size + 1, batch_size):
            yield order[start : start + batch_size]
        if n < batch_size:  # tiny train sets: one short batch per epoch
            yield order


# --------------------------------------------------------------------------- cache


def load_or_warm_start(
    cache_dir: Path,
    *,
    task: AdditionTask,
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
    progress: ProgressFn | None = None,
    device: str = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, dict[str, Any]]:
    """Return a warm-started (model, tokenizer, info), from ``cache_dir`` when possible.

    ``device`` is where SFT runs (the model comes back on the CPU). It is not part of the
    cache key: a model warm-started on a GPU serves CPU runs too, and the other way round.

    ``info`` holds ``accuracy``, ``steps``, ``seconds`` (of the original SFT run), the
    cache ``key`` and ``path``, and ``cached`` (True when loaded from disk).
    """
    cache_dir = Path(cache_dir)
    recipe = {
        "format": CACHE_FORMAT_VERSION,
        "charset": CHARSET,
        "model_dims": _resolved_dims(model_dims or {}),
        # addition's key is unchanged from before other tasks existed (its cache stays valid)
        "task": task.cache_key() if hasattr(task, "cache_key") else
        {"digits": task.digits, "holdout_frac": task.holdout_frac, "seed": task.seed},
        "sft": {
            "target_acc": target_acc, "seed": seed, "lr": lr, "batch_size": batch_size,
            "eval_every": eval_every, "eval_n": eval_n, "max_steps": max_steps,
        },
    }
    # options added later enter the key only when on, so the entries cached before them stay valid
    recipe["sft"].update({k: v for k, v in (("warmup_steps", warmup_steps), ("near_every", near_every)) if v})
    key = _cache_key(recipe)
    folder = cache_dir / key
    if (folder / "info.json").exists():
        return _load_entry(folder)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=seed, **recipe["model_dims"]).to(device)
    result = sft(
        model, tokenizer, task, target_acc=target_acc, lr=lr, batch_size=batch_size,
        eval_every=eval_every, eval_n=eval_n, max_steps=max_steps, seed=seed, progress=progress,
        warmup_steps=warmup_steps, near_every=near_every,
    )
    info = {**asdict(result), "key": key, "recipe": recipe}
    model.cpu()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the run's roles get the GPU memory back
    _save_entry(folder, model, tokenizer, info)
    return model.eval(), tokenizer, {**info, "path": str(folder), "cached": False}


def _resolved_dims(model_dims: dict[str, int]) -> dict[str, int]:
    """``model_dims`` with tiny_config's defaults filled in, so ``{}`` and explicit
    defaults hash to the same key; unknown names fail here, not deep inside SFT."""
    defaults = {
        name: p.default
        for name, p in inspect.signature(tiny_config).parameters.items()
        if name != "tokenizer"
    }
    unknown = set(model_dims) - set(defaults)
    if unknown:
        raise ValueError(f"unknown model_dims {sorted(unknown)}; valid names: {sorted(defaults)}")
    return {**defaults, **model_dims}


def _cache_key(recipe: dict[str, Any]) -> str:
    blob = json.dumps(recipe, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _save_entry(
    folder: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, info: dict[str, Any]
) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "info.json").write_text(json.dumps(info, indent=2, sort_keys=True))
        os.replace(tmp, folder)
    except OSError:
        # A concurrent run may have published the same key first (os.replace cannot
        # overwrite a non-empty folder); its entry is equivalent, so keep it.
        if not (folder / "info.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_entry(folder: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, dict[str, Any]]:
    info = json.loads((folder / "info.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    return model.eval(), tokenizer, {**info, "path": str(folder), "cached": True}


def _chars_to_ids(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[list[int]]:
    # add_special_tokens=False documents intent (bos/eos are placed by the callers);
    # the char tokenizer never adds any anyway. One batched call: fast for 10k rows.
    return tokenizer(list(texts), add_special_tokens=False).input_ids
