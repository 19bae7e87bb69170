"""Rollout role: continuous-batching generation fed by prompt rows, with admission control.

Each ``poll`` is one micro-batch boundary of the engine (one decode step):

1. **swap weights** if the subscriber has staged a newer version (delayed parameter
   update). ``on_swap="continue"``: unfinished answers continue under the new weights
   (partial rollout), their KV cache rebuilt first when ``recompute_on_swap``; every token
   records the version that sampled it (``token_versions``). ``on_swap="discard"``: every
   group with an unfinished answer is restarted *whole* from its prompt under the new
   weights (its finished answers are dropped too), so all tokens of a group come from one
   version; the restart keeps the group's admission slot (it is not a new group) and
   moves its version tag and deadline to the new version (:meth:`GroupPlacer.restart`);
2. **refill** free slots with whole prompt groups. Prompts are fetched in order, a step's
   worth per round trip, as far as admission allows (:class:`GroupPlacer`: at version
   ``v`` at most ``(v + staleness + 1) * prompts_per_step`` groups ever started);
3. **decode** one token for every live answer. When a group's answers are all finished it
   is placed in a training step by completion order within the bound (a slow group moves
   to a later step instead of holding its step back), and goes to the data plane
   (streaming), batched per step, with ``put_nowait`` (no round trip on the hot path).

Every answer is tagged with the version that *started* it (for a restarted group: the
version it restarted at); the placer guarantees that a
group started at ``w`` lands in a step ``<= w + staleness``, which the trainer trains at
that version: the bound holds per sample, by construction, and nothing is thrown away.

**Rewards in rollout** (``scorer`` given: ``reward.placement=rollout``, the default): each
answer is handed to the :class:`~asyncflow.workflow.roles.reward.GroupScorer` as soon as it
finishes, and its group is placed once all its rewards are in (a local reward at once;
remote or async calls stay in flight while decoding goes on, and are collected at every
decode boundary; with nothing to decode, rollout sleeps until the first result comes back
or new weights are staged, whichever is first); the rewards travel in the group's put, so
no reward role runs. Until then the group still counts as running
in the placer, so admission and deadlines are unchanged.

**Dynamic sampling** (DAPO; ``drop_flat``): whether a scored group is kept decides whether
it takes a training slot. A group whose (shaped) rewards are all equal has no advantage
signal: it is dropped (:meth:`GroupPlacer.drop` returns its admission, so another prompt
starts in its place) and never reaches the data plane; a kept group is placed as above.
Steps therefore fill only with groups that carry signal, the staleness bound holds as
before (drops only free slots), and nothing is trained twice.
Prompts run out faster than one partition per step, so rollout feeds its own prompt partitions
(``feed``: a :class:`~asyncflow.workflow.feeder.PromptFeeder`, told each prompt dropped or placed) before reading each.

**Over-provisioning** (``overprovision = E > 0``, APRIL): admission lets ``E`` more groups
run, so a step fills with its fastest groups and the stragglers keep decoding into the next
step. A straggler that can no longer meet its deadline (:class:`GroupPlacer` *stalls* it)
is never trained as it is: its live rows leave the batch at once (``batch.drop``), its
answers are thrown away (counted in ``discarded``) and it starts again from its prompt,
ahead of new prompts, as soon as it can have a guaranteed slot (:meth:`GroupPlacer.retry`;
with ``k = 0`` at the next version), tagged with the version it restarts at. Sync
mode ends its rollout phase when the step is full, not when the extras finish: they stay in
the batch and go on in the next phase.

**Shards** (``shard = r``: rank ``r`` of a data-parallel ``sync`` run): rollout takes only the
prompts tagged ``shard = r`` (``prompts_per_step`` is then its share) and tags its rows so,
for the rank's reference role.

**In-memory hand-off** (``local``, set by the worker: ``sync`` where rollout writes every field
the actor of its own worker reads, i.e. rewards in rollout, no reference, no critic): a step's
rows go to ``local[partition]`` instead of the data plane, and that actor takes them from there
(:func:`~asyncflow.workflow.builders.link_local`): no put, no get, no copy between processes.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from asyncflow.dataplane import QueueTimeout, ShardSampler
from asyncflow.dataplane.api import DataPlaneClient
from asyncflow.engines.types import Completion, Request, SamplingParams
from asyncflow.weights.subscriber import WeightSubscriber
from asyncflow.workflow import inflight
from asyncflow.workflow.checkpoint import Snapshot
from asyncflow.workflow.placement import GroupPlacer
from asyncflow.workflow.roles.base import Role
from asyncflow.workflow.roles.reward import GroupScorer

PROMPT_FIELDS = ["query_ids", "answer", "gen_len"]


class RolloutRole(Role):
    name = "rollout"

    def __init__(self, engine: Any, plane: DataPlaneClient, sampling: SamplingParams, group_size: int,
                 prompts_per_step: int, staleness: int, weights: WeightSubscriber | None = None,
                 recompute_on_swap: bool = True, on_swap: str = "continue",
                 scorer: GroupScorer | None = None,
                 shape: Callable[[np.ndarray, list[int]], Sequence[float] | np.ndarray] | None = None,
                 feed: Any = None, drop_flat: bool = False, overprovision: int = 0,
                 shard: int | None = None, by_prompt_id: bool = False):
        # engine: any engine of the protocol in asyncflow.engines.types (built-in, vLLM, SGLang, fake)
        if on_swap not in ("continue", "discard"):
            raise ValueError(f"on_swap = {on_swap!r}: expected 'continue' or 'discard'")
        super().__init__()
        self.engine, self.plane, self.weights = engine, plane, weights
        self.group_size, self.prompts_per_step = group_size, prompts_per_step
        self.recompute_on_swap, self.on_swap = recompute_on_swap, on_swap
        self.groups: dict[int, list[Request]] = {}  # running group id -> its requests (for restarts)
        self.restarts: deque[int] = deque()  # discarded groups waiting to start again
        self.stale: deque[int] = deque()  # stalled stragglers (over-provisioning) waiting to start again
        self.discarded = 0  # answers (finished or not) thrown away at swaps (discard) and stalls
        self.batch = engine.new_batch(sampling)
        self.placer = GroupPlacer(prompts_per_step, staleness, overprovision)
        self.partition = 0  # the prompt partition prompts are taken from now
        self.taken = 0  # prompts taken from it so far
        self.finished: dict[int, list[Completion]] = defaultdict(list)  # answers of unfinished groups
        self.produced: dict[int, int] = defaultdict(int)  # sample rows put per partition
        self.slot_steps = 0  # sum over decode steps of live rows (for slot utilisation)
        self.steps = 0
        self.waiting: deque[list[Request]] = deque()  # fetched prompt groups not started yet
        self.outbox: dict[int, list[Completion]] = defaultdict(list)  # finished, not sent yet
        self._outbox_since: float | None = None
        self.batch_rows = prompts_per_step * group_size
        self.flush_s = 0.02
        # scorer: a GroupScorer (rewards computed here). Dynamic sampling (drop_flat): shape(rewards,
        # lengths) -> the rewards the trainer will see (e.g. overlong penalty) decides keep or drop
        self.scorer, self.shape, self.feed, self.drop_flat = scorer, shape, feed, drop_flat
        if scorer is not None and scorer.bell is not None and weights is not None:
            weights.bell = scorer.bell  # idle on rewards in flight, wake for new weights too
        self.scoring: dict[int, tuple] = {}  # group id -> (submission id, finished answers awaiting rewards)
        self.opened: dict[int, int] = {}  # group id -> submission id, while its answers are still finishing
        self._sid = 0
        self.rewards: dict[int, list[float]] = defaultdict(list)  # partition -> rewards of outbox rows
        self.groups_scored = self.groups_dropped = 0
        self.shard = shard  # data-parallel sync: only this shard's prompts (see the module docstring)
        # a group's id: its prompt's stable prompt_id (the feeder's; the same across a resume), else its row id
        self.prompt_fields = PROMPT_FIELDS + (["prompt_id"] if by_prompt_id else [])
        self.asked: deque[inflight.SnapshotRequest] = deque()  # checkpoints' requests, served in order by the loop
        self.placed: dict[int, tuple[int, list[Completion], list[float] | None]] = {}  # placed, maybe not trained
        self.local: dict[int, list[dict]] | None = None  # sync, the actor's every field from here: see the docstring

    # ------------------------------------------------------------------ policy version
    @property
    def version(self) -> int:
        return self.engine.version

    def set_version(self, version: int) -> None:
        """Colocated (sync) mode: the model is shared with the trainer; only the tag moves."""
        self.engine.version = version
        self.batch.version = version

    def resume(self, step: int, version: int, timeout: float, saved: Snapshot | None = None) -> list[int]:
        """A resumed ``stream``/``async`` run: swap in the restored policy ``version``, keep the ``saved``
        groups that may (:mod:`asyncflow.workflow.inflight`; the others restart from their prompts, fed
        again), take prompts after the slots of ``step`` steps and the kept groups; the kept group ids."""
        if self.weights is not None:
            deadline = time.monotonic() + timeout
            while self.weights.staged_version() < version:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rollout: the restored weights (version {version}) did not arrive "
                                       f"within {timeout:.0f} s")
                self.weights.wait_staged(0.5)
            self.weights.swap_if_ready()
            self.batch.version = self.version
        self.placer.started, self.placer.lowest = step * self.prompts_per_step, step
        continued = inflight.resume(self, step, *saved) if saved is not None else []
        self.partition, self.taken = divmod(step * self.prompts_per_step + len(continued), self.prompts_per_step)
        return continued

    def snapshot_in_flight(self, timeout: float, done: int) -> Snapshot:
        """The groups not trained once ``done`` steps are, taken by rollout's loop between polls (inflight)."""
        asked = inflight.SnapshotRequest(done)
        self.asked.append(asked)  # (never replacing another waiting: its checkpoint would time out, be lost)
        return asked.wait(timeout, self)

    @property
    def staleness(self) -> int:
        return self.placer.k

    @staleness.setter
    def staleness(self, k: int) -> None:
        self.placer.k = k

    def admissible(self) -> bool:
        """May more prompts be fetched now (beyond those already waiting)?"""
        return self.placer.admits(self.version, extra=len(self.waiting)) > 0

    # ------------------------------------------------------------------ the loop body
    def poll(self, timeout: float) -> int:
        while self.asked:  # checkpoints' snapshots, between two decode steps
            self.asked.popleft().serve(self)
        if self.weights is not None and self.weights.staged_version() > self.version:
            with self.work():
                self.weights.swap_if_ready()
                self.batch.version = self.version
                inflight.forget_trained(self)
                if self.on_swap == "discard":
                    self._discard()
                elif self.recompute_on_swap:
                    self.batch.recompute_cache()
        self._refill(timeout)
        if not len(self.batch):
            self._emit([], force=True, wait_s=min(timeout, 0.02) if self.scoring else 0.0)
            if not self.scoring and not self.admissible() and self.weights is not None:
                self.weights.wait_staged(timeout)  # idle at the staleness bound
            return 0
        with self.work():
            self.slot_steps += len(self.batch)
            self.steps += 1
            done = self.batch.step()
            self._emit(done)
        return len(done)

    def _discard(self) -> None:
        """Drop every live answer and the finished answers of their groups; queue the groups."""
        live = self.batch.drop_all()
        gids = sorted({r.key[0] for r in live} | set(self.finished))
        self.discarded += len(live) + sum(len(self._forget(g)) for g in gids)
        self.restarts.extend(gids)

    def _forget(self, gid: int) -> list[Completion]:
        """Drop a group's finished answers (and their rewards in flight); return the answers."""
        if gid in self.opened:
            assert self.scorer is not None  # groups are opened and scored only with a scorer
            self.scorer.cancel((gid, self.opened.pop(gid)))
        if gid in self.scoring:
            assert self.scorer is not None
            sid, group = self.scoring.pop(gid)
            self.scorer.cancel((gid, sid))
            return group
        return self.finished.pop(gid, [])

    def _refill(self, timeout: float) -> None:
        """Start waiting prompt groups in free slots (restarted groups first); fetch the next
        prompts when none wait."""
        free_groups = (self.engine.max_batch - len(self.batch)) // self.group_size
        if free_groups <= 0:
            return
        restart = [self.restarts.popleft() for _ in range(min(free_groups, len(self.restarts)))]
        for gid in restart:
            self.placer.restart(gid, self.version)
        while self.stale and len(restart) < free_groups and self.placer.retry(self.stale[0], self.version):
            restart.append(self.stale.popleft())  # (False until a guaranteed slot is free: a newer version)
        if restart:
            fresh = [Request(r.key, r.prompt_ids, r.max_new_tokens, r.min_new_tokens)
                     for gid in restart for r in self.groups[gid]]
            free_groups -= len(restart)
            with self.work():
                self._emit(self.batch.add(fresh))
            if free_groups <= 0:
                return
        if not self.waiting and self.admissible():
            self._fetch(block=len(self.batch) == 0 and not self.scoring, timeout=timeout)
        start = [self.waiting.popleft() for _ in range(min(free_groups, len(self.waiting)))]
        if start:
            for group in start:
                self.placer.start(group[0].key[0], self.version)
                self.groups[group[0].key[0]] = group
            with self.work():
                self._emit(self.batch.add([req for group in start for req in group]))

    def _fetch(self, block: bool, timeout: float) -> None:
        """Take the admitted prompts of the current prompt partition (one round trip).

        Admission counts fetched groups at fetch time; a group's version tag and deadline
        are set when it starts, which can only be later (newer weights): still admitted.
        """
        n = min(self.prompts_per_step - self.taken, self.placer.admits(self.version, extra=len(self.waiting)))
        if self.feed is not None:
            self.feed.fill(self.partition + 1)
        try:
            meta, data = self.plane.get_batch("rollout", self.prompt_fields, n=n, partition=self.partition, min_n=1,
                                              sampler=None if self.shard is None else ShardSampler(self.shard),
                                              block=block, timeout=timeout)
        except QueueTimeout:
            return
        for i, row in enumerate(meta.rows):
            row = int(data["prompt_id"][i]) if "prompt_id" in data else row
            query = data["query_ids"][i].tolist()
            L = int(data["gen_len"][i])
            self.waiting.append([Request(key=(row, data["answer"][i]), prompt_ids=query,
                                         max_new_tokens=L or None, min_new_tokens=L)
                                 for _ in range(self.group_size)])
        self.taken += len(meta.rows)
        if self.taken >= self.prompts_per_step:
            self.partition, self.taken = self.partition + 1, 0

    def _emit(self, done: list[Completion], force: bool = False, wait_s: float = 0.0) -> None:
        """Collect finished answers; score and place each completed group in a step; send when
        a step is complete, the oldest placed group has waited ``flush_s``, or ``force``
        (batching bounds the data-plane calls to a few per step without holding a group back long)."""
        now = time.perf_counter()
        for c in done:
            gid = c.key[0]
            group = self.finished[gid]
            if self.scorer is not None:  # each answer is scored as soon as it finishes
                if not group:  # a submission id: results for a group forgotten meanwhile are ignored
                    self._sid += 1
                    self.scorer.open((gid, self._sid), self.group_size)
                    self.opened[gid] = self._sid
                self.scorer.add((gid, self.opened[gid]), len(group), (c.prompt_ids, c.response_ids, c.key[1]))
            group.append(c)
            if len(group) == self.group_size:  # the whole group is done: place it once scored
                del self.finished[gid]
                if self.scorer is None:
                    self._place(gid, group, None)
                else:
                    self.scoring[gid] = (self.opened.pop(gid), group)
        if self.scoring:
            assert self.scorer is not None  # groups are scored only with a scorer
            for (gid, sid), raw in self.scorer.ready(wait_s):
                if self.scoring.get(gid, (None,))[0] == sid:
                    self._place(gid, self.scoring.pop(gid)[1], raw)
        if self.placer.extra:
            self._expire()
        waiting = sum(len(cs) for cs in self.outbox.values())
        if not waiting:
            return
        complete = any(self.produced[p] + len(cs) >= self.batch_rows for p, cs in self.outbox.items())
        assert self._outbox_since is not None  # set with the outbox's first answer
        if force or complete or now - self._outbox_since >= self.flush_s:
            self._flush()

    def _place(self, gid: int, group: list[Completion], raw: list[float] | None) -> None:
        """Put a finished (and scored) group in its step's outbox; or drop it (dynamic
        sampling); or, an over-provisioned straggler past its deadline, queue it to start again."""
        if raw is not None:
            self.groups_scored += 1
        if self.drop_flat:
            assert raw is not None  # dynamic sampling scores every group in rollout
            shaped = self.shape(np.asarray(raw, dtype=np.float32), [len(c.response_ids) for c in group]) \
                if self.shape is not None else raw
            if max(shaped) - min(shaped) <= 1e-9:
                self.placer.drop(gid)  # no signal: never trained, admission given back
                self.groups.pop(gid, None)
                self.groups_dropped += 1
                if self.feed is not None:  # (its prompt is used: a resume does not feed it again)
                    self.feed.settle(gid, None)
                return
        part = self.placer.complete(gid)
        if part is None:  # an over-provisioned straggler past its deadline: start again
            self.discarded += len(group)
            self.stale.append(gid)
            return
        self.groups.pop(gid, None)
        if self.feed is not None:
            self.feed.settle(gid, part)
        self.outbox[part].extend(group)
        if self.weights is not None:  # (stream/async) kept until trained, for a checkpoint (inflight)
            self.placed[gid] = (part, group, raw)
        if raw is not None:
            self.rewards[part].extend(raw)
        self._outbox_since = self._outbox_since or time.perf_counter()

    def _expire(self) -> None:
        """Stragglers whose every step up to their deadline is full leave the batch now (no
        more tokens spent on them; a finished one awaiting its rewards is forgotten) and queue
        to start again from the prompt."""
        gids = self.placer.expire()
        if gids:
            out = set(gids)
            live = self.batch.drop(lambda req: req.key[0] in out)
            self.discarded += len(live) + sum(len(self._forget(g)) for g in gids)
            self.stale.extend(gids)

    def _flush(self) -> None:
        for part, cs in self.outbox.items():
            data = {
                "prompt_ids": [np.asarray(c.prompt_ids, dtype=np.int64) for c in cs],
                "response_ids": [np.asarray(c.response_ids, dtype=np.int64) for c in cs],
                "logprobs": [np.asarray(c.logprobs, dtype=np.float32) for c in cs],
                "token_versions": [np.asarray(c.token_versions, dtype=np.int64) for c in cs],
                "answer": [c.key[1] for c in cs],
                "group": np.asarray([c.key[0] for c in cs], dtype=np.int64),
                "version": np.asarray([c.version for c in cs], dtype=np.int64),
            }
            if self.scorer is not None:  # raw rewards; the trainer applies the shaping itself
                data["reward"] = np.asarray(self.rewards.pop(part), dtype=np.float32)
            tags = {"group": [c.key[0] for c in cs], "version": [c.version for c in cs],
                    "tokens": [len(c.prompt_ids) + len(c.response_ids) for c in cs]}
            if self.shard is not None:
                tags["shard"] = [self.shard] * len(cs)
            if self.local is not None:  # (sync: handed to this worker's actor in memory)
                self.local.setdefault(part, []).append(data)
            else:
                self.plane.put_nowait(data, partition=part, tags=tags)
            self.produced[part] += len(cs)
            self.items += len(cs)
        self.outbox.clear()
        self._outbox_since = None

    def stats(self) -> dict:
        s = super().stats()
        s.update(version=self.version, slot_steps=self.slot_steps, decode_steps=self.steps,
                 max_batch=self.engine.max_batch,
                 swap_s=self.weights.swap_seconds if self.weights else 0.0,
                 swaps=self.weights.swaps if self.weights else 0,
                 weights_rejected=self.weights.rejected if self.weights else 0,
                 discarded=self.discarded, groups_carried=self.placer.carried,
                 groups_restarted=self.placer.stalls, **getattr(self.engine, "stats", dict)())  # (ETMR's tokens)
        if self.scorer is not None:
            s.update(groups_scored=self.groups_scored, reward_errors=self.scorer.errors, **self.scorer.stats())
        if self.drop_flat:
            s.update(groups_dropped=self.groups_dropped)
        return s
