"""The initial policy: a user's model folder (checked before any worker starts), or the
built-in tiny model, warm-started by SFT on the task's reference answers (cached by data,
model and recipe). A model folder is warm-started the same way with
``warmstart.model_folder=true``. A task without reference answers (a dataset whose
answers are all empty) skips the warm-start with one line on stderr.

A folder's tokenizer is loaded from its own ``tokenizer.json`` exactly as saved
(:func:`asyncflow.tasks.layout.load_tokenizer`): ``AutoTokenizer`` picks the class registered for the model type
(Qwen2's for a qwen2 folder) and that class rebuilds the pre-tokenizer and decoder, which
silently changed the built-in byte-fallback tokenizer of every checkpoint ('ABC' decoded
as '<0x41><0x42><0x43>'; before byte fallback, unknown characters were dropped).

This module imports torch and transformers: only the driver and the workers import it
(the CLI imports the driver lazily, so ``--help`` stays instant).
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
from transformers.utils import logging as hf_logging

from asyncflow.config import ConfigError, RunConfig
from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model
from asyncflow.tasks import warmstart  # called through the module: tests replace load_or_warm_start
from asyncflow.tasks.base import Task
from asyncflow.tasks.environments import heldout_episodes, tool_schemas, trace_tensors
from asyncflow.tasks.layout import load_tokenizer  # re-exported: the driver loads the tokenizer from here
from asyncflow.tasks.plugins import load_callable
from asyncflow.tasks.registry import build_task, heldout_metric
from asyncflow.tasks.rewards import RewardFunction, load_reward_fn


def load_model(path: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model, tokenizer) from a local Hugging Face folder; never downloads."""
    hf_logging.disable_progress_bar()  # "Loading weights" bars in every worker drown the run's own
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    return model, load_tokenizer(path)


def check_model_folder(path: str) -> str:
    """The resolved folder if it holds a causal LM and a tokenizer; else a one-line ConfigError.

    Checked in the driver before any worker starts, so a wrong ``model.path`` fails in a
    second with what was expected, not deep inside a remote process.
    """
    p = Path(path).expanduser()
    what = f"model.path = '{path}'"
    if not p.is_dir():
        raise ConfigError(f"{what}: no such folder (expected a Hugging Face model folder saved with save_pretrained)")
    if not (p / "config.json").is_file():
        raise ConfigError(f"{what}: no config.json there (expected a Hugging "
                          f"Face model folder saved with save_pretrained)")
    try:
        config = AutoConfig.from_pretrained(p, local_files_only=True)
    except Exception as e:
        raise ConfigError(f"{what}: config.json cannot be read ({str(e).splitlines()[0]})") from None
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ConfigError(f"{what}: model_type '{config.model_type}' is not a causal LM "
                          "(AutoModelForCausalLM cannot load it; give a decoder-only model such as Qwen2 or Llama)")
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
    if not any((p / f).is_file() for f in files):  # AutoTokenizer may build an empty one instead of failing
        raise ConfigError(f"{what}: no tokenizer there (expected tokenizer.json or tokenizer_config.json; "
                          "save one with tokenizer.save_pretrained(path))")
    try:
        load_tokenizer(p)
    except Exception as e:
        raise ConfigError(f"{what}: the tokenizer cannot be loaded ({str(e).splitlines()[0]})") from None
    return str(p)


def _warmstart_device(cfg: RunConfig) -> str:
    """SFT runs on ``resources.device`` when this process sees that GPU (a Ray driver may not)."""
    dev = cfg.resources.device
    return dev if dev != "cpu" and torch.cuda.is_available() else "cpu"


