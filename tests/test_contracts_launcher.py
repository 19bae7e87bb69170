"""Contract of :class:`asyncflow.workflow.launcher.Launcher`, run against every launcher.

One module-scoped launcher per implementation (``LAUNCHERS``: adding one is one line); the
Ray one starts a local Ray of 2 CPUs once for the module. Workers are a small plain class
(:class:`Echo`), spawned the way a job spawns its workers.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import pytest
import torch

from asyncflow.dataplane import Field, Schema
from asyncflow.dataplane.api import DataPlaneClient
from asyncflow.weights.store import WeightSource, seal, verify
from asyncflow.workflow.launcher import Launcher
from asyncflow.workflow.plan import WorkerSpec

torch.set_num_threads(1)

SCHEMA = Schema([Field("x", "int64"), Field("ids", "int64", ragged=True)])
SPEC = WorkerSpec(name="echo", roles=[], threads=1, cpus=0.5)


class EchoError(ValueError):
    """Raised by :meth:`Echo.boom`: comes back to the caller as itself."""


class Echo:
    """A plain class, as a worker is: built from picklable arguments, called by method name."""

    def __init__(self, base: int):
        self.base = base
        self.calls = 0

    def add(self, x: int) -> int:
        self.calls += 1
        return self.base + x

    def count(self) -> int:
        return self.calls

    def slow(self, seconds: float) -> str:
        time.sleep(seconds)
        return "done"

    def boom(self, message: str) -> None:
        raise EchoError(message)

    def niceness(self) -> int:
        return os.getpriority(os.PRIO_PROCESS, 0)


def _local():
    from asyncflow.launch.local import LocalLauncher

    return LocalLauncher()


def _ray():
    import ray.cloudpickle

    from asyncflow.launch.ray_launcher import RayLauncher

    # Ray's workers cannot import this test module (tests/ is not a package on their path):
    # its classes travel by value, as a user's classes defined in a script do.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return RayLauncher(num_cpus=2)


LAUNCHERS = {"local": _local, "ray": _ray}


@pytest.fixture(scope="module", params=["local", pytest.param("ray", marks=pytest.mark.ray)])
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def launcher(kind):
    launcher = LAUNCHERS[kind]()
    yield launcher
    launcher.shutdown()
    launcher.shutdown()  # idempotent


@pytest.fixture(scope="module")
def echo(launcher):
    handle = launcher.spawn(SPEC, Echo, 10)
    yield handle
    launcher.release(handle)


def test_is_a_launcher(launcher):
    assert isinstance(launcher, Launcher)
    assert launcher.cpus >= 1 and launcher.gpus >= 0 and isinstance(launcher.owns_host, bool)
    launcher.check_device("cpu")


def test_spawn_call_submit_result(launcher, echo):
    assert launcher.call(echo, "add", 1) == 11
    futures = [launcher.submit(echo, "add", k) for k in range(3)]
    assert [launcher.result(f, 10) for f in futures] == [10, 11, 12]
    assert launcher.call(echo, "count") == 4  # one object: calls share its state


def test_a_worker_computes_at_the_drivers_priority(kind, launcher, echo):
    # Ray's default niceness for workers is 15: their compute would yield to every other process
    if kind == "ray" and not launcher.owns_host:
        pytest.skip("an instance at RAY_ADDRESS keeps its own worker_niceness")
    assert launcher.call(echo, "niceness") == os.getpriority(os.PRIO_PROCESS, 0)


def test_result_times_out(launcher, echo):
    fut = launcher.submit(echo, "slow", 0.8)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        launcher.result(fut, 0.1)
    assert time.monotonic() - start < 0.7  # not the call's own 0.8 s
    assert launcher.result(fut, 10) == "done"  # the call itself goes on


def test_errors_come_back_as_themselves(launcher, echo):
    with pytest.raises(EchoError, match="bad input 7"):
        launcher.call(echo, "boom", "bad input 7")
    with pytest.raises(EchoError, match="bad input 8"):
        launcher.result(launcher.submit(echo, "boom", "bad input 8"), 10)
    assert launcher.call(echo, "add", 0) == 10  # the worker survives its call's error


def test_data_plane_works(launcher):
    plane = launcher.data_plane(SCHEMA)
    try:
        assert isinstance(plane, DataPlaneClient)
        rows = plane.put({"x": [1, 2], "ids": [[1], [2, 3]]}, partition=0, tags={"group": [0, 0]})
        meta, data = plane.get_batch("t", ["x", "ids"], n=2, partition=0, timeout=10)
        assert meta.rows == rows and data["x"].tolist() == [1, 2]
        assert [a.tolist() for a in data["ids"]] == [[1], [2, 3]]
    finally:
        launcher.release(plane)
        launcher.release(plane)  # idempotent


def test_a_spawned_worker_uses_the_launchers_data_plane(launcher):
    plane = launcher.data_plane(SCHEMA)
    handle = launcher.spawn(SPEC, _Producer, plane)
    try:
        assert launcher.call(handle, "produce", 3) == 3
        meta, data = plane.get_batch("t", ["x"], n=3, partition="w", timeout=10)
        assert sorted(data["x"].tolist()) == [0, 1, 2]
    finally:
        launcher.release(handle)
        launcher.release(handle)  # idempotent
        launcher.release(plane)


class _Producer:
    def __init__(self, plane):
        self.plane = plane

    def produce(self, n: int) -> int:
        return len(self.plane.put({"x": list(range(n))}, partition="w"))


def test_weight_store_publishes_and_waits(launcher):
    store = launcher.weight_store()
    assert isinstance(store, WeightSource)
    assert store.wait_newer(-1, 0.05) is None
    weights = {"w": np.arange(4, dtype=np.float32)}
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("v", store.wait_newer(0, 10)))
    t.start()
    store.publish(1, seal(weights))
    t.join(10)
    version, buffers = got["v"]
    assert version == 1 and verify(buffers)["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert store.latest_version() == 1
    store.close()
    launcher.release(store)
    launcher.release(store)


def test_shutdown_is_idempotent(kind, launcher):
    """(The module's own launcher is shut down twice at teardown.)"""
    other = LAUNCHERS[kind]()
    handle = other.spawn(SPEC, Echo, 1)
    assert other.call(handle, "add", 1) == 2
    other.release(handle)
    other.shutdown()
    other.shutdown()
    handle = launcher.spawn(SPEC, Echo, 5)
    assert launcher.call(handle, "add", 0) == 5  # the other's shutdown left this one working
    launcher.release(handle)
