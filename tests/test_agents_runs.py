"""Multi-turn runs end to end through the CLI (tiny models, a few steps, in this process).

* the openai_agent example trains through rollout's endpoint (its agent: the real openai client);
* an environment that raises on ~10% of its steps finishes the run: the count in summary.json, in
  one line on stderr, and the first tracebacks in RUN_DIR/env_errors.log;
* an async run resumed from a checkpoint taken while episodes were in flight continues them, and
  trains every prompt group exactly once.
"""

from __future__ import annotations

import json
import runpy
import shutil
from pathlib import Path

from asyncflow.cli import main
from asyncflow.workflow import checkpoint as C

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
QUICK = ["launcher=local", "progress=false", "train.prompts_per_step=2", "rollout.group_size=2",
         "train.micro_prompts=1", "task.eval_n=4", "train.eval_every=0", "warmstart.enabled=false"]

ENV = '''
import random

rng = random.Random(0)
LOG = {log!r}


class Talk:
    """Answers every turn with a few words, three turns an episode; raises on ~{p:.0%} of steps."""

    def reset(self, sample):
        self.n = 0
        return sample["prompt"]

    def step(self, turn):
        if rng.random() < {p}:
            with open(LOG, "a") as f:
                f.write("raised\\n")
            raise ConnectionError("the tool's server went away")
        self.n += 1
        return (" go on" if self.n < 3 else None), float(len(turn.content)), self.n >= 3

    def state_dict(self):
        return {{"n": self.n}}

    def load_state_dict(self, state):
        self.n = state["n"]


def make():
    return Talk()
'''


def _env(tmp_path: Path, p: float) -> str:
    path = tmp_path / "talk.py"
    path.write_text(ENV.format(log=str(tmp_path / "raised.txt"), p=p))
    return f"env.fn={path}:make"


def _summary(runs: Path) -> dict:
    return json.loads((next(d for d in runs.iterdir() if d.is_dir()) / "summary.json").read_text())


def test_the_openai_agent_example_trains_through_the_endpoint(tmp_path):
    for name in ("calculator_tool", "openai_agent"):
        shutil.copytree(EXAMPLES / name, tmp_path / name, ignore=shutil.ignore_patterns("model", "__pycache__"))
    runpy.run_path(str(tmp_path / "calculator_tool" / "build_model.py"))["main"](tmp_path / "calculator_tool" / "model")
    yaml = tmp_path / "openai_agent" / "openai_agent.yaml"
    assert main(["train", str(yaml), *QUICK, "train.steps=2", f"run_dir={tmp_path / 'runs'}"]) == 0
    s = _summary(tmp_path / "runs")
    assert s["samples"] == 8 and s["episodes"]["episodes"] >= 8 and s["env_errors"] == 0, s["episodes"]
    assert s["heldout_metric"] == "mean episode reward"


def test_a_flaky_environment_finishes_the_run_and_the_errors_are_counted(tmp_path, capsys):
    assert main(["train", *QUICK, "mode=async", "train.steps=4", _env(tmp_path, 0.1), "env.max_turns=3",
                 f"run_dir={tmp_path / 'runs'}"]) == 0
    raised = len((tmp_path / "raised.txt").read_text().splitlines())
    s = _summary(tmp_path / "runs")
    assert raised > 0 and s["env_errors"] == s["episodes"]["env_exception"] == raised
    assert s["env_first_error"] == "ConnectionError: the tool's server went away"
    line = [x for x in capsys.readouterr().err.splitlines() if "environment error" in x]
    assert len(line) == 1 and f"ended {raised} of {s['episodes']['episodes']} episodes" in line[0]
    log = next((tmp_path / "runs").iterdir()) / "env_errors.log"
    assert "ConnectionError: the tool's server went away" in log.read_text() and "Traceback" in log.read_text()


def test_an_async_run_resumed_mid_episode_continues_its_episodes(tmp_path):
    steps = ["mode=async", "staleness=2", "train.save_every=1", _env(tmp_path, 0.0), "env.max_turns=3"]
    assert main(["train", *QUICK, "train.steps=4", *steps, f"run_dir={tmp_path / 'runs'}"]) == 0
    whole = next((tmp_path / "runs").iterdir())
    again = shutil.copytree(whole, tmp_path / "again")
    shutil.rmtree(again / "checkpoint")
    shutil.rmtree(again / "checkpoints" / "step-4")
    saved = C.read(C.latest(again))[1]
    assert saved["driver"]["step"] == 3 and saved["rollout"]["episodes"]  # episodes were in flight there
    assert main(["train", "--resume", str(again)]) == 0
    s = json.loads((again / "summary.json").read_text())
    assert s["resumed_from"] == 3 and s["in_flight_answers"]["continued"] > 0
    lines = [json.loads(x) for x in (again / "metrics.jsonl").read_text().splitlines()]
    trained = [g for m in lines for g in m["groups"]]
    assert len(trained) == len(set(trained)) == 4 * 2  # every prompt group trained exactly once


def test_a_multi_turn_sync_run_resumed_trains_the_same_prompts_in_the_same_steps(tmp_path):
    """``sync`` checkpoints at the step boundary (the prompt cursor and counters): the
    resumed run trains the prompts the whole run trained, step by step. (Not the same weights: when an
    environment answers decides which decode step a turn joins, so multi-turn sampling is not
    reproducible bit for bit.)"""
    # (one torch thread: two of them spin against each other on a loaded 2-core machine)
    steps = ["mode=sync", "resources.sync_threads=1", "train.save_every=1", _env(tmp_path, 0.0), "env.max_turns=3"]
    assert main(["train", *QUICK, "task.eval_n=2", "train.steps=2", *steps, f"run_dir={tmp_path / 'runs'}"]) == 0
    whole = next((tmp_path / "runs").iterdir())
    again = shutil.copytree(whole, tmp_path / "again")
    shutil.rmtree(again / "checkpoint")
    shutil.rmtree(again / "checkpoints" / "step-2")
    assert main(["train", "--resume", str(again)]) == 0
    lines = [[json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (whole, again)]
    assert [sorted(m["groups"]) for m in lines[0]] == [sorted(m["groups"]) for m in lines[1]]


def test_the_calculator_tool_answers_error_to_any_malformed_expression():
    """The model writes the tool's argument: whatever it writes, the example's tool answers (a
    malformed one with ``error``, which the model reads) and never raises, so it never ends an
    episode as an environment error. ``'\\x1e44'`` (a control character ``str.strip`` removes and
    ``int`` refuses) raised before, 2 episodes in 7,680 of a calculator run."""
    calc = runpy.run_path(str(EXAMPLES / "calculator_tool" / "calc.py"))["calc"]
    assert [calc(x) for x in ("12*3", "12 + 30", "\x1e44*3", "²*3", "1*", "*", "", "a*b", "3**2")] == [
        "36", "42", "132", "error", "error", "error", "error", "error", "error"]
