"""Contract of a role (:class:`asyncflow.workflow.roles.base.Role`), run against every role class.

``ROLES`` lists the implementations (adding one is one line), each built as its own role
test builds it, on an in-process data plane and the tiny model (rollout with the
deterministic ``FakeEngine``; the reward role with a local and with an emulated remote
function). The contract (the base module's doc): a ``Role`` with a ``name``; ``poll`` on an
empty plane returns 0 within about its timeout; ``run`` stops when told to or when the
plane closes; ``stats()`` has the busy keys; work on the role's input rows is counted in
``busy_s``, ``spans`` and ``items``. The actor is stepped (``train_step``), not polled.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from asyncflow.algorithms.algorithm import Algorithm
from asyncflow.dataplane import DataPlane, QueueTimeout
from asyncflow.engines.training import TrainEngine
from asyncflow.workflow.fields import SCHEMA, encode_text
from asyncflow.workflow.roles.base import Role

torch.set_num_threads(1)

GROUP, PROMPTS = 2, 2
BUSY_KEYS = {"busy_s", "busy_cpu_s", "items"}
ACTOR_POLLS = pytest.mark.xfail(strict=True, raises=NotImplementedError, reason=(
    "ActorRole is stepped by the driver (train_step) and has no poll loop: Role.poll raises NotImplementedError"))


def _tiny():
    from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model

    return build_tiny_model(build_char_tokenizer(), seed=0, hidden_size=32, num_layers=1, num_heads=2,
                            num_kv_heads=1, intermediate_size=64)


def decode(ids) -> str:
    return "".join(str(i % 10) for i in ids)


def exact(prompt: str, response: str, answer: str) -> float:
    return 1.0 if response == answer else 0.0


def put_prompts(plane) -> None:
    """What the feeder puts: prompt rows of step 0."""
    plane.put({"query_ids": [np.array([1, 5 + i]) for i in range(PROMPTS)],
               "answer": [encode_text("7")] * PROMPTS, "gen_len": np.zeros(PROMPTS, np.int64)}, partition=0)


def put_answers(plane) -> None:
    """What rollout puts without scoring (``reward.placement=separate``): one step's answers."""
    put_samples(plane, reward=False)


def put_samples(plane, reward: bool = True) -> None:
    """What rollout puts (rewards included, as rollout scores them): one step's answers."""
    n = PROMPTS * GROUP
    responses = [np.array([4 + i, 5, 2][: 1 + i % 3]) for i in range(n)]
    group = np.repeat(np.arange(PROMPTS), GROUP)
    plane.put({"prompt_ids": [np.array([1, 5, 14, 6, 18])] * n, "response_ids": responses,
               "logprobs": [np.full(len(r), -1.0, np.float32) for r in responses],
               "token_versions": [np.zeros(len(r), np.int64) for r in responses],
               "answer": [encode_text("45")] * n, "group": group, "version": np.zeros(n, np.int64),
               **({"reward": np.array([1, 0, 0, 1], np.float32)} if reward else {})},
              partition=0,
              tags={"group": group.tolist(), "version": [0] * n, "tokens": [5 + len(r) for r in responses]})


def _rollout(plane):
    from asyncflow.engines.fake import FakeEngine
    from asyncflow.engines.types import SamplingParams
    from asyncflow.workflow.rollout import RolloutRole

    return RolloutRole(FakeEngine(max_batch=8), plane, SamplingParams(max_new_tokens=4), GROUP, PROMPTS,
                       staleness=0), put_prompts


def _reward(latency_ms=None):
    def build(plane):
        from asyncflow.workflow.roles.reward import RewardRole

        return RewardRole(plane, exact, decode, micro=4, concurrency=4, latency_ms=latency_ms), put_answers

    return build


def _reference(plane):
    from asyncflow.workflow.roles.reference import ReferenceRole

    return ReferenceRole(TrainEngine(_tiny(), pad_id=0), plane, micro=4), put_samples


def _critic(plane):
    from asyncflow.engines.critic import CriticEngine
    from asyncflow.workflow.roles.critic import CriticRole

    return CriticRole(CriticEngine(_tiny(), pad_id=0, lr=1e-2), plane, Algorithm(estimator="gae"),
                      batch_size=PROMPTS * GROUP, micro=4), put_samples


