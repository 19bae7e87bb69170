"""Allocation search behind ``asyncflow plan``.

Candidates on a CPU budget of ``cpus`` cores (what the real launcher can run):

* ``sync``: one colocated worker on ``t`` threads, ``t`` in 1 .. cpus;
* ``stream`` / ``async``: one process per role with ``t`` threads each
  (``resources.threads_per_role``), ``2t <= cpus`` (``train.tp``: ``(1 + tp) t``, the trainer's
  ``tp`` ranks kept as the config has them; ``sync`` refuses tp): rollout and actor together never ask
  for more threads than cores (oversubscribed OpenMP teams spin-wait for each other far
  worse than the simulator's proportional sharing: 2 threads per role on 2 cores was
  predicted 1081 samples/s and measured 275), staleness ``k`` in 1 .. 3 for async;
* on this machine (``asyncflow plan``, ``plan=auto``) no team larger than
  :func:`team_limit`, the cores other jobs leave free;

each with every micro-batch size that divides ``prompts_per_step`` and whose rows are within
the rows the training curve was profiled at (:func:`profiled_rows`: a linear fit's
intercept, extrapolated to 4x the measured rows, made a whole-batch micro-batch look
~20% faster than four, and it measured 3-16% slower), and no larger than the config's
own micro-batch: even with the curve measured up to the whole batch, micro-batches of 16
prompts were predicted 4% faster than 4 and measured 30% slower (439 vs 632 samples/s,
actor-bound in both): the simulator does not yet know why, so it does not go there. Every candidate is
simulated on the profiled costs with the roles sharing ``cpus`` cores; the plan is the
highest simulated samples/s, where candidates within ``TIE`` (3%) of the best count as
equal (below the simulator's error on this machine) and the simplest of them wins: sync,
then stream, then the smaller staleness (fresher samples are never worse for learning),
fewer threads, the larger micro-batch. The list returned is that plan first, then the
rest best first.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from asyncflow.config import RunConfig
from asyncflow.observe.trace import write_gantt, write_sim_trace
from asyncflow.planner.costs import ProfiledCost
from asyncflow.planner.sim import Allocation, CostModel, SimResult, Workload, simulate

MODES = ("sync", "stream", "async")
TIE = 0.03  # candidates within 3% of the best simulated samples/s count as equal


def workload_from(cfg: RunConfig, prof: dict, steps: int | None = None, micro: int | None = None) -> Workload:
    """The simulator's workload for ``cfg``, with lengths and prompt length from a profile."""
    layers, hidden = model_dims(cfg) if cfg.train.tp > 1 else (0, 0)
    return Workload(prompts_per_step=cfg.train.prompts_per_step, group_size=cfg.rollout.group_size,
                    prompt_len=prof["prompt_len"], lengths={int(k): v for k, v in prof["lengths"].items()},
                    steps=steps or cfg.train.steps, reward_latency_s=cfg.reward.latency_ms and
                    (cfg.reward.latency_ms[0] / 1e3, cfg.reward.latency_ms[1] / 1e3),
                    reward_concurrency=cfg.reward.concurrency, seed=cfg.seed, prefill_token=True,
                    layers=layers, hidden=hidden)


