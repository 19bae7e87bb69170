"""Drift shows itself: the simulator's prediction for a run's own config, beside what it measured.

* :func:`prediction` / :func:`annotate`: every run trained through :func:`asyncflow.api.train`
  (the CLI's ``asyncflow train`` too) gets ``planner`` in its ``summary.json`` and a line in the
  printed summary: ``planner predicted X samples/s, measured Y (error Z%)``, and which profile
  the prediction used: this machine's (``<run_dir>/profile.json``, where ``asyncflow profile``
  and ``plan=auto`` keep it, when its fingerprint matches the machine and job:
  :func:`asyncflow.planner.auto.cached_profile`), else the built-in default profile
  (``default_profile.json``, measured on a 2-core machine; another machine's or model's
  numbers, so only its order of magnitude means anything). It is computed after the run, from
  the run's own config (evaluations, checkpoints, data-parallel ranks and all), at most
  ``MAX_STEPS`` simulated steps: nothing is added to the run's start, and a few tenths of a
  second of simulation to its end. It never fails a run: an error is reported in its place.
* :func:`accuracy` / :func:`format_accuracy`: ``asyncflow plan --check`` (and
  ``benchmarks/planner_accuracy.py``): a profile, then a short run of each mode, each
  measured beside the prediction for the same config, and term by term
  (:mod:`asyncflow.planner.terms`) where the two differ.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from asyncflow.config import RunConfig
from asyncflow.planner.auto import cached_profile, profile_path
from asyncflow.planner.costs import ProfiledCost
from asyncflow.planner.search import predict
from asyncflow.planner.terms import format_terms, step_terms

DEFAULT_PROFILE = Path(__file__).with_name("default_profile.json")
MAX_STEPS = 60  # simulated steps of the drift line (a longer run's evaluations and checkpoints keep their period)


def load_profile(cfg: RunConfig, cpus: int) -> tuple[dict, str]:
    """(profile, where from): this machine's cached one, else the built-in default."""
    path = profile_path(cfg)
    prof = cached_profile(cfg, path, cpus)
    if prof is not None:
        return prof, f"this machine's profile {path}, measured {prof.get('created', '?')}"
    return json.loads(DEFAULT_PROFILE.read_text()), ("the built-in default profile (another machine: "
                                                     "`asyncflow profile` measures this one)")


def prediction(cfg: RunConfig, cpus: int, evaluate: bool = True) -> dict[str, Any]:
    """The simulator's steady samples/s for ``cfg`` on ``cpus`` cores, and its profile's source."""
    t = time.perf_counter()
    try:
        prof, source = load_profile(cfg, cpus)
        steps = min(cfg.train.steps, MAX_STEPS)
        r = predict(cfg, ProfiledCost.from_dict(prof), prof, cpus, steps=max(2, steps), evaluate=evaluate)
        out: dict[str, Any] = {"predicted_samples_per_s": r.samples_per_s, "profile": source,
                               "simulated_steps": max(2, steps)}
    except Exception as e:  # (the line says why there is no prediction; the run itself succeeded)
        out = {"predicted_samples_per_s": None, "error_reason": f"{type(e).__name__}: {e}"}
    out["seconds"] = time.perf_counter() - t
    return out


def annotate(cfg: RunConfig, cpus: int, evaluate: bool = True) -> Callable[[dict], dict]:
    """The driver's summary hook: ``{"planner": prediction + measured + error}`` for a summary."""
    def hook(summary: dict) -> dict:
        p = prediction(cfg, cpus, evaluate)
        measured = summary.get("steady_samples_per_s") or 0.0
        pred = p.get("predicted_samples_per_s")
        p.update(measured_samples_per_s=measured, error=pred / measured - 1 if pred and measured else None)
        return {"planner": p}

    return hook


# ---------------------------------------------------------------------------- plan --check
def mode_config(base: RunConfig, mode: str, steps: int, run_dir: str) -> RunConfig:
    """``base`` in ``mode`` for a short measured run: ``steps`` steps, no periodic evaluation, no bar."""
    data = base.model_dump()
    data.update(mode=mode, progress=False, run_dir=run_dir, plan="off")
    data["train"].update(steps=steps, eval_every=0)
    return RunConfig.model_validate(data)


