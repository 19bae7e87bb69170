"""Reward role: scores finished answers as they stream in, many calls in flight.

A reward function is ``fn(prompt: str, response: str, answer: str) -> float``. Local
functions run inline. A remote verifier (or its emulation, ``latency_ms``) runs in a
thread pool of ``concurrency`` calls, so the role overlaps the waits of many samples; each
result is written back to its row as soon as it is known. A function that raises or
returns a non-number scores 0 and is counted in ``errors`` (never stops the run).
"""

from __future__ import annotations

import math
import random
import time
from collections import defaultdict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Callable

import numpy as np

from asyncflow.queue import QueueTimeout
from asyncflow.workflow.fields import decode_text
from asyncflow.workflow.role import Role

RewardFn = Callable[[str, str, str], float]
FIELDS = ["prompt_ids", "response_ids", "answer"]


class RewardRole(Role):
    name = "reward"

    def __init__(self, dp, reward_fn: RewardFn, decode: Callable[[list[int]], str], micro: int = 64,
                 concurrency: int = 64, latency_ms: tuple[float, float] | None = None, seed: int = 0):
        super().__init__()
        self.dp, self.fn, self.decode, self.micro = dp, reward_fn, decode, micro
        self.latency_ms = latency_ms
        self.concurrency = concurrency
        self.rng = random.Random(seed)
        self.pool = ThreadPoolExecutor(concurrency, thread_name_prefix="reward") if latency_ms else None
        self.inflight: dict[Future, tuple] = {}
        self.errors = 0

    def _score(self, prompt: str, response: str, answer: str, delay_s: float) -> float:
        if delay_s:
            time.sleep(delay_s)  # the emulated remote service's latency
        return self.fn(prompt, response, answer)

    def poll(self, timeout: float) -> int:
        room = self.concurrency - len(self.inflight) if self.pool else self.micro
        fetched = 0
        if room > 0:
            try:
                meta, data = self.dp.get_batch("reward", FIELDS, n=min(room, self.micro), partition=None,
                                               min_n=1, block=not self.inflight, timeout=timeout)
            except QueueTimeout:
                meta = None
            if meta is not None and meta.rows:
                with self.work():
                    texts = [(self.decode(data["prompt_ids"][i].tolist()),
                              self.decode(data["response_ids"][i].tolist()),
                              decode_text(data["answer"][i])) for i in range(len(meta.rows))]
                    if self.pool is None:
                        scores = [self._safe(lambda t=t: self._score(*t, 0.0)) for t in texts]
                        self._put(meta.partition, meta.rows, scores)
                        self.linger(len(meta.rows), self.micro)
                        return len(meta.rows)
                    fetched = len(meta.rows)
                    for row, t in zip(meta.rows, texts):
                        delay = self.rng.uniform(*self.latency_ms) / 1000.0
                        self.inflight[self.pool.submit(self._score, *t, delay)] = (meta.partition, row)
        if not self.inflight:
            return 0
        # Wait a little for results when there was nothing new to start (no busy spinning).
        done, _ = wait(list(self.inflight), timeout=0 if fetched else min(timeout, 0.02),
                       return_when=FIRST_COMPLETED)
        by_part: dict = defaultdict(lambda: ([], []))
        for f in done:
            part, row = self.inflight.pop(f)
            rows, scores = by_part[part]
            rows.append(row)
            scores.append(self._safe(f.result))
        for part, (rows, scores) in by_part.items():
            self._put(part, rows, scores)
        return len(done)

    def _safe(self, call) -> float:
        try:
            v = float(call())
            if math.isfinite(v):
                return v
        except Exception:
            pass
        self.errors += 1
        return 0.0

    def _put(self, partition, rows, scores) -> None:
        with self.work():
            self.dp.put_nowait({"reward": np.asarray(scores, dtype=np.float32)}, partition=partition, rows=rows)
            self.items += len(rows)

    def stats(self) -> dict:
        s = super().stats()
        s.update(errors=self.errors, inflight=len(self.inflight))
        return s
