"""Reward role: scores finished answers as they stream in, many calls in flight.

A reward function is ``fn(prompt: str, response: str, answer: str) -> float`` (a configured
``reward.fn`` is wrapped by :class:`~asyncflow.tasks.rewards.RewardFunction` to that shape).
How the role calls it depends on its shape:

* local sync function: inline, one call per sample of the fetched micro-batch;
* **batched** (``fn.batched``, from ``reward.batched``): inline, ``fn.call_batch(texts)``
  once per fetched micro-batch (up to ``micro`` samples);
* **grouped** (``fn.grouped``: TTRL's majority vote, ``reward.mode=majority``): the role
  fetches whole answer groups only (the data plane's ``GroupSampler``: a group is handed out
  once all ``group_size`` of its rows are in) and calls ``fn.call_batch`` once per group;
* **async** (``fn.is_async`` or a bare coroutine function) and the emulated remote verifier
  (``latency_ms`` of network time per call): up to ``concurrency`` calls in flight on one
  event-loop thread (:class:`RemoteCalls`), so the role overlaps the waits of many samples;
  results are written back as they complete (one data-plane put per collection window).

With ``reward.placement=rollout`` (the default) no reward role runs: rollout scores each
answer group as it finishes through a :class:`GroupScorer` (same calls, same error
handling, the same ``RemoteCalls`` for async and remote functions), and the rewards travel
in rollout's own put. That saves a process and a data-plane round trip per sample, whose
CPU on a small machine is taken from the trainer.

Invariant: every fetched sample gets exactly one reward written back. A function that
raises or returns a non-number scores 0 and is counted in ``errors`` (never stops the run);
a ``RewardFunction`` applies its own ``timeout_s`` / ``on_error`` first and counts in its stats.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import queue
import random
import threading
import time
import traceback
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable, Hashable, Iterable, Sequence
from typing import Any

import numpy as np

from asyncflow.dataplane import GroupSampler, QueueTimeout
from asyncflow.dataplane.api import DataPlaneClient
from asyncflow.tasks.base import TaskReward
from asyncflow.workflow.fields import decode_text
from asyncflow.workflow.roles.base import Role

RewardFn = TaskReward  # what RewardRole calls: (prompt, response, answer) -> float
FIELDS = ["prompt_ids", "response_ids", "answer"]
KEEP_FAILURES = 5  # failures whose traceback (or value) a role keeps for the run's reward_errors.log


class RemoteCalls:
    """Calls in flight on one event-loop thread: emulated remote calls and coroutines.

    ``submit`` schedules a sync ``fn(*args)`` after ``delay_s`` of (emulated) network latency;
    ``submit_async`` runs ``await coro_fn(*args)`` (after ``delay_s``) as a task on the loop;
    ``drain`` returns the finished ``(key, value_or_exception)`` pairs. Hundreds of calls
    in flight cost one thread and almost no CPU, as with a real async HTTP client.
    ``bell`` (an event) is rung by every finished call; whoever waits on it (``drain(...,
    early=True)``, rollout idling between decode steps) wakes at the first result, or when
    someone else rings it (rollout's weight subscriber, when it stages new weights).
    """

    def __init__(self, bell: threading.Event | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.bell = bell or threading.Event()
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.inflight = 0
        self._tasks: set = set()  # strong references: the loop keeps only weak ones
        self._thread = threading.Thread(target=self.loop.run_forever, name="reward-remote", daemon=True)
        self._thread.start()

    def submit(self, calls: list[tuple]) -> None:
        """Start ``(key, fn, args, delay_s)`` calls: one wake-up of the loop for the batch,
        one timer per call (no coroutine, task or future per call)."""
        self.inflight += len(calls)
        self.loop.call_soon_threadsafe(self._schedule, calls)

    def _schedule(self, calls: list[tuple]) -> None:
        for key, fn, args, delay_s in calls:
            self.loop.call_later(delay_s, self._finish, key, fn, args)

    def submit_async(self, calls: list[tuple]) -> None:
        """Start ``(key, coro_fn, args, delay_s)`` calls as tasks (one loop wake-up for the batch)."""
        self.inflight += len(calls)
        self.loop.call_soon_threadsafe(self._start_tasks, calls)

    def _start_tasks(self, calls: list[tuple]) -> None:
        for key, coro_fn, args, delay_s in calls:
            task = self.loop.create_task(self._run(key, coro_fn, args, delay_s))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, key: Hashable, coro_fn: Callable[..., Awaitable[Any]], args: tuple, delay_s: float) -> None:
        try:
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            value = await coro_fn(*args)
        except Exception as e:  # reported as a reward error, never raised
            value = e
        self.done.put((key, value))
        self.bell.set()

    def _finish(self, key: Hashable, fn: Callable[..., Any], args: tuple) -> None:
        try:
            value = fn(*args)
        except Exception as e:  # reported as a reward error, never raised
            value = e
        self.done.put((key, value))
        self.bell.set()

    def drain(self, timeout: float, early: bool = False) -> list[tuple]:
        """The calls finished by ``timeout`` seconds from now. It sleeps the whole window and
        then takes every result at once: one wake-up and, for the caller, one data-plane put
        per window rather than one per trickling result. ``early``: return as soon as the
        bell rings (a result, or another waker) instead, with whatever is finished by then
        (the caller batches its puts itself)."""
        if timeout > 0:
            if not early:
                time.sleep(timeout)
            elif self.done.empty():
                self.bell.wait(timeout)
        self.bell.clear()  # (a result landing after this rings it again)
        out: list = []
        try:
            while True:
                out.append(self.done.get_nowait())
        except queue.Empty:
            pass
        self.inflight -= len(out)
        return out

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


class RewardRole(Role):
    name = "reward"
    window_s = 0.05  # remote calls: results are collected this long per data-plane round trip
    # a task's reward, or a RewardFunction (asyncflow.tasks.rewards: call_batch, acall, stats, close)
    fn: Any

    def __init__(self, plane: DataPlaneClient, reward_fn: RewardFn, decode: Callable[[list[int]], str], micro: int = 64,
                 concurrency: int = 64, latency_ms: tuple[float, float] | None = None, seed: int = 0,
                 group_size: int | None = None):
        super().__init__()
        self.plane, self.fn, self.decode, self.micro = plane, reward_fn, decode, micro
        self.latency_ms = latency_ms
        self.concurrency = concurrency
        self.rng = random.Random(seed)
        self.batched = bool(getattr(reward_fn, "batched", False))
        # async per-sample: a RewardFunction's acall (its timeout and counters), or a bare coroutine fn
        is_async = getattr(reward_fn, "is_async", False) or inspect.iscoroutinefunction(reward_fn)
        self.async_fn = getattr(reward_fn, "acall", reward_fn) if is_async and not self.batched else None
        self.remote = RemoteCalls() if (latency_ms or self.async_fn) and not self.batched else None
        self.errors = 0
        self.failures: list[str] = []  # the first KEEP_FAILURES failures of the function itself
        # a group reward (fn.grouped: TTRL's majority vote) is called with whole groups only, fetched whole
        self.group_size = group_size if getattr(reward_fn, "grouped", False) else None
        if getattr(reward_fn, "grouped", False) and not group_size:
            raise ValueError("a grouped reward function (reward.mode=majority) needs the role's group_size")

    def poll(self, timeout: float) -> int:
        inflight = self.remote.inflight if self.remote else 0
        room = self.concurrency - inflight if self.remote else self.micro
        fetched = 0
        if room > 0:
            g = self.group_size
            try:  # (a group reward: whole groups only, each group's rows together, in order)
                meta, data = self.plane.get_batch("reward", FIELDS, n=max(min(room, self.micro), g or 1),
                                               partition=None, min_n=g or 1, block=not inflight, timeout=timeout,
                                               sampler=GroupSampler(g) if g else None)
            except QueueTimeout:
                meta = None
            if meta is not None and meta.rows:
                with self.work():
                    texts = [(self.decode(data["prompt_ids"][i].tolist()),
                              self.decode(data["response_ids"][i].tolist()),
                              decode_text(data["answer"][i])) for i in range(len(meta.rows))]
                    if self.remote is None:
                        scores = self._score_local(texts)
                        self._put(meta.partition, meta.rows, scores)
                        self.linger(len(meta.rows), self.micro)
                        return len(meta.rows)
                    fetched = len(meta.rows)
                    calls = [((meta.partition, row), self.async_fn or self.fn, t, self._delay())
                             for row, t in zip(meta.rows, texts)]
                    (self.remote.submit_async if self.async_fn else self.remote.submit)(calls)
        if not self.remote or not self.remote.inflight:
            return 0
        # Unless a full batch just arrived, collect results for one window before the next
        # poll: one fetch and one put per window, not one per trickling result (data-plane
        # calls cost CPU on both sides, and on a small machine that CPU is the trainer's).
        done = self.remote.drain(0 if fetched >= self.micro else self.window_s)
        by_part: dict = defaultdict(lambda: ([], []))
        for (part, row), value in done:
            rows, scores = by_part[part]
            rows.append(row)
            scores.append(self._safe(value))
        for part, (rows, scores) in by_part.items():
            self._put(part, rows, scores)
        return len(done)

    def _score_local(self, texts: list[tuple]) -> list[float]:
        """Scores of fetched samples by a local function: per sample, per batch, or per whole group."""
        g = self.group_size
        if g:  # the sampler handed out whole groups, each group's rows together: one call per group
            return [x for k in range(0, len(texts), g) for x in self._call_batch(texts[k:k + g])]
        return self._call_batch(texts) if self.batched else [self._call(t) for t in texts]

    def score_ids(self, prompt_ids: Iterable[int], response_ids: Iterable[int], answer: Iterable[int]) -> float:
        """One local call on token ids (used inline by rollout for dynamic sampling)."""
        return self._call((self.decode(list(prompt_ids)), self.decode(list(response_ids)), decode_text(answer)))

    def _delay(self) -> float:
        return self.rng.uniform(*self.latency_ms) / 1000.0 if self.latency_ms else 0.0

    def _call_batch(self, texts: list[tuple]) -> list[float]:
        try:
            values = list(self.fn.call_batch(texts))
        except Exception:
            values = []
        if len(values) != len(texts):  # a RewardFunction never gets here; a bare object might
            values = [math.nan] * len(texts)
        return [self._safe(v) for v in values]

    def _call(self, texts: tuple) -> float:
        try:
            return self._safe(self.fn(*texts))
        except Exception:
            self.errors += 1
            self._keep(traceback.format_exc())
            return 0.0

    def _safe(self, value: Any) -> float:
        """A finite float, or 0.0 counted in ``errors`` (an exception, None, NaN, a string)."""
        try:
            v = float(value) if not isinstance(value, BaseException) else math.nan
        except (TypeError, ValueError):
            v = math.nan
        if math.isfinite(v):
            return v
        self.errors += 1
        self._keep("".join(traceback.format_exception(value)) if isinstance(value, BaseException)
                   else f"returned {value!r:.80} (not a finite number)")
        return 0.0

    def _keep(self, failure: str) -> None:
        if len(self.failures) < KEEP_FAILURES:
            self.failures.append(failure.rstrip())

    def _put(self, partition: Hashable, rows: Sequence[int], scores: Sequence[float]) -> None:
        with self.work():
            self.plane.put_nowait({"reward": np.asarray(scores, dtype=np.float32)}, partition=partition, rows=rows)
            self.items += len(rows)

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()
        if hasattr(self.fn, "close"):
            self.fn.close()

    def stats(self) -> dict:
        s = super().stats()
        s.update(errors=self.errors, inflight=self.remote.inflight if self.remote else 0)
        if hasattr(self.fn, "stats"):  # a configured reward.fn: its error counters and named scores
            s.update(self.fn.stats())
        return with_failures(s, self.failures)


class GroupScorer:
    """Scores answer groups where they finish (inside rollout), with a reward role's
    function, error handling and remote calls; the role itself never polls the data plane.

    Per answer: ``open(key, n)`` declares a group of ``n`` answers, ``add(key, i, item)``
    hands answer ``i`` (a ``(prompt_ids, response_ids, answer)`` triple) *as soon as it
    finishes*: an async or emulated remote call goes in flight at once, so the group's
    rewards are in at ``max(finish_i + latency_i)`` rather than after its last answer plus
    the slowest of its calls (by arithmetic, for 8 calls of 100-300 ms: a last answer that
    finishes well after the others adds ~0.2 s, one call, instead of ~0.28 s, the expected
    slowest of 8; the bench's answers of one prompt share a length and finish together, so
    it measured no change there). A local function is called at once too; a batched one
    once per group, when its last answer is added. ``submit(key, items)`` = ``open`` + ``add`` of every answer.
    ``cancel(key)`` forgets a group (restarted or expired): its queued calls are not sent
    and results of calls in flight are ignored. ``ready(wait_s)`` returns the groups whose
    every answer is added and scored, as ``(key, rewards)`` with rewards in answer order.

    At most ``concurrency`` calls are in flight (the rest wait here, in order). Invariant:
    every opened group that is not cancelled comes back exactly once, with one finite reward
    per answer (failures score 0 and count in ``errors``).
    """

    def __init__(self, role: RewardRole) -> None:
        self.role = role
        self.pending: dict = {}  # key -> [rewards so far (None = not back), results still to come]
        self.texts: dict = {}  # key -> decoded answers (batched functions: called at the last)
        self.backlog: deque = deque()  # remote calls waiting for room under concurrency
        self.done: list[tuple] = []

    @property
    def errors(self) -> int:
        return self.role.errors

    @property
    def bell(self) -> threading.Event | None:
        """The event that results of remote calls ring (None: calls are local, no waiting)."""
        return self.role.remote.bell if self.role.remote is not None else None

    @property
    def waiting(self) -> int:
        """Groups opened but not returned by :meth:`ready` yet."""
        return len(self.pending) + len(self.done)

    def score_ids(self, prompt_ids: Iterable[int], response_ids: Iterable[int], answer: Iterable[int]) -> float:
        return self.role.score_ids(prompt_ids, response_ids, answer)

    def open(self, key: Hashable, n: int) -> None:
        self.pending[key] = [[None] * n, n]
        if self.role.batched:
            self.texts[key] = [None] * n

    def add(self, key: Hashable, i: int, item: tuple) -> None:
        r, slot = self.role, self.pending[key]
        p, resp, a = item
        text = (r.decode(list(p)), r.decode(list(resp)), decode_text(a))
        if r.remote is not None:
            self.backlog.append(((key, i), r.async_fn or r.fn, text, r._delay()))
            self._send()
        elif r.batched:
            texts = self.texts[key]
            texts[i] = text
            if all(t is not None for t in texts):
                del self.texts[key], self.pending[key]
                self.done.append((key, r._call_batch(texts)))
        else:
            self._settle(key, slot, i, r._call(text))

    def submit(self, key: Hashable, items: list[tuple]) -> None:
        self.open(key, len(items))
        for i, item in enumerate(items):
            self.add(key, i, item)

    def cancel(self, key: Hashable) -> None:
        if self.pending.pop(key, None) is not None:
            self.texts.pop(key, None)
            self.backlog = deque(c for c in self.backlog if c[0][0] != key)

    def _settle(self, key: Hashable, slot: list, i: int, value: float) -> None:
        slot[0][i] = value
        slot[1] -= 1
        if slot[1] == 0:
            self.done.append((key, slot[0]))
            del self.pending[key]

    def _send(self) -> None:
        r = self.role
        assert r.remote is not None  # only remote calls are sent
        n = min(len(self.backlog), r.concurrency - r.remote.inflight)
        if n > 0:
            (r.remote.submit_async if r.async_fn else r.remote.submit)([self.backlog.popleft() for _ in range(n)])

    def ready(self, wait_s: float = 0.0) -> list[tuple]:
        """Groups whose rewards are all in; waits up to ``wait_s`` when none is yet, and
        returns early at the first result back (or another ring of the calls' ``bell``)."""
        r = self.role
        if self.pending and r.remote is not None:
            for (key, i), value in r.remote.drain(0.0 if self.done else wait_s, early=True):
                value = r._safe(value)  # (counted as an error even for a cancelled group)
                slot = self.pending.get(key)
                if slot is not None:  # else: cancelled meanwhile
                    self._settle(key, slot, i, value)
            self._send()
        out, self.done = self.done, []
        return out

    def stats(self) -> dict:
        """A configured reward.fn's counters (calls, errors by kind, named score means)."""
        fn = self.role.fn
        return with_failures(fn.stats() if hasattr(fn, "stats") else {}, self.role.failures)

    def close(self) -> None:
        self.role.close()


def with_failures(stats: dict, failures: list[str]) -> dict:
    """``stats`` with the role's own failures before its function's (``failures``, the first few)."""
    if failures:
        stats["failures"] = (failures + stats.get("failures", []))[:KEEP_FAILURES]
    return stats
