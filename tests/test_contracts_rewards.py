"""Contract of the reward function (:class:`asyncflow.tasks.base.TaskReward`, the
``(prompt, response, answer) -> float`` the roles call), run against every shape of it.

``REWARDS`` lists the implementations (adding one is one line): a task's own ``reward``,
and :class:`~asyncflow.tasks.rewards.RewardFunction` around each shape of a user's
:class:`~asyncflow.tasks.rewards.RewardFn`: sync, ``async def``, batched, async batched,
named scores, and a ``path/to/file.py:fn`` loaded with ``load_reward_fn``. They all
score the same triples to the same floats; a function that raises scores ``on_error``
and is counted.
"""

from __future__ import annotations

import textwrap

import pytest

from asyncflow.tasks.addition import AdditionTask
from asyncflow.tasks.base import TaskReward
from asyncflow.tasks.rewards import BatchedRewardFn, RewardFn, RewardFunction, load_reward_fn

TRIPLES = [("1+2=", "3", "3"), ("1+2=", " 3 ", "3"), ("4+4=", "9", "8"), ("9+9=", "", "18"), ("0+0=", "0", "0"),
           ("5+5=", "10", "10"), ("5+5=", "1O", "10")]
EXPECTED = [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
ON_ERROR = -1.0


def exact(prompt, response, sample):
    return 1.0 if response.strip() == sample["answer"] else 0.0


async def exact_async(prompt, response, sample):
    return exact(prompt, response, sample)


def exact_batched(prompts, responses, samples):
    return [exact(p, r, s) for p, r, s in zip(prompts, responses, samples)]


async def exact_async_batched(prompts, responses, samples):
    return exact_batched(prompts, responses, samples)


def exact_named(prompt, response, sample):
    return {"correct": exact(prompt, response, sample)}


USER_FILE = textwrap.dedent('''
    def exact(prompt, response, sample):
        return 1.0 if response.strip() == sample["answer"] else 0.0


    def broken(prompt, response, sample):
        raise RuntimeError("verifier down")
''')


def _file(tmp_path, name: str):
    path = tmp_path / "my_reward.py"
    path.write_text(USER_FILE)
    return load_reward_fn(f"{path}:{name}")


REWARDS = {  # name -> (fn, tmp_path) -> the reward the roles call, and the RewardFunction (None: a task's own)
    "task": lambda tmp_path: (AdditionTask(digits=1).reward, None),
    "sync": lambda tmp_path: _wrap(exact),
    "async": lambda tmp_path: _wrap(exact_async),
    "batched": lambda tmp_path: _wrap(exact_batched, batched=True),
    "async-batched": lambda tmp_path: _wrap(exact_async_batched, batched=True),
    "named-scores": lambda tmp_path: _wrap(exact_named),
    "file": lambda tmp_path: _wrap(_file(tmp_path, "exact")),
}


def _wrap(fn, **kw):
    rf = RewardFunction(fn, timeout_s=5.0, on_error=ON_ERROR, **kw)
    return rf, rf


@pytest.fixture(params=list(REWARDS))
def reward(request, tmp_path):
    fn, rf = REWARDS[request.param](tmp_path)
    yield fn, rf
    if rf is not None:
        rf.close()


@pytest.fixture(params=[name for name in REWARDS if name != "task"])
def wrapped(request, tmp_path) -> RewardFunction:
    """The implementations that are a :class:`RewardFunction` (all but a task's own reward)."""
    _, rf = REWARDS[request.param](tmp_path)
    yield rf
    rf.close()


def test_is_a_reward(reward):
    fn, rf = reward
    assert isinstance(fn, TaskReward)
    if rf is not None:
        assert isinstance(rf.fn, BatchedRewardFn if rf.batched else RewardFn)


def test_scores_the_same_triples_to_the_same_floats(reward):
    fn, rf = reward
    scores = [fn(*t) for t in TRIPLES]
    assert scores == EXPECTED and all(type(s) is float for s in scores)
    if rf is not None:
        assert rf.call_batch(TRIPLES) == EXPECTED
        assert rf.stats()["reward_calls"] == 2 * len(TRIPLES)
        assert sum(v for k, v in rf.stats().items() if k in ("reward_exception", "reward_timeout", "reward_non_number",
                                                             "reward_wrong_length")) == 0


def test_the_async_entry_point_scores_alike(wrapped):
    """``acall``: what the reward role awaits for an async function (any shape works)."""
    import asyncio

    async def all_of():
        return await asyncio.gather(*(wrapped.acall(*t) for t in TRIPLES))

    assert list(asyncio.run(all_of())) == EXPECTED


def _raises(prompt, response, sample):
    raise RuntimeError("verifier down")


async def _raises_async(prompt, response, sample):
    raise RuntimeError("verifier down")


def _raises_batched(prompts, responses, samples):
    raise RuntimeError("verifier down")


FAILING = {
    "sync": lambda tmp_path: RewardFunction(_raises, on_error=ON_ERROR),
    "async": lambda tmp_path: RewardFunction(_raises_async, on_error=ON_ERROR),
    "batched": lambda tmp_path: RewardFunction(_raises_batched, on_error=ON_ERROR, batched=True),
    "file": lambda tmp_path: RewardFunction(_file(tmp_path, "broken"), on_error=ON_ERROR),
    "non-number": lambda tmp_path: RewardFunction(lambda p, r, s: "1.0", on_error=ON_ERROR),
}


@pytest.mark.parametrize("shape", list(FAILING))
def test_a_failing_fn_scores_on_error_and_is_counted(shape, tmp_path):
    rf = FAILING[shape](tmp_path)
    try:
        assert [rf(*t) for t in TRIPLES[:3]] == [ON_ERROR] * 3
        assert rf.call_batch(TRIPLES[:2]) == [ON_ERROR] * 2
        stats = rf.stats()
        errors = sum(v for k, v in stats.items() if k in ("reward_exception", "reward_timeout", "reward_non_number",
                                                          "reward_wrong_length"))
        assert errors == 5 and stats["reward_calls"] == 5
    finally:
        rf.close()
