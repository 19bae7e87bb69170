"""Rollout's finished answers -> training steps: scoring, keep-or-drop, placement, sending.

:class:`Collector` is the second half of rollout's loop (the first, the decode loop and the
prompt intake, is :class:`~asyncflow.workflow.rollout.role.RolloutRole`). It takes every
finished answer (:meth:`Collector.collect`) and moves its group through the stages of
:class:`~asyncflow.workflow.rollout.state.RolloutState`:

* **scoring** (``scorer`` given: rewards in rollout): each answer goes to the
  :class:`~asyncflow.workflow.roles.reward.GroupScorer` as soon as it finishes (a submission id
  per group, so results for a group forgotten meanwhile are ignored); the group waits in
  ``scoring`` until all its rewards are in. Answers that arrive with their rewards already
  known (a multi-turn episode scored by its environment: :meth:`collect` with ``rewards``)
  skip the scorer;
* **dynamic sampling** (``drop_flat``): a group whose shaped rewards are all equal is dropped
  (:meth:`GroupPlacer.drop <asyncflow.workflow.placement.GroupPlacer.drop>` gives its
  admission back) and never sent;
* **placement**: the placer puts it in the lowest step that is not full within its deadline;
  an over-provisioned straggler past its deadline is queued to start again (``stale``);
* **sending**: a step's rows are batched in the outbox and sent with ``put_nowait`` when a
  step is complete, the oldest has waited ``flush_s``, or on ``force`` (a few data-plane calls
  a step without holding a group back long); ``sync`` with every field in rollout hands them
  to the actor in memory (``local``).

It never decodes and never fetches prompts; the engine batch is used only to drop an
expired straggler's live rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from asyncflow.agents.episode import Trajectory
from asyncflow.dataplane.api import DataPlaneClient
from asyncflow.engines.types import Completion, EngineBatch
from asyncflow.workflow.feeder import PromptFeeder
from asyncflow.workflow.roles.reward import GroupScorer
from asyncflow.workflow.rollout.state import RolloutState

Shape = Callable[[np.ndarray, list[int]], "Sequence[float] | np.ndarray"]


class Collector:
    """Finished answers -> scored, placed groups -> the data plane (module doc)."""

    def __init__(self, state: RolloutState, plane: DataPlaneClient, batch: EngineBatch, group_size: int,
                 batch_rows: int, scorer: GroupScorer | None = None, shape: Shape | None = None,
                 feed: PromptFeeder | None = None, drop_flat: bool = False, shard: int | None = None,
                 keep_placed: bool = False):
        self.state, self.plane, self.batch = state, plane, batch
        self.group_size, self.batch_rows = group_size, batch_rows
        self.scorer, self.shape, self.feed, self.drop_flat, self.shard = scorer, shape, feed, drop_flat, shard
        self.keep_placed = keep_placed  # stream/async: placed groups kept until trained, for a checkpoint
        self.flush_s = 0.02
        self.sent = 0  # sample rows sent (the role's items)
        self.local: dict[int, list[dict]] | None = None  # sync, the actor's every field from here (link_local)

    def collect(self, done: Sequence[Completion], force: bool = False, wait_s: float = 0.0) -> None:
        """Collect finished answers; score and place each completed group in a step; send when
        a step is complete, the oldest placed group has waited ``flush_s``, or ``force``.
        A :class:`~asyncflow.agents.episode.Trajectory` (a multi-turn episode) comes scored by its
        environment: it skips the scorer."""
        s, now = self.state, time.perf_counter()
        for c in done:
            gid = c.key[0]
            group = s.finished[gid]
            scored = isinstance(c, Trajectory)
            if self.scorer is not None and not scored:  # each answer is scored as soon as it finishes
                if not group:  # a submission id: results for a group forgotten meanwhile are ignored
                    s.sid += 1
                    self.scorer.open((gid, s.sid), self.group_size)
                    s.opened[gid] = s.sid
                self.scorer.add((gid, s.opened[gid]), len(group), (c.prompt_ids, c.response_ids, c.key[1]))
            group.append(c)
            if len(group) == self.group_size:  # the whole group is done: place it once scored
                del s.finished[gid]
                if scored:
                    self.place(gid, group, [a.reward for a in group if isinstance(a, Trajectory)])
                elif self.scorer is None:
                    self.place(gid, group, None)
                else:
                    s.scoring[gid] = (s.opened.pop(gid), group)
        if s.scoring:
            assert self.scorer is not None  # groups are scored only with a scorer
            for (gid, sid), raw in self.scorer.ready(wait_s):
                if s.scoring.get(gid, (None,))[0] == sid:
                    self.place(gid, s.scoring.pop(gid)[1], raw)
        if s.placer.extra:
            self.expire()
        if not any(s.outbox.values()):
            return
        complete = any(s.produced[p] + len(cs) >= self.batch_rows for p, cs in s.outbox.items())
        assert s.outbox_since is not None  # set with the outbox's first answer
        if force or complete or now - s.outbox_since >= self.flush_s:
            self.flush()

    def place(self, gid: int, group: list[Completion], raw: list[float] | None) -> None:
        """Put a finished (and scored) group in its step's outbox; or drop it (dynamic
        sampling); or, an over-provisioned straggler past its deadline, queue it to start again."""
        s = self.state
        if raw is not None:
            s.groups_scored += 1
        if self.drop_flat and self._flat(group, raw):
            s.placer.drop(gid)  # no signal: never trained, admission given back
            s.groups.pop(gid, None)
            s.groups_dropped += 1
            if self.feed is not None:  # (its prompt is used: a resume does not feed it again)
                self.feed.settle(gid, None)
            return
        part = s.placer.complete(gid)
        if part is None:  # an over-provisioned straggler past its deadline: start again
            s.discarded += len(group)
            s.stale.append(gid)
            return
        s.groups.pop(gid, None)
        if self.feed is not None:
            self.feed.settle(gid, part)
        self.put_back(gid, part, group, raw)

    def put_back(self, gid: int, part: int, group: list[Completion], raw: list[float] | None) -> None:
        """A placed group into step ``part``'s outbox (and, stream/async, kept until trained)."""
        s = self.state
        s.outbox[part].extend(group)
        if self.keep_placed:
            s.placed[gid] = (part, group, raw)
        if raw is not None:
            s.rewards[part].extend(raw)
        s.outbox_since = s.outbox_since or time.perf_counter()

    def _flat(self, group: list[Completion], raw: list[float] | None) -> bool:
        """Dynamic sampling: are the group's shaped rewards all equal (no advantage signal)?"""
        assert raw is not None  # dynamic sampling scores every group in rollout
        shaped = self.shape(np.asarray(raw, dtype=np.float32), [len(c.response_ids) for c in group]) \
            if self.shape is not None else raw
        return bool(max(shaped) - min(shaped) <= 1e-9)

    def forget(self, gid: int) -> list[Completion]:
        """Drop a group's finished answers (and their rewards in flight); return the answers."""
        s = self.state
        if gid in s.opened:
            assert self.scorer is not None  # groups are opened and scored only with a scorer
            self.scorer.cancel((gid, s.opened.pop(gid)))
        if gid in s.scoring:
            assert self.scorer is not None
            sid, group = s.scoring.pop(gid)
            self.scorer.cancel((gid, sid))
            return group
        return s.finished.pop(gid, [])

    def expire(self) -> None:
        """Stragglers whose every step up to their deadline is full leave the batch now (no
        more tokens spent on them; a finished one awaiting its rewards is forgotten) and queue
        to start again from the prompt."""
        s = self.state
        gids = s.placer.expire()
        if gids:
            out = set(gids)
            live = self.batch.drop(lambda req: req.key[0] in out)
            s.discarded += len(live) + sum(len(self.forget(g)) for g in gids)
            s.stale.extend(gids)

    def flush(self) -> None:
        """Send every step's outbox (one put per step)."""
        s = self.state
        for part, cs in s.outbox.items():
            data = {
                "prompt_ids": [np.asarray(c.prompt_ids, dtype=np.int64) for c in cs],
                "response_ids": [np.asarray(c.response_ids, dtype=np.int64) for c in cs],
                "logprobs": [np.asarray(c.logprobs, dtype=np.float32) for c in cs],
                "token_versions": [np.asarray(c.token_versions, dtype=np.int64) for c in cs],
                "answer": [c.key[1] for c in cs],
                "group": np.asarray([c.key[0] for c in cs], dtype=np.int64),
                "version": np.asarray([c.version for c in cs], dtype=np.int64),
            }
            if cs and isinstance(cs[0], Trajectory):  # (multi-turn: observation tokens stay out of the loss)
                data["loss_mask"] = [np.asarray(c.loss_mask if isinstance(c, Trajectory) else [], dtype=np.uint8)
                                     for c in cs]
            if part in s.rewards:  # raw rewards; the trainer applies the shaping itself
                data["reward"] = np.asarray(s.rewards.pop(part), dtype=np.float32)
            tags = {"group": [c.key[0] for c in cs], "version": [c.version for c in cs],
                    "tokens": [len(c.prompt_ids) + len(c.response_ids) for c in cs]}
            if self.shard is not None:
                tags["shard"] = [self.shard] * len(cs)
            if self.local is not None:  # (sync: handed to this worker's actor in memory)
                self.local.setdefault(part, []).append(data)
            else:
                self.plane.put_nowait(data, partition=part, tags=tags)
            s.produced[part] += len(cs)
            self.sent += len(cs)
        s.outbox.clear()
        s.outbox_since = None