def prepare_model(cfg: RunConfig, run_dir: Path, progress: Callable | None = None,
                  note: Callable[[str], None] | None = None) -> tuple[str, dict[str, Any]]:
    """Return the folder every worker loads the initial policy from, and how it was made.

    ``model.path`` set: that folder (warm-started first with ``warmstart.model_folder``).
    Otherwise the built-in tiny model, warm-started by SFT (cached, so the next run skips
    it) unless ``warmstart.enabled`` is off or the task has no reference answers.
    """
    folder = check_model_folder(cfg.model.path) if cfg.model.path else None
    warm = cfg.warmstart.enabled and (folder is None or cfg.warmstart.model_folder)
    task = build_task(cfg) if warm else None
    if task is not None and not warmstart.has_answers(task):
        print(f"asyncflow: warm-start skipped: task.path = '{cfg.task.path}' has no reference answers (every "
              "answer is empty); RL starts from the model as it is", file=sys.stderr, flush=True)
        task = None
    if task is not None:
        w = cfg.warmstart
        _, _, info = warmstart.load_or_warm_start(
            Path(w.cache_dir).expanduser(), task=task, model_dims=cfg.model.dims(), target_acc=w.target_acc,
            warmup_steps=w.warmup_steps, near_every=w.near_every, land_every=w.land_every, seed=cfg.seed,
            progress=progress, note=note, device=_warmstart_device(cfg), model_dir=folder, spec=eval_spec(cfg, task),
            lr=warmstart.LR if w.lr is None else w.lr, **_traces(cfg, task))
        keep = ("accuracy", "steps", "seconds", "cached", "replayed")
        return info["path"], {"source": "warmstart", **{k: info[k] for k in keep if k in info}}
    if folder is not None:
        return folder, {"source": "path"}
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, seed=cfg.seed, **cfg.model.dims())
    out = run_dir / "initial_model"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out), {"source": "random"}


def _traces(cfg: RunConfig, task: Task) -> dict[str, Any]:
    """``warmstart.traces``: the multi-turn SFT rows (made once the tokenizer is known) and their cache key."""
    spec = cfg.warmstart.traces
    if spec is None:
        return {}
    fn = load_callable(spec, "warmstart.traces")

    def rows(tok: PreTrainedTokenizerBase) -> tuple[torch.Tensor, torch.Tensor]:
        return trace_tensors(tok, task.train, fn, tool_schemas(cfg, tok))

    return {"traces": rows, "traces_key": ",".join(_callable_key(x) for x in [spec, *cfg.env.tools])}


def eval_spec(cfg: RunConfig, task: Task) -> warmstart.EvalSpec:
    """What the warm-start's held-out evaluation measures: what RL's reports (``heldout_metric``).

    The built-in tasks keep their default (exact match or their ``eval_score``); a task that
    generates ``greedy_eval_tokens`` (a dataset) is scored by its reward, ``reward.fn`` or
    ``eval.metric`` as RL's evaluation is, named in the cache key by that setting.
    """
    r = cfg.reward

    def reward() -> Callable:
        if not r.fn:
            return task.reward
        return RewardFunction(load_reward_fn(r.fn), r.timeout_s, r.on_error, r.key, batched=r.batched)

    chat = cfg.task.chat_template
    if cfg.env.enabled:  # (multi-turn: greedy episodes in the run's environments)
        name, run = heldout_episodes(cfg, task, reward)
        specs = [*cfg.env.tools, cfg.env.fn or "", cfg.env.agent or "", cfg.eval.metric or r.fn or cfg.task.name]
        return warmstart.EvalSpec(run=run, key=f"episodes:{name}:{','.join(_callable_key(x) for x in specs if x)}")
    if not task.greedy_eval_tokens and not cfg.eval.metric and not r.fn:
        return warmstart.EvalSpec(chat=chat)
    name, score = heldout_metric(cfg, task, reward)
    return warmstart.EvalSpec(score=score, max_new_tokens=task.greedy_eval_tokens, chat=chat,
                              key=f"{name}:{_callable_key(cfg.eval.metric or r.fn or cfg.task.name)}")


def _callable_key(spec: str) -> str:
    """``module:fn`` as it is; ``path/file.py:fn`` as a digest of the file's contents and ``fn``, so
    the cache key follows what the function does, not where its folder was copied."""
    path, _, fn = spec.rpartition(":")
    if path.endswith(".py") and Path(path).is_file():
        return f"{hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]}:{fn}"
    return spec
