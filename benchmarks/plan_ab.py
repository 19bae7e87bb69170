"""plan=auto against the default config: is the planner's choice at least as fast?

    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/plan_ab.py [--rounds 3] [--steps 20] [--profile P.json]

Profiles this machine (``asyncflow profile``; or reads ``--profile``), resolves the plan that
``asyncflow train plan=auto`` would run on that profile (:func:`asyncflow.planner.auto.apply_plan`
of :func:`asyncflow.planner.search.search`'s choice, thread teams limited by the load as
``plan=auto`` does), then trains the default config and the plan's in ``--rounds`` interleaved
rounds (the order alternates from round to round, so the machine's drift favours neither),
``--steps`` steps each, ``evaluate=False``, on one launcher. Prints each run's steady samples/s
(after step 1), the median of each side, their ratio plan / default and the median of the
per-round ratios; ``--out`` writes them as JSON. When the plan is the default config itself the
ratio measures only the machine's spread (it says so).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile


def rounds_order(rounds: int) -> list[tuple[str, str]]:
    """Each round's order: default first in even rounds, the plan first in odd ones."""
    return [("default", "plan") if i % 2 == 0 else ("plan", "default") for i in range(rounds)]


def summarize(runs: dict[str, list[float]]) -> dict:
    """Medians of each side, their ratio and the median of the per-round ratios."""
    med = {k: statistics.median(v) for k, v in runs.items()}
    per_round = [p / d for p, d in zip(runs["plan"], runs["default"])]
    return {"median": med, "ratio": med["plan"] / med["default"], "median_round_ratio": statistics.median(per_round),
            "round_ratios": per_round}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile", default=None, help="profile JSON (default: measure one now)")
    ap.add_argument("--quick", action="store_true", help="the short profile")
    ap.add_argument("--out", default=None, help="write the runs and ratios as JSON here")
    ap.add_argument("--run-dir", default=None, help="run folders here (default: a temporary folder)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the default config (both sides)")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from asyncflow.config import load_config
    from asyncflow.launch.registry import get_launcher
    from asyncflow.planner.auto import apply_plan
    from asyncflow.planner.check import mode_config
    from asyncflow.planner.costs import ProfiledCost
    from asyncflow.planner.profile import run_profile
    from asyncflow.planner.search import allocation_for, search, team_limit
    from asyncflow.workflow.driver import train

    root = args.run_dir or tempfile.mkdtemp(prefix="asyncflow-plan-ab-")
    base = load_config(None, args.overrides)
    prof = json.load(open(args.profile)) if args.profile else run_profile(base, quick=args.quick)
    cpus = os.cpu_count() or 1
    best = search(base, ProfiledCost.from_dict(prof), prof, cpus, max_threads=team_limit(cpus))[0][0]
    default = mode_config(base, base.mode, args.steps, root)
    sides = {"default": default, "plan": apply_plan(default, best)}
    same = allocation_for(sides["plan"], cpus) == allocation_for(default, cpus)
    print(f"[plan_ab] plan=auto chooses: {best.describe()}" + (" (= the default config)" if same else ""), flush=True)
    runs: dict[str, list[float]] = {"default": [], "plan": []}
    launcher = get_launcher(default.launcher)
    try:
        for i, order in enumerate(rounds_order(args.rounds)):
            for side in order:
                s = train(sides[side], launcher, evaluate=False)
                runs[side].append(s["steady_samples_per_s"])
                print(f"[plan_ab] round {i + 1}: {side} {s['steady_samples_per_s']:.1f} samples/s", flush=True)
    finally:
        launcher.shutdown()
    out = {"plan": best.describe(), "plan_is_default": same, "steps": args.steps, "cpus": cpus, "runs": runs,
           **summarize(runs)}
    print(f"\n== plan=auto vs default: {args.rounds} interleaved rounds of {args.steps} steps, {cpus} CPUs ==")
    print(f"plan: {best.describe()}" + (" (the default config itself: the ratio is the machine's spread)"
                                         if same else ""))
    for side in ("default", "plan"):
        print(f"{side:<8} " + "  ".join(f"{x:7.1f}" for x in runs[side]) + f"   median {out['median'][side]:.1f}")
    print(f"ratio plan / default: {out['ratio']:.3f} (medians); per round {out['median_round_ratio']:.3f} (median of "
          + ", ".join(f"{r:.3f}" for r in out["round_ratios"]) + ")")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
    sys.exit(0)
