"""Resumable checkpoints, written in the background, atomically.

After a due step (every ``train.save_every`` steps and the last) the trainer's worker starts a
snapshot (:mod:`asyncflow.workflow.role_state`): its small part copied at once, the weights
and AdamW's state copied to host memory beside the next step, whose optimizer step waits for
that copy (:mod:`asyncflow.workflow.hostcopy`; the summary's ``checkpoint_pause_s``). A
:class:`CheckpointWriter` thread collects it, writes ``RUN_DIR/checkpoints/.tmp-<step>`` and
renames it to ``step-<step>`` once complete: a crash mid-write leaves the previous
checkpoint whole (a ``.tmp-*`` folder is never read). Then checkpoints beyond
``train.keep_checkpoints`` (the oldest) are deleted. A write that fails (a worker that never
answered its snapshot, a full disk) is raised to the driver at the next write or at the end,
whichever comes first, even when later writes succeeded: no checkpoint goes missing unsaid.

A checkpoint is two files and no pickle: ``state.safetensors`` (the model's state_dict as
``model/<name>``; with ``model.lora`` the adapters alone, the frozen base coming back from the
model folder: :func:`~asyncflow.engines.lora.trained_state`; AdamW's per-parameter tensors
as ``optim/<index>/<key>``, the RNG states as ``rng/...``) and ``state.json`` (the
optimizer's param groups, the LR schedule's position, the policy versions, numpy's and
Python's RNG positions, the driver's state: the step, the prompt ids trained so far
(:func:`pack`) and the answers in flight).

Resume (:func:`check_resume`, then :func:`latest` and :func:`read`) restores all of it
(:func:`restore`). ``sync`` is exact: a resumed run takes the same steps as an uninterrupted
one. At its step boundary nothing is decoding; what crosses it is rollout's state there
(tensors ``rollout/...``, JSON ``rollout``: :mod:`asyncflow.workflow.rollout.inflight`, ``sync``):
over-provisioning's stalled stragglers, the groups fetched but not started, the counters, and
rollout's prompt cursor, from which the feeder (the driver's, or dynamic sampling's self-feeding
one) feeds again, so rollout reads the same prompts in the same fetches. ``stream``/``async``:
the trainer is restored and republishes its weights, rollout takes them before it starts (:meth:`RolloutRole.resume
<asyncflow.workflow.rollout.RolloutRole.resume>`), and the feeder feeds every prompt the
checkpoint had not trained nor continued, once. Rollout's groups in flight at the boundary are
snapshotted with the checkpoint (tensors ``rollout/...``, JSON ``rollout``); on resume the
built-in engine's continue from their saved tokens where the staleness bound (counted
across the restart: the versions continue) still allows, the others and the answers
generated but not trained restart from their prompts (:mod:`asyncflow.workflow.rollout.inflight`).
Over-provisioning's soft and carried-over running groups continue as such and its stalled
stragglers stay stalled (each restarts from its prompt once, as a firm group); dynamic
sampling's self-feeding rollout saves its prompt position (the ids it fed, dropped, placed:
:class:`~asyncflow.workflow.feeder.PromptFeeder`), so a dropped prompt is not fed again and
an untrained one is fed once; both features' counters continue (JSON ``rollout.counters``).
With ``train.dp = N`` (``ddp``) rank 0's weights and AdamW state are saved once (every rank
holds the same) with every rank's own RNGs (:func:`merge_ranks`, :func:`rank_part`).
``fsdp`` and ``train.tp > 1``: every rank saves its own shards of the weights and AdamW's state beside
its RNGs (rank ``r``'s under ``rank<r>/``; with ``dp x tp`` the ``dp`` copies of a ``tp`` shard are each
saved) and restores them in place, so a resume keeps ``train.dp`` and ``train.tp``
(:func:`check_resume` refuses any change but ``train.steps``); :mod:`asyncflow.workflow.shards`
says why shards rather than a full state dict gathered into rank 0. PPO: the
critic (value model, AdamW, LR schedule, version; JSON ``critic``) is saved under ``critic/``
in every mode: in ``sync`` from the colocated worker; in ``stream``/``async`` its own worker
snapshots it (with its process's RNGs) right after its update of step ``done - 1``
(:func:`checkpoint_due`, asked on both sides), so the checkpoint after ``done`` steps holds the
critic of the actor's step boundary, and a resume restores it before the actor
(:mod:`asyncflow.workflow.role_state`). Refused (:func:`not_resumable`): over-provisioning in
``sync`` with ``train.dp > 1`` (each rank's rollout has its own prompt cursor over the shared
partitions, which the one feeder cannot feed again as they were).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

from asyncflow.config import ConfigError, RunConfig, load_config
from asyncflow.engines.lora import load_trained_state, trained_state
from asyncflow.workflow.shards import load_shards, local

CKPT_DIR = "checkpoints"
_STEP = re.compile(r"^step-(\d+)$")
Snapshot = tuple[dict[str, np.ndarray], dict[str, Any]]


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", copy=True).contiguous().numpy()


def host_all(live: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Host copies of ``live`` tensors (what :func:`capture_parts` left to copy)."""
    return {k: _host(v) for k, v in live.items()}


