"""Resumable ``train.strategy=fsdp`` runs: each rank checkpoints and restores its own shards.

* Exact: two trainer ranks (real :class:`Worker` s in forked processes, FSDP2 over gloo) stopped
  at a checkpoint and resumed from it, with fresh processes, end with the weights of two ranks
  never stopped (1e-6), under a warmup-then-cosine LR schedule and AdamW (a resume that lost
  the moments, the step counts or the schedule's position would not). Each rank trains the
  same fixed rows each step, as ``sync`` would: ``mode=sync`` itself refuses fsdp (each rank's
  rollout decodes with its whole model, :mod:`asyncflow.config.checks`). The checkpoint is
  checked too: each rank's shards, put together, are the whole weights at the checkpoint.
* ``async`` under Ray, ``kill -9`` of the driver after a checkpoint, then ``--resume``: every
  prompt group of every step is trained once and the versions go on.
* ``kill -9`` of trainer rank 1 after a checkpoint (rank 0 then fails in a collective): the
  run restarts from the checkpoint (``train.max_restarts``), naming the lost rank, and trains
  every prompt group once.
* A shard of another shape (saved with another ``train.dp``) is refused in one line.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from test_dp_trainer import _forked, fill
from test_resume_async import TINY, _start, check_every_group_once

from asyncflow.cli import main
from asyncflow.config import load_config
from asyncflow.dataplane import DataPlane
from asyncflow.workflow import checkpoint as C
from asyncflow.workflow.fields import SCHEMA
from asyncflow.workflow.job import Job
from asyncflow.workflow.shards import load_shards
from asyncflow.workflow.worker import Worker
from test_failures import SLOW_BUILD  # (a loaded machine's note: not an error)

STEPS, AT = 4, 2  # the checkpoint after AT steps
CFG = ["mode=async", "launcher=ray", "train.dp=2", "train.strategy=fsdp", "train.prompts_per_step=4",
       "rollout.group_size=4", "train.micro_prompts=2", f"train.steps={STEPS}", "train.lr=1e-2",
       "train.lr_schedule=cosine", "train.warmup_steps=1", "algorithm.loss_agg=token-mean", "staleness=1",
       "warmstart.enabled=false"]


def _rank(rank: int, address: str, phase: str, model_dir: str, out: str) -> None:
    """One trainer rank: ``whole`` trains every step (the weights after AT steps and at the end);
    ``cut`` trains AT steps, snapshots, trains one more (the host copy beside it) and saves its
    snapshot as a worker would hand it over; ``resume`` restores its part of the checkpoint in
    ``out`` and trains the rest (the weights at the end)."""
    try:
        torch.set_num_threads(1)
        plane = DataPlane(SCHEMA)
        for v in range(STEPS):
            fill(plane, v)
        w = Worker(load_config(None, CFG), ["actor"], model_dir, plane, None, threads=1, rank=rank)
        w.health()
        w.join_dp(address)
        first = 0
        if phase == "resume":
            first = AT
            w.restore(C.rank_part(C.read(C.latest(Path(out))), rank), AT)
        for v in range(first, AT + 1 if phase == "cut" else STEPS):
            w.train_step(v, v + 1 < STEPS, snapshot=phase == "cut" and v == AT - 1)
            if phase == "whole" and v == AT - 1:
                np.savez(f"{out}/at.{rank}.npz", **w.roles["actor"].engine.export_weights())  # (an all-gather)
        if phase == "cut":
            tensors, meta = w.taken_snapshot(AT, 60)
            save_file(tensors, f"{out}/snap.{rank}.safetensors")
            Path(f"{out}/snap.{rank}.json").write_text(json.dumps(meta))
        else:
            np.savez(f"{out}/end.{rank}.npz", **w.roles["actor"].engine.export_weights())
        w.stop()
    except BaseException:
        traceback.print_exc()
        os._exit(1)


def test_fsdp_ranks_stopped_at_a_checkpoint_and_resumed_end_with_the_weights_of_ranks_never_stopped(
        tmp_path, model_dir):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    whole.mkdir(), cut.mkdir()
    _forked(_rank, "whole", str(model_dir), str(whole))
    _forked(_rank, "cut", str(model_dir), str(cut))
    snaps = [(load_file(str(cut / f"snap.{r}.safetensors")), json.loads((cut / f"snap.{r}.json").read_text()))
             for r in range(2)]
    writer = C.CheckpointWriter(cut / C.CKPT_DIR, keep=2)  # (the driver's merge and write)
    writer.write(AT, C.merge_ranks(snaps))
    writer.close()
    tensors, meta = C.read(C.latest(cut))
    at = np.load(whole / "at.0.npz")
    for name, w in at.items():  # each rank saved its own half of every weight: together, the whole
        parts = [tensors[f"model/{name}"], tensors[f"rank1/model/{name}"]]
        assert parts[0].shape[0] < w.shape[0] and parts[1].shape[0] < w.shape[0], name
        np.testing.assert_array_equal(np.concatenate(parts), w, err_msg=name)
    assert meta["version"] == meta["ranks"][0]["version"] == AT and meta["sched"]["last_epoch"] == AT
    assert {k for k in tensors if k.startswith("rank1/optim/")} == {f"rank1/{k}" for k in tensors
                                                                    if k.startswith("optim/")}
    _forked(_rank, "resume", str(model_dir), str(cut))
    end = np.load(whole / "end.0.npz")
    for rank in range(2):
        got = np.load(cut / f"end.{rank}.npz")
        assert set(got.files) == set(end.files)
        for name, w in end.items():
            assert not np.allclose(w, at[name], atol=1e-4) or "norm" in name, name  # (it trained after AT)
            np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=1e-6, err_msg=f"rank {rank} {name}")


def test_a_shard_of_another_shape_is_refused_in_one_line():
    model = torch.nn.Linear(4, 6)
    opt = torch.optim.AdamW(model.parameters())
    half = {"weight": torch.zeros(3, 4), "bias": torch.zeros(3)}  # (saved by one of 2 ranks)
    with pytest.raises(ValueError, match=r"^checkpoint: model/weight is a shard of shape \(3, 4\) but this rank "
                                         r"holds \(6, 4\); resume with the train.dp, train.tp and train.strategy it was saved"):
        load_shards(model, opt, half, {})
    with pytest.raises(ValueError, match="its weights differ from the model's"):
        load_shards(model, opt, {"weight": torch.zeros(6, 4)}, {})


def test_fsdp_runs_take_checkpoints():
    cfg = load_config(None, CFG)
    assert C.not_resumable(cfg) is None
    assert C.Checkpoints(cfg, None, Path("unused")).due(STEPS)


def _descendants(pid: int) -> dict[int, bytes]:
    """Every process below ``pid``, by pid, with its command line (to end only those same processes;
    one that ends, or a thread of one, while we look is skipped)."""
    out: dict[int, bytes] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tids:
        try:
            kids = [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
        for c in kids:
            try:
                out[c] = Path(f"/proc/{c}/cmdline").read_bytes()
            except (FileNotFoundError, ProcessLookupError):
                continue
            out.update(_descendants(c))
    return out


def _end_orphans(procs: dict[int, bytes], wait_s: float = 10.0) -> None:
    """End at once what the killed driver leaves behind for a few seconds (Ray's agents, until
    the reaper sweeps: tests/test_ray_reaper.py tests that), ``kill -9`` each by its pid, only while
    it still runs the same command line, so the resumed run's timing does not depend on them. Its
    data-plane processes (``multiprocessing`` children) are given ``wait_s`` to stop by themselves
    first: the controller removes the job's folder when it sees its owner gone (killed, it would
    leave an empty ``asyncflow-plane-*`` folder in the temp dir; tests/test_queue_shm.py tests that)."""

    def same(pid: int, cmd: bytes) -> bool:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes() == cmd
        except (FileNotFoundError, ProcessLookupError):
            return False

    plane = {pid: cmd for pid, cmd in procs.items() if b"multiprocessing" in cmd}
    until = time.monotonic() + wait_s
    for pid, cmd in [*[(p, c) for p, c in procs.items() if p not in plane], *plane.items()]:
        while pid in plane and same(pid, cmd) and time.monotonic() < until:
            time.sleep(0.05)
        try:
            if same(pid, cmd):
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.acceptance  # (the acceptance tier: python3 -m pytest -m acceptance; docs/testing.md)
@pytest.mark.ray
@pytest.mark.slow
def test_an_async_fsdp_run_killed_and_resumed_trains_every_group_once(tmp_path):
    """(~50-80 s on a loaded 2-core machine: two Ray starts, each with three worker processes.)"""
    runs, n = tmp_path / "runs", 6
    args = [*[a for a in TINY if a != "launcher=local"], "launcher=ray", "train.dp=2", "train.strategy=fsdp",
            f"train.steps={n}"]
    proc = _start([*args, f"run_dir={runs}"])
    kids: dict[int, bytes] = {}
    try:
        t = time.time()
        while not runs.exists() or not any(runs.iterdir()) or not C.complete(next(runs.iterdir()) / C.CKPT_DIR):
            assert proc.poll() is None and time.time() - t < 300, "no checkpoint appeared"
            time.sleep(0.01)
    finally:
        if proc.poll() is None:
            kids = _descendants(proc.pid)
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        _end_orphans(kids)
    run = next(runs.iterdir())
    first = C.read(C.latest(run))
    assert first[1]["driver"]["step"] < n and "rank1/model/lm_head.weight" in first[0]  # (rank 1's own shard)
    resumed = _start(["--resume", str(run)])
    try:
        assert resumed.wait(240) == 0
    finally:
        if resumed.poll() is None:
            resumed.kill()
            resumed.wait()
    check_every_group_once(run, n)
    assert json.loads((run / "summary.json").read_text())["resumed_from"] == first[1]["driver"]["step"]
    last = C.read(C.latest(run))[1]
    assert last["version"] == last["ranks"][0]["version"] == last["driver"]["step"] == n  # versions went on


@pytest.mark.ray
@pytest.mark.slow
def test_a_killed_fsdp_rank_restarts_the_run_from_its_shards(tmp_path, capsys, monkeypatch):
    """``kill -9`` of trainer rank 1's process once a checkpoint exists (rank 0 is then waiting
    in a collective): the run restarts from the checkpoint (one line naming the worker), every
    rank takes its shards back, and it finishes with every step and every prompt group once."""
    start, killed = Job.start, []
    runs, n = tmp_path / "runs", 6

    def start_then_kill(self):
        start(self)
        if killed:  # (the restarted job is left alone)
            return
        pid = self.watch.ask("actor.1", "stats")["actor.1"]["pid"]
        killed.append(pid)

        def kill():
            t = time.time()
            while not (runs.exists() and any(runs.iterdir()) and C.complete(next(runs.iterdir()) / C.CKPT_DIR)):
                assert time.time() - t < 300, "no checkpoint appeared"
                time.sleep(0.01)
            os.kill(pid, signal.SIGKILL)

        threading.Thread(target=kill, daemon=True).start()

    monkeypatch.setattr(Job, "start", start_then_kill)
    args = [a for a in TINY if a != "launcher=local"]
    assert main(["train", *args, "launcher=ray", "train.dp=2", "train.strategy=fsdp", "train.step_timeout_s=30",
                 f"run_dir={runs}", f"train.steps={n}"]) == 0
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("asyncflow:") and not x.startswith(SLOW_BUILD)]
    assert len(err) == 1 and err[0].startswith("asyncflow: restart 1/2 from checkpoint step-"), err
    assert "worker 'actor.1'" in err[0], err
    run = next(runs.iterdir())
    check_every_group_once(run, n)
    assert json.loads((run / "summary.json").read_text())["restarts"] == 1
    last = C.read(C.latest(run))[1]
    assert last["version"] == last["ranks"][0]["version"] == last["driver"]["step"] == n
