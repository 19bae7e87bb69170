"""A user's mistakes are one clear line, through the CLI (``asyncflow train ...``), before the
roles start where possible: a bad dataset row (file, line, field and the config key that skips
it), a reward module or function that is not there; a reward that raises on some answers is
one warning line at the end with the count and the first error (tracebacks in
``reward_errors.log``), and the counts in ``summary.json`` agree. Relative paths in a YAML
file are relative to that file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncflow.cli import main
from asyncflow.config import ConfigError, load_config
from asyncflow.observe.report import FN_ERRORS

TINY = ["mode=sync", "progress=false", "train.steps=2", "train.prompts_per_step=2",
        "train.micro_prompts=1", "rollout.group_size=2", "rollout.max_batch=4", "task.eval_n=4",
        "rollout.max_new_tokens=3"]


# Each mistake under both launchers: the ones found before the roles start never start Ray; the
# rewards that raise run their roles in Ray workers and must still come back as one line and counts.
LAUNCHERS = ["local", pytest.param("ray", marks=pytest.mark.ray)]


def _dataset(path: Path, bad: str | None = None) -> Path:
    rows = [json.dumps({"q": f"{a}+{b}=", "a": str(a + b)}) for a in range(4) for b in range(4)]
    if bad is not None:
        rows.insert(1, bad)
    path.write_text("\n".join(rows) + "\n")
    return path


def _errors(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("asyncflow:")]


def _summary(run_dir: Path) -> dict:
    (run,) = [p for p in run_dir.iterdir() if (p / "summary.json").is_file()]
    return json.loads((run / "summary.json").read_text())


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_bad_row_is_one_line_naming_file_line_field_and_the_key_that_skips_it(model_dir, tmp_path, capsys,
                                                                                launcher):
    data = _dataset(tmp_path / "train.jsonl", bad=json.dumps({"q": "9+9="}))
    argv = ["train", "task.name=dataset", f"task.path={data}", "task.fields={prompt: q, answer: a}",
            f"model.path={model_dir}", f"run_dir={tmp_path}/runs", f"launcher={launcher}", *TINY]
    assert main(argv) == 2
    (line,) = _errors(capsys.readouterr().err)
    assert f"{data}:2: field 'a' (mapped to answer) is missing" in line and "task.on_bad_row=skip" in line
    assert "on_error" not in line and not (tmp_path / "runs").exists()  # failed before the run began

    assert main([*argv, "task.on_bad_row=skip"]) == 0
    out = capsys.readouterr().out
    summary = _summary(tmp_path / "runs")
    assert summary["skipped_rows"] == 1 and summary["skipped_first"].startswith(f"{data}:2: field 'a'")
    assert "bad rows skipped   1 (task.on_bad_row=skip)" in out
    assert summary["heldout_metric"] == "mean reward" and "held-out mean reward" in out


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("fn, says", [
    ("no_such_module_xyz:score", "reward.fn = 'no_such_module_xyz:score': cannot import module 'no_such_module_xyz'"),
    ("{here}/rewards.py:nope", "'{here}/rewards.py' has no function 'nope'"),
    ("{here}/missing.py:score", "no such file '{here}/missing.py'"),
])
def test_a_missing_reward_module_or_function_is_one_line(tmp_path, capsys, fn, says, launcher):
    (tmp_path / "rewards.py").write_text("def score(prompt, response, sample):\n    return 1.0\n")
    argv = ["train", f"reward.fn={fn.format(here=tmp_path)}", "warmstart.enabled=false", f"run_dir={tmp_path}/runs",
            f"launcher={launcher}", *TINY]
    assert main(argv) == 2
    (line,) = _errors(capsys.readouterr().err)
    assert says.format(here=tmp_path) in line and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_reward_that_raises_is_one_line_at_the_end_and_counted_once(tmp_path, capsys, launcher):
    (tmp_path / "flaky.py").write_text(
        "def score(prompt, response, sample):\n"
        "    if len(response) % 2:\n"
        "        raise ValueError(f'cannot parse {len(response)} characters')\n"
        "    return 1.0\n")
    argv = ["train", f"reward.fn={tmp_path}/flaky.py:score", "warmstart.enabled=false", f"run_dir={tmp_path}/runs",
            f"launcher={launcher}", *TINY]
    assert main(argv) == 0
    (line,) = _errors(capsys.readouterr().err)
    s = _summary(tmp_path / "runs")
    n, calls = s["reward_errors"], s["reward_fn"]["reward_calls"]
    assert 0 < n == sum(s["reward_fn"][k] for k in FN_ERRORS) == s["reward_fn"]["reward_exception"]
    assert f"the reward failed on {n} of {calls} answers" in line
    assert "first: ValueError: cannot parse" in line and s["reward_first_error"].startswith("ValueError: cannot parse")
    log = Path(s["run_dir"]) / "reward_errors.log"
    assert str(log) in line
    text = log.read_text()
    assert 1 <= text.count("Traceback (most recent call last)") == min(n, 5) and "flaky.py" in text


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_task_reward_that_raises_is_one_line_too(tmp_path, capsys, launcher):
    (tmp_path / "tasks.py").write_text(
        "from asyncflow.tasks.addition import AdditionTask\n"
        "class Picky(AdditionTask):\n"
        "    def reward(self, prompt, response, answer):\n"
        "        if len(response) % 2:\n"
        "            raise KeyError('odd')\n"
        "        return 1.0\n"
        "def build(cfg):\n"
        "    return Picky(digits=2, holdout_frac=0.2, seed=0)\n")
    argv = ["train", f"task.name={tmp_path}/tasks.py:build", "warmstart.enabled=false", f"run_dir={tmp_path}/runs",
            f"launcher={launcher}", *TINY]
    assert main(argv) == 0
    (line,) = _errors(capsys.readouterr().err)
    s = _summary(tmp_path / "runs")
    assert s["reward_errors"] > 0 and s["reward_fn"] == {} and s["reward_first_error"] == "KeyError: 'odd'"
    assert f"the reward failed on {s['reward_errors']} answers" in line and "first: KeyError: 'odd'" in line
    assert "tasks.py" in (Path(s["run_dir"]) / "reward_errors.log").read_text()


def test_relative_paths_in_a_yaml_file_are_relative_to_it(tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "run.yaml").write_text(
        "model: {path: models/m}\n"
        "task: {name: tasks.py:build, path: data/train.jsonl, heldout_path: ../held.jsonl}\n"
        "reward: {fn: rewards.py:score}\n"
        "eval: {metric: my_pkg.metrics:exact}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(conf / "run.yaml")
    assert cfg.model.path == f"{conf}/models/m" and cfg.task.path == f"{conf}/data/train.jsonl"
    assert cfg.task.heldout_path == f"{conf}/../held.jsonl"
    assert cfg.task.name == f"{conf}/tasks.py:build" and cfg.reward.fn == f"{conf}/rewards.py:score"
    assert cfg.eval.metric == "my_pkg.metrics:exact"  # a module path is not a file
    cfg = load_config(Path("../conf/run.yaml"), ["task.path=rel.jsonl", "eval.metric=m.py:f"])
    assert cfg.task.path == "rel.jsonl" and cfg.eval.metric == "m.py:f"  # overrides: the working directory's
    assert cfg.model.path == f"{conf}/models/m"
    (conf / "abs.yaml").write_text(f"task: {{path: {tmp_path}/a.jsonl}}\nmodel: {{path: ~/m}}\n")
    cfg = load_config(conf / "abs.yaml")
    assert cfg.task.path == f"{tmp_path}/a.jsonl" and cfg.model.path == "~/m"
    from asyncflow.config import dump_config

    cfg = load_config(None, ["task.path=rel.jsonl", "reward.fn=r.py:f"])  # a run folder's config.yaml:
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "config.yaml").write_text(dump_config(cfg, absolute=True))  # reads the same from there
    again = load_config(tmp_path / "runs" / "config.yaml")
    assert again.task.path == f"{elsewhere}/rel.jsonl" and again.reward.fn == f"{elsewhere}/r.py:f"


def test_a_missing_file_says_how_relative_paths_are_read(tmp_path):
    with pytest.raises(ConfigError, match="relative to the folder of the YAML file that gives it"):
        from asyncflow.tasks.plugins import load_callable

        load_callable("nowhere/r.py:score", "reward.fn")


def test_a_missing_tracker_package_is_one_line_naming_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError, match=r"mlflow needs the mlflow package.*pip install 'asyncflow\[mlflow\]'"):
        load_config(None, ["log.backends=[jsonl, mlflow]"])
    assert load_config(None, ["log.backends=jsonl"]).log.backends == ["jsonl"]  # one name, or a,b
