"""Synchronous client of the distributed data plane: a thin wrapper of the asyncio core.

:class:`ZmqDataPlane` (what the roles use) runs an
:class:`~asyncflow.dataplane.transport.client_async.AsyncZmqDataPlane` on a private event-loop thread, one
per client, started on first use (and again after a fork), and waits for each call's
result. It has no method logic of its own: its methods are generated from the core's, so
there is one implementation of every data-plane operation. Thread-safe: calls from many
threads run concurrently on the one loop (a blocked ``get_meta`` holds up nothing else).
The loop thread stops (after flushing sent ``put_nowait``) on :meth:`ZmqDataPlane.disconnect`,
when the client is garbage-collected, or at interpreter exit. Picklable: only
``(endpoint, token, credentials)`` travel. No module-level clients.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import weakref
from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from asyncflow.dataplane.core.schema import Schema
from asyncflow.dataplane.transport.auth import Credentials

if TYPE_CHECKING:
    from asyncflow.dataplane.core.rules import BatchMeta, Data
    from asyncflow.dataplane.core.samplers import Sampler
from asyncflow.dataplane.transport.client_async import AsyncZmqDataPlane
from asyncflow.dataplane.transport.link import DEADLINE_S

__all__ = ["AsyncZmqDataPlane", "ZmqDataPlane"]


class _LoopThread:
    """A private event loop running in a daemon thread, for one :class:`ZmqDataPlane`."""

    def __init__(self, core: AsyncZmqDataPlane) -> None:
        self.core, self.loop = core, asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="asyncflow-plane-client", daemon=True)
        self.thread.start()

    def run(self, coro: Any) -> Any:
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("ZmqDataPlane called from its own event-loop thread; await the core instead")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        if self.loop.is_closed() or not self.thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self.core.aclose(), self.loop).result(30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
            if not self.thread.is_alive():
                self.loop.close()


class ZmqDataPlane:
    """Synchronous client: each method runs the same-named :class:`AsyncZmqDataPlane`
    coroutine on a private event-loop thread and returns its result (thread-safe)."""

    def __init__(self, endpoint: str, token: str | None = None, use_shm: bool = True,
                 credentials: Credentials | None = None, deadline: float = DEADLINE_S, sealed: bool = True) -> None:
        self.endpoint, self.token, self.use_shm, self.sealed = endpoint, token, use_shm, sealed
        self.credentials = None if credentials is None else credentials.for_client()
        self.deadline = deadline
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._core = AsyncZmqDataPlane(self.endpoint, self.token, self.use_shm, credentials=self.credentials,
                                       deadline=self.deadline, sealed=self.sealed)
        self._thread: _LoopThread | None = None
        self._finalizer: weakref.finalize | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"endpoint": self.endpoint, "token": self.token, "use_shm": self.use_shm,
                "keys": None if self.credentials is None else self.credentials.to_msg(),
                "deadline": self.deadline, "sealed": self.sealed}

    def __setstate__(self, state: dict) -> None:
        self.endpoint, self.token = state["endpoint"], state["token"]
        self.use_shm = state.get("use_shm", True)
        keys = state.get("keys")
        self.credentials = None if keys is None else Credentials.from_msg(keys)
        self.deadline, self.sealed = state.get("deadline", DEADLINE_S), state.get("sealed", True)
        self._reset()

    def _run(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if self._pid != os.getpid():  # a fork: the parent's loop thread does not exist here
            self._reset()
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    thread = _LoopThread(self._core)
                    # Stops the thread (flushing sent puts) when this client is collected or at exit.
                    self._finalizer = weakref.finalize(self, thread.stop)
                    self._thread = thread
        return self._thread.run(getattr(self._core, name)(*args, **kwargs))

    @property
    def schema(self) -> Schema:
        return self._run("get_schema")

    def disconnect(self) -> None:
        """Flush sent puts, close the sockets and stop the loop thread (servers keep running)."""
        with self._lock:
            finalizer, self._thread = self._finalizer, None
        if finalizer is not None:
            finalizer()

    if TYPE_CHECKING:  # set below by _sync: AsyncZmqDataPlane's coroutines, run to their results
        def put(self, data: Mapping[str, Any], partition: Hashable = 0, rows: Sequence[int] | None = None,
                tags: Mapping[str, Sequence[int]] | None = None, timeout: float | None = None) -> list[int]: ...
        def put_nowait(self, data: Mapping[str, Any], partition: Hashable = 0, rows: Sequence[int] | None = None,
                       tags: Mapping[str, Sequence[int]] | None = None) -> None: ...
        def flush(self) -> None: ...
        def seal(self, partition: Hashable) -> None: ...
        def clear(self, partition: Hashable) -> None: ...
        def clear_rows(self, rows: Sequence[int]) -> None: ...
        def reset_consumption(self, task: str) -> None: ...
        def close(self) -> None: ...
        def save(self, path: str | os.PathLike) -> None: ...
        def load(self, path: str | os.PathLike) -> None: ...
        def get_meta(self, task: str, fields: Sequence[str], n: int, partition: Hashable | None = None,
                     sampler: Sampler | None = None, min_n: int | None = None, block: bool = True,
                     timeout: float | None = None) -> BatchMeta: ...
        def get_data(self, meta: BatchMeta, fields: Sequence[str] | None = None) -> Data: ...
        def ack(self, meta: BatchMeta) -> None: ...
        def nack(self, meta: BatchMeta) -> None: ...
        def get_batch(self, task: str, fields: Sequence[str], n: int, partition: Hashable | None = None,
                      sampler: Sampler | None = None, min_n: int | None = None, block: bool = True,
                      timeout: float | None = None) -> tuple[BatchMeta, Data]: ...
        def tags(self, rows: Sequence[int]) -> dict[str, list[int]]: ...
        def stats(self) -> dict[str, Any]: ...
        def storage_endpoints(self) -> list[str]: ...
        def transports(self) -> list[str]: ...
        def shutdown_servers(self) -> None: ...


def _sync(name: str) -> Any:
    method = getattr(AsyncZmqDataPlane, name)

    @functools.wraps(method)
    def call(self: ZmqDataPlane, *args: Any, **kwargs: Any) -> Any:
        return self._run(name, *args, **kwargs)

    return call


for _name in ("put", "put_nowait", "flush", "seal", "clear", "clear_rows", "reset_consumption", "close",
              "save", "load", "get_meta", "get_data", "ack", "nack", "get_batch", "tags", "stats", "storage_endpoints",
              "transports",
              "shutdown_servers"):
    setattr(ZmqDataPlane, _name, _sync(_name))
del _name
