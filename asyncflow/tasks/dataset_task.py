"""``task.name=dataset``: prompts and answers from a local file (JSONL, Parquet, save_to_disk).

Its warm-start cache key (:meth:`DatasetTask.cache_key`) hashes the rows themselves (the
train and held-out prompts and answers, in order), so editing the data starts a new entry
and moving the file does not.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from asyncflow.config import ConfigError, RunConfig
from asyncflow.tasks.datasets import DatasetError, load_dataset

SKIP_HINT = "set task.on_bad_row=skip"  # the config key that skips bad rows, named in a bad row's error


class DatasetTask:
    """Rows of a local file (``task.path``, mapped by ``task.fields``), split into train and
    held-out (``task.heldout_path``, or a seeded random ``holdout_frac`` of ``path``).

    The reward is exact match of the stripped answer unless ``reward.fn`` names another;
    evaluation generates up to ``rollout.max_new_tokens`` and averages that reward.
    """

    def __init__(self, cfg: RunConfig) -> None:
        t = cfg.task
        assert t.path is not None  # RunConfig requires task.path for task.name=dataset
        try:
            train = load_dataset(t.path, t.fields, t.on_bad_row, t.split, skip_hint=SKIP_HINT,
                                 template=t.prompt_template)
            held = load_dataset(t.heldout_path, t.fields, t.on_bad_row, t.heldout_split, skip_hint=SKIP_HINT,
                                template=t.prompt_template) if t.heldout_path else None
        except DatasetError as e:
            raise ConfigError(str(e)) from None
        self.skipped = train.skipped + (held.skipped if held else 0)  # bad rows skipped (task.on_bad_row=skip)
        self.bad_rows = train.errors + (held.errors if held else [])  # the first few of them, one line each
        if held is None:
            order = np.random.default_rng(cfg.seed).permutation(len(train.samples))
            k = min(max(1, int(round(t.holdout_frac * len(order)))), len(order) - 1)  # both sides non-empty
            self.heldout = [train.samples[i] for i in order[:k]]
            self.train = [train.samples[i] for i in order[k:]]
        else:
            self.train, self.heldout = train.samples, held.samples
        if not self.train:
            raise ConfigError(f"task.path = '{t.path}': no training rows left")
        self.greedy_eval_tokens = cfg.rollout.max_new_tokens

    def reward(self, prompt: str, response: str, answer: str) -> float:
        return 1.0 if response.strip() == answer.strip() else 0.0

    def cache_key(self) -> dict[str, str]:
        """The data part of the warm-start cache key: a digest of the train and held-out rows."""
        rows = [[[p.prompt, p.answer] for p in self.train], [[p.prompt, p.answer] for p in self.heldout]]
        return {"dataset": hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]}
