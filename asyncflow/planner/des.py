"""A minimal discrete-event kernel: generator processes on a time-ordered event queue.

A process is a generator: ``yield seconds`` sleeps (works) that long, ``yield signal``
sleeps until the signal's next ``fire``. Events at the same time run in the order they
were scheduled (a sequence number breaks ties), so a simulation is deterministic.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator


class Signal:
    """Processes ``yield`` a signal to sleep until its next ``fire``."""

    def __init__(self, env: Env):
        self.env, self.waiters = env, []

    def fire(self) -> None:
        waiters, self.waiters = self.waiters, []
        for g in waiters:
            self.env.at(self.env.now, lambda g=g: self.env.resume(g))


class Env:
    def __init__(self) -> None:
        self.now, self._q, self._seq = 0.0, [], 0

    def at(self, t: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._q, (t, self._seq, fn))

    def process(self, gen: Iterator) -> None:
        self.at(self.now, lambda: self.resume(gen))

    def resume(self, gen: Iterator) -> None:
        try:
            cmd = next(gen)
        except StopIteration:
            return
        if isinstance(cmd, Signal):
            cmd.waiters.append(gen)
        else:
            self.at(self.now + float(cmd), lambda: self.resume(gen))

    def run(self) -> None:
        while self._q:
            t, _, fn = heapq.heappop(self._q)
            self.now = t
            fn()
