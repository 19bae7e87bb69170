"""The prompt feeder: each step's prompts, put into the data plane as one partition.

Partition ``p`` holds step ``p``'s prompts; which prompts depend only on ``(seed, p)``, so a
run is reproducible whatever the timing, and a resumed run feeds the same prompts. In
data-parallel ``sync`` (``train.dp = N``) prompt ``i`` of a step is tagged ``shard = i % N``:
rank ``r`` generates the shard-``r`` prompts (:func:`~asyncflow.workflow.plan.sync_share`).
"""

from __future__ import annotations

import numpy as np
from transformers import PreTrainedTokenizerBase

from asyncflow.config import RunConfig
from asyncflow.dataplane.api import DataPlaneClient
from asyncflow.tasks.base import Task
from asyncflow.tasks.warmstart import prompt_ids
from asyncflow.workflow.fields import encode_text
from asyncflow.workflow.plan import sync_ranks


class PromptFeeder:
    """Puts each step's prompt rows into the data plane (partition = step index).

    Partition ``p``'s prompts depend only on ``(seed, p)``. With dynamic sampling rollout
    owns its feeder (``unlimited``: dropped groups consume prompts beyond the last step's
    partition) and the driver feeds nothing.
    """

    def __init__(self, cfg: RunConfig, tokenizer: PreTrainedTokenizerBase, task: Task, plane: DataPlaneClient,
                 unlimited: bool = False):
        self.cfg, self.tok, self.task, self.plane = cfg, tokenizer, task, plane
        self.fed = 0  # partitions put so far
        self.limit = None if unlimited else cfg.train.steps

    def fill(self, upto: int) -> None:
        """Make sure partitions ``0 .. upto - 1`` (capped at the last step) have their prompts."""
        r, shards = self.cfg.rollout, sync_ranks(self.cfg)
        while self.fed < (upto if self.limit is None else min(upto, self.limit)):
            rng = np.random.default_rng([self.cfg.seed, self.fed])
            idx = rng.choice(len(self.task.train), self.cfg.train.prompts_per_step, replace=False)
            probs = [self.task.train[i] for i in idx]
            ids = prompt_ids(self.tok, [p.prompt for p in probs], self.cfg.task.chat_template)
            if r.gen_len == "longtail":
                long = rng.random(len(probs)) < r.longtail_frac
                gen_len = np.where(long, r.longtail_long, r.longtail_short)
            else:
                gen_len = np.zeros(len(probs))
            self.plane.put({"query_ids": [np.asarray(x, dtype=np.int64) for x in ids],
                         "answer": [encode_text(p.answer) for p in probs],
                         "gen_len": gen_len.astype(np.int64)}, partition=self.fed,
                           tags={"shard": [i % shards for i in range(len(probs))]} if shards > 1 else None)
            self.fed += 1
