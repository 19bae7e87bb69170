"""Environment calls off the decode loop: a thread pool, an event loop for ``async def``, deadlines.

:class:`EnvCalls` runs an environment's ``reset``/``step`` (or any callable) without blocking the
caller: ``submit(tag, fn, *args)`` starts it (a plain function on one of ``concurrency`` worker
threads, a coroutine function on one event-loop thread shared by all), ``done()`` returns the
finished calls as ``(tag, value, error)``. A call's deadline (``timeout_s``) counts from when it
starts running, not from when it was queued. Past it, a coroutine is cancelled and a thread is
abandoned (Python cannot kill a thread; its late result is dropped) and the call comes back
with a :class:`CallTimeout`. ``bell`` is set whenever a call finishes, so an idle caller can
sleep until there is something to collect.

Invariant: every submitted call comes back from ``done()`` exactly once (value or error), unless
``forget(tag)`` dropped it first.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
import traceback
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any


class CallTimeout(TimeoutError):
    """An environment call ran past its deadline."""


@dataclass
class _Call:
    future: Future
    what: str
    started: list[float] = field(default_factory=list)  # set when it starts running (a list: set from its thread)


class EnvCalls:
    """Environment calls in flight (module doc)."""

    def __init__(self, concurrency: int = 64, timeout_s: float | None = 10.0):
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="env")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._calls: dict[Hashable, _Call] = {}
        self.bell = threading.Event()

    def __len__(self) -> int:
        return len(self._calls)

    def submit(self, tag: Hashable, fn: Callable[..., Any], *args: Any, what: str = "") -> None:
        """Start ``fn(*args)`` under ``tag`` (one call per tag at a time); ``what`` names it in errors."""
        if tag in self._calls:
            raise RuntimeError(f"env call {tag!r} is already in flight")
        call = _Call(Future(), what or getattr(fn, "__qualname__", "call"))
        if inspect.iscoroutinefunction(fn):
            loop = self._event_loop()

            async def run() -> Any:
                call.started.append(time.monotonic())
                return await fn(*args)

            call.future = asyncio.run_coroutine_threadsafe(run(), loop)
        else:
            def run_sync() -> Any:
                call.started.append(time.monotonic())
                return fn(*args)

            call.future = self._pool.submit(run_sync)
        call.future.add_done_callback(lambda _: self.bell.set())
        self._calls[tag] = call

    def done(self) -> list[tuple[Hashable, Any, BaseException | None]]:
        """The calls that finished or ran out of time since the last call, as ``(tag, value, error)``."""
        out: list[tuple[Hashable, Any, BaseException | None]] = []
        now = time.monotonic()
        self.bell.clear()
        for tag, call in list(self._calls.items()):
            if call.future.done():
                del self._calls[tag]
                err = call.future.exception() if not call.future.cancelled() else CallTimeout(f"{call.what} cancelled")
                out.append((tag, None if err else call.future.result(), err))
            elif self.timeout_s is not None and call.started and now - call.started[0] > self.timeout_s:
                del self._calls[tag]
                call.future.cancel()  # (a coroutine is cancelled; a running thread is left to finish, unheard)
                out.append((tag, None, CallTimeout(f"{call.what} timed out after env.timeout_s = {self.timeout_s} s")))
        return out

    def wait(self, timeout: float) -> None:
        """Sleep until a call finishes or ``timeout`` seconds pass (at most until the next deadline)."""
        if self.timeout_s is not None and self._calls:
            timeout = min(timeout, self.timeout_s)
        self.bell.wait(timeout)

    def forget(self, tag: Hashable) -> None:
        """Drop a call: it will not come back from :meth:`done`."""
        call = self._calls.pop(tag, None)
        if call is not None:
            call.future.cancel()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="env-loop", daemon=True).start()
            return self._loop


def describe(err: BaseException) -> str:
    """An error as its traceback (a timeout: its one line)."""
    if isinstance(err, CallTimeout):
        return str(err)
    return "".join(traceback.format_exception(type(err), err, err.__traceback__)).rstrip()
