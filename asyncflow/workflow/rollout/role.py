"""Rollout role: continuous-batching generation fed by prompt rows, with admission control.

The decode loop and the prompt intake live here; finished answers go to the
:class:`~asyncflow.workflow.rollout.collect.Collector` (scoring, placement, sending), the
state both change is one :class:`~asyncflow.workflow.rollout.state.RolloutState`, and
checkpoints of it are :mod:`asyncflow.workflow.rollout.inflight`.

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

**Multi-turn** (``episodes``: an :class:`~asyncflow.agents.episode.EpisodeRunner`, ``env`` configured): an
answer is an episode of turns and environment steps. A started group's requests become episodes
(their environments reset off the loop); every finished turn goes to its episode, whose environment
answers off the loop; the next turns (new requests with the whole history, or ``extend`` of kept rows)
go into the batch at the next poll, before new groups (an episode waiting on its environment holds no
slot), and a finished episode comes back as one scored :class:`~asyncflow.agents.episode.Trajectory`
with its loss mask, placed like any answer. With nothing to decode, rollout sleeps until an
environment call comes back or new weights are staged.

**In-memory hand-off** (``local``, set by the worker: ``sync`` where rollout writes every field
the actor of its own worker reads, i.e. rewards in rollout, no reference, no critic): a step's
rows go to ``local[partition]`` instead of the data plane, and that actor takes them from there
(:func:`~asyncflow.workflow.builders.link_local`): no put, no get, no copy between processes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from asyncflow.agents.drive import can_extend, submit_turns
from asyncflow.agents.episode import EpisodeRunner
from asyncflow.dataplane import QueueTimeout, ShardSampler
from asyncflow.dataplane.api import DataPlaneClient
from asyncflow.engines.types import Completion, Engine, Request, SamplingParams
from asyncflow.weights.subscriber import WeightSubscriber
from asyncflow.workflow.checkpoint import Snapshot
from asyncflow.workflow.feeder import PromptFeeder
from asyncflow.workflow.fields import decode_text
from asyncflow.workflow.placement import GroupPlacer
from asyncflow.workflow.roles.base import Role
from asyncflow.workflow.roles.reward import GroupScorer
from asyncflow.workflow.rollout import inflight
from asyncflow.workflow.rollout.collect import Collector
from asyncflow.workflow.rollout.state import RolloutState

PROMPT_FIELDS = ["query_ids", "answer", "gen_len"]


class RolloutRole(Role):
    name = "rollout"

    def __init__(self, engine: Engine, plane: DataPlaneClient, sampling: SamplingParams, group_size: int,
                 prompts_per_step: int, staleness: int, weights: WeightSubscriber | None = None,
                 recompute_on_swap: bool = True, on_swap: str = "continue",
                 scorer: GroupScorer | None = None,
                 shape: Callable[[np.ndarray, list[int]], Sequence[float] | np.ndarray] | None = None,
                 feed: PromptFeeder | None = None, drop_flat: bool = False, overprovision: int = 0,
                 shard: int | None = None, by_prompt_id: bool = False, episodes: EpisodeRunner | None = None):
        # engine: any engine of the protocol in asyncflow.engines.types (built-in, vLLM, SGLang, fake)
        if on_swap not in ("continue", "discard"):
            raise ValueError(f"on_swap = {on_swap!r}: expected 'continue' or 'discard'")
        self.engine, self.plane, self.weights = engine, plane, weights
        self.group_size, self.prompts_per_step = group_size, prompts_per_step
        self.recompute_on_swap, self.on_swap = recompute_on_swap, on_swap
        self.batch = engine.new_batch(sampling)
        self.state = RolloutState(GroupPlacer(prompts_per_step, staleness, overprovision))
        self.batch_rows = prompts_per_step * group_size
        # scorer: a GroupScorer (rewards computed here). Dynamic sampling (drop_flat): shape(rewards,
        # lengths) -> the rewards the trainer will see (e.g. overlong penalty) decides keep or drop
        self.scorer, self.feed = scorer, feed
        self.collector = Collector(self.state, plane, self.batch, group_size, self.batch_rows, scorer, shape, feed,
                                   drop_flat, shard, keep_placed=weights is not None)
        super().__init__()  # (after the collector: Role sets items, which is the collector's count)
        if scorer is not None and scorer.bell is not None and weights is not None:
            weights.bell = scorer.bell  # idle on rewards in flight, wake for new weights too
        # multi-turn (asyncflow.agents): each answer is an episode of turns and environment steps
        self.episodes = episodes
        if episodes is not None:
            episodes.keep = can_extend(self.batch)
            episodes.version = lambda: self.version
            if weights is not None:
                weights.bell = episodes.calls.bell  # idle on environment calls, wake for new weights too
        self.shard = shard  # data-parallel sync: only this shard's prompts (see the module docstring)
        # a group's id: its prompt's stable prompt_id (the feeder's; the same across a resume), else its row id
        self.prompt_fields = PROMPT_FIELDS + (["prompt_id"] if by_prompt_id else []) + (["prompt"] if episodes else [])
        self.asked: deque[inflight.SnapshotRequest] = deque()  # checkpoints' requests, served in order by the loop

    # ------------------------------------------------------------------ counters and hand-offs
    @property
    def items(self) -> int:
        """Sample rows sent (the collector counts them)."""
        return self.collector.sent

    @items.setter
    def items(self, n: int) -> None:
        self.collector.sent = n

    @property
    def local(self) -> dict[int, list[dict]] | None:
        """``sync``: a step's rows handed to this worker's actor in memory (module doc)."""
        return self.collector.local

    @local.setter
    def local(self, rows: dict[int, list[dict]] | None) -> None:
        self.collector.local = rows

    @property
    def placer(self) -> GroupPlacer:
        return self.state.placer

    @property
    def steps(self) -> int:
        """Decode steps so far (the worker's heartbeat counts them as progress)."""
        return self.state.steps

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
        groups that may (:mod:`asyncflow.workflow.rollout.inflight`; the others restart from their prompts,
        fed again), take prompts after the slots of ``step`` steps and the kept groups; the kept group ids."""
        if self.weights is not None:
            deadline = time.monotonic() + timeout
            while self.weights.staged_version() < version:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rollout: the restored weights (version {version}) did not arrive "
                                       f"within {timeout:.0f} s")
                self.weights.wait_staged(0.5)
            self.weights.swap_if_ready()
            self.batch.version = self.version
        s = self.state
        s.placer.started, s.placer.lowest = step * self.prompts_per_step, step
        continued = inflight.resume(self, step, *saved) if saved is not None else []
        s.partition, s.taken = divmod(step * self.prompts_per_step + len(continued), self.prompts_per_step)
        return continued

    def snapshot_in_flight(self, timeout: float, done: int) -> Snapshot:
        """The groups not trained once ``done`` steps are, taken by rollout's loop between polls (inflight)."""
        asked = inflight.SnapshotRequest(done)
        self.asked.append(asked)  # (never replacing another waiting: its checkpoint would time out, be lost)
        return asked.wait(timeout, self)

    @property
    def staleness(self) -> int:
        return self.state.placer.k

    @staleness.setter
    def staleness(self, k: int) -> None:
        self.state.placer.k = k

    def admissible(self) -> bool:
        """May more prompts be fetched now (beyond those already waiting)?"""
        return self.state.placer.admits(self.version, extra=len(self.state.waiting)) > 0

    # ------------------------------------------------------------------ the loop body
    def poll(self, timeout: float) -> int:
        s = self.state
        while self.asked:  # checkpoints' snapshots, between two decode steps
            self.asked.popleft().serve(self)
        if self.weights is not None and self.weights.staged_version() > self.version:
            with self.work():
                self.weights.swap_if_ready()
                self.batch.version = self.version
                inflight.forget_trained(s, self.version)
                if self.on_swap == "discard":
                    self._discard()
                elif self.recompute_on_swap:
                    self.batch.recompute_cache()
        self._refill(timeout)
        if self.episodes is not None:
            self._turns()
        if not len(self.batch):
            self.collector.collect([], force=True, wait_s=min(timeout, 0.02) if s.scoring else 0.0)
            if self.episodes is not None and self.episodes.active:
                self.episodes.calls.wait(min(timeout, 0.05))  # only environment calls in flight
            elif not s.scoring and not self.admissible() and self.weights is not None:
                self.weights.wait_staged(timeout)  # idle at the staleness bound
            return 0
        with self.work():
            s.slot_steps += len(self.batch)
            s.steps += 1
            done = self.batch.step()
            self._finished(done)
        return len(done)

    def _finished(self, done: list[Completion]) -> None:
        """Answers (single-turn) to the collector; turns (multi-turn) to their episodes."""
        if self.episodes is None:
            self.collector.collect(done)
        else:
            self.episodes.on_turns(done)

    def _turns(self) -> None:
        """Multi-turn: take the environment's answers, start the next turns, collect finished episodes."""
        runner = self.episodes
        assert runner is not None
        runner.collect()
        nexts, trajectories, release = runner.take(self.engine.max_batch - len(self.batch))
        if trajectories:
            self.collector.collect(trajectories)
        if nexts or release:
            with self.work():
                runner.on_turns(submit_turns(self.batch, nexts, release))

    def _discard(self) -> None:
        """Drop every live answer and the finished answers of their groups; queue the groups."""
        s = self.state
        live = self.batch.drop_all()
        gids = sorted({r.key[0] for r in live} | set(s.finished))
        s.discarded += len(live) + sum(len(self.collector.forget(g)) for g in gids)
        s.restarts.extend(gids)

    def _refill(self, timeout: float) -> None:
        """Start waiting prompt groups in free slots (restarted groups first); fetch the next
        prompts when none wait."""
        s = self.state
        # (multi-turn: episodes waiting on their environment hold no slot; turns waiting for one go first)
        busy = len(self.batch) + (self.episodes.queued if self.episodes is not None else 0)
        free_groups = (self.engine.max_batch - busy) // self.group_size
        if free_groups <= 0:
            return
        restart = [s.restarts.popleft() for _ in range(min(free_groups, len(s.restarts)))]
        for gid in restart:
            s.placer.restart(gid, self.version)
        while s.stale and len(restart) < free_groups and s.placer.retry(s.stale[0], self.version):
            restart.append(s.stale.popleft())  # (False until a guaranteed slot is free: a newer version)
        if restart:
            fresh = [Request(r.key, r.prompt_ids, r.max_new_tokens, r.min_new_tokens)
                     for gid in restart for r in s.groups[gid]]
            free_groups -= len(restart)
            with self.work():
                self._start(fresh)
            if free_groups <= 0:
                return
        if not s.waiting and self.admissible():
            self._fetch(block=len(self.batch) == 0 and not s.scoring, timeout=timeout)
        start = [s.waiting.popleft() for _ in range(min(free_groups, len(s.waiting)))]
        if start:
            for group in start:
                s.placer.start(group[0].key[0], self.version)
                s.groups[group[0].key[0]] = group
            with self.work():
                self._start([req for group in start for req in group])

    def _start(self, requests: list[Request]) -> None:
        """Start answers: in the batch, or (multi-turn) as episodes, each from its environment's reset."""
        if self.episodes is None:
            self.collector.collect(self.batch.add(requests))
            return
        slot: dict[int, int] = {}
        for r in requests:
            gid, answer, prompt = r.key
            j = slot[gid] = slot.get(gid, -1) + 1
            self.episodes.start((gid, answer), (gid, j), {"prompt": decode_text(prompt), "answer": decode_text(answer)},
                                r.prompt_ids)

    def _fetch(self, block: bool, timeout: float) -> None:
        """Take the admitted prompts of the current prompt partition (one round trip).

        Admission counts fetched groups at fetch time; a group's version tag and deadline
        are set when it starts, which can only be later (newer weights): still admitted.
        """
        s = self.state
        n = min(self.prompts_per_step - s.taken, s.placer.admits(self.version, extra=len(s.waiting)))
        if self.feed is not None:
            self.feed.fill(s.partition + 1)
        try:
            meta, data = self.plane.get_batch("rollout", self.prompt_fields, n=n, partition=s.partition, min_n=1,
                                              sampler=None if self.shard is None else ShardSampler(self.shard),
                                              block=block, timeout=timeout)
        except QueueTimeout:
            return
        for i, row in enumerate(meta.rows):
            row = int(data["prompt_id"][i]) if "prompt_id" in data else row
            query = data["query_ids"][i].tolist()
            L = int(data["gen_len"][i])
            key = (row, data["answer"][i]) + ((data["prompt"][i],) if "prompt" in data else ())
            s.waiting.append([Request(key=key, prompt_ids=query, max_new_tokens=L or None, min_new_tokens=L)
                              for _ in range(self.group_size)])
        s.taken += len(meta.rows)
        if s.taken >= self.prompts_per_step:
            s.partition, s.taken = s.partition + 1, 0

    def stats(self) -> dict:
        s, st = super().stats(), self.state
        s.update(version=self.version, slot_steps=st.slot_steps, decode_steps=st.steps,
                 max_batch=self.engine.max_batch,
                 swap_s=self.weights.swap_seconds if self.weights else 0.0,
                 swaps=self.weights.swaps if self.weights else 0,
                 weights_rejected=self.weights.rejected if self.weights else 0,
                 discarded=st.discarded, groups_carried=st.placer.carried,
                 groups_restarted=st.placer.stalls, **getattr(self.engine, "stats", dict)())  # (ETMR's tokens)
        if self.scorer is not None:
            s.update(groups_scored=st.groups_scored, reward_errors=self.scorer.errors, **self.scorer.stats())
        if self.collector.drop_flat:
            s.update(groups_dropped=st.groups_dropped)
        if self.episodes is not None:
            s.update(self.episodes.stats())
        return s
