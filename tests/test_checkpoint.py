"""Resumable checkpoints: atomic background writes, ``keep_checkpoints``, an exact ``--resume`` of
``mode=sync`` after the driver process is killed with ``kill -9`` (``stream``/``async``:
tests/test_resume_async.py)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from asyncflow.cli import main
from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model
from asyncflow.engines.training import TrainEngine, lr_multiplier
from asyncflow.workflow import checkpoint as C
from asyncflow.workflow import hostcopy

STEPS = 6
TINY = ["mode=sync", "launcher=local", "warmstart.enabled=false", "progress=false", f"train.steps={STEPS}",
        "train.prompts_per_step=2", "rollout.group_size=2", "train.micro_prompts=1", "task.eval_n=2",
        "train.eval_every=0", "rollout.max_new_tokens=8", "train.save_every=1", "train.keep_checkpoints=2"]
# (by content: an untrained model's answers all run to max_new_tokens, so a length reward would be flat)
REWARD = "def score(prompt, response, sample):\n    return float(sum(map(ord, response)) % 3)\n"


def snap(i: int) -> C.Snapshot:
    return {"model/w": np.full(3, i, np.float32)}, {"i": i}


def test_writes_are_atomic_and_only_the_newest_are_kept(tmp_path, monkeypatch):
    w = C.CheckpointWriter(tmp_path / "checkpoints", keep=2)
    for i in (1, 2, 3):
        w.write(i, snap(i))
    w.close()
    assert [p.name for p in C.complete(tmp_path / "checkpoints")] == ["step-2", "step-3"]

    def crash(tensors, path):  # the process dies half-way through writing step 4
        Path(path).write_bytes(b"half")
        raise OSError("disk gone")

    monkeypatch.setattr(C, "save_file", crash)
    w = C.CheckpointWriter(tmp_path / "checkpoints", keep=2)
    w.write(4, snap(4))
    with pytest.raises(OSError):
        w.close()
    assert (tmp_path / "checkpoints" / ".tmp-4").is_dir()  # left behind, never read
    last = C.latest(tmp_path)
    assert last.name == "step-3" and C.read(last)[1] == {"i": 3}
    assert (C.read(last)[0]["model/w"] == 3).all()


def test_a_failed_write_followed_by_a_good_one_is_still_an_error(tmp_path):
    """Writes queue behind each other: when one fails and a later one succeeds, the failure
    must still reach the driver (at the next write or at close), never be dropped because it
    was not the last write (a checkpoint silently missing)."""
    w = C.CheckpointWriter(tmp_path / "checkpoints", keep=2)
    go = threading.Event()

    def late_failure(_: C.Snapshot) -> C.Snapshot:
        go.wait(5)
        raise TimeoutError("rollout did not take its checkpoint snapshot within 60 s")

    w.write(1, snap(1), late_failure)
    w.write(2, snap(2))  # queued behind step 1, which has not failed yet
    go.set()
    with pytest.raises(TimeoutError, match="checkpoint snapshot"):
        w.close()
    assert [p.name for p in C.complete(tmp_path / "checkpoints")] == ["step-2"]

    w = C.CheckpointWriter(tmp_path / "other", keep=2)
    w.write(1, snap(1), late_failure)  # (go is set: fails at once)
    w._pool.submit(lambda: None).result()  # (the write of step 1 is done)
    with pytest.raises(TimeoutError):  # the next write says so
        w.write(2, snap(2))


def test_resume_is_refused_in_one_line_for_sync_dp_overprovision_and_for_a_changed_config(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("mode: sync\ntrain:\n  dp: 2\nrollout:\n  overprovision: 2\n")
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"asyncflow: error: --resume {run}: resume with rollout.overprovision > 0 in mode=sync with "
                   "train.dp > 1 is not supported yet (its state is not checkpointed)")
    for mode in ("sync", "async"):  # dynamic sampling resumes in every mode
        (run / "config.yaml").write_text(f"mode: {mode}\nalgorithm:\n  dynamic_sampling: true\n")
        assert main(["train", "--resume", str(run)]) == 2
        assert "no complete checkpoint" in capsys.readouterr().err
    (run / "config.yaml").write_text("mode: async\nalgorithm:\n  name: ppo\n")  # PPO resumes in every mode
    assert main(["train", "--resume", str(run)]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    (run / "config.yaml").write_text("mode: sync\n")
    assert main(["train", "--resume", str(run), "mode=async"]) == 2
    assert "mode differs" in capsys.readouterr().err
    assert main(["train", "--resume", str(run), "train.lr=0.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert "train.lr differs" in err and "\n" not in err
    assert main(["train", "--resume", str(run), "train.steps=7"]) == 2  # allowed, but nothing to resume
    assert "no complete checkpoint" in capsys.readouterr().err


def _engine() -> TrainEngine:
    tok = build_char_tokenizer()
    return TrainEngine(build_tiny_model(tok, seed=0), pad_id=tok.pad_token_id, lr=1e-2,
                       schedule=lambda s: lr_multiplier(s, 6, warmup=2, schedule="cosine"))


def _train(engine: TrainEngine, steps: int) -> None:
    """Steps on data drawn from the global RNGs (so their restored states matter too)."""
    for _ in range(steps):
        prompt = torch.randint(3, 20, (4,)).tolist() + [int(np.random.randint(3, 20)), random.randint(3, 19)]
        engine.forward_backward([prompt], [[5, 6, 7]], {}, lambda out, b, x: (-(out * b.mask).sum(), {}))
        engine.optimizer_step()


def test_capture_then_restore_continues_the_same_steps(tmp_path):
    """Weights, AdamW moments, the LR schedule's position, the version and the RNGs come back
    through the files (no pickle): the steps after a restore are the steps after the capture."""
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    a = _engine()
    _train(a, 2)
    w = C.CheckpointWriter(tmp_path / "checkpoints", keep=1)
    w.write(2, C.capture(a.model, a, None))
    w.close()
    _train(a, 3)
    torch.manual_seed(7), np.random.seed(7), random.seed(7)  # other RNG states: restore must set them
    b = _engine()
    C.restore(b.model, b, None, C.read(C.latest(tmp_path)))
    assert b.version == 2 and b.opt.param_groups[0]["lr"] == pytest.approx(1e-2)
    _train(b, 3)
    assert b.version == a.version == 5 and b.opt.param_groups[0]["lr"] == a.opt.param_groups[0]["lr"]
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), n


def _copied_beside_a_step(engine: TrainEngine, monkeypatch, delay: float) -> tuple[C.Snapshot, dict]:
    """A :class:`HostCopy` slowed by ``delay`` s, then one step at once; the copy and the step's metrics."""
    def slow(live):
        time.sleep(delay)
        return C.host_all(live)

    monkeypatch.setattr(hostcopy, "host_all", slow)
    live, small = C.capture_parts(engine.model, engine, None)
    copy = hostcopy.HostCopy(live, small, [engine], timeout=30)
    engine.forward_backward([[3, 4, 5]], [[5, 6, 7]], {}, lambda out, b, x: (-(out * b.mask).sum(), {}))
    step = engine.optimizer_step()  # (the first in-place change of the weights and AdamW's state)
    return copy.result(10), step