def capture(model: torch.nn.Module, engine: Any, generator: torch.Generator | None, full: bool = True) -> Snapshot:
    """The trainer's state in host memory: weights, AdamW, LR schedule, version, RNGs
    (not ``full``: the RNGs and the version only, what differs between data-parallel ranks)."""
    live, (tensors, meta) = capture_parts(model, engine, generator, full)
    tensors.update(host_all(live))
    return tensors, meta


def capture_parts(model: torch.nn.Module, engine: Any, generator: torch.Generator | None,
                  full: bool = True) -> tuple[dict[str, torch.Tensor], Snapshot]:
    """:func:`capture` in two parts: the live tensors it holds by reference (the weights and
    AdamW's per-parameter tensors: changed in place by the next optimizer step, so copied
    before it, :mod:`asyncflow.workflow.hostcopy`; FSDP: this rank's shards), and the rest
    copied now (RNGs, JSON)."""
    live: dict[str, torch.Tensor] = {}
    tensors: dict[str, np.ndarray] = {}
    meta: dict[str, Any] = {"version": engine.version}
    if full:
        live.update({f"model/{k}": local(v) for k, v in trained_state(model).items()})  # (LoRA: the adapters)
        opt = engine.opt.state_dict()
        scalars: dict[str, dict[str, Any]] = {}
        for idx, st in opt["state"].items():
            for key, val in st.items():
                if isinstance(val, torch.Tensor):
                    live[f"optim/{idx}/{key}"] = local(val)
                else:
                    scalars.setdefault(str(idx), {})[key] = val
        sched = engine.sched.state_dict() if engine.sched is not None else None
        # (a JSON round trip: the next step changes these dicts' values, not this copy)
        meta.update(json.loads(json.dumps({
            "optim_groups": opt["param_groups"], "optim_scalars": scalars,
            "sched": {k: v for k, v in sched.items() if k != "lr_lambdas"} if sched is not None else None})))
    tensors["rng/torch"] = _host(torch.get_rng_state())
    if generator is not None:
        tensors["rng/generator"] = _host(generator.get_state())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors.update({f"rng/cuda/{i}": _host(st) for i, st in enumerate(torch.cuda.get_rng_state_all())})
    name, keys, pos, has_gauss, cached = np.random.get_state()
    tensors["rng/numpy"] = np.array(keys)
    py = random.getstate()
    meta.update(numpy_rng=[name, int(pos), int(has_gauss), float(cached)], python_rng=[py[0], list(py[1]), py[2]])
    return live, (tensors, meta)


