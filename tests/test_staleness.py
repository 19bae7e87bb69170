"""The staleness bound holds per trained sample, whatever the timing of the roles.

The real pipeline (in-process launcher, tiny random model) runs with random delays
injected into every data-plane call and into weight delivery. A spy on the data plane
records, independently of the actor's own bookkeeping, the policy version of every
sample handed to the trainer and the version the trainer was at (the partition it
trains), and checks ``0 <= v - version <= k`` for each one.
"""

from __future__ import annotations

import pickle
import random
import threading
import time

import numpy as np
import pytest

from asyncflow.algorithms.algorithm import Algorithm
from asyncflow.api import train
from asyncflow.config import AlgorithmConfig, load_config
from asyncflow.dataplane import DataPlane
from asyncflow.launch.local import LocalLauncher
from asyncflow.weights.store import WeightStore
from asyncflow.workflow.fields import SCHEMA
from asyncflow.workflow.roles.actor import ActorRole, StalenessViolation


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
            self.saw(meta, data)
        return meta, data

    def saw(self, meta, data) -> None:
        """A batch handed to the trainer (through this plane, or in memory: :func:`spy_in_memory`)."""
        with self.lock:
            self.trained += [(meta.partition, int(v)) for v in data["version"]]


def spy_in_memory(monkeypatch, launcher) -> None:
    """Record the rows a ``sync`` worker's rollout hands its actor in memory (``link_local``: they
    never pass through the data plane) in ``launcher.plane`` as if fetched from it."""
    take = ActorRole._take_local

    def taken(self, v, rows):
        meta, data = take(self, v, rows)
        if meta.rows:
            launcher.plane.saw(meta, data)
        return meta, data

    monkeypatch.setattr(ActorRole, "_take_local", taken)


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

    def data_plane(self, schema, kind="ray", storage_units=2, **limits):
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


@pytest.mark.parametrize("extra", [
    ["rollout.overprovision=2"],  # stragglers stall and restart at a later version
    ["rollout.on_swap=discard"],  # groups restart whole at each swap
    ["reward.placement=separate"],  # rewards from a reward role: rows reach the trainer later
], ids=["overprovision", "discard", "separate-reward"])
def test_the_bound_holds_on_every_path_that_restarts_or_delays_groups(tmp_path, extra):
    """No row outside the bound reaches the trainer (it would raise StalenessViolation).
    (Dynamic sampling: tests/test_dynamic_sampling.py checks the bound on its own path.)"""
    steps, k = 5, 1
    cfg = small_job(tmp_path, "mode=async", f"staleness={k}", f"train.steps={steps}", "rollout.max_batch=8", *extra)
    launcher = DelayLauncher(7, max_delay_s=0.01)
    train(cfg, launcher=launcher, evaluate=False)
    lags = [v - w for v, w in launcher.plane.trained]
    assert len(lags) == steps * 16 and 0 <= min(lags) and max(lags) <= k


class CountingEngine:
    """A training engine stand-in: counts the rows it is asked to train."""

    version, trained, steps = 0, 0, 0

    def forward_backward(self, prompts, responses, extras, loss):
        self.trained += len(prompts)
        return {"loss": 0.0}

    def optimizer_step(self, **kw):
        self.steps += 1
        self.version += 1
        return {}


@pytest.mark.parametrize("lag", [2, -1], ids=["too-old", "from-the-future"])
def test_a_row_outside_the_bound_raises_and_nothing_of_its_batch_is_trained(lag):
    """A row of version v - k - 1 (or v + 1) put straight into partition v: the trainer raises
    StalenessViolation naming it, instead of dropping it and normalising by the full batch."""
    v, k, group = 3, 1, 2
    plane, engine = DataPlane(SCHEMA), CountingEngine()
    n = 2 * group
    versions = [v] * n
    versions[3] = v - lag  # one row of the second group
    plane.put({"prompt_ids": [np.array([1, 5])] * n, "response_ids": [np.array([6, 7])] * n,
               "logprobs": [np.zeros(2, np.float32)] * n, "reward": np.arange(n, dtype=np.float32),
               "group": np.repeat([0, 1], group), "version": np.array(versions)},
              partition=v, tags={"group": [0, 0, 1, 1], "version": versions})
    role = ActorRole(engine, plane, n, group, 2, staleness=k, algorithm=Algorithm.from_config(AlgorithmConfig(), 8),
                     wait_timeout_s=5)
    with pytest.raises(StalenessViolation) as e:
        role.train_step(v)
    err = e.value
    assert (err.row, err.version, err.trainer_version, err.bound) == (3, v - lag, v, k)
    assert f"row 3 of version {v - lag}" in str(err) and f"trainer at version {v}" in str(err)
    assert f"staleness={k}" in str(err)
    assert engine.trained == 0 and engine.steps == 0  # the whole micro-batch is refused
    assert pickle.loads(pickle.dumps(err)).args == err.args  # crosses processes (Ray) intact
