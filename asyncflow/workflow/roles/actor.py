"""Actor role: streams one partition's groups through gradient accumulation, then steps.

``train_step(v)`` trains policy version ``v`` on partition ``v``:

* pulls micro-batches of whole GRPO groups (``GroupSampler``) as soon as their rewards
  (and reference log-probs, with KL) are produced, so training overlaps generation;
* the staleness bound is an invariant, not a filter: admission control
  (:class:`~asyncflow.workflow.placement.GroupPlacer`) never places a group started at
  ``w`` in a step later than ``w + staleness``, so every row of partition ``v`` has
  ``v - staleness <= version <= v``. A row outside that range raises
  :class:`StalenessViolation` (naming the row, its version, ``v`` and the bound) before
  anything of its micro-batch is trained: nothing is dropped, nothing is mis-normalised;
* computes advantages (PPO: reads those the critic role wrote) with the configured
  :class:`~asyncflow.algorithms.algorithm.Algorithm` and accumulates its loss's gradient
  (normalised by the step's totals, so accumulation equals one big batch), then one
  optimizer step. Group estimators (GRPO, RLOO...) train each micro-batch as it arrives;
  batch-level ones (REINFORCE++: whitening over the step) collect the step first.
  ``token-mean`` needs the step's token count, known only at the end: its loss is a
  token sum and the gradient is scaled by ``1 / tokens`` before the step;
* publishes version ``v + 1`` to the weight store without waiting, and clears the
  partition (frees its rows in the data plane). With ``prefetch_next`` the clear and the
  first fetch of ``v + 1`` run on the prefetch thread as soon as ``v``'s rows are all in
  hand (measured: the step boundary cost the trainer ~29 ms a step, ~7% of a run).

Data parallel (``group``, an :mod:`asyncflow.engines.collective` group of ``world``
ranks, one ``ActorRole`` each; ``train.dp``): rank 0 alone asks the data plane for each
micro-batch (``world x micro_prompts`` groups: each rank trains about ``micro_prompts`` groups'
rows of it, as one process would; splitting one process's micro-batch instead ran twice as
many half-size passes: 0.364 s of training a step against 0.274 s, benchmarks/minimal_grpo.py), with
``TokenBalancedSampler(world, <the sampler above>)``, and broadcasts
the answer (its rows) to every rank. Every rank reads the micro-batch's
columns and computes the same advantages over it (a balanced split may cut a GRPO
group), then trains only its own contiguous chunk of the rows (``chunk_sizes``: rank
``i`` gets chunk ``i``), so each row is trained exactly once per step. Losses are
normalised by the global step (sequences: ``batch_size``; ``token-mean``: the tokens of
every rank's rows, which each rank counts from the whole micro-batches), and the engine
sums gradients over ranks before clipping: one dp step = the single-process step on the
same rows. The step's rows are freed (``clear``) by rank 0 after a barrier that every
rank reaches once it has read them. Rank 0 alone publishes weights; the staleness check,
histogram, rewards and sample counts are over all rows on every rank (rank 0 reports
them); loss metrics (``loss``, ``clip_frac``...) are over the reporting rank's rows.
Control ops (broadcast, barrier) run on the prefetch thread, gradient sums on the
compute thread, each in the same order on every rank.
Tensor parallel (``train.tp``; the group is a :class:`~asyncflow.engines.tensor_parallel.MeshGroup`
of ``dp x tp`` processes): ``rank`` / ``world`` count processes (rank 0 fetches, every process gets
the broadcast and joins the barrier), while the rows are split over the group's ``shards`` (``dp``):
the ``tp`` ranks of one ``dp`` index (``shard``) train the same rows, each its own shards of the
weights; every rank joins the weights' all-gathers, bucket by bucket, and rank 0 publishes each
bucket as a part (:func:`publish_weights`; FSDP's weights take the same path).
Own rows (``shard_rows``: data-parallel ``sync``, not FSDP, a group-level estimator): each rank
generated and scored whole groups of its own shard, so it trains exactly those
(``ShardSampler(rank)``, one request a step, no rank-0 meta nor broadcast, and it starts as
soon as its own rows are in, as the plain N-process loop does); ``token-mean`` all-reduces the
step's token count; the metrics (samples, tokens, rewards, groups) are the rank's own, and
the job sums them over the ranks (``dp_share`` in the metrics; :meth:`Job.result
<asyncflow.workflow.job.Job.result>`). The optimizer step's gradient sum is every rank's
sign that it read its rows, so the clear needs no barrier.
In-memory rows (``local``, ``sync`` where this worker's rollout writes every field the actor
reads: :func:`~asyncflow.workflow.builders.link_local`): the step's rows are taken from
rollout's hand-off, not fetched; everything after (staleness check, passes, clear) is the same.
Greedy fetches (``greedy``: a lone trainer in ``stream``/``async``, whose engine trains a call's
rows in length-sorted passes of ``micro_prompts`` groups' rows, ``rows_per_pass``): each fetch
asks for the rest of the step and returns once at least a micro-batch of whole groups is ready,
with every whole group ready by then, so a trainer that falls behind rollout (the usual
bottleneck) trains big sorted calls with little padding, and one that waits still starts on
the first micro-batch. FSDP (the engine's ``fsdp``)
gathers and scatters inside every forward/backward and export: each rank runs one pass
per micro-batch (config: ``dp <= group_size``, so a micro-batch of whole groups leaves
no rank empty; no token-budget chunks) and joins the weights' all-gathers each step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from asyncflow.algorithms.algorithm import Algorithm
from asyncflow.dataplane import BatchMeta, GroupSampler, Sampler, ShardSampler, TokenBalancedSampler, chunk_sizes
from asyncflow.dataplane.api import DataPlaneClient
from asyncflow.dataplane.core.rules import Data
from asyncflow.engines.collective import BUCKET_BYTES, Collective, full_buckets
from asyncflow.engines.training import TrainEngine, take_rows
from asyncflow.workflow.roles.base import Role

FIELDS = ["prompt_ids", "response_ids", "logprobs", "reward", "group", "version"]


def publish_weights(engine: Any, publish: Callable[[int, Iterable[dict]], None] | None,
                    bucket_bytes: int = BUCKET_BYTES) -> None:
    """Publish the engine's weights as its version (``publish``: rank 0's; others pass ``None``).
    Sharded weights (the engine's ``gathers``: FSDP, tensor parallel) are gathered in buckets of
    ``bucket_bytes``, every rank joining each all-gather, and published as parts; whole ones as one part."""
    if getattr(engine, "gathers", False):
        parts = full_buckets(engine.model, bucket_bytes)
        if publish is None:
            for _ in parts:  # (this rank's share of each all-gather; rank 0 publishes)
                pass
            return
        publish(engine.version, parts)
    elif publish is not None:
        publish(engine.version, [engine.export_weights()])


class StalenessViolation(RuntimeError):
    """A row generated outside ``[v - staleness, v]`` reached the trainer at version ``v``
    (admission control failed, or a row was put into the partition by hand)."""

    def __init__(self, row: int, version: int, trainer_version: int, bound: int):
        self.row, self.version, self.trainer_version, self.bound = row, version, trainer_version, bound
        super().__init__(f"row {row} of version {version} reached the trainer at version {trainer_version}: "
                         f"outside the staleness bound (versions {trainer_version - bound}..{trainer_version}, "
                         f"staleness={bound})")

    def __reduce__(self):  # pickled with its fields (a Ray worker's error crosses processes)
        return type(self), (self.row, self.version, self.trainer_version, self.bound), self.__dict__


class ActorRole(Role):
    name = "actor"

    def __init__(self, engine: TrainEngine, plane: DataPlaneClient, batch_size: int, group_size: int,
                 micro_prompts: int, staleness: int, *, algorithm: Algorithm,
                 publish: Callable[[int, Iterable[dict]], None] | None = None, wait_timeout_s: float = 600.0,
                 group: Collective | None = None, shard_rows: int | None = None, greedy: bool = False,
                 masked: bool = False):
        super().__init__()
        self.group = group  # data-parallel ranks (None: this role trains alone)
        self.rank, self.world = (group.rank, group.world) if group is not None else (0, 1)
        # the rows this rank trains: shard `shard` of `shards` (tensor parallel: the tp ranks of a dp index share one)
        self.shard, self.shards = (group.shard, group.shards) if group is not None else (0, 1)
        # own rows: this rank trains the shard_rows rows of its own shard a step (see the module docstring)
        self.own = shard_rows is not None and self.world > 1 and not algorithm.batch_level
        self.rows = shard_rows if self.own and shard_rows is not None else batch_size
        # greedy (a lone trainer): each fetch takes every ready whole group of the step, at least a micro-batch's
        self.greedy = greedy and self.world == 1
        self.local: dict[int, list[dict]] | None = None  # sync: the step's rows from rollout in memory (link_local)
        self.engine, self.plane, self.publish = engine, plane, publish
        self.batch_size, self.group_size, self.micro_prompts = batch_size, group_size, micro_prompts
        self.staleness, self.algorithm = staleness, algorithm
        self.loss = self.algorithm.loss(batch_size)
        self.fields = FIELDS + (["ref_logprobs"] if self.algorithm.needs_reference else [])
        self.fields += ["advantages"] if self.algorithm.needs_critic else []  # PPO: written by the critic
        self.fields += ["loss_mask"] if masked else []  # multi-turn: observation tokens stay out of the loss
        self.wait_timeout_s = wait_timeout_s
        self.wait_s = 0.0
        self._fetcher = ThreadPoolExecutor(1, thread_name_prefix="actor-prefetch")
        self._next: tuple | None = None  # (step, submit, first fetch, clear of the step before)
        self.max_staleness = 0
        self.staleness_hist: dict[int, int] = {}

    def _fetcher_for(self, v: int) -> Callable[[int], Future]:
        """``submit(n)``: fetch the next ``n`` rows of partition ``v`` on the prefetch thread."""
        sampler: Sampler = GroupSampler(self.group_size)  # (no staleness filter: see _check_staleness)
        if self.own:
            sampler = ShardSampler(self.rank, inner=sampler)
        elif self.shards > 1:
            sampler = TokenBalancedSampler(self.shards, sampler)

        least = self.micro_prompts * self.group_size  # (greedy: a lone trainer's micro-batch)

        def get(want: int) -> BatchMeta:
            return self.plane.get_meta("actor", self.fields, n=want, partition=v, sampler=sampler,
                                    min_n=want, block=True, timeout=self.wait_timeout_s)

        def fetch(want: int) -> tuple[BatchMeta, Data]:
            if self.world == 1 or self.own:
                return self.plane.get_batch("actor", self.fields, n=want, partition=v, sampler=sampler,
                                         min_n=min(least, want) if self.greedy else want, block=True,
                                         timeout=self.wait_timeout_s)
            assert self.group is not None  # world > 1
            meta: BatchMeta | Exception | None = None
            if self.rank == 0:
                try:
                    meta = get(want)
                except Exception as e:  # every rank raises it rather than wait for a meta
                    meta = e
            meta = self.group.broadcast(meta)
            if isinstance(meta, BaseException):
                raise meta
            return meta, (self.plane.get_data(meta) if meta.rows else {})

        return lambda want: self._fetcher.submit(fetch, want)

    def _clear(self, v: int) -> None:
        """Free partition ``v`` once every rank has read its rows (on the prefetch thread)."""
        if self.world > 1 and not self.own:  # (own rows: the gradient sum came after every rank's read)
            assert self.group is not None
            self.group.barrier()
        if self.rank == 0:
            self.plane.clear(v)

    def _mine(self, n: int) -> list[int]:
        """Positions, in a micro-batch of ``n`` rows, of the rows this rank trains."""
        if self.own:
            return list(range(n))
        sizes = chunk_sizes(n, self.shards)
        start = sum(sizes[: self.shard])
        return list(range(start, start + sizes[self.shard]))

    def train_step(self, v: int, prefetch_next: bool = False) -> dict:
        """Train version ``v`` on partition ``v`` (blocks until the partition is consumed).
        ``prefetch_next`` (``train_step(v + 1)`` comes next): once ``v``'s last rows are in hand,
        clear ``v`` and fetch ``v + 1``'s first micro-batch on the prefetch thread, so the
        step boundary (back to the driver, its call, the first fetch) leaves no idle trainer."""
        # micro_prompts groups for each rank to train (own rows: of this rank's own; greedy: the rest of the step)
        micro = self.micro_prompts * self.group_size * (1 if self.own else self.shards)
        total = self.rows
        micro = total if self.greedy else micro
        submit, nxt = self._first(v, min(micro, total))
        lengths: list[int]
        seen, metrics, rewards, lengths, pending, groups = 0, [], [], [], [], set[int]()
        while seen < total:
            t = time.perf_counter()
            meta, data = nxt.result()
            self.wait_s += time.perf_counter() - t
            seen += len(meta.rows)
            if seen < total:  # the next micro-batch travels while this one computes
                nxt = submit(min(micro, total - seen))
            elif prefetch_next:  # the step's rows are all here: clear it, start the next step
                cleared = self._fetcher.submit(self._clear, v)
                nsubmit = self._fetcher_for(v + 1)
                self._next = (v + 1, nsubmit, nsubmit(min(micro, total)), cleared)
            if not meta.rows:
                continue
            self._check_staleness(v, meta.rows, data["version"])
            if self.algorithm.batch_level:
                pending.append(data)
            else:
                with self.work("train"):  # (span names: the planner's terms, asyncflow.planner.terms)
                    metrics.append(self._accumulate(v, data, self.algorithm.advantages(data)))
            rewards.extend(data["reward"].tolist())
            groups.update(int(g) for g in data["group"])  # (metrics' 'groups': a resume feeds the others)
            lengths.extend(_trained_tokens(data))
        with self.work("step"):
            if pending:
                metrics.extend(self._accumulate_batch(v, pending))
            tokens = self._step_tokens(sum(lengths))
            scale = 1.0 / max(tokens, 1) if self.loss.loss_agg == "token-mean" else 1.0
            # (an engine without grad_scale still serves every other aggregation)
            step = self.engine.optimizer_step(grad_scale=scale) if scale != 1.0 else self.engine.optimizer_step()
            publish_weights(self.engine, self.publish)
        if not prefetch_next:
            self._fetcher.submit(self._clear, v).result()
        self.items += seen
        metrics = [m for m in metrics if m]  # (a rank may get no rows of a micro-batch)
        out: dict[str, Any] = {k: float(np.mean([m[k] for m in metrics])) for k in metrics[0]} if metrics else {}
        out.update(step, reward=float(np.mean(rewards)) if rewards else 0.0,
                   response_len=float(np.mean(lengths)) if lengths else 0.0,
                   samples=len(rewards), tokens=int(sum(lengths)), max_staleness=self.max_staleness,
                   groups=sorted(groups))
        if self.own:
            out["dp_share"] = True  # the rank's own rows: the job sums the ranks' metrics
        return out

    def _first(self, v: int, want: int) -> tuple[Callable[[int], Future], Future]:
        """Step ``v``'s fetcher and its first fetch: the rows in memory (``local``), the one
        prefetched at the end of step ``v - 1``, or a new one."""
        if self.local is not None:  # (sync: rollout of this worker put them here; no fetch)
            done: Future = Future()
            done.set_result(self._take_local(v, self.rows))
            return self._fetcher_for(v), done
        if self._next is None:
            submit = self._fetcher_for(v)
            return submit, submit(want)
        nv, submit, nxt, cleared = self._next
        self._next = None
        if nv != v:
            raise RuntimeError(f"train_step({v}) after prefetching step {nv}: steps must be consecutive")
        cleared.result()  # the previous step's clear (raises its error, if any)
        return submit, nxt

    def _take_local(self, v: int, rows: int) -> tuple[BatchMeta, Data]:
        """Step ``v``'s rows that this worker's rollout handed over in memory, as one batch."""
        assert self.local is not None
        parts = self.local.pop(v, [])
        data: dict[str, Any] = {k: [x for d in parts for x in d[k]] if isinstance(parts[0][k], list)
                                else np.concatenate([d[k] for d in parts]) for k in parts[0]} if parts else {}
        n = len(data.get("version", ()))
        if n != rows:
            raise RuntimeError(f"step {v}: rollout handed the actor {n} rows in memory, expected {rows}")
        return BatchMeta(v, list(range(n)), list(self.fields)), data

    def _step_tokens(self, mine: int) -> int:
        """The step's response tokens (every rank's; own rows: summed over the ranks)."""
        if not (self.own and self.loss.loss_agg == "token-mean"):
            return mine
        assert self.group is not None  # own rows: world > 1
        n = torch.tensor([float(mine)], dtype=torch.float64)
        self.group.all_reduce_sum([n])
        return int(n.item())

    def _accumulate_batch(self, v: int, parts: list[dict]) -> list[dict]:
        """Advantages over the whole step (batch-level estimators), then train each part."""
        merged: dict[str, Any] = {"reward": np.concatenate([d["reward"] for d in parts]),
                  "group": np.concatenate([d["group"] for d in parts])}
        for k in ("response_ids", "logprobs", "ref_logprobs"):
            if k in parts[0]:
                merged[k] = [row for d in parts for row in d[k]]
        adv = self.algorithm.advantages(merged)
        out, i = [], 0
        for d in parts:
            n = len(d["reward"])
            out.append(self._accumulate(v, d, adv[i: i + n]))
            i += n
        return out

    def _check_staleness(self, v: int, rows: list[int], versions: Sequence[int] | np.ndarray) -> None:
        """Raise :class:`StalenessViolation` for the first row outside ``[v - staleness, v]``;
        else count every row's lag (checked for the whole micro-batch before any is trained)."""
        lags = [v - int(ver) for ver in versions]
        for row, lag in zip(rows, lags):
            if not 0 <= lag <= self.staleness:
                raise StalenessViolation(row, v - lag, v, self.staleness)
        for lag in lags:
            self.staleness_hist[lag] = self.staleness_hist.get(lag, 0) + 1
            self.max_staleness = max(self.max_staleness, lag)

    def _accumulate(self, v: int, data: dict, adv: list) -> dict:
        """Accumulate the gradient of this rank's rows (their staleness is checked on arrival)."""
        idx = self._mine(len(data["version"]))
        if not idx:
            return {}
        extras = {"logprobs": take_rows(data["logprobs"], idx), "advantages": take_rows(adv, idx)}
        for k in ("ref_logprobs", "loss_mask"):
            if k in data:
                extras[k] = take_rows(data[k], idx)
        return self.engine.forward_backward([data["prompt_ids"][i].tolist() for i in idx],
                                            [data["response_ids"][i].tolist() for i in idx], extras, self.loss)

    def stats(self) -> dict:
        s = super().stats()
        s.update(version=self.engine.version, wait_s=self.wait_s, max_staleness=self.max_staleness,
                 staleness_hist=dict(self.staleness_hist))
        return s


def _trained_tokens(data: dict) -> list[int]:
    """Each row's tokens in the loss: its response, or (multi-turn) the generated ones of it."""
    if "loss_mask" in data:
        return [int(np.count_nonzero(m)) for m in data["loss_mask"]]
    return [len(r) for r in data["response_ids"]]