def merge_ranks(snaps: list[Snapshot]) -> Snapshot:
    """One snapshot of the trainer's ranks: rank 0's whole, and each other rank's under
    ``rank<r>/`` (tensors) and ``ranks`` (JSON): its RNGs and version (ddp: :func:`capture` not
    ``full``), FSDP also its shards of the weights and AdamW's state."""
    tensors, meta = dict(snaps[0][0]), {**snaps[0][1], "ranks": [m for _, m in snaps[1:]]}
    for r, (t, _) in enumerate(snaps[1:], 1):
        tensors.update({f"rank{r}/{k}": v for k, v in t.items()})
    return tensors, meta


def rank_part(snap: Snapshot, r: int) -> Snapshot:
    """What rank ``r`` restores from a :func:`merge_ranks` snapshot: its own RNGs and version,
    and its own shards (FSDP), else rank 0's weights and AdamW state (ddp: ranks hold the same)."""
    tensors = {k: v for k, v in snap[0].items() if not k.startswith("rank")}
    meta = {k: v for k, v in snap[1].items() if k != "ranks"}
    if r:
        tensors.update({k.split("/", 1)[1]: v for k, v in snap[0].items() if k.startswith(f"rank{r}/")})
        meta.update(snap[1]["ranks"][r - 1])
    return tensors, meta


def restore(model: torch.nn.Module, engine: Any, generator: torch.Generator | None, snap: Snapshot) -> None:
    """Put a :func:`capture` back (into a trainer built from the same config)."""
    tensors, meta = snap
    # (a loaded file's arrays are read-only views; torch wants writable ones: copy them)
    weights = {k[6:]: torch.from_numpy(np.array(v)) for k, v in tensors.items() if k.startswith("model/")}
    state: dict[int, dict[str, Any]] = {int(i): dict(s) for i, s in meta["optim_scalars"].items()}
    for k, v in tensors.items():
        if k.startswith("optim/"):
            _, idx, key = k.split("/", 2)
            state.setdefault(int(idx), {})[key] = torch.from_numpy(v.copy())
    if getattr(engine, "gathers", False):  # (FSDP, TP: this rank's shards)
        load_shards(model, engine.opt, weights, state)
    else:
        load_trained_state(model, weights)
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in meta["optim_groups"]]
    engine.opt.load_state_dict({"state": state, "param_groups": groups})
    if meta["sched"] is not None:
        engine.sched.load_state_dict({**engine.sched.state_dict(), **meta["sched"]})
    engine.version = meta["version"]
    torch.set_rng_state(torch.from_numpy(tensors["rng/torch"].copy()))
    if generator is not None:
        generator.set_state(torch.from_numpy(tensors["rng/generator"].copy()))
    cuda = sorted((int(k.split("/")[2]), v) for k, v in tensors.items() if k.startswith("rng/cuda/"))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.from_numpy(v.copy()) for _, v in cuda])
    name, pos, has_gauss, cached = meta["numpy_rng"]
    np.random.set_state((name, tensors["rng/numpy"], pos, has_gauss, cached))
    version, keys, gauss = meta["python_rng"]
    random.setstate((version, tuple(keys), gauss))


