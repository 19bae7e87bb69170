"""Resumable ``train.tp`` runs: each rank checkpoints and restores its own shards.

* Exact (forked processes, no Ray): two tensor-parallel trainer ranks (real :class:`Worker` s,
  DTensors over gloo) checkpoint after ``AT`` steps and are then killed (``SIGKILL``, while they
  train on); fresh processes resume from the checkpoint and end with the weights of two ranks
  never stopped (1e-6), under a warmup-then-cosine LR schedule and AdamW (a resume that lost the
  moments, the step counts or the schedule's position would not). Each rank trains the same
  fixed rows each step (``mode=sync`` refuses tp: its rollout decodes with the trainer's model).
  The checkpoint is checked too: each rank's shards, put together (by rows or columns, or one
  replicated copy), are the whole weights at the checkpoint.
* Under Ray (slow): a run whose trainer rank 1 is killed restarts from its shards and trains every
  prompt group once; its final ``checkpoint/`` is the shards put together.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.tensor.parallel  # (imported once here: each forked rank inherits it)
from safetensors.numpy import load_file, save_file
from test_dp_trainer import fill
from test_failures import SLOW_BUILD
from test_resume_async import TINY, check_every_group_once
from test_tensor_parallel import run_ranks
from transformers import AutoModelForCausalLM

from asyncflow.cli import main
from asyncflow.config import load_config
from asyncflow.dataplane import DataPlane
from asyncflow.engines.collective import free_address
from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model
from asyncflow.workflow import checkpoint as C
from asyncflow.workflow.fields import SCHEMA
from asyncflow.workflow.job import Job
from asyncflow.workflow.worker import Worker

STEPS, AT = 4, 2  # the checkpoint after AT steps
CFG = ["mode=async", "launcher=ray", "train.tp=2", "train.prompts_per_step=4", "rollout.group_size=4",
       "train.micro_prompts=2", f"train.steps={STEPS}", "train.lr=1e-2", "train.lr_schedule=cosine",
       "train.warmup_steps=1", "algorithm.loss_agg=token-mean", "staleness=1", "warmstart.enabled=false"]


def _rank(rank: int, address: str, phase: str, model_dir: str, out: str) -> None:
    """One trainer rank: ``whole`` trains every step (the weights after AT steps and at the end);
    ``cut`` trains AT steps, snapshots, trains on (the host copy beside the next step), saves its
    snapshot as a worker hands it over, trains on and waits to be killed; ``resume`` restores its
    part of the checkpoint in ``out`` and trains the rest (the weights at the end)."""
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
        for v in range(first, STEPS):
            w.train_step(v, v + 1 < STEPS, snapshot=phase == "cut" and v == AT - 1)
            if phase == "whole" and v == AT - 1:
                np.savez(f"{out}/at.{rank}.npz", **w.roles["actor"].engine.export_weights())  # (all-gathers)
            if phase == "cut" and v == AT:
                tensors, meta = w.taken_snapshot(AT, 60)
                save_file(tensors, f"{out}/snap.{rank}.safetensors")
                Path(f"{out}/snap.{rank}.json").write_text(json.dumps(meta))
        if phase == "cut":
            time.sleep(600)  # (killed before this ends)
        np.savez(f"{out}/end.{rank}.npz", **w.roles["actor"].engine.export_weights())
        w.stop()
    except BaseException:
        traceback.print_exc()
        os._exit(1)


def _killed_after_snapshots(model_dir: str, out: Path, deadline_s: float = 300.0) -> None:
    """The ``cut`` ranks, ``SIGKILL`` ed once both have saved their snapshot (any later moment of
    their training: the resume must need nothing of them but the checkpoint)."""
    ctx, address = mp.get_context("fork"), free_address()
    procs = [ctx.Process(target=_rank, args=(r, address, "cut", model_dir, str(out))) for r in range(2)]
    for p in procs:
        p.start()
    until = time.monotonic() + deadline_s
    try:
        while not all((out / f"snap.{r}.json").exists() for r in range(2)):
            assert all(p.is_alive() for p in procs), f"a rank exited before its snapshot: {[p.exitcode for p in procs]}"
            assert time.monotonic() < until, "no snapshot within the deadline"
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(10)
    assert [p.exitcode for p in procs] == [-signal.SIGKILL] * 2


def _whole_from(parts: list[np.ndarray], whole: np.ndarray) -> bool:
    """Whether the ranks' shards of one tensor put together are ``whole``."""
    if all(p.shape == whole.shape for p in parts):  # replicated
        return all(np.array_equal(p, whole) for p in parts)
    return any(np.concatenate(parts, axis=d).shape == whole.shape and np.array_equal(np.concatenate(parts, axis=d),
                                                                                      whole)
               for d in range(whole.ndim))


