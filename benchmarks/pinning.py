"""Does each role computing on a core of its own (``resources.pin_cores``) pay?

Runs ``async`` on the bench workloads (the bench preset: steps of 32 prompts x 8 answers,
4096 samples a run) with ``resources.pin_cores=off`` and ``on`` in interleaved pairs on one
local Ray instance (the order alternates from pair to pair, so the machine's drift favours
neither), and prints each run's steady samples/s, the trainer's and rollout's busy fraction
and CPU, and the on/off ratio of every pair and of the means.

    python benchmarks/pinning.py --pairs 4            # workloads a and b
    python benchmarks/pinning.py --pairs 4 --workloads a
"""

from __future__ import annotations

import argparse
import statistics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=4, help="interleaved off/on pairs per workload")
    ap.add_argument("--workloads", nargs="+", default=["a", "b"], choices=["a", "b"])
    ap.add_argument("--samples", type=int, default=4096, help="samples per run")
    ap.add_argument("--run-dir", default="runs/pinning")
    args = ap.parse_args()

    from asyncflow.bench import PROMPTS_PER_STEP, _variant
    from asyncflow.config import load_config
    from asyncflow.launch import get_launcher
    from asyncflow.tasks import prepare_model
    from asyncflow.workflow.driver import train

    launcher = get_launcher("ray")
    try:
        for wl in args.workloads:
            speeds: dict[str, list[float]] = {"off": [], "on": []}
            print(f"\nworkload {wl}: async, steps of {PROMPTS_PER_STEP} prompts, {args.samples} samples a run")
            print(f"{'pair':>4} {'pin':>4} {'samples/s':>10} {'actor busy':>11} {'rollout busy':>13} "
                  f"{'actor cpu':>10} {'rollout cpu':>12} {'other cpu':>10}  pinned")
            for i in range(args.pairs):
                for pin in (("off", "on") if i % 2 == 0 else ("on", "off")):
                    cfg = load_config(None, [f"train.prompts_per_step={PROMPTS_PER_STEP}",
                                             f"resources.pin_cores={pin}", f"run_dir={args.run_dir}"])
                    prepare_model(cfg, args.run_dir)  # warm-start once (cached), before any timing
                    steps = max(2, args.samples // cfg.batch_size)
                    s = train(_variant(cfg, wl, "async", steps, args.run_dir), launcher=launcher, evaluate=False)
                    speeds[pin].append(s["steady_samples_per_s"])
                    roles, busy = (s["cpu"] or {}).get("roles", {}), s["busy"]
                    print(f"{i + 1:>4} {pin:>4} {s['steady_samples_per_s']:>10.1f} {busy.get('actor', 0):>11.0%} "
                          f"{busy.get('rollout', 0):>13.0%} {roles.get('actor', 0):>10.2f} {roles.get('rollout', 0):>12.2f} "
                          f"{(s['cpu'] or {}).get('other') or 0:>10.2f}  {s['pinned'] or '-'}", flush=True)
            ratios = [on / off for on, off in zip(speeds["on"], speeds["off"])]
            print(f"workload {wl}: on/off per pair " + " ".join(f"{r:.2f}" for r in ratios)
                  + f"; means {statistics.mean(speeds['on']):.1f} / {statistics.mean(speeds['off']):.1f} = "
                  f"{statistics.mean(speeds['on']) / statistics.mean(speeds['off']):.2f}x; "
                  f"pairs faster pinned: {sum(r > 1 for r in ratios)} of {len(ratios)}", flush=True)
    finally:
        launcher.shutdown()


if __name__ == "__main__":
    main()