def test_a_snapshot_copied_beside_the_next_step_is_bitwise_the_blocking_one(monkeypatch):
    """The weights and AdamW's state are copied beside the next step: its optimizer step waits for
    the copy, so the snapshot is the state at the boundary, bit for bit (without the wait it is not)."""
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    a = _engine()
    _train(a, 2)
    blocking = C.capture(a.model, a, None)
    (tensors, meta), step = _copied_beside_a_step(a, monkeypatch, 0.3)
    assert step["checkpoint_wait_s"] >= 0 and a.version == 3  # its optimizer step waited for the copy
    assert tensors.keys() == blocking[0].keys() and any(k.startswith("optim/") for k in tensors)
    for k, v in blocking[0].items():
        assert v.dtype == tensors[k].dtype and v.tobytes() == tensors[k].tobytes(), k
    assert meta == json.loads(json.dumps(blocking[1]))
    assert not np.array_equal(C.capture(a.model, a, None)[0]["model/lm_head.weight"], tensors["model/lm_head.weight"])

    monkeypatch.setattr(TrainEngine, "defer_updates", lambda self, done, timeout: None)  # no wait: not the boundary
    before = C.capture(a.model, a, None)[0]
    (torn, _), step = _copied_beside_a_step(a, monkeypatch, 1.5)  # (copied after the step, certainly)
    assert "checkpoint_wait_s" not in step
    assert any(not np.array_equal(v, torn[k]) for k, v in before.items() if not k.startswith("rng/"))


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    t = time.time()
    while not path.exists():
        assert proc.poll() is None, "the run ended before its checkpoint appeared"
        assert time.time() - t < timeout, f"{path} did not appear"
        time.sleep(0.02)


