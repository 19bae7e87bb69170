"""The prompt feeder: each step's prompts, put into the data plane as one partition.

Every prompt has a stable id, ``q = s * prompts_per_step + i`` (prompt ``i`` of *source*
partition ``s``); which prompts source partition ``s`` holds depends only on ``(seed, s)``,
so a run is reproducible whatever the timing. They are drawn from the task's training problems,
or, in test-time RL (``task.test_time``), from the evaluation problems themselves
(:attr:`PromptFeeder.pool`). A fresh run puts source partition ``p`` as partition ``p``
(step ``p``'s prompts), each row carrying its ``prompt_id``.

A resumed run (:meth:`PromptFeeder.resume`) knows which prompt ids the checkpoint had
trained: it feeds the others, in id order, ``prompts_per_step`` to a partition, from the
checkpoint's step on. In ``sync`` the trained ids and the groups rollout holds (over-provisioning's
stalled and waiting ones) are exactly the ids below rollout's cursor, so the partitions are the
uninterrupted run's; in ``stream``/``async`` a step may
train prompts of later source partitions (completion order) and leave a straggler of an
earlier one: each is fed again exactly once, and none twice (the invariant the resume test
checks). Groups that continue across the restart (:mod:`asyncflow.workflow.rollout.inflight`) keep
their prompt slots: their ids are skipped, and the first partitions fed hold that many fewer
prompts (rollout starts taking prompts after those slots). In data-parallel ``sync``
(``train.dp = N``) prompt ``i`` of a partition is tagged ``shard = i % N``: rank ``r`` generates the shard-``r`` prompts
(:func:`~asyncflow.workflow.plan.sync_share`).

**Self-feeding** (dynamic sampling: rollout owns an ``unlimited`` feeder, dropped groups
consume prompts faster than a partition a step): the feeder also keeps which fed prompt ids
rollout has *settled* (:meth:`settle`: dropped, or placed in a step). A checkpoint of ``done``
steps saves its :meth:`position`: every id below ``next`` was fed, and of those only the
``pending`` ones are not settled for it (not dropped nor placed in a step ``< done``: running,
waiting, unread, or placed in a step the checkpoint did not train). A resumed run
(:meth:`resume_position`) feeds the pending ones that did not continue, in id order, then the
ids from ``next`` on: a dropped prompt is never fed again, a trained one never twice. The ids
settled below the first pending one are folded into one number (``below``), so what is kept
is about the groups in flight, not the run's length. In ``sync`` rollout reads the prompt ids
in order, so its position is a cursor (partition, prompts taken): the resumed feeder feeds
from it with :meth:`resume`, the cursor's partition short by the prompts taken.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

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

    With dynamic sampling rollout owns its feeder (``unlimited``: dropped groups consume
    prompts beyond the last step's partition) and the driver feeds nothing.
    """

    def __init__(self, cfg: RunConfig, tokenizer: PreTrainedTokenizerBase, task: Task, plane: DataPlaneClient,
                 unlimited: bool = False):
        self.cfg, self.tok, self.task, self.plane = cfg, tokenizer, task, plane
        self.fed = 0  # partitions put so far
        self.limit = None if unlimited else cfg.train.steps
        self.skip: set[int] = set()  # prompt ids trained before a resume: never fed again
        self._next = 0  # the next prompt id to consider
        self._short = 0  # prompt slots of the next partition taken by continued groups (resume)
        self._sources: dict[int, tuple[list, np.ndarray]] = {}  # source partition -> (problems, gen_len)
        self.settled: dict[int, int | None] = {}  # (self-feeding) prompt id -> step placed in, None: dropped
        self.below = 0  # (self-feeding) every id below is settled for every later checkpoint

    def resume(self, fed: int, trained: Iterable[int], held: int = 0) -> None:
        """Continue from partition ``fed`` with every prompt id but ``trained`` (module doc);
        ``held``: that many prompt slots from partition ``fed`` on are taken by groups that
        continue across the restart (their ids are in ``trained``): those partitions get fewer rows."""
        P = self.cfg.train.prompts_per_step
        self.fed, self.skip, self._next = fed + held // P, set(trained), 0
        self._short = held % P
        self._sources.clear()

    def settle(self, q: int, step: int | None) -> None:
        """Rollout placed prompt group ``q`` in ``step`` (None: dropped it; never trained)."""
        self.settled[q] = step

    def position(self, done: int) -> dict[str, Any]:
        """For a checkpoint of ``done`` steps (module doc): ``below``, ``next`` and ``pending``."""
        def settled(q: int) -> bool:  # dropped, or placed in a step the checkpoint trained
            s = self.settled.get(q, done)  # (not settled yet: as if placed in step done)
            return s is None or s < done

        while self.below < self._next and settled(self.below):
            self.settled.pop(self.below, None)
            self.below += 1
        return {"below": self.below, "next": self._next,
                "pending": [q for q in range(self.below, self._next) if not settled(q)]}

    def resume_position(self, fed: int, pos: dict[str, Any], held: list[int]) -> None:
        """A self-feeding feeder of a resumed run: partitions from ``fed`` on, with the ``pending``
        ids of a :meth:`position` not in ``held`` (groups that continue, placed again or running:
        they keep their prompt slots and settle when placed) fed first, then those from ``next``."""
        pending, keep = {int(q) for q in pos["pending"]}, set(held)
        self.resume(fed, {q for q in range(pos["below"], pos["next"]) if q not in pending} | keep, len(held))
        self._next = self.below = int(pos["below"])
        for q in range(self.below, int(pos["next"])):  # (the groups placed again already settled theirs)
            if q not in pending:
                self.settled.setdefault(q, -1)

    @property
    def pool(self) -> Sequence[Any]:
        """The problems prompts are drawn from: the task's training problems, or with
        ``task.test_time`` the evaluation problems themselves (the first ``task.eval_n`` held-out
        ones, as the evaluation scores them; rewarded without their labels: ``reward.mode=majority``)."""
        return self.task.heldout[: self.cfg.task.eval_n] if self.cfg.task.test_time else self.task.train

    def _source(self, s: int) -> tuple[list, np.ndarray]:
        """Source partition ``s``: its problems and answer lengths, from ``(seed, s)`` only."""
        if s not in self._sources:
            r = self.cfg.rollout
            rng = np.random.default_rng([self.cfg.seed, s])
            pool = self.pool
            idx = rng.choice(len(pool), self.cfg.train.prompts_per_step, replace=False)
            probs = [pool[i] for i in idx]
            if r.gen_len == "longtail":
                long = rng.random(len(probs)) < r.longtail_frac
                gen_len = np.where(long, r.longtail_long, r.longtail_short)
            else:
                gen_len = np.zeros(len(probs))
            self._sources = {k: v for k, v in self._sources.items() if k >= s - 1}  # (ids only grow)
            self._sources[s] = (probs, gen_len.astype(np.int64))
        return self._sources[s]

    def _take(self, n: int) -> list[int]:
        """The next ``n`` prompt ids not trained yet."""
        out: list[int] = []
        while len(out) < n:
            if self._next not in self.skip:
                out.append(self._next)
            self._next += 1
        return out

    def fill(self, upto: int) -> None:
        """Make sure partitions ``0 .. upto - 1`` (capped at the last step) have their prompts."""
        P, shards = self.cfg.train.prompts_per_step, sync_ranks(self.cfg)
        while self.fed < (upto if self.limit is None else min(upto, self.limit)):
            ids, self._short = self._take(P - self._short), 0
            rows = [(self._source(q // P), q % P) for q in ids]
            probs = [src[0][i] for src, i in rows]
            tokens = prompt_ids(self.tok, [p.prompt for p in probs], self.cfg.task.chat_template)
            data = {"query_ids": [np.asarray(x, dtype=np.int64) for x in tokens],
                    "answer": [encode_text(p.answer) for p in probs],
                    "gen_len": np.asarray([src[1][i] for src, i in rows], dtype=np.int64),
                    "prompt_id": np.asarray(ids, dtype=np.int64)}
            if self.cfg.env.enabled:  # (an environment starts from the prompt's text: asyncflow.agents)
                data["prompt"] = [encode_text(p.prompt) for p in probs]
            self.plane.put(data, partition=self.fed,
                           tags={"shard": [i % shards for i in range(len(probs))]} if shards > 1 else None)
            self.fed += 1