def test_tp_ranks_killed_after_a_checkpoint_and_resumed_end_with_the_weights_of_ranks_never_stopped(tmp_path):
    tok = build_char_tokenizer()
    build_tiny_model(tok, seed=0, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
                     intermediate_size=64).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    model_dir, whole, cut = str(tmp_path / "m"), tmp_path / "whole", tmp_path / "cut"
    whole.mkdir(), cut.mkdir()
    run_ranks(_rank, 2, "whole", model_dir, str(whole))
    _killed_after_snapshots(model_dir, cut)
    snaps = [(load_file(str(cut / f"snap.{r}.safetensors")), json.loads((cut / f"snap.{r}.json").read_text()))
             for r in range(2)]
    writer = C.CheckpointWriter(cut / C.CKPT_DIR, keep=2)  # (the driver's merge and write)
    writer.write(AT, C.merge_ranks(snaps))
    writer.close()
    tensors, meta = C.read(C.latest(cut))
    at = np.load(whole / "at.0.npz")
    sharded = 0
    for name, w in at.items():  # each rank saved its own shard of every weight: together, the whole
        parts = [tensors[f"model/{name}"], tensors[f"rank1/model/{name}"]]
        assert _whole_from(parts, w), name
        sharded += parts[0].shape != w.shape
    assert sharded >= 5  # embedding (= the tied head), q, k, v, o, gate, up, down: split; the norms replicated
    assert meta["version"] == meta["ranks"][0]["version"] == AT and meta["sched"]["last_epoch"] == AT
    run_ranks(_rank, 2, "resume", model_dir, str(cut))
    end = np.load(whole / "end.0.npz")
    for rank in range(2):
        got = np.load(cut / f"end.{rank}.npz")
        assert set(got.files) == set(end.files)
        for name, w in end.items():
            assert not np.allclose(w, at[name], atol=1e-4) or "norm" in name, name  # (it trained after AT)
            np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=1e-6, err_msg=f"rank {rank} {name}")


@pytest.mark.acceptance  # (the acceptance tier: python3 -m pytest -m acceptance; docs/testing.md)
@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:train.dp=1 x train.tp=2.*oversubscribe")  # 3 compute roles on 2 CPUs, as intended
def test_a_killed_tp_rank_restarts_the_run_from_its_shards(tmp_path, capsys, monkeypatch):
    """The whole path under Ray (``asyncflow train ... train.tp=2``): ``kill -9`` of trainer rank 1's
    process once a checkpoint exists (rank 0 is then waiting in a collective) restarts the run from
    the checkpoint (one line naming the worker), every rank takes its shards back, and it finishes
    with every step and every prompt group once, the versions going on. The run's final
    ``checkpoint/`` (the weights gathered bucket by bucket into rank 0's copy) is the last resumable
    checkpoint's shards put together."""
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
    assert main(["train", *args, "launcher=ray", "train.tp=2", "train.step_timeout_s=120", f"run_dir={runs}",
                 f"train.steps={n}"]) == 0
    err = [x for x in capsys.readouterr().err.splitlines()
           if x.startswith("asyncflow:") and not x.startswith(SLOW_BUILD)]  # (a loaded machine's note: not an error)
    assert len(err) == 1 and err[0].startswith("asyncflow: restart 1/2 from checkpoint step-"), err
    assert "worker 'actor.1'" in err[0], err
    run = next(runs.iterdir())
    check_every_group_once(run, n)
    assert json.loads((run / "summary.json").read_text())["restarts"] == 1
    tensors, last = C.read(C.latest(run))
    assert last["version"] == last["ranks"][0]["version"] == last["driver"]["step"] == n
    final = AutoModelForCausalLM.from_pretrained(run / "checkpoint")
    for name, w in final.named_parameters():
        parts = [tensors[f"model/{name}"], tensors[f"rank1/model/{name}"]]
        assert _whole_from(parts, w.detach().numpy()), name
