"""Contract of :class:`asyncflow.weights.store.WeightSource` (the weight store) and of the
:class:`asyncflow.weights.subscriber.WeightSubscriber` that reads one, run against every store.

``STORES`` lists the implementations (adding one is one line): the in-process
``WeightStore`` and the Ray actor client ``RayWeightStore`` (one local Ray of 2 CPUs for
the module). Each test makes a fresh store; a Ray store's ``publish`` does not wait, so
tests read what they published through ``wait_newer``.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from asyncflow.weights.store import (
    CHECKSUMS,
    WeightSource,
    WeightStore,
    WeightTransferError,
    publish_parts,
    seal,
    verify,
)
from asyncflow.weights.subscriber import WeightSubscriber

torch.set_num_threads(1)

_ray = {}


def _ray_store():
    if "launcher" not in _ray:
        from asyncflow.launch.ray_launcher import RayLauncher

        _ray["launcher"] = RayLauncher(num_cpus=2)
    return _ray["launcher"].weight_store()


STORES = {"local": WeightStore, "ray": _ray_store}


@pytest.fixture(scope="module", params=["local", pytest.param("ray", marks=pytest.mark.ray)])
def make_store(request):
    made = []

    def make() -> WeightSource:
        made.append(STORES[request.param]())
        return made[-1]

    yield make
    for store in made:
        store.close()
    if "launcher" in _ray:
        _ray.pop("launcher").shutdown()


def weights(k: float) -> dict[str, np.ndarray]:
    return {"a": np.full((2, 3), k, dtype=np.float32), "b": np.arange(4, dtype=np.int64) + int(k)}


def wait_version(store, v: int, timeout: float = 10.0) -> tuple[int, dict]:
    """The store's newest set once it is at least ``v`` (a remote publish lands later)."""
    got = store.wait_newer(v - 1, timeout)
    assert got is not None, f"version {v} never became visible"
    return got


def until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


# --------------------------------------------------------------------------- the store


def test_is_a_weight_source(make_store):
    store = make_store()
    assert isinstance(store, WeightSource)
    assert store.latest_version() == -1


def test_versions_only_grow(make_store):
    store = make_store()
    store.publish(1, weights(1))
    assert wait_version(store, 1)[0] == 1
    store.publish(3, weights(3))
    store.publish(2, weights(2))  # late and older: ignored
    version, buffers = wait_version(store, 3)
    time.sleep(0.05)  # (a remote publish of 2 has landed by now)
    assert version == 3 and store.latest_version() == 3
    assert buffers["a"][0, 0] == 3.0
    again = store.wait_newer(1, 1.0)
    assert again is not None and again[0] == 3  # the newest, never an older one
    store.publish(3, weights(30))  # equal: ignored too
    time.sleep(0.05)
    assert store.wait_newer(2, 1.0)[1]["a"][0, 0] == 3.0


def test_wait_newer_returns_at_once_or_none_after_timeout(make_store):
    store = make_store()
    start = time.monotonic()
    assert store.wait_newer(-1, 0.2) is None
    assert 0.15 <= time.monotonic() - start < 10.0  # (it comes back: 3.1 s under Ray beside a CPU hog)
    store.publish(0, weights(0))
    assert wait_version(store, 0)[0] == 0
    start = time.monotonic()
    assert store.wait_newer(-1, 5.0)[0] == 0  # already newer: at once
    assert time.monotonic() - start < 1.0
    assert store.wait_newer(0, 0.1) is None


def test_wait_newer_wakes_on_publish_and_on_close(make_store):
    store = make_store()
    got = []
    t = threading.Thread(target=lambda: got.append(store.wait_newer(4, 20)))
    t.start()
    time.sleep(0.1)
    store.publish(5, weights(5))
    t.join(10)
    assert got and got[0][0] == 5
    got.clear()
    t = threading.Thread(target=lambda: got.append(store.wait_newer(5, 20)))
    t.start()
    time.sleep(0.1)
    start = time.monotonic()
    store.close()
    t.join(10)
    assert not t.is_alive() and time.monotonic() - start < 5.0 and got == [None]
    assert store.wait_newer(5, 5.0) is None  # closed: at once


def test_sealed_buffers_verify_after_the_trip(make_store):
    store = make_store()
    sent = weights(7)
    store.publish(1, seal(sent))
    _, buffers = wait_version(store, 1)
    assert CHECKSUMS in buffers
    tensors = verify(buffers)
    assert set(tensors) == set(sent)
    for name in sent:
        np.testing.assert_array_equal(tensors[name], sent[name])
        assert tensors[name].dtype == sent[name].dtype


