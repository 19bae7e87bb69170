"""The staleness bound holds per trained sample, whatever the timing of the roles.

The real pipeline (in-process launcher, tiny random model) runs with random delays
injected into every data-plane call and into weight delivery. A spy on the data plane
records, independently of the actor's own bookkeeping, the policy version of every
sample handed to the trainer and the version the trainer was at (the partition it
trains), and checks ``0 <= v - version <= k`` for each one.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from asyncflow.config import load_config
from asyncflow.weights.store import WeightStore
from asyncflow.launch.local import LocalLauncher
from asyncflow.dataplane import DataPlane
from asyncflow.api import train


class DelayedDataPlane(DataPlane):
    """A data plane whose every call sleeps a random 0..max_delay_s first; records actor batches."""

    def __init__(self, schema, rng: random.Random, max_delay_s: float):
        super().__init__(schema)
        self.rng, self.max_delay_s, self.lock = rng, max_delay_s, threading.Lock()
        self.trained: list[tuple[int, int]] = []  # (trainer version, sample version)

    def _sleep(self) -> None:
        with self.lock:
            d = self.rng.uniform(0, self.max_delay_s)
        time.sleep(d)

    def put(self, *a, **kw):
        self._sleep()
        return super().put(*a, **kw)

    def get_batch(self, task, fields, n, **kw):
        self._sleep()
        meta, data = super().get_batch(task, fields, n, **kw)
        if task == "actor":
            with self.lock:
                self.trained += [(meta.partition, int(v)) for v in data["version"]]
        return meta, data


class DelayedWeightStore(WeightStore):
    def __init__(self, rng: random.Random, max_delay_s: float):
        super().__init__()
        self.rng, self.max_delay_s = rng, max_delay_s

    def wait_newer(self, version, timeout):
        got = super().wait_newer(version, timeout)
        if got is not None:
            time.sleep(self.rng.uniform(0, self.max_delay_s))  # a slow transfer
        return got


class DelayLauncher(LocalLauncher):
    def __init__(self, seed: int, max_delay_s: float):
        super().__init__()
        self.rng, self.max_delay_s = random.Random(seed), max_delay_s
        self.plane: DelayedDataPlane | None = None

    def data_plane(self, schema, kind="ray", storage_units=2):
        self.plane = DelayedDataPlane(schema, self.rng, self.max_delay_s)
        return self.plane

    def weight_store(self):
        return DelayedWeightStore(random.Random(self.rng.random()), 5 * self.max_delay_s)


def small_job(tmp_path, *overrides):
    """A tiny random-init job: 4 prompts x 4 answers per step, one group per micro-batch."""
    return load_config(None, [
        "launcher=local", "warmstart.enabled=false", "progress=false", "train.prompts_per_step=4",
        "train.micro_prompts=1", "rollout.group_size=4", f"run_dir={tmp_path}", *overrides])


@pytest.mark.parametrize("seed,k", [(0, 1), (1, 1), (2, 2)])
def test_every_trained_sample_is_within_the_bound(tmp_path, seed, k):
    steps, prompts, group = 6, 4, 4
    cfg = small_job(tmp_path, "mode=async", f"staleness={k}", f"train.steps={steps}", "rollout.max_batch=8",
                    f"seed={seed}")
    launcher = DelayLauncher(seed, max_delay_s=0.01)
    summary = train(cfg, launcher=launcher, evaluate=False)
    trained = launcher.plane.trained
    assert len(trained) == steps * prompts * group  # nothing lost, nothing dropped
    lags = [v - w for v, w in trained]
    assert min(lags) >= 0 and max(lags) <= k, f"lags {sorted(set(lags))} outside [0, {k}]"
    assert summary["max_staleness"] == max(lags)
    assert summary["dropped_stale"] == 0
    assert sum(summary["staleness_hist"].values()) == len(trained)


def test_stream_mode_is_on_policy(tmp_path):
    cfg = small_job(tmp_path, "mode=stream", "staleness=3", "train.steps=4")
    launcher = DelayLauncher(3, max_delay_s=0.01)
    summary = train(cfg, launcher=launcher, evaluate=False)
    assert {v - w for v, w in launcher.plane.trained} == {0}  # stream ignores staleness: always 0
    assert summary["staleness_bound"] == 0


def test_async_actually_overlaps(tmp_path):
    """Not vacuous: with a bound of 1, some samples are trained one version late."""
    cfg = small_job(tmp_path, "mode=async", "staleness=1", "train.steps=6")
    launcher = DelayLauncher(5, max_delay_s=0.0)
    train(cfg, launcher=launcher, evaluate=False)
    lags = [v - w for v, w in launcher.plane.trained]
    assert max(lags) == 1 and min(lags) == 0
