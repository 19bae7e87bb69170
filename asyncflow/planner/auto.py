"""``asyncflow train plan=auto``: profile (or reuse the cached profile), search, apply the plan.

:func:`resolve` turns a config with ``plan: auto`` into the config that will run:

1. the profile is ``<run_dir>/profile.json`` (``runs/profile.json`` by default, where
   ``asyncflow profile`` writes it). It is reused when its :func:`fingerprint` equals this
   machine's and this job's (host, cores, torch version, model, and the settings that
   change the cost curves or the answer lengths); otherwise the machine is profiled again
   (``asyncflow.planner.profile.run_profile``, ~30-70 s) and the file replaced;
2. :func:`asyncflow.planner.search.search` simulates every candidate on ``os.cpu_count()``
   cores, thread teams no larger than the cores other jobs leave free (``team_limit``); the
   best one is applied: ``mode``, ``staleness`` (async), ``train.micro_prompts``
   and ``resources.sync_threads`` (sync) or ``resources.threads_per_role`` (stream/async);
3. the resolved config has ``plan: off`` (so its ``config.yaml`` reruns exactly the plan);
   the plan text (what ``asyncflow plan`` prints) is returned beside it.

Invariant: every other field is left as given, and the result is validated by
:class:`~asyncflow.config.RunConfig` like any config (a plan can never produce an invalid
config, e.g. a micro-batch larger than the step). Imports torch only to profile.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from asyncflow.config import RunConfig
from asyncflow.planner import profile as profiler  # light: torch only when it profiles; tests replace run_profile
from asyncflow.planner.costs import ProfiledCost
from asyncflow.planner.search import allocation_for, format_plan, noisy_calibration, predict, search, team_limit
from asyncflow.planner.sim import Allocation


def fingerprint(cfg: RunConfig, cpus: int | None = None) -> dict:
    """What a profile depends on: the machine, and the job's model and workload shape."""
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "none"
    r = cfg.rollout
    return {"host": platform.node(), "cpus": cpus or os.cpu_count() or 1, "torch": torch_version,
            "model": cfg.model.path or cfg.model.dims(), "task": [cfg.task.name, cfg.task.path, cfg.task.digits],
            "rollout": [r.max_batch, r.max_new_tokens, r.temperature, r.top_p, r.gen_len,
                        r.longtail_short, r.longtail_long, r.longtail_frac],
            "launcher": cfg.launcher}


def profile_path(cfg: RunConfig) -> Path:
    return Path(cfg.run_dir).expanduser() / "profile.json"


def cached_profile(cfg: RunConfig, path: Path, cpus: int | None = None) -> dict | None:
    """The profile at ``path`` if it was measured for this machine and job, else None."""
    try:
        prof = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return prof if prof.get("fingerprint") == json.loads(json.dumps(fingerprint(cfg, cpus))) else None


def apply_plan(cfg: RunConfig, alloc: Allocation) -> RunConfig:
    """``cfg`` with the allocation's mode, staleness, micro-batch, data-parallel ranks and threads, ``plan: off``."""
    data = cfg.model_dump()
    data.update(mode=alloc.mode, plan="off")
    if alloc.mode == "async":
        data["staleness"] = alloc.staleness
    data["train"]["micro_prompts"] = alloc.micro_prompts
    data["train"]["dp"] = alloc.ranks  # (sync: colocated ranks, each generating its share)
    if alloc.mode == "sync":
        data["resources"]["sync_threads"] = alloc.rollout_res
    else:
        data["resources"]["threads_per_role"] = alloc.rollout_res
    return RunConfig.model_validate(data)


def resolve(cfg: RunConfig, cpus: int | None = None, log: Callable[[str], None] = print,
            profile: str | Path | None = None) -> tuple[RunConfig, str]:
    """Resolve ``plan: auto``; return (the config to run, the plan text). ``plan: off``
    returns ``cfg`` unchanged and an empty text."""
    if cfg.plan != "auto":
        return cfg, ""
    cpus = cpus or os.cpu_count() or 1
    path = Path(profile) if profile else profile_path(cfg)
    prof = cached_profile(cfg, path, cpus)
    if prof is None:
        log(f"[plan=auto] no profile of this machine and model at {path}: profiling (~30-70 s) ...")
        prof = profiler.run_profile(cfg, out=str(path), cpus=cpus)
    else:
        log(f"[plan=auto] reusing the profile {path} (measured {prof.get('created', '?')})")
    cost = ProfiledCost.from_dict(prof)
    teams = team_limit(cpus)
    ranked = search(cfg, cost, prof, cpus, max_threads=teams)
    given = allocation_for(cfg, cpus)
    text = format_plan(ranked, cpus, (given, predict(cfg, cost, prof, cpus, 12, given)))
    if teams < cpus:
        text += f"\nthread teams limited to {teams}: other jobs load this machine (1-minute load average)"
    noisy = noisy_calibration(prof)
    if noisy:
        text += "\nwarning: the profile looks disturbed by other load (" + ", ".join(noisy) + ")"
    return apply_plan(cfg, ranked[0][0]), text