def _actor(plane):
    from asyncflow.workflow.roles.actor import ActorRole

    return ActorRole(TrainEngine(_tiny(), pad_id=0, lr=1e-2), plane, PROMPTS * GROUP, GROUP, 1, staleness=0,
                     algorithm=Algorithm(), wait_timeout_s=0.3), put_samples


ROLES = {  # name -> (plane) -> (role, feed(plane): its input rows)
    "rollout": _rollout,
    "reward": _reward(),
    "reward-remote": _reward((1.0, 5.0)),
    "reference": _reference,
    "critic": _critic,
    "actor": _actor,
}
STEPPED = {"actor"}  # driven by the driver's train_step, not by a poll loop


@pytest.fixture
def plane():
    p = DataPlane(SCHEMA)
    yield p
    p.close()


def build(name, plane):
    role, feed = ROLES[name](plane)
    return role, feed


@pytest.fixture(params=list(ROLES))
def case(request, plane):
    role, feed = build(request.param, plane)
    yield request.param, role, feed
    close = getattr(role, "close", None)
    if callable(close):
        close()


def polled(names=ROLES):
    """Role names, the stepped ones marked: their poll is the xfail above."""
    return [pytest.param(n, marks=ACTOR_POLLS) if n in STEPPED else n for n in names]


# --------------------------------------------------------------------------- every role


def test_is_a_role(case):
    name, role, _ = case
    assert isinstance(role, Role)
    assert isinstance(role.name, str) and role.name == name.split("-")[0]
    assert role.error is None and role.spans == [] and role.busy_s == 0.0 and role.items == 0
    stats = role.stats()
    assert BUSY_KEYS <= set(stats) and all(isinstance(stats[k], (int, float)) for k in BUSY_KEYS)


@pytest.mark.parametrize("name", polled())
def test_poll_on_an_empty_plane_returns_zero_in_time(name, plane):
    role, _ = build(name, plane)
    try:
        for timeout in (0.0, 0.1):
            start = time.monotonic()
            assert role.poll(timeout) == 0
            assert time.monotonic() - start < timeout + 1.0
        assert role.items == 0 and role.error is None
    finally:
        getattr(role, "close", lambda: None)()


@pytest.mark.parametrize("name", polled())
def test_run_stops_when_told_and_when_the_plane_closes(name, plane):
    role, _ = build(name, plane)
    try:
        stop = threading.Event()
        errors = []

        def run():
            try:
                role.run(stop, timeout=0.05)
            except BaseException as e:  # noqa: BLE001 - kept in role.error too
                errors.append(e)

        t = threading.Thread(target=run)
        t.start()
        time.sleep(0.15)
        stop.set()
        t.join(5)
        assert not t.is_alive()
        if errors or role.error is not None:  # run() keeps its error in role.error (the worker reports it)
            raise (errors or [role.error])[0]
        t = threading.Thread(target=run)
        stop.clear()
        t.start()
        time.sleep(0.15)
        plane.close()
        t.join(5)
        assert not t.is_alive() and not errors and role.error is None
    finally:
        getattr(role, "close", lambda: None)()


@pytest.mark.parametrize("name", [n for n in ROLES if n not in STEPPED])
def test_poll_on_its_input_rows_does_counted_work(name, plane):
    role, feed = build(name, plane)
    try:
        feed(plane)
        got, deadline = 0, time.monotonic() + 10
        while got == 0:
            assert time.monotonic() < deadline, f"{name} did nothing with its input rows"
            got += role.poll(0.05)
        assert role.items > 0 and role.busy_s > 0 and role.spans and role.error is None
        stats = role.stats()
        assert stats["busy_s"] == role.busy_s and stats["items"] == role.items
    finally:
        getattr(role, "close", lambda: None)()


# --------------------------------------------------------------------------- stepped roles


@pytest.mark.parametrize("name", sorted(STEPPED))
def test_a_step_on_an_empty_plane_times_out(name, plane):
    role, _ = build(name, plane)
    start = time.monotonic()
    with pytest.raises(QueueTimeout):
        role.train_step(0)
    assert time.monotonic() - start < role.wait_timeout_s + 2.0


@pytest.mark.parametrize("name", sorted(STEPPED))
def test_a_step_on_its_input_rows_does_counted_work(name, plane):
    role, feed = build(name, plane)
    feed(plane)
    metrics = role.train_step(0)
    assert metrics["samples"] == PROMPTS * GROUP and role.engine.version == 1
    assert role.items == PROMPTS * GROUP and role.busy_s > 0 and role.spans and role.error is None
