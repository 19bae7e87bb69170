"""The token layout shared by warm-start SFT, rollout and evaluation, and greedy evaluation.

Token layout (the same for SFT and RL, for the tiny model and any Hugging Face folder)
-------------------------------------------------------------------------------------
* prompt ids   = ``[bos] + tokens(prompt)`` (no ``bos`` when the tokenizer has none, e.g.
  Qwen's), or with ``task.chat_template`` the tokenizer's chat template around one user
  message, generation prompt added. Left-padded for generation.
* SFT sequence = prompt ids + ``tokens(answer)`` + ``[eos]`` (right-padded); the loss
  covers the answer tokens and ``eos`` only.
* response     = the generated ids up to (excluding) the first ``eos``, decoded with
  special tokens skipped. So an answer ends where the model emits ``eos``.

``tokens(text)`` never adds special tokens (``add_special_tokens=False``); the prompt
and the answer are tokenized apart, as RL sees them (the answer is generated after the
prompt's last token).

Invariants
----------
* ``evaluate`` runs under ``torch.no_grad`` and restores ``model.training``.
* :func:`load_tokenizer` is the single place a folder's tokenizer is loaded (workers,
  driver, warm-start cache): its ``tokenizer.json`` as saved, never a class's rebuild of it.
* :func:`prompt_ids` is the single place prompts become ids: rollout, evaluation and SFT
  all call it, so they see exactly the same prompt tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import cast

import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from asyncflow.tasks.base import ProblemLike


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer alone of a local Hugging Face folder (the driver needs no weights); never downloads.

    A folder with a ``tokenizer.json`` gets exactly that tokenizer (with the folder's special
    tokens, chat template and padding side), not the one ``AutoTokenizer`` would rebuild for
    the model type; a folder without one (e.g. sentencepiece only) goes through ``AutoTokenizer``.
    """
    if (Path(path) / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


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
        out.append(cast(str, tokenizer.decode(row[:cut], skip_special_tokens=True)))  # one row: one str
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
    # generate comes from GenerationMixin; transformers' types resolve it through nn.Module.__getattr__
    out = model.generate(  # type: ignore[operator]
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
    problems: Sequence[ProblemLike],
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
    correct: float = 0
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


def sft_tensors(
    tokenizer: PreTrainedTokenizerBase, problems: Sequence[ProblemLike], chat: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded :func:`prompt_ids` + answer + ``[eos]`` ids, and labels (answer + eos only)."""
    answer_chars = _chars_to_ids(tokenizer, [p.answer for p in problems])
    prompts = prompt_ids(tokenizer, [p.prompt for p in problems], chat)
    targets = [[*chars, tokenizer.eos_token_id] for chars in answer_chars]
    width = max(len(p) + len(t) for p, t in zip(prompts, targets))
    ids = torch.full((len(problems), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(problems), width), -100, dtype=torch.long)
    for i, (p, t) in enumerate(zip(prompts, targets)):
        ids[i, : len(p) + len(t)] = torch.tensor(p + t)
        labels[i, len(p) : len(p) + len(t)] = torch.tensor(t)
    return ids, labels


def _chars_to_ids(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[list[int]]:
    # add_special_tokens=False documents intent (bos/eos are placed by the callers);
    # the char tokenizer never adds any anyway. One batched call: fast for 10k rows.
    return tokenizer(list(texts), add_special_tokens=False).input_ids
