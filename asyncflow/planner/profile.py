"""``asyncflow profile``: a short measured run that records this machine's cost curves.

For each torch thread count (1, 2, 4, ... up to the cores), on the job's own model:

* decode seconds per round vs live rows ``n`` and context length (the built-in engine's ``batch.step``
  at several batch sizes while the context grows), fitted as ``a + b*n + c*n*ctx``;
* prefill seconds vs ``rows * prompt_len`` (``batch.add``);
* training seconds per micro-batch vs ``rows * padded_len`` (``forward_backward`` with the
  GRPO loss), and the optimizer step;
* once: weight export and load (the swap), reward seconds per sample, the natural
  answer-length distribution of the policy, the mean prompt length;
* calibration: each role alone through the real role code (:func:`asyncflow.bench.solo.
  measure_roles`, in-process data plane) for a few steps, divided by what the curves
  predict for the same work: the factor covers data-plane calls and bookkeeping;
* pipeline: the weight store's publish -> staged latency (warm, median), a short real
  one-thread ``sync`` run and a short ``async`` run on the job's launcher, decomposed
  step by step from their traces (:mod:`asyncflow.planner.calib`): role factors, the sync
  step overhead, the data-plane latency of a finished group, the actor's step boundary,
  and the interference between busy roles (without the pipeline runs: 1); and a short
  ``sync`` run on each multi-thread team size, whose own role factors correct that team
  (``role_factor_threads``: a team of t threads beside the framework's other processes is
  slower than the same team alone, which the one-thread factors cannot see).

Everything is written as one JSON file that :class:`~asyncflow.planner.costs.ProfiledCost`
reads. Measurements take the median of repeats; the machine may be shared, so the file
records when and how it was measured.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncflow.algorithms.algorithm import Algorithm
from asyncflow.bench.solo import measure_roles
from asyncflow.config import RunConfig
from asyncflow.engines.inference import (
    InferenceEngine,  # lazy: torch, profiling only
    Request,
    SamplingParams,
)
from asyncflow.engines.training import TrainEngine
from asyncflow.launch.registry import get_launcher
from asyncflow.observe.trace import tracks
from asyncflow.planner.calib import actor_steps, fit_pipeline, overlap_interference
from asyncflow.planner.costs import ProfiledCost
from asyncflow.planner.search import workload_from
from asyncflow.planner.sim import Allocation, simulate
from asyncflow.tasks.models import load_model, prepare_model
from asyncflow.tasks.registry import build_task
from asyncflow.weights.store import seal
from asyncflow.weights.subscriber import WeightSubscriber
from asyncflow.workflow.driver import train


def _min_time(fn: Callable[[], Any], reps: int = 3) -> float:
    """Fastest of ``reps`` runs: on a shared machine other load only ever adds time."""
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.min(ts))


def _fit(X: list[list[float]], y: list[float]) -> list[float]:
    """Least squares with non-negative coefficients (a cost never falls with more work;
    a negative term is dropped and the rest refitted: a small active-set NNLS)."""
    A, b = np.asarray(X, dtype=float), np.asarray(y, dtype=float)
    keep = list(range(A.shape[1]))
    while keep:
        coef, *_ = np.linalg.lstsq(A[:, keep], b, rcond=None)
        if (coef >= 0).all():
            out = np.zeros(A.shape[1])
            out[keep] = coef
            return [float(c) for c in out]
        keep.pop(int(np.argmin(coef)))
    return [0.0] * A.shape[1]


def _thread_counts(ncpu: int) -> list[int]:
    out, t = [], 1
    while t < ncpu:
        out.append(t)
        t *= 2
    return out + [ncpu]


def _curves(model: Any, tok: Any, prompt_ids: list[list[int]], cfg: RunConfig, quick: bool) -> dict:


    sp = SamplingParams(temperature=1.0, max_new_tokens=10**6)
    max_new = 24 if quick else max(48, cfg.rollout.longtail_long)
    dec_X, dec_y, pre_X, pre_y = [], [], [], []
    sizes = sorted({min(s, cfg.rollout.max_batch) for s in (4, 16, 32, cfg.rollout.max_batch)})
    for n in sizes:
        runs = []
        for _ in range(2):  # elementwise min of two sweeps: other load on a shared machine only adds time
            reqs = [Request(key=i, prompt_ids=prompt_ids[i % len(prompt_ids)], max_new_tokens=max_new,
                            min_new_tokens=max_new) for i in range(n)]
            batch = InferenceEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch=n, seed=0).new_batch(sp)
            t = time.perf_counter()
            batch.add(reqs)
            times = [time.perf_counter() - t]
            for _ in range(max_new - 2):
                t = time.perf_counter()
                batch.step()
                times.append(time.perf_counter() - t)
            runs.append(times)
        best = np.min(np.asarray(runs), axis=0)
        plen = float(np.mean([len(prompt_ids[i % len(prompt_ids)]) for i in range(n)]))
        pre_X.append([1.0, n * plen])
        pre_y.append(float(best[0]))
        for i, s in enumerate(best[2:], start=1):  # the first round after a prefill pays allocator warm-up
            dec_X.append([1.0, n, n * (plen + i + 1)])
            dec_y.append(float(s))
    engine = TrainEngine(model, tok.pad_token_id, lr=1e-6)
    loss = Algorithm().loss(cfg.batch_size)
    tr_X, tr_y = [], []
    train_rows = sorted({8, 32, cfg.batch_size})  # up to the whole batch: the search never extrapolates
    for rows in train_rows:
        for L in ((4, 24) if quick else (4, 24, 48)):
            prompts = [prompt_ids[i % len(prompt_ids)] for i in range(rows)]
            resp = [[5] * L for _ in range(rows)]
            extras = {"logprobs": [np.zeros(L, np.float32)] * rows, "advantages": np.ones(rows, np.float32)}
            s = _min_time(partial(engine.forward_backward, prompts, resp, extras, loss), 3)
            tr_X.append([1.0, rows * (max(len(p) for p in prompts) + L)])
            tr_y.append(s)
    step = _min_time(engine.optimizer_step, 3)
    return {"decode": _fit(dec_X, dec_y), "prefill": _fit(pre_X, pre_y), "train": _fit(tr_X, tr_y), "step_s": step,
            "train_rows": train_rows, "points": {"decode": len(dec_y), "train": len(tr_y)}}


def _lengths(model: Any, tok: Any, prompt_ids: list[list[int]], cfg: RunConfig) -> dict[int, float]:


    r = cfg.rollout
    if r.gen_len == "longtail":
        return {r.longtail_short: 1 - r.longtail_frac, r.longtail_long: r.longtail_frac}
    sp = SamplingParams(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens)
    batch = InferenceEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch=128, seed=0).new_batch(sp)
    done = batch.add([Request(key=i, prompt_ids=p) for i, p in enumerate(prompt_ids[:128])])
    while len(batch):
        done += batch.step()
    counts: dict[int, int] = {}
    for c in done:
        counts[len(c.response_ids)] = counts.get(len(c.response_ids), 0) + 1
    return {L: n / len(done) for L, n in sorted(counts.items())}


def _calibrate(cfg: RunConfig, model_dir: str, curves: dict, prof: dict, threads: int, steps: int) -> dict:
    """Each role alone through the real role code vs the curves' prediction of the same work."""
    # min of two runs: on a shared machine other load only ever adds time
    runs = [measure_roles(cfg, model_dir, steps, threads, continuous=True) for _ in range(2)]
    measured = {k: min(r[k] for r in runs) for k in runs[0]}
    cost = ProfiledCost.from_dict({**prof, "curves": {threads: curves}, "calibration": {}})
    wl = workload_from(cfg, prof, steps=steps)
    r = simulate(wl, Allocation("async", threads, threads, cfg.train.micro_prompts, 10**6, cfg.rollout.max_batch), cost)
    # rollout ran partitions 1..steps-1 continuously; actor trained steps 1..steps-1 (no export: shared model)
    roll = sum(d for role, what, _, d in r.spans if role == "rollout") * (steps - 1) / steps
    actor = sum(d for role, what, _, d in r.spans if role == "actor" and what == "train") * (steps - 1) / steps
    actor += (steps - 1) * curves["step_s"]
    return {"rollout": measured["rollout"] / roll, "actor": measured["actor"] / actor,
            "measured_s": measured, "predicted_s": {"rollout": roll, "actor": actor}}


