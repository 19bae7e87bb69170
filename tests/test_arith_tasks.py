"""Countdown and multistep: safe parser, rewards on hand-computed cases, seeded disjoint splits,
char-tokenizer coverage and the warm-start cache key (addition's key must not change)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from asyncflow.config import load_config
from asyncflow.engines.tiny import CHARSET
from asyncflow.tasks.registry import build_task
from asyncflow.tasks.arith import ArithError, evaluate
from asyncflow.tasks.arith_tasks import CountdownTask, MultistepTask


@pytest.mark.parametrize("text, value", [
    ("3+4*2-5", 6), ("(3+5)*2", 16), ("8-3-2", 3), ("8/4/2", 1), ("7/2", Fraction(7, 2)),
    ("2*(3+(4-1))", 12), (" 9 - 9 ", 0)])
def test_parser_hand_computed(text, value):
    assert evaluate(text) == value


@pytest.mark.parametrize("text", [
    "", "3+", "(3+5", "3+5)", "-3+5", "3**2", "3//2", "4/0", "4/(2-2)", "__import__('os')", "1e3",
    "3 4", "((((((((((1))))))))))", "1" * 65])
def test_parser_rejects_malformed_and_unsafe_text(text):
    with pytest.raises(ArithError):
        evaluate(text)


def test_countdown_reward_hand_computed():
    t = CountdownTask(terms=3, seed=0)
    p = "2,3,5:13="
    assert t.reward(p, "3+5*2", "3+5*2") == 1.0
    assert t.reward(p, " 5*2+3", "3+5*2") == 1.0  # another correct expression, spaces ignored
    assert t.reward(p, "(2+3)*5", "3+5*2") == 0.1  # well formed, 25 != 13
    assert t.reward(p, "3+5", "3+5*2") == 0.1  # a subset of the numbers is allowed
    assert t.reward(p, "3+5*2+2", "3+5*2") == 0.0  # 2 used twice (given once) -> 15 but invalid
    assert t.reward(p, "8+5", "3+5*2") == 0.0  # 8 is not given
    assert t.reward(p, "3+5*", "3+5*2") == 0.0  # malformed
    assert t.reward(p, "13", "3+5*2") == 0.0  # the target itself is not a given number
    assert t.reward("5,5,7:30=", "5*7-5", "5*7-5") == 1.0  # repeated numbers: each given copy usable once
    assert t.eval_score(p, "(2+3)*5", "3+5*2") == 0.0 and t.eval_score(p, "2*5+3", "") == 1.0


def test_multistep_reward_and_problems():
    t = MultistepTask(terms=4, seed=0)
    assert t.reward("3+4*2-5=", " 6", "6") == 1.0 and t.reward("3+4*2-5=", "7", "6") == 0.0
    for p in t.train[:200]:
        assert p.prompt.endswith("=") and len(p.prompt) == 8  # 4 digits + 3 operators + '='
        assert evaluate(p.prompt[:-1]) == int(p.answer)


@pytest.mark.parametrize("cls, terms", [(CountdownTask, 3), (MultistepTask, 4)])
def test_split_is_seeded_disjoint_and_in_the_tokenizer(cls, terms):
    a, b, c = cls(terms=terms, seed=0), cls(terms=terms, seed=0), cls(terms=terms, seed=1)
    assert a.train == b.train and a.heldout == b.heldout  # same seed, same split
    assert a.heldout != c.heldout
    train, held = {p.prompt for p in a.train}, {p.prompt for p in a.heldout}
    assert train and held and not train & held
    assert len(held) == pytest.approx(0.2 * (len(train) + len(held)), abs=1)
    chars = set("".join(p.prompt + p.answer for p in a.train + a.heldout))
    assert chars <= set(CHARSET)
    for p in a.train[:300]:  # every reference answer is correct under the task's own reward
        assert a.reward(p.prompt, p.answer, p.answer) == 1.0


def test_build_task_and_cache_keys():
    t = build_task(load_config(None, ["task.name=countdown"]))
    assert isinstance(t, CountdownTask) and t.terms == 3
    m = build_task(load_config(None, ["task.name=multistep", "task.terms=3"]))
    assert isinstance(m, MultistepTask) and m.terms == 3
    assert t.cache_key() == {"name": "countdown", "terms": 3, "holdout_frac": 0.2, "seed": 0}
    add = build_task(load_config())
    assert not hasattr(add, "cache_key")  # addition keeps its original key (no cache invalidation)
