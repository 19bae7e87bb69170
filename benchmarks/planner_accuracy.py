"""Planner accuracy: predicted vs measured samples/s of the built-in example on this machine.

    PYTHONPATH=. python benchmarks/planner_accuracy.py [--steps 10] [--modes sync,stream,async] [--profile P.json]

Profiles this machine (``asyncflow profile``, ~30-70 s, minutes under load) unless a profile is given, then
for each mode trains the built-in example for ``--steps`` steps with
``asyncflow.workflow.driver.train(progress=False, evaluate=False)`` (the real launcher,
roles as processes) and prints the measured steady samples/s (after step 1) beside the
simulator's prediction for the same config, steps and cores, and the error; also the
throughput of the median step (less sensitive to a stall of a shared machine).

``--plan``: also run the plan that ``asyncflow train plan=auto`` would choose on the same
profile (:func:`asyncflow.planner.auto.apply_plan` of the search's best) as one more row,
so the plan and the default config (the ``async`` row) are measured in one invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--modes", default="sync,stream,async")
    p.add_argument("--profile", default=None, help="profile JSON (default: measure one now)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--plan", action="store_true", help="also measure the plan=auto config (one more row)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides (e.g. launcher=local)")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from asyncflow.config import load_config
    from asyncflow.planner.costs import ProfiledCost
    import numpy as np

    from asyncflow.planner.profile import run_profile, step_seconds
    from asyncflow.planner.search import predict
    from asyncflow.api import train

    cpus = os.cpu_count() or 1
    base = load_config(None, args.overrides)
    if args.profile:
        prof = json.load(open(args.profile))
    else:
        prof = run_profile(base, out=args.out and args.out.replace(".json", "") + "-profile.json")
    cost = ProfiledCost.from_dict(prof)
    rows = []
    root = tempfile.mkdtemp(prefix="asyncflow-accuracy-")
    runs = []
    for mode in args.modes.split(","):
        runs.append((mode, load_config(None, [f"mode={mode}", f"train.steps={args.steps}", "train.eval_every=0",
                                              "progress=false", f"run_dir={root}", *args.overrides])))
    if args.plan:
        from asyncflow.planner.auto import apply_plan
        from asyncflow.planner.search import search

        from asyncflow.planner.search import team_limit

        best = search(runs[0][1], cost, prof, cpus, max_threads=team_limit(cpus))[0][0]
        print(f"[accuracy] plan=auto chooses: {best.describe()}", flush=True)
        runs.append(("plan=auto", apply_plan(runs[0][1], best)))
    for mode, cfg in runs:
        pred = predict(cfg, cost, prof, cpus, steps=args.steps)
        t = time.perf_counter()
        s = train(cfg, evaluate=False)
        meas = s["steady_samples_per_s"]
        median = cfg.batch_size / float(np.median(step_seconds(s["run_dir"])))  # less sensitive to a stall
        rows.append({"mode": mode, "predicted": pred.samples_per_s, "measured": meas, "measured_median_step": median,
                     "error": pred.samples_per_s / meas - 1, "wall_s": time.perf_counter() - t,
                     "busy_measured": s["busy"], "busy_predicted": pred.busy})
        print(f"[accuracy] {mode}: predicted {pred.samples_per_s:.1f}, measured {meas:.1f} samples/s", flush=True)
    pl = prof.get("pipeline", {})
    print(f"\n== planner accuracy: built-in example, {args.steps} steps, {cpus} CPUs ==")
    print(f"profile {prof.get('created')}: role factors {pl.get('role_factor')}, interference "
          f"{prof.get('interference', 1.0):.2f}, transfer {pl.get('transfer_s', 0) * 1e3:.1f} ms, sync overhead "
          f"{pl.get('step_overhead_s', 0) * 1e3:.1f} ms, data latency {pl.get('data_latency_s', 0) * 1e3:.1f} ms, "
          f"actor step boundary {pl.get('actor_overhead_s', 0) * 1e3:.1f} ms")
    print(f"{'mode':<10}{'predicted':>10}{'measured':>10}{'error':>8}{'median-step':>12}{'error':>8}"
          "   busy measured / predicted (rollout, actor)")
    for r in rows:
        bm, bp = r["busy_measured"], r["busy_predicted"]
        med = r["measured_median_step"]
        print(f"{r['mode']:<10}{r['predicted']:>10.1f}{r['measured']:>10.1f}{r['error']:>+8.1%}"
              f"{med:>12.1f}{r['predicted'] / med - 1:>+8.1%}   "
              f"{bm.get('rollout', 0):.0%}/{bm.get('actor', 0):.0%} vs {bp['rollout']:.0%}/{bp['actor']:.0%}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cpus": cpus, "steps": args.steps, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