def model_dims(cfg: RunConfig) -> tuple[int, int]:
    """(decoder layers, hidden size) of the policy: the built-in model's, or its folder's ``config.json``
    ((0, 0) when unreadable: the tensor-parallel all-reduces are then not counted)."""
    if not cfg.model.path:
        return cfg.model.num_layers, cfg.model.hidden_size
    try:
        d = json.loads((Path(cfg.model.path) / "config.json").read_text())
        d = d.get("text_config", d)
        return int(d["num_hidden_layers"]), int(d["hidden_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0, 0


def allocation_for(cfg: RunConfig, cpus: int) -> Allocation:
    """The allocation ``cfg`` runs with today (what ``asyncflow train`` would do)."""
    r = cfg.resources
    t = (r.sync_threads or cpus) if cfg.mode == "sync" else r.threads_per_role
    return Allocation(cfg.mode, t, t, cfg.train.micro_prompts, cfg.staleness, cfg.rollout.max_batch, cfg.train.tp)


def predict(cfg: RunConfig, cost: CostModel, prof: dict, cpus: int, steps: int | None = None,
            alloc: Allocation | None = None) -> SimResult:
    wl = workload_from(cfg, prof, steps=steps)
    return simulate(wl, alloc or allocation_for(cfg, cpus), cost, cores=cpus)


def profiled_rows(prof: dict) -> int:
    """The largest training micro-batch (rows) every thread count's curve was measured at
    (profiles that do not say were measured at 8 and 32 rows)."""
    return min(max(c.get("train_rows", [8, 32])) for c in prof["curves"].values())


def team_limit(cpus: int) -> int:
    """Largest torch thread team to plan for: the cores other jobs leave free (1-minute load
    average) when that is fewer than ``cpus``. A team of ``t`` threads waits for its slowest
    thread, so one busy neighbour collapses it: sync on 2 threads of 2 shared cores measured
    793, 27, 20 and 86 samples/s in four runs this day, the one-thread roles 308-616."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return cpus
    return max(1, min(cpus, int(cpus - load + 0.5)))


def candidates(cfg: RunConfig, cpus: int, modes: Sequence[str] = MODES, max_staleness: int = 3,
               max_rows: int | None = None, max_threads: int | None = None) -> list[Allocation]:
    P, slots, G, tp = cfg.train.prompts_per_step, cfg.rollout.max_batch, cfg.rollout.group_size, cfg.train.tp
    micros = [m for m in range(1, P + 1) if P % m == 0 and (max_rows is None or m * G <= max_rows)] or [1]
    out = []
    for m in micros:
        if "sync" in modes and tp == 1:  # (sync refuses train.tp)
            out += [Allocation("sync", t, t, m, 0, slots) for t in range(1, (max_threads or cpus) + 1)]
        # rollout's process and the trainer's tp: never more threads than cores
        for t in range(1, max(1, min(cpus // (1 + tp), max_threads or cpus)) + 1):
            if "stream" in modes:
                out.append(Allocation("stream", t, t, m, 0, slots, tp))
            if "async" in modes:
                out += [Allocation("async", t, t, m, k, slots, tp) for k in range(1, max_staleness + 1)]
    return out


def search(cfg: RunConfig, cost: CostModel, prof: dict, cpus: int, steps: int = 12, modes: Sequence[str] = MODES,
           max_threads: int | None = None) -> list[tuple[Allocation, SimResult]]:
    """Every candidate with its simulated result, the plan first (``max_threads``: largest
    thread team, e.g. :func:`team_limit`; None = ``cpus``)."""
    rank = {m: i for i, m in enumerate(MODES)}
    rows = min(profiled_rows(prof), cfg.train.micro_prompts * cfg.rollout.group_size)  # see the module doc
    cands = candidates(cfg, cpus, modes, max_rows=rows, max_threads=max_threads)
    res = [(a, predict(cfg, cost, prof, cpus, steps, a)) for a in cands]
    simple = lambda ar: (rank[ar[0].mode], ar[0].staleness, ar[0].rollout_res, -ar[0].micro_prompts)  # noqa: E731
    res.sort(key=lambda ar: (-round(ar[1].samples_per_s, 6), *simple(ar)))
    near = [ar for ar in res if ar[1].samples_per_s >= (1 - TIE) * res[0][1].samples_per_s]
    pick = min(near, key=simple)  # within the model's error of the best: the simplest, freshest
    return [pick] + [ar for ar in res if ar is not pick]


def format_plan(ranked: list[tuple[Allocation, SimResult]], cpus: int,
                current: tuple[Allocation, SimResult] | None = None) -> str:
    best_a, best = ranked[0]
    by_mode: dict[str, tuple[Allocation, SimResult]] = {}
    for a, r in ranked:
        by_mode.setdefault(a.mode, (a, r))
    lines = [f"== asyncflow plan: {cpus} CPU cores (simulated on the profiled costs) ==",
             f"plan: {best_a.describe()}",
             f"      config: mode={best_a.mode}" + (f" staleness={best_a.staleness}" if best_a.mode == "async" else "")
             + f" train.micro_prompts={best_a.micro_prompts} "
             + (f"resources.sync_threads={best_a.rollout_res}" if best_a.mode == "sync"
                else f"resources.threads_per_role={best_a.rollout_res}"),
             f"predicted: {best.samples_per_s:.1f} samples/s; idle: "
             + ", ".join(f"{k} {v:.0%}" for k, v in best.idle.items())]
    if best_a.mode == "sync":
        lines.append("sync wins here: with so few cores the roles would only take cores from each other, "
                     "so overlapping them does not pay")
    lines += ["", "best of each mode:",
              f"{'mode':<7}{'samples/s':>10}{'vs plan':>9}  {'idle rollout/reward/actor':<27}allocation"]
    for m in MODES:
        if m in by_mode:
            a, r = by_mode[m]
            idle = "/".join(f"{r.idle[k]:.0%}" for k in ("rollout", "reward", "actor"))
            vs_plan = r.samples_per_s / best.samples_per_s
            lines.append(f"{m:<7}{r.samples_per_s:>10.1f}{vs_plan:>8.2f}x  {idle:<27}{a.describe()}")
    if current is not None:
        a, r = current
        lines.append(f"\nthe config as given ({a.describe()}): {r.samples_per_s:.1f} samples/s predicted "
                     f"({r.samples_per_s / best.samples_per_s:.2f}x the plan)")
    return "\n".join(lines)


def plan(cfg: RunConfig, profile: str, cpus: int | None = None, trace: str | None = None,
         gantt: str | None = None) -> str:
    """``asyncflow plan``: search on the profiled costs and format the plan."""
    cpus = cpus or os.cpu_count() or 1
    prof = json.loads(open(profile).read())
    cost = ProfiledCost.from_dict(prof)
    teams = team_limit(cpus) if cpus == (os.cpu_count() or 1) else cpus  # another budget: assume it is free
    ranked = search(cfg, cost, prof, cpus, max_threads=teams)
    current_alloc = allocation_for(cfg, cpus)
    current = (current_alloc, predict(cfg, cost, prof, cpus, 12, current_alloc))
    text = format_plan(ranked, cpus, current)
    if teams < cpus:
        text += f"\nthread teams limited to {teams}: other jobs load this machine (1-minute load average)"
    noisy = noisy_calibration(prof)
    if noisy:
        text += ("\nwarning: the profile looks disturbed by other load (" + ", ".join(noisy) + "); "
                 "the plan may be wrong: re-run `asyncflow profile` on a quiet machine")
    if trace:
        write_sim_trace(ranked[0][1], trace)
        text += f"\ntrace of the planned run: {trace} (open in https://ui.perfetto.dev)"
    if gantt:
        write_gantt(ranked[0][1].spans, gantt, f"simulated: {ranked[0][0].describe()}")
        text += f"\nGantt chart of the planned run: {gantt}"
    return text


def noisy_calibration(prof: dict, lo: float = 0.5, hi: float = 2.0) -> list[str]:
    """Calibration factors far from 1: the curves and the role runs disagree, which on a
    shared machine means one of them was slowed by other load."""
    return [f"{role} on {t} thread(s) x{f:.2f}" for t, cal in prof.get("calibration", {}).items()
            for role, f in cal.items() if isinstance(f, (int, float)) and not lo <= f <= hi]