class CheckpointWriter:
    """Writes snapshots in a background thread, one at a time, each atomically (module doc)."""

    def __init__(self, folder: Path, keep: int):
        self.folder, self.keep = Path(folder), keep
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self._queued: list[Future] = []
        self._lock = threading.Lock()

    def write(self, step: int, snap: Snapshot, finish: Callable[[Snapshot], Snapshot] | None = None) -> None:
        """Queue ``snap`` as ``step-<step>``, completed by ``finish`` first in the writer's thread
        (raises the error of an earlier write that failed, if any: every one, not only the last)."""
        with self._lock:
            self._raise_done()
            self._queued.append(self._pool.submit(self._write, step, snap, finish))

    def _raise_done(self) -> None:
        while self._queued and self._queued[0].done():
            self._queued.pop(0).result()

    def _write(self, step: int, snap: Snapshot, finish: Callable[[Snapshot], Snapshot] | None = None) -> None:
        if finish is not None:
            snap = finish(snap)
        tmp, final = self.folder / f".tmp-{step}", self.folder / f"step-{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(snap[0], str(tmp / "state.safetensors"))
        (tmp / "state.json").write_text(json.dumps(snap[1]))
        for f in tmp.iterdir():  # on disk before the rename makes it the latest
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fd = os.open(self.folder, os.O_RDONLY)  # the rename itself on disk
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        for old in complete(self.folder)[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        """Wait for the writes queued; raise the first error of any."""
        self._pool.shutdown(wait=True)
        with self._lock:
            self._raise_done()


def complete(folder: Path) -> list[Path]:
    """The complete checkpoints in ``folder``, oldest first (``.tmp-*`` ones are not)."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest(run_dir: Path) -> Path:
    """The newest complete checkpoint of ``run_dir``; a ``ConfigError`` if there is none."""
    found = complete(Path(run_dir) / CKPT_DIR)
    if not found:
        raise ConfigError(f"--resume {run_dir}: no complete checkpoint in {Path(run_dir) / CKPT_DIR} "
                          "(train.save_every steps must have passed)")
    return found[-1]


def read(path: Path) -> Snapshot:
    return load_file(str(Path(path) / "state.safetensors")), json.loads((Path(path) / "state.json").read_text())


def check_resume(cfg: RunConfig, run_dir: Path) -> None:
    """One line (``ConfigError``) unless ``cfg`` may resume ``run_dir``: the same config as its
    ``config.yaml`` but for ``train.steps``, and a set-up whose whole state a checkpoint holds."""
    where = f"--resume {run_dir}"
    saved_file = Path(run_dir) / "config.yaml"
    if not saved_file.is_file():
        raise ConfigError(f"{where}: {saved_file} not found (not a run folder)")
    saved, now = load_config(saved_file).model_dump(mode="json"), cfg.model_dump(mode="json")
    now["train"]["steps"] = saved["train"]["steps"]  # extending a run is allowed
    field = _first_difference(saved, now)
    if field is not None:
        raise ConfigError(f"{where}: {field} differs from {saved_file}; only train.steps may change on resume")
    why = not_resumable(cfg)
    if why:
        raise ConfigError(f"{where}: resume with {why} is not supported yet (its state is not checkpointed)")


def not_resumable(cfg: RunConfig) -> str | None:
    """Why a run of ``cfg`` could not be resumed (None: it can; ``sync`` exactly)."""
    if cfg.mode == "sync" and cfg.train.dp > 1 and cfg.rollout.overprovision > 0:  # (one feeder, a cursor a rank)
        return "rollout.overprovision > 0 in mode=sync with train.dp > 1"
    return None


def checkpoint_due(cfg: RunConfig, done: int) -> bool:
    """Whether a run of ``cfg`` checkpoints once ``done`` steps are done: every ``train.save_every``
    steps and after the last, if it could be resumed. The driver asks it, and so does PPO's critic
    worker (``stream``/``async``), which snapshots itself right after its update of step ``done - 1``."""
    every = cfg.train.save_every
    return not_resumable(cfg) is None and (done == cfg.train.steps or (every > 0 and done % every == 0))


class Checkpoints:
    """The driver's side: when to snapshot (only a run it could resume), the pause each cost, the
    writer; and, for a resumed run, putting the snapshot back."""

    def __init__(self, cfg: RunConfig, job: Any, run_dir: Path):
        self.cfg, self.job, self.run_dir = cfg, job, Path(run_dir)  # job: a workflow.job.Job
        self.on = not_resumable(cfg) is None
        self.writer = CheckpointWriter(self.run_dir / CKPT_DIR, cfg.train.keep_checkpoints) if self.on else None
        self.pauses: list[float] = []  # per snapshot: the driver's seconds + the next optimizer step's wait
        self.trained: set[int] = set()  # the prompt groups trained so far (the actor's 'groups' of each step)
        self.restarted = 0  # answers in flight at the checkpoint resumed from: restarted from their prompts
        self.continued: list[int] = []  # ... and the groups that continued from their saved tokens (sync: held)
        self.acc0: float | None = None

    def due(self, done: int) -> bool:
        """Whether to checkpoint once ``done`` steps are done (:func:`checkpoint_due`)."""
        return self.on and checkpoint_due(self.cfg, done)

    def saw(self, m: dict) -> None:
        """A step's metrics: the prompt groups it trained; the wait of its optimizer step for the
        last checkpoint's host copy (``checkpoint_wait_s``), part of that checkpoint's pause."""
        self.trained.update(m.get("groups", ()))
        if "checkpoint_wait_s" in m and self.pauses:
            self.pauses[-1] += float(m["checkpoint_wait_s"])

    def save(self, done: int, fed: int) -> None:
        """Checkpoint ``done`` steps (step ``done - 1`` was submitted with ``snapshot=due(done)``)."""
        assert self.writer is not None  # (due() is False without one)
        t = time.perf_counter()
        collect = self.job.snapshot(done)
        driver = {"step": done, "fed": fed, "metrics_lines": done, "acc0": self.acc0, "trained": pack(self.trained)}

        def finish(_: Snapshot) -> Snapshot:  # (the writer's thread: the host copies, taken meanwhile)
            tensors, meta = collect()
            meta["driver"] = {**driver, "in_flight": self.job.in_flight(done, meta)}
            return tensors, meta

        self.writer.write(done, ({}, {}), finish)
        self.pauses.append(time.perf_counter() - t)

    def resume(self, snap: Snapshot | None, evaluate: bool) -> tuple[int, float | None]:
        """The first step to run and the held-out metric before training: a fresh run evaluates
        it (when ``evaluate``); a resumed one restores ``snap`` and keeps its metrics lines."""
        if snap is None:
            self.acc0 = self.job.evaluate() if evaluate else None
            return 0, self.acc0
        d = snap[1]["driver"]
        if d["step"] > self.cfg.train.steps:
            raise ConfigError(f"--resume: the checkpoint is of step {d['step']}, beyond train.steps="
                              f"{self.cfg.train.steps}")
        self.continued = self.job.restore(snap, d["step"])
        self.trained = (unpack(d["trained"]) if "trained" in d  # (a checkpoint of sync before they were kept)
                        else set(range(d["step"] * self.cfg.train.prompts_per_step)))
        self.restarted = max(0, d.get("in_flight", 0) - self.continued_answers)
        metrics = self.run_dir / "metrics.jsonl"
        if metrics.exists():  # the steps after the checkpoint run again
            lines = metrics.read_text().splitlines(keepends=True)
            metrics.write_text("".join(lines[: d["metrics_lines"]]))
        self.acc0 = d["acc0"]
        return d["step"], self.acc0

    @property
    def continued_answers(self) -> int:  # (sync: its held groups are stalled or waiting, none has answers)
        return 0 if self.cfg.mode == "sync" else len(self.continued) * self.cfg.rollout.group_size

    def close(self, quiet: bool = False) -> None:
        """Wait for the checkpoints being written (``quiet``: ignore a failed write)."""
        try:
            if self.writer is not None:
                self.writer.close()
        except Exception:
            if not quiet:
                raise


def pack(ids: set[int]) -> dict[str, Any]:
    """A set of prompt ids as JSON: every id below ``below``, and the ``more`` above it."""
    below = 0
    while below in ids:
        below += 1
    return {"below": below, "more": sorted(i for i in ids if i > below)}


def unpack(d: dict[str, Any]) -> set[int]:
    return set(range(int(d["below"]))) | {int(i) for i in d["more"]}


def _first_difference(a: Any, b: Any, prefix: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            d = _first_difference(a.get(k), b.get(k), f"{prefix}{k}.")
            if d is not None:
                return d
        return None
    return None if a == b else prefix.rstrip(".")
