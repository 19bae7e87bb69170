"""Tasks by name: the built-in ones, and a user's own by import path.

``task.name`` is either a built-in name (a key of :data:`FACTORIES`) or an import path
``package.module:factory`` / ``path/to/file.py:factory``: ``factory(cfg) -> Task`` (a class
whose constructor takes the run config works too). Adding a built-in task is its module
plus one line in :data:`FACTORIES` (and its name in
:data:`asyncflow.config.BUILTIN_TASKS`, which the config validates against; a test keeps
the two equal). Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncflow.config import ConfigError, RunConfig
from asyncflow.tasks.addition import AdditionTask
from asyncflow.tasks.arith_tasks import CountdownTask, MultistepTask
from asyncflow.tasks.base import Task
from asyncflow.tasks.dataset_task import DatasetTask
from asyncflow.tasks.plugins import load_callable

TaskFactory = Callable[[RunConfig], Task]

# TODO(merge): drop these ignores once tasks/base.py's Task declares train / heldout /
# greedy_eval_tokens read-only (properties): as settable protocol attributes they are
# invariant, so list[Problem] and a plain None do not match (warn_unused_ignores flags them then).
FACTORIES: dict[str, TaskFactory] = {
    "addition": lambda cfg: AdditionTask(  # type: ignore[dict-item, return-value]
        digits=cfg.task.digits, holdout_frac=cfg.task.holdout_frac, seed=cfg.seed),
    "countdown": lambda cfg: CountdownTask(  # type: ignore[dict-item, return-value]
        terms=cfg.task.terms or 3, holdout_frac=cfg.task.holdout_frac, seed=cfg.seed),
    "multistep": lambda cfg: MultistepTask(  # type: ignore[dict-item, return-value]
        terms=cfg.task.terms or 4, holdout_frac=cfg.task.holdout_frac, seed=cfg.seed),
    "dataset": DatasetTask,  # type: ignore[dict-item]
}


def build_task(cfg: RunConfig) -> Task:
    """The task named by ``cfg.task.name`` (built-in, or ``module:factory`` of the user's)."""
    name = cfg.task.name
    if name in FACTORIES:
        return FACTORIES[name](cfg)
    factory = load_callable(name, what="task.name")
    task = factory(cfg)
    missing = [a for a in ("train", "heldout", "reward", "greedy_eval_tokens") if not hasattr(task, a)]
    if missing:
        raise ConfigError(f"task.name = '{name}': the task it built has no {', '.join(missing)} "
                          "(a task needs train, heldout, reward(prompt, response, answer) and greedy_eval_tokens; "
                          "see asyncflow/tasks/base.py)")
    return task


def heldout_metric(cfg: RunConfig, task: Task,
                   reward: Callable[[], Callable] | None = None) -> tuple[str, Callable | None]:
    """What the held-out evaluation measures: its name and the score ``fn(prompt, response, answer)``
    (None = exact match of the stripped response). ``eval.metric`` when set (named after its
    function); else a task's ``eval_score`` ("accuracy") unless ``reward.fn`` replaces the reward;
    else the reward ("mean reward": ``reward()`` builds it) for a task that generates
    ``greedy_eval_tokens``; else "exact match"."""
    if cfg.eval.metric:
        fn = load_callable(cfg.eval.metric, what="eval.metric")
        return getattr(fn, "__name__", cfg.eval.metric), fn
    score = getattr(task, "eval_score", None) if not cfg.reward.fn else None
    if score is not None:
        return "accuracy", score
    if task.greedy_eval_tokens:
        return "mean reward", reward() if reward is not None else task.reward
    return "exact match", None
