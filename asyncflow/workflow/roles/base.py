"""What a role is (:class:`Role`, the base of every role): the poll loop and busy-time accounting.

A role is a plain class (never a Ray actor itself: a worker hosts it) with

* ``name``: its name in stats and traces (``rollout``, ``reward``, ``reference``, ``critic``, ``actor``);
* ``poll(timeout) -> int``: one round of its loop body, the rows it finished; with nothing
  to do it returns ``0`` within about ``timeout`` seconds (it never blocks longer);
* ``run(stop)``: ``poll`` until ``stop`` is set or the data plane closes; any other error is
  kept in ``error`` (the worker's health check raises it) and re-raised;
* ``stats() -> dict``: at least ``busy_s``, ``busy_cpu_s`` and ``items``;
* ``busy_s``, ``busy_cpu_s``, ``items``, ``spans``, ``error``: see below.

The actor is the one role the driver *steps* instead of polling (``train_step(v)``: one
training step on partition ``v``, raising ``QueueTimeout`` when its rows do not come within
its ``wait_timeout_s``); it has no ``poll`` loop. One contract test
(``tests/test_contracts_roles.py``) checks every role class against this.

``busy_s`` counts seconds spent computing (inside :meth:`Role.work` sections), not
waiting on the data plane or on weights; ``busy_s / wall`` is the role's busy fraction.
``busy_cpu_s`` counts the CPU time the thread running those sections got in them
(``time.thread_time``; torch's intra-op helper threads not included): ``busy_cpu_s /
busy_s`` below 1 is time the role meant to compute but was not on a core (other threads
and processes ran there).
Each section is also kept as a span ``(wall-clock start, seconds)`` (the first
``MAX_SPANS``) for the run's timeline trace; a section that says what it is
(``work("step")``) is kept as ``(start, seconds, what)``, and ``trace.json`` names the event
so (the planner reads them: :mod:`asyncflow.planner.terms`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Iterator
from contextlib import contextmanager

from asyncflow.dataplane import BatchMeta, QueueClosed, QueueTimeout, Sampler
from asyncflow.dataplane.api import DataPlaneClient
from asyncflow.dataplane.core.rules import Data

MAX_SPANS = 200_000


class Role:
    """Base of every role (the contract is the module doc's)."""

    name: str = "role"
    busy_s: float  # seconds inside work() sections
    busy_cpu_s: float  # CPU seconds this thread got inside them
    items: int  # rows produced
    error: BaseException | None  # the error that stopped run(), if any
    spans: list[tuple]  # (wall-clock start, seconds[, what]) of each work() section

    def __init__(self) -> None:
        self.busy_s = 0.0
        self.busy_cpu_s = 0.0
        self.items = 0  # rows produced
        self.error: BaseException | None = None
        self.spans: list[tuple] = []
        self._since: float | None = None  # start of the current poll or work section (the watchdog's)

    def stuck_s(self) -> float:
        """Seconds this role has been inside its current poll (or computing section); 0 when
        it is between them (the watchdog names the role stuck longest)."""
        since = self._since
        return time.perf_counter() - since if since is not None else 0.0

    @contextmanager
    def work(self, what: str = "") -> Iterator[None]:
        """A computing section (``what``: its name in the trace, e.g. the actor's ``train`` / ``step``)."""
        t, c = time.perf_counter(), time.thread_time()
        outer = self._since
        self._since = outer if outer is not None else t
        try:
            yield
        finally:
            self._since = outer
            d = time.perf_counter() - t
            self.busy_s += d
            self.busy_cpu_s += time.thread_time() - c
            if len(self.spans) < MAX_SPANS:
                # wall clock: comparable across processes
                self.spans.append((time.time() - d, d, what) if what else (time.time() - d, d))

    linger_s = 0.02  # after a short batch, let rows accumulate before asking again

    def linger(self, got: int, want: int) -> None:
        """Sleep ``linger_s`` after a batch smaller than ``want``: a consumer that keeps up
        with a trickle would otherwise make one data-plane call per row."""
        if got < want:
            time.sleep(self.linger_s)

    def fetch(self, plane: DataPlaneClient, task: str, fields: list[str], n: int, partition: Hashable | None = None,
              timeout: float = 0.05, sampler: Sampler | None = None) -> tuple[BatchMeta, Data] | None:
        """Up to ``n`` ready rows of ``task`` (at least one, waiting up to ``timeout``; chosen
        by ``sampler``, default the oldest): ``(meta, data)``, or ``None`` when nothing came."""
        try:
            meta, data = plane.get_batch(task, fields, n=n, partition=partition, min_n=1, block=True, timeout=timeout,
                                         sampler=sampler)
        except QueueTimeout:
            return None
        return (meta, data) if meta.rows else None

    def poll(self, timeout: float) -> int:  # pragma: no cover - interface
        """One round of the role's loop: the rows it finished (0 within ~``timeout`` when idle)."""
        raise NotImplementedError

    def run(self, stop: threading.Event, timeout: float = 0.05) -> None:
        """Poll until ``stop`` is set or the data plane closes. Errors are kept in ``error``."""
        try:
            while not stop.is_set():
                self._since = time.perf_counter()
                self.poll(timeout)
                self._since = None
        except QueueClosed:
            pass
        except BaseException as e:  # surfaced by the worker's health check (not re-raised: the
            self.error = e  # thread's own report would go to stderr, beside the driver's one line)

    def stats(self) -> dict:
        return {"busy_s": self.busy_s, "busy_cpu_s": self.busy_cpu_s, "items": self.items}
