"""Contract of :class:`asyncflow.tasks.base.Task`, run against every built-in task and a user's.

``TASKS`` lists the implementations: every key of
:data:`asyncflow.tasks.registry.FACTORIES` (a test keeps the list complete) and a user's
task named by import path, as a file (``path/to/file.py:build``) and as a module
(``package.module:build``). Each is built the way a run builds it: ``build_task(cfg)``
on a validated config.
"""

from __future__ import annotations

import json
import math
import textwrap

import pytest

from asyncflow.config import BUILTIN_TASKS, ConfigError, load_config
from asyncflow.tasks.base import ProblemLike, Task, TaskReward
from asyncflow.tasks.registry import FACTORIES, build_task

USER_TASK = textwrap.dedent('''
    from dataclasses import dataclass


    @dataclass(frozen=True)
    class Problem:
        prompt: str
        answer: str


    class EchoTask:
        """Repeat the number before '='."""

        greedy_eval_tokens = 4

        def __init__(self, cfg):
            self.train = [Problem(f"{i}=", str(i)) for i in range(8)]
            self.heldout = [Problem("9=", "9")]

        def reward(self, prompt, response, answer):
            return 1.0 if response.strip() == answer else 0.0


    def build(cfg):
        return EchoTask(cfg)


    def build_incomplete(cfg):
        return object()
''')


def _builtin(name: str):
    def overrides(tmp_path, monkeypatch) -> list[str]:
        return [f"task.name={name}"]

    return overrides


def _dataset(tmp_path, monkeypatch) -> list[str]:
    rows = [{"q": f"{a}*{b}=", "a": a * b} for a in range(4) for b in range(4)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ["task.name=dataset", f"task.path={path}", "task.fields={prompt: q, answer: a}",
            f"model.path={tmp_path}"]  # (a model folder: only checked when a run loads it)


def _user_file(tmp_path, monkeypatch) -> list[str]:
    (tmp_path / "my_task.py").write_text(USER_TASK)
    return [f"task.name={tmp_path / 'my_task.py'}:build"]


def _user_module(tmp_path, monkeypatch) -> list[str]:
    (tmp_path / "contract_user_tasks").mkdir()
    (tmp_path / "contract_user_tasks" / "__init__.py").write_text("")
    (tmp_path / "contract_user_tasks" / "echo.py").write_text(USER_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    return ["task.name=contract_user_tasks.echo:build"]


TASKS = {**{name: _builtin(name) for name in FACTORIES}, "dataset": _dataset,
         "user-file": _user_file, "user-module": _user_module}


@pytest.fixture(params=list(TASKS))
def task(request, tmp_path, monkeypatch) -> Task:
    return build_task(load_config(None, TASKS[request.param](tmp_path, monkeypatch)))


def test_every_builtin_task_is_registered_and_tested():
    assert set(FACTORIES) == set(BUILTIN_TASKS)
    assert set(FACTORIES) <= set(TASKS)


def test_is_a_task(task):
    assert isinstance(task, Task)
    assert isinstance(task.reward, TaskReward)
    assert task.greedy_eval_tokens is None or (isinstance(task.greedy_eval_tokens, int) and task.greedy_eval_tokens > 0)


def test_train_and_heldout_are_non_empty_problems(task):
    assert len(task.train) > 0 and len(task.heldout) > 0
    for p in list(task.train[:50]) + list(task.heldout[:50]):
        assert isinstance(p, ProblemLike)
        assert isinstance(p.prompt, str) and p.prompt and isinstance(p.answer, str) and p.answer


def test_reference_answer_scores_one_and_a_wrong_one_less(task):
    for p in list(task.train[:50]) + list(task.heldout[:50]):
        right = task.reward(p.prompt, p.answer, p.answer)
        assert right == 1.0, (p, right)
        assert task.reward(p.prompt, f" {p.answer} ", p.answer) == 1.0  # surrounding whitespace is not an error
        for wrong in ("?", p.answer + "1"):
            score = task.reward(p.prompt, wrong, p.answer)
            assert isinstance(score, float) and math.isfinite(score) and score < 1.0, (p, wrong, score)


def test_a_user_task_missing_a_method_is_a_config_error(tmp_path):
    (tmp_path / "my_task.py").write_text(USER_TASK)
    cfg = load_config(None, [f"task.name={tmp_path / 'my_task.py'}:build_incomplete"])
    with pytest.raises(ConfigError, match="no train, heldout, reward, greedy_eval_tokens"):
        build_task(cfg)
