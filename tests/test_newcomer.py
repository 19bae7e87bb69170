"""A newcomer's first hour: the rough edges a fresh user met (issue 34), each pinned here.

* the summary gives the warm-start and the held-out figure in one unit, named;
* without a terminal the warm-start lines carry the last held-out figure, count the model's
  steps (not replays) and say why the loss jumps at a landing rewind;
* ``--dry-run`` finds a ``reward.fn`` file that is not there;
* an out-of-range command-line override is blamed on the command line, not the YAML file; a
  YAML syntax error names the line and column;
* a slow build is not a stall (``train.build_timeout_s``), and a restart says whether it is after
  a fault or a missed deadline;
* ``train.keep_best`` keeps the best evaluated weights as ``checkpoint/``.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from asyncflow.cli import main
from asyncflow.observe.report import Progress, format_summary
from asyncflow.tasks.warmstart_landing import Snapshot, Trainer, land
from asyncflow.workflow.best import BestKeeper
from asyncflow.workflow.failure import DeadlineMissed, StepStalled, WorkerLost, restart_cause
from asyncflow.workflow.watchdog import Watchdog


def _summary(metric: str, before: float, after: float) -> dict:
    return {"heldout_acc_before": before, "heldout_acc_after": after, "heldout_metric": metric,
            "busy": {}, "cpu": {"cores": None}, "init": {"source": "warmstart", "cached": True, "accuracy": before,
                                                          "steps": 300, "replayed": 20},
            "mode": "async", "staleness_bound": 1, "samples_per_s": 1.0, "tokens_per_s": 1.0, "samples": 1,
            "wall_s": 1.0, "steady_samples_per_s": 1.0, "max_staleness": 0, "staleness_hist": {}, "dropped_stale": 0,
            "run_dir": "runs/x"}


@pytest.mark.parametrize("metric, ws, held", [
    ("exact", "SFT to held-out exact 0.575 in 300 steps, 20 more replayed", "held-out exact     0.575 -> 0.990"),
    ("exact match", "SFT to held-out exact match 57.5% in 300 steps", "held-out exact match 57.5% -> 99.0%"),
])
def test_the_summary_gives_warmstart_and_heldout_in_one_unit(metric, ws, held):
    text = format_summary(_summary(metric, 0.575, 0.99))
    assert ws in text and held in text, text


def test_warmstart_lines_without_a_terminal_carry_the_last_heldout_figure(capsys):
    p = Progress(10, metric="exact match", tty=False, every_s=0.0)
    p.warmstart(50, 0.31, 1.5)
    p.warmstart(51, None, 1.4)
    p.note("warm-start: rewinding to step 40")
    p.warmstart(41, None, 1.9)
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["warm-start (SFT) step 50: loss 1.500, held-out exact match 31.0%",
                     "warm-start (SFT) step 51: loss 1.400, held-out exact match 31.0% (at step 50)",
                     "warm-start: rewinding to step 40",
                     "warm-start (SFT) step 41: loss 1.900, held-out exact match 31.0% (at step 50)"]


def test_a_landing_rewind_is_announced_and_progress_counts_the_models_steps():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen, notes = [], []
    trainer = Trainer(model, opt, lambda rows: 1.0, lambda step: 0.1, lambda s, a, loss: seen.append((s, a)),
                      notes.append)
    snap = Snapshot.take(model, opt, 4)
    trainer.since = [None] * 6  # the steps 5..10 run since the snapshot (rows unused by the step function)
    figures = iter([0.2, 0.5, 0.7])
    acc, step = land(trainer, snap, lambda n: next(figures), target=0.65, every=2, screen_n=None)
    assert (acc, step) == (0.7, 10)
    assert len(notes) == 1 and "at step 10; rewinding to step 4 and replaying its 6 steps" in notes[0], notes
    assert [s for s, _ in seen] == [5, 6, 7, 8, 9, 10]  # the model's steps again, not 11.. (replays counted)
    assert [a for _, a in seen] == [None, 0.2, None, 0.5, None, 0.7]


def test_dry_run_finds_a_reward_file_that_is_not_there(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--dry-run", "reward.fn=./nope.py:score"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "reward.fn = './nope.py:score': no such file 'nope.py'" in err[0], err


@pytest.mark.parametrize("yaml_text, overrides, says", [
    ("train:\n  micro_prompts: 4\n", ["train.prompts_per_step=1"],
     "in the override train.prompts_per_step=1 (with train.micro_prompts from '{f}'): "
     "train.micro_prompts (4) must be <= train.prompts_per_step (1)"),
    ("train:\n  micro_prompts: 40\n", [], "in '{f}': train.micro_prompts (40) must be <= train.prompts_per_step"),
    ("train:\n  steps: 3\n", ["train.micro_prompts=40"],
     "in the override train.micro_prompts=40 (with train.prompts_per_step's default)"),
    ("train:\n  steps: 3\n", ["train.steps=-1"], "in the override train.steps=-1: train.steps = -1"),
    ("train:\n  steps: [1,\n", [], "'{f}' is not valid YAML: line 3, column 1: expected the node content"),
])
def test_a_config_error_names_where_the_value_came_from(tmp_path, capsys, yaml_text, overrides, says):
    f = tmp_path / "base.yaml"
    f.write_text(yaml_text)
    assert main(["train", "--dry-run", str(f), *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says.format(f=f) in err[0], err


class _Launcher:
    """A launcher whose ``health`` answers after ``delay`` seconds (or raises ``error``)."""

    def __init__(self, delay: float, error: Exception | None = None):
        self.delay, self.error = delay, error

    def submit(self, handle, method, *args):
        fut: Future = Future()

        def answer():
            time.sleep(self.delay)
            fut.set_exception(self.error) if self.error else fut.set_result({})

        threading.Thread(target=answer, daemon=True).start()
        return fut

    def result(self, fut, timeout):
        try:
            return fut.result(timeout)
        except TimeoutError:
            raise
        except Exception as e:  # (concurrent.futures.TimeoutError is TimeoutError on 3.11)
            raise e


def test_a_build_slower_than_the_step_timeout_is_not_a_stall(capsys):
    Watchdog(_Launcher(delay=1.0), {"rollout": object()}, step_timeout_s=0.2).wait_built(limit=30.0)
    err = capsys.readouterr().err
    assert "building the workers takes longer than train.step_timeout_s = 0.2 s" in err


def test_a_build_past_its_own_deadline_is_a_missed_deadline_and_a_dead_one_fails_at_once():
    with pytest.raises(DeadlineMissed, match="worker 'rollout' did not answer within 1 s"):
        Watchdog(_Launcher(delay=30.0), {"rollout": object()}, step_timeout_s=0.3).wait_built(limit=1.0)
    t = time.monotonic()
    with pytest.raises(WorkerLost) as lost:
        Watchdog(_Launcher(0.0, WorkerLost("the process died")), {"actor": object()}, 0.3).wait_built(limit=600.0)
    assert time.monotonic() - t < 5 and not isinstance(lost.value, DeadlineMissed)


def test_a_restart_says_whether_it_is_after_a_fault_or_a_deadline():
    assert restart_cause(WorkerLost("gone")) == "a fault"
    assert restart_cause(DeadlineMissed("slow")).startswith("a missed deadline")
    assert restart_cause(StepStalled("stuck")).startswith("a missed deadline")


def _save(marker: str):
    def save(path: str) -> None:
        import pathlib

        pathlib.Path(path).mkdir(parents=True)
        (pathlib.Path(path) / "weights").write_text(marker)
    return save


def test_best_keeper_keeps_the_best_strictly_and_swaps_it_in_at_the_end(tmp_path):
    k = BestKeeper(tmp_path)
    assert k.offer(10, 0.5, _save("v10")) and not k.offer(20, 0.5, _save("v20"))  # a tie keeps the earlier
    assert k.offer(30, 0.9, _save("v30")) and not k.offer(40, None, _save("v40"))
    assert BestKeeper(tmp_path).best == (30, 0.9)  # a resumed run reads it back
    _save("v50")(str(tmp_path / "checkpoint"))  # the last weights, as the run's end writes them
    kept = k.finish(tmp_path, 50, 0.8)
    assert kept == {"kept": "best", "version": 30, "heldout_acc": 0.9, "last_version": 50, "last_heldout_acc": 0.8}
    assert (tmp_path / "checkpoint" / "weights").read_text() == "v30"
    assert (tmp_path / "checkpoint-last" / "weights").read_text() == "v50"
    assert not (tmp_path / "checkpoint-best").exists()


def test_best_keeper_leaves_the_last_when_it_is_as_good(tmp_path):
    k = BestKeeper(tmp_path)
    k.offer(10, 0.9, _save("v10"))
    _save("v20")(str(tmp_path / "checkpoint"))
    assert k.finish(tmp_path, 20, 0.9)["kept"] == "last"
    assert (tmp_path / "checkpoint" / "weights").read_text() == "v20" and not (tmp_path / "checkpoint-best").exists()


@pytest.mark.parametrize("mode", ["sync", "async"])  # (evaluations pausing training; beside it, from the evaluator)
def test_keep_best_in_a_run_keeps_the_best_evaluated_version(tmp_path, mode):
    args = ["train", "launcher=local", f"mode={mode}", "warmstart.enabled=false", "progress=false",
            f"train.steps={4 if mode == 'sync' else 8}", "train.eval_every=1", "task.eval_n=20", "train.prompts_per_step=2",
            "train.micro_prompts=1", "train.lr=1e-2", "train.keep_best=true", f"run_dir={tmp_path}"]
    assert main(args) == 0
    run = next(tmp_path.iterdir())
    s = json.loads((run / "summary.json").read_text())
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    periodic = [m["heldout_acc"] for m in lines if m.get("heldout_acc") is not None]
    kept = s["checkpoint_kept"]
    # (async: evaluations run beside training and one due while another runs is skipped: on a busy
    # machine none may finish before the end; then the last is kept, which the else branch checks)
    assert kept is not None and (periodic or mode == "async")
    if periodic and max(periodic) > s["heldout_acc_after"]:
        assert kept["kept"] == "best" and kept["heldout_acc"] == max(periodic)
        assert (run / "checkpoint-last" / "config.json").is_file()
    else:
        assert kept["kept"] == "last" and not (run / "checkpoint-last").exists()
    assert (run / "checkpoint" / "config.json").is_file() and not (run / "checkpoint-best").exists()
