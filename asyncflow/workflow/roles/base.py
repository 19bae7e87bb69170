"""Base of every role: the poll loop and busy-time accounting.

``busy_s`` counts seconds spent computing (inside :meth:`Role.work` sections), not
waiting on the data plane or on weights; ``busy_s / wall`` is the role's busy fraction.
``busy_cpu_s`` counts the CPU time the thread running those sections got in them
(``time.thread_time``; torch's intra-op helper threads not included): ``busy_cpu_s /
busy_s`` below 1 is time the role meant to compute but was not on a core (other threads
and processes ran there).
Each section is also kept as a span ``(wall-clock start, seconds)`` (the first
``MAX_SPANS``) for the run's timeline trace.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

from asyncflow.dataplane import QueueClosed, QueueTimeout


MAX_SPANS = 200_000


class Role:
    name = "role"

    def __init__(self) -> None:
        self.busy_s = 0.0
        self.busy_cpu_s = 0.0
        self.items = 0  # rows produced
        self.error: BaseException | None = None
        self.spans: list[tuple[float, float]] = []
        self._since: float | None = None  # start of the current poll or work section (the watchdog's)

    def stuck_s(self) -> float:
        """Seconds this role has been inside its current poll (or computing section); 0 when
        it is between them (the watchdog names the role stuck longest)."""
        since = self._since
        return time.perf_counter() - since if since is not None else 0.0

    @contextmanager
    def work(self):
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
                self.spans.append((time.time() - d, d))  # wall clock: comparable across processes

    linger_s = 0.02  # after a short batch, let rows accumulate before asking again

    def linger(self, got: int, want: int) -> None:
        """Sleep ``linger_s`` after a batch smaller than ``want``: a consumer that keeps up
        with a trickle would otherwise make one data-plane call per row."""
        if got < want:
            time.sleep(self.linger_s)

    def fetch(self, plane, task: str, fields: list[str], n: int, partition=None, timeout: float = 0.05):
        """Up to ``n`` ready rows of ``task`` (at least one, waiting up to ``timeout``):
        ``(meta, data)``, or ``None`` when nothing came."""
        try:
            meta, data = plane.get_batch(task, fields, n=n, partition=partition, min_n=1, block=True, timeout=timeout)
        except QueueTimeout:
            return None
        return (meta, data) if meta.rows else None

    def poll(self, timeout: float) -> int:  # pragma: no cover - interface
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