def _transfer(launcher: Any, param_bytes: int, reps: int = 10, warm: int = 3) -> float:
    """publish -> staged at a :class:`WeightSubscriber` (the path rollout's weights take:
    the store, the subscriber's copy and checksum check), the median of ``reps`` after
    ``warm`` rounds. The old measurement, the mean of 5 rounds on a fresh store with no
    subscriber, included the store actor's start: 56-144 ms, where stream traces show
    7-13 ms between the actor's publish and rollout's swap."""
    store = launcher.weight_store()
    w = seal({"w": np.zeros(max(1, param_bytes // 4), np.float32)})  # same size as the model
    sub = WeightSubscriber(store, lambda v, b: None, start_version=0, poll_s=0.5)
    times = []
    try:
        for v in range(1, warm + reps + 1):
            t = time.perf_counter()
            store.publish(v, w)
            while sub.staged_version() < v:
                sub.wait_staged(5.0)
            times.append(time.perf_counter() - t)
            sub.swap_if_ready()
    finally:
        sub.close()
    return float(np.median(times[warm:]))


def _pipeline(cfg: RunConfig, prof: dict, ncpu: int, steps: int = 8) -> dict:
    """Short real runs on the job's launcher: a one-thread ``sync`` run (a one-thread step
    does not collapse when another process takes a core, as a multi-threaded one can),
    decomposed by :func:`asyncflow.planner.calib.fit_pipeline`, then an ``async`` run (one
    thread per role, staleness 2 so the trainer's next rows are always ready) for the
    actor's step-boundary overhead and the interference between busy roles
    (:func:`asyncflow.planner.calib.actor_steps`, :func:`~asyncflow.planner.calib.overlap_interference`);
    and the weight store's publish -> staged latency (:func:`_transfer`)."""

    def run_cfg(**kw: Any) -> RunConfig:
        data = cfg.model_dump()
        data.update(plan="off", progress=False, run_dir=tempfile.mkdtemp(prefix="asyncflow-profile-run-"), **kw)
        data["train"].update(steps=steps, eval_every=0, tp=1)  # (one process's costs: the simulator adds tp's)
        data["resources"].update(sync_threads=1, threads_per_role=1)
        return RunConfig.model_validate(data)

    sync, asyn = run_cfg(mode="sync"), run_cfg(mode="async", staleness=max(2, cfg.staleness))
    teams = [t for t in _thread_counts(ncpu) if t > 1 and str(t) in prof["curves"]]
    sync_mt = {t: RunConfig.model_validate({**sync.model_dump(), "resources": {
        **sync.resources.model_dump(), "sync_threads": t}}) for t in teams}
    launcher = get_launcher(cfg.launcher)
    try:
        transfer = _transfer(launcher, prof["param_bytes"])
        s = train(sync, launcher=launcher, evaluate=False)
        a = train(asyn, launcher=launcher, evaluate=False)
        mt = {t: train(c, launcher=launcher, evaluate=False) for t, c in sync_mt.items()}
    finally:
        launcher.shutdown()
    base = {**prof, "pipeline": {"transfer_s": transfer}}
    fit = fit_pipeline(sync, base, tracks(f"{s['run_dir']}/trace.json")[1], ncpu)
    fit["transfer_s"] = transfer
    # multi-thread teams (sync on t threads): their own factors, from a real colocated run each
    fit["role_factor_threads"] = {str(t): fit_pipeline(sync_mt[t], base, tracks(f"{r['run_dir']}/trace.json")[1],
                                                       ncpu)["role_factor"] for t, r in mt.items()}
    atracks = tracks(f"{a['run_dir']}/trace.json")[1]
    actor = actor_steps(atracks, steps)
    if actor:
        fit["actor_overhead_s"] = max(0.0, float(np.median([x["gap"] for x in actor])))
    interference = overlap_interference(atracks, steps)
    return {**fit, "interference": interference, "launcher": cfg.launcher, "steps": steps,
            "sync_steady_samples_per_s": s["steady_samples_per_s"],
            "async_steady_samples_per_s": a["steady_samples_per_s"]}


def step_seconds(run_dir: str) -> list[float]:
    """Durations of steps 1..N-1 of a finished run (from its metrics.jsonl)."""
    elapsed = [json.loads(line)["elapsed_s"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return list(np.diff(elapsed))


def _costs(model: Any, tok: Any, task: Any, prompts: list[list[int]], cfg: RunConfig) -> dict:
    """Weight export and load times, the weights' size, and the reward's cost per sample."""
    eng = TrainEngine(model, tok.pad_token_id)
    out: dict = {"export_s": _min_time(eng.export_weights, 5)}
    w = eng.export_weights()
    out["param_bytes"] = int(sum(v.nbytes for v in w.values()))
    inf = InferenceEngine(model, tok.eos_token_id, tok.pad_token_id, cfg.rollout.max_batch, cfg.seed)
    out["load_s"] = _min_time(lambda: inf.load_weights(1, w), 5)
    probs = task.train[:200]
    t = time.perf_counter()
    for p in probs:
        task.reward(p.prompt, p.answer, p.answer)
        tok.decode(prompts[0], skip_special_tokens=True)
    out["reward_s_per_sample"] = (time.perf_counter() - t) / len(probs)
    return out


def run_profile(cfg: RunConfig, out: str | None = None, quick: bool = False, calibrate: bool = True,
                cpus: int | None = None, pipeline: bool = True) -> dict:
    """Measure this machine's cost curves for ``cfg``'s model; write and return the JSON."""


    t_start = time.perf_counter()
    ncpu = cpus or os.cpu_count() or 1
    tmp = Path(tempfile.mkdtemp(prefix="asyncflow-profile-"))
    model_dir, _ = prepare_model(cfg, tmp)
    model, tok = load_model(model_dir)
    task = build_task(cfg)
    prompts = [[tok.bos_token_id] + tok(p.prompt, add_special_tokens=False).input_ids for p in task.train[:256]]
    prof: dict = {"created": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": ncpu, "torch": torch.__version__,
                  "model": cfg.model.dims() if not cfg.model.path else cfg.model.path,
                  "prompt_len": float(np.mean([len(p) for p in prompts])), "curves": {}, "calibration": {}}
    try:
        for t in _thread_counts(ncpu):
            torch.set_num_threads(t)
            print(f"[profile] curves on {t} thread(s) ...", flush=True)
            prof["curves"][str(t)] = _curves(model, tok, prompts, cfg, quick)
        torch.set_num_threads(1)
        model, tok = load_model(model_dir)  # untouched weights for the length distribution
        prof["lengths"] = {str(k): v for k, v in _lengths(model, tok, prompts, cfg).items()}
        prof.update(_costs(model, tok, task, prompts, cfg))
        if calibrate:
            for t in sorted({1, ncpu}):
                print(f"[profile] calibration: roles alone through the role code on {t} thread(s) ...", flush=True)
                cal = _calibrate(cfg, model_dir, prof["curves"][str(t)], prof, t, 5)
                prof["calibration"][str(t)] = cal
        if pipeline:
            print(f"[profile] pipeline: short sync and async runs on the {cfg.launcher} launcher ...", flush=True)
            prof["pipeline"] = _pipeline(cfg, prof, ncpu)
            prof["interference"] = prof["pipeline"].pop("interference")
        prof["seconds"] = time.perf_counter() - t_start
        from asyncflow.planner.auto import fingerprint  # lazy: planner.auto imports this module

        prof["fingerprint"] = fingerprint(cfg, ncpu)  # plan=auto reuses the file only for the same machine and job
    finally:
        torch.set_num_threads(1)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(prof, indent=1))
        print(f"[profile] written {out} ({prof['seconds']:.0f} s)")
    return prof
