"""In-process launcher: every worker is an object in this process, background roles are
threads. For tests and debugging (set breakpoints anywhere); the GIL limits overlap.

A data-parallel trainer's ranks are threads too: they share a
:class:`~asyncflow.engines.collective.ThreadRendezvous` (gradient sums in rank order, no
``torch.distributed``; ``train.strategy=fsdp`` needs processes, i.e. ``launcher=ray``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from asyncflow.config import ConfigError
from asyncflow.dataplane import DataPlane, Schema
from asyncflow.engines.collective import ThreadRendezvous
from asyncflow.engines.device import resolve_device
from asyncflow.weights.store import WeightStore


class LocalLauncher:
    def __init__(self) -> None:
        self.cpus = os.cpu_count() or 1
        self.owns_host = False  # roles share this process (and its GIL): pin_cores=auto does not pin
        # room for every trainer rank's call at once (they wait for each other in collectives)
        self._pool = ThreadPoolExecutor(66, thread_name_prefix="local-launcher")

    gpus = 0  # roles share this process: resources.device names the GPU itself
    in_process = True  # every worker is an object of this process (the job builds the evaluator after them)

    @staticmethod
    def check_device(device: str) -> None:
        """``device`` must exist in this process (the roles run here)."""
        try:
            resolve_device(device)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def data_plane(self, schema: Schema, kind: str = "auto", storage_units: int = 2, handout_ttl: float = 60.0,
                   unit_deadline: float = 120.0) -> DataPlane:
        """The in-process data plane (``kind``, ``storage_units``, ``unit_deadline``: the Ray launcher's)."""
        return DataPlane(schema, handout_ttl=handout_ttl)

    def weight_store(self) -> WeightStore:
        return WeightStore()

    def dp_rendezvous(self, rank0: Any, world: int) -> ThreadRendezvous:
        """What ``world`` trainer ranks (threads here) share to form their group."""
        return ThreadRendezvous(world)

    def spawn(self, spec: Any, cls: Callable[..., Any], *args: Any) -> Any:
        return cls(*args)

    def submit(self, handle: Any, method: str, *args: Any) -> Future:
        return self._pool.submit(getattr(handle, method), *args)

    def result(self, fut: Future, timeout: float) -> Any:
        try:
            return fut.result(timeout)
        except FutureTimeout:  # a distinct class before Python 3.11
            raise TimeoutError from None

    def call(self, handle: Any, method: str, *args: Any) -> Any:
        return getattr(handle, method)(*args)

    def release(self, obj: Any) -> None:
        """Nothing to free in process (threads stop with ``Worker.stop``)."""

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)
