"""Planner accuracy: predicted vs measured samples/s of the built-in example on this machine.

    PYTHONPATH=. python benchmarks/planner_accuracy.py [--steps 10] [--modes sync,stream,async] [--profile P.json]

Profiles this machine (``asyncflow profile``, ~30-70 s, minutes under load) unless a profile is given, then
for each mode trains the built-in example for ``--steps`` steps with
``asyncflow.api.train(evaluate=False)`` (the real launcher, roles as processes) and prints the
measured steady samples/s (after step 1) beside the simulator's prediction for the same config,
steps and cores, and the error; also the throughput of the median step (less sensitive to a
stall of a shared machine), and, per mode, each term of a steady step real vs simulated
(:mod:`asyncflow.planner.terms`: step, rollout and trainer busy, the trainer's step boundary,
stream's transfer, prompt fetch and data hop), which says where an error comes from. The same
as ``asyncflow plan --check`` with the full profile (:mod:`asyncflow.planner.check`).

``--plan``: also run the plan that ``asyncflow train plan=auto`` would choose on the same
profile (:func:`asyncflow.planner.auto.apply_plan` of the search's best) as one more row,
so the plan and the default config (the ``async`` row) are measured in one invocation
(``benchmarks/plan_ab.py`` measures the two in interleaved rounds).
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--modes", default="sync,stream,async")
    p.add_argument("--profile", default=None, help="profile JSON (default: measure one now)")
    p.add_argument("--out", default=None, help="write the rows as JSON here (and the profile beside it)")
    p.add_argument("--plan", action="store_true", help="also measure the plan=auto config (one more row)")
    p.add_argument("--quick", action="store_true", help="the short profile (asyncflow plan --check's)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides (e.g. launcher=local)")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import json

    from asyncflow.config import load_config
    from asyncflow.planner.check import accuracy, format_accuracy, mode_config
    from asyncflow.planner.costs import ProfiledCost
    from asyncflow.planner.profile import run_profile

    base = load_config(None, args.overrides)
    out_prof = args.out and args.out.replace(".json", "") + "-profile.json"
    prof = json.load(open(args.profile)) if args.profile else run_profile(base, out=out_prof, quick=args.quick)
    extra = []
    if args.plan:
        from asyncflow.planner.auto import apply_plan
        from asyncflow.planner.search import search, team_limit

        cpus = os.cpu_count() or 1
        best = search(base, ProfiledCost.from_dict(prof), prof, cpus, max_threads=team_limit(cpus))[0][0]
        print(f"[accuracy] plan=auto chooses: {best.describe()}", flush=True)
        import tempfile

        extra.append(("plan=auto", apply_plan(mode_config(base, base.mode, args.steps,
                                                          tempfile.mkdtemp(prefix="asyncflow-accuracy-")), best)))
    from asyncflow.api import train

    report = accuracy(base, train, args.steps, args.modes.split(","), profile=prof, out=args.out, extra=extra)
    print("\n" + format_accuracy(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