def test_a_version_published_in_parts_is_visible_only_whole(make_store):
    """Parts arrive in any order; the version appears once the last one has, as their union, and
    its checksums (the last part of :func:`publish_parts`) verify the whole set."""
    store = make_store()
    parts = [{"a": np.full((2, 3), 1.0, dtype=np.float32)}, {"b": np.arange(4)}, {"c": np.ones(5, dtype=np.float16)}]
    sealed = seal({k: v for part in parts for k, v in part.items()})
    store.publish_part(1, 2, parts[2])
    store.publish_part(1, 3, {CHECKSUMS: sealed[CHECKSUMS]}, total=4)
    store.publish_part(1, 0, parts[0])
    assert store.wait_newer(-1, 0.3) is None and store.latest_version() == -1  # part 1 is missing
    store.publish_part(1, 1, parts[1])
    version, buffers = wait_version(store, 1)
    assert version == 1 and set(verify(buffers)) == {"a", "b", "c"}
    np.testing.assert_array_equal(buffers["c"], parts[2]["c"])
    store.publish_part(1, 0, {"a": np.zeros(1)}, total=1)  # a part of a version not newer: ignored
    time.sleep(0.05)
    assert store.latest_version() == 1 and wait_version(store, 1)[1]["a"].shape == (2, 3)


def test_publish_parts_seals_many_parts_as_one_set_and_one_part_as_a_publish(make_store):
    store = make_store()
    sent = [{"x": np.arange(3, dtype=np.float32)}, {"y": np.full((2, 2), 7, dtype=np.int64)}, {"z": np.zeros(1)}]
    publish_parts(store, 2, iter(sent))  # (a generator: each part taken once)
    _, buffers = wait_version(store, 2)
    tensors = verify(buffers)  # one CRC-32 a tensor over the union, as seal() of it at once
    assert set(tensors) == {"x", "y", "z"}
    np.testing.assert_array_equal(tensors["y"], sent[1]["y"])
    publish_parts(store, 3, [weights(3)])
    _, buffers = wait_version(store, 3)
    assert set(verify(buffers)) == {"a", "b"}


# --------------------------------------------------------------------------- the subscriber


class Model:
    """What ``apply`` loads into: records each (version, tensors) and on which thread."""

    def __init__(self):
        self.loaded: list[tuple[int, dict]] = []
        self.threads: list[str] = []

    def apply(self, version, tensors):
        self.loaded.append((version, {k: np.array(v) for k, v in tensors.items()}))
        self.threads.append(threading.current_thread().name)


def test_subscriber_stages_then_swaps_at_the_callers_boundary(make_store):
    store, model = make_store(), Model()
    sub = WeightSubscriber(store, model.apply, start_version=0, poll_s=0.05)
    try:
        assert sub.staged_version() == 0 and not sub.swap_if_ready()
        store.publish(1, seal(weights(1)))
        assert sub.wait_staged(10)
        assert sub.staged_version() == 1 and sub.version == 0 and model.loaded == []  # staged, not applied
        assert sub.swap_if_ready()
        assert sub.version == 1 and sub.swaps == 1 and model.threads == [threading.current_thread().name]
        version, tensors = model.loaded[0]
        assert version == 1 and set(tensors) == {"a", "b"}  # verified: no checksum entry
        np.testing.assert_array_equal(tensors["a"], weights(1)["a"])
        assert not sub.swap_if_ready()  # nothing new
        store.publish(2, seal(weights(2)))
        store.publish(3, seal(weights(3)))
        until(lambda: sub.staged_version() == 3)
        assert sub.swap_if_ready() and sub.version == 3  # the newest: 2 may be skipped
        assert [v for v, _ in model.loaded][-1] == 3 and sub.rejected == 0
    finally:
        sub.close()


def test_subscriber_rejects_and_counts_a_corrupted_set(make_store):
    store, model = make_store(), Model()
    sub = WeightSubscriber(store, model.apply, start_version=0, poll_s=0.05)
    try:
        store.publish(1, seal(weights(1)))
        assert sub.wait_staged(10) and sub.swap_if_ready()
        bad = seal(weights(2))
        bad["a"] = bad["a"].copy()
        bad["a"][0, 0] = -1.0  # changed after sealing
        store.publish(2, bad)
        until(lambda: sub.rejected == 1)
        assert sub.staged_version() == 1 and not sub.swap_if_ready() and sub.version == 1
        partial = seal(weights(3))
        del partial["b"]
        store.publish(3, partial)
        until(lambda: sub.rejected == 2)
        assert not sub.swap_if_ready() and [v for v, _ in model.loaded] == [1]
        store.publish(4, seal(weights(4)))  # the next good version goes through
        until(lambda: sub.staged_version() == 4)
        assert sub.swap_if_ready() and sub.version == 4 and sub.rejected == 2
    finally:
        sub.close()


def test_verify_names_the_bad_tensor():
    bad = seal(weights(1))
    bad["b"] = bad["b"] + 1
    with pytest.raises(WeightTransferError, match="'b'"):
        verify(bad)
    with pytest.raises(WeightTransferError, match="checksums"):
        verify(weights(1))