def accuracy(base: RunConfig, train: Callable[..., dict], steps: int = 10,
             modes: Sequence[str] = ("sync", "stream", "async"), profile: str | dict | None = None,
             out: str | None = None, quick: bool = False, profile_out: str | None = None,
             log: Callable[[str], None] = print, extra: Sequence[tuple[str, RunConfig]] = (),
             run_root: str | None = None) -> dict:
    """Read ``profile`` if given (a path, or the profile itself), else profile this machine
    (``quick``: the short profile) into ``profile_out``; then train each mode of ``base``
    ``steps`` steps (``evaluate=False``; and each ``(name, config)`` of ``extra``) and compare
    each with its prediction, term by term. The runs' folders go under ``run_root`` (default: a
    new temporary folder; the report names each). ``train``: :func:`asyncflow.api.train` (passed in by
    the callers above: the API sits above the planner)."""
    from asyncflow.planner.profile import run_profile, step_seconds  # lazy: torch, only to measure

    cpus = os.cpu_count() or 1
    if isinstance(profile, dict):
        prof = profile
    elif profile:
        prof = json.loads(Path(profile).read_text())
    else:
        prof = run_profile(base, out=profile_out, quick=quick)
    cost, rows = ProfiledCost.from_dict(prof), []
    root = run_root or tempfile.mkdtemp(prefix="asyncflow-accuracy-")
    runs = [(m, mode_config(base, m, steps, root)) for m in modes] + list(extra)
    for name, cfg in runs:
        pred = predict(cfg, cost, prof, cpus, steps=cfg.train.steps, evaluate=False)
        s = train(cfg, evaluate=False)
        meas = s["steady_samples_per_s"]
        median = cfg.batch_size / float(np.median(step_seconds(s["run_dir"])))  # less sensitive to a stall
        rows.append({"mode": name, "predicted": pred.samples_per_s, "measured": meas, "measured_median_step": median,
                     "error": pred.samples_per_s / meas - 1, "busy_measured": s["busy"], "busy_predicted": pred.busy,
                     "terms_real": step_terms(Path(s["run_dir"]) / "trace.json", cfg.mode),
                     "terms_sim": step_terms(pred, cfg.mode), "run_dir": s["run_dir"]})
        log(f"[check] {name}: predicted {pred.samples_per_s:.1f}, measured {meas:.1f} samples/s")
    report = {"cpus": cpus, "steps": steps, "profile": {k: prof.get(k) for k in ("created", "seconds")},
              "pipeline": prof.get("pipeline", {}), "interference": prof.get("interference", 1.0), "rows": rows}
    if out:
        Path(out).write_text(json.dumps(report, indent=1))
    return report


def format_accuracy(report: dict) -> str:
    pl = report["pipeline"]
    ms = lambda k: f"{pl.get(k, 0) * 1e3:.1f} ms"  # noqa: E731
    lines = [f"== planner accuracy: {report['steps']} steps, {report['cpus']} CPUs ==",
             f"profile {report['profile'].get('created')}: role factors {pl.get('role_factor')}, interference "
             f"{report['interference']:.2f}, transfer {ms('transfer_s')}, publish {ms('publish_s')}, sync overhead "
             f"{ms('step_overhead_s')}, prompt fetch {ms('fetch_s')}, data latency {ms('data_latency_s')}, "
             f"actor step boundary {ms('actor_overhead_s')}",
             f"{'mode':<10}{'predicted':>10}{'measured':>10}{'error':>8}{'median-step':>12}{'error':>8}"
             "   busy measured / predicted (rollout, actor)"]
    for r in report["rows"]:
        bm, bp, med = r["busy_measured"], r["busy_predicted"], r["measured_median_step"]
        lines.append(f"{r['mode']:<10}{r['predicted']:>10.1f}{r['measured']:>10.1f}{r['error']:>+8.1%}"
                     f"{med:>12.1f}{r['predicted'] / med - 1:>+8.1%}   "
                     f"{bm.get('rollout', 0):.0%}/{bm.get('actor', 0):.0%} vs {bp['rollout']:.0%}/{bp['actor']:.0%}")
    for r in report["rows"]:
        lines += [f"\n{r['mode']}: per steady step, median (asyncflow.planner.terms)",
                  format_terms(r["terms_real"], r["terms_sim"])]
    return "\n".join(lines)