def test_a_sync_run_killed_and_resumed_ends_with_the_same_weights(tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    common = [*TINY, f"reward.fn={reward}:score"]
    assert main(["train", *common, f"run_dir={tmp_path / 'whole'}"]) == 0
    whole = next((tmp_path / "whole").iterdir())

    proc = subprocess.Popen([sys.executable, "-m", "asyncflow.cli", "train", *common,
                             f"run_dir={tmp_path / 'killed'}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        while not (tmp_path / "killed").exists() or not any((tmp_path / "killed").iterdir()):
            assert proc.poll() is None
            time.sleep(0.02)
        killed = next((tmp_path / "killed").iterdir())
        _wait_for(killed / "checkpoints" / "step-2", proc)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert not (killed / "checkpoint").exists()  # it never got to the end
    assert C.latest(killed).name != f"step-{STEPS}"
    (killed / "checkpoints" / f".tmp-{STEPS + 5}").mkdir()  # a half-written one is ignored

    assert main(["train", "--resume", str(killed)]) == 0
    a, b = (load_file(str(d / "checkpoint" / "model.safetensors")) for d in (whole, killed))
    assert a.keys() == b.keys()
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) <= 1e-6
    grads = [json.loads(line)["grad_norm"] for line in (whole / "metrics.jsonl").read_text().splitlines()]
    assert any(g > 0 for g in grads)  # the weights did move
    steps = [json.loads(line)["step"] for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))
    last = C.read(C.latest(killed))[1]
    assert last["version"] == last["rollout_version"] == last["driver"]["step"] == STEPS
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["resumed_from"] >= 2 and all(p >= 0 for p in summary["checkpoint_pause_s"])

    # a finished run extended by train.steps: from its last checkpoint, metrics go on
    assert main(["train", "--resume", str(killed), f"train.steps={STEPS + 1}"]) == 0
    steps = [json.loads(line)["step"] for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 2)) and C.latest(killed).name == f"step-{STEPS + 1}"


@pytest.mark.parametrize("extra", ["train.dp=2", "algorithm.name=ppo"])
def test_a_run_resumed_from_an_earlier_checkpoint_is_exact(tmp_path, extra):
    """train.dp=2: rank 0's weights and AdamW state, every rank's own RNGs and versions; PPO:
    the critic's value model, AdamW state and step too."""
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    assert main(["train", *TINY, "train.steps=4", "train.save_every=2", extra, f"reward.fn={reward}:score",
                 f"run_dir={tmp_path / 'runs'}"]) == 0
    whole = next((tmp_path / "runs").iterdir())
    again = shutil.copytree(whole, tmp_path / "again")
    shutil.rmtree(again / "checkpoint")
    shutil.rmtree(again / "checkpoints" / "step-4")
    assert main(["train", "--resume", str(again)]) == 0
    a, b = (load_file(str(d / "checkpoint" / "model.safetensors")) for d in (whole, again))
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) <= 1e-6
    assert [json.loads(line)["step"] for line in (again / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    last = C.read(C.latest(again))[1]
    assert last["version"] == last["rollout_version"] == 4
    if extra == "train.dp=2":
        assert last["ranks"][0]["version"] == last["ranks"][0]["rollout_version"] == 4
    else:
        assert last["critic"]["version"] == 4  # (one critic epoch a step)
