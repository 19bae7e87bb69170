"""A/B of one config change on ``async``, in interleaved pairs: does it pay?

Runs ``async`` on the bench workloads (the bench preset: steps of 32 prompts x 8 answers,
4096 samples a run) with the ``base`` overrides and the ``new`` overrides, in interleaved
pairs on one local Ray instance (the order alternates from pair to pair, so the machine's
drift favours neither side), and prints each run's steady samples/s, the trainer's and
rollout's busy fraction, the share of it each was on its core (actor/rollout; unlike
samples/s, it does not move with the machine's speed), their CPU, the CPU outside the
roles, and the new/base ratio of every pair and of the means.

    python benchmarks/ab.py resources.pin_cores=off resources.pin_cores=on --pairs 4
    python benchmarks/ab.py train.split_padding=0 train.split_padding=128 --pairs 3 --workloads a

Each side is one argument of space-separated ``key=value`` overrides (quote several).
An item whose key is an environment variable's name (a capital in it, no dot) sets that
variable instead, for the whole job: every run then starts a fresh local Ray instance
with the side's environment, which Ray's daemons and the role processes inherit (both
sides pay the same restart):

    python benchmarks/ab.py RAY_worker_niceness=15 RAY_worker_niceness=0 --pairs 4
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics

ENV = re.compile(r"^(?=[^=]*[A-Z])[A-Za-z_][A-Za-z0-9_]*=")  # a name with a capital (config keys have none)


def split_side(items: list[str]) -> tuple[list[str], dict[str, str]]:
    """(config overrides, environment variables) of one side's ``key=value`` items."""
    env = dict(item.split("=", 1) for item in items if ENV.match(item))
    return [item for item in items if not ENV.match(item)], env


@contextlib.contextmanager
def environment(env: dict[str, str], names):
    """``os.environ`` with ``env`` set and every other variable in ``names`` unset, as before after."""
    saved = {k: os.environ.get(k) for k in names}
    for k in names:
        os.environ.pop(k, None)
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base", help="overrides of the baseline, e.g. 'resources.pin_cores=off'")
    ap.add_argument("new", help="overrides of the change, e.g. 'resources.pin_cores=on'")
    ap.add_argument("--pairs", type=int, default=4, help="interleaved base/new pairs per workload")
    ap.add_argument("--workloads", nargs="+", default=["a", "b"], choices=["a", "b"])
    ap.add_argument("--samples", type=int, default=4096, help="samples per run")
    ap.add_argument("--run-dir", default="runs/ab")
    args = ap.parse_args()

    from asyncflow.bench.run import PROMPTS_PER_STEP, _variant
    from asyncflow.config import load_config
    from asyncflow.launch.registry import get_launcher
    from asyncflow.tasks.models import prepare_model
    from asyncflow.api import train

    sides = {"base": split_side(args.base.split()), "new": split_side(args.new.split())}
    cfgs = {side: load_config(None, [f"train.prompts_per_step={PROMPTS_PER_STEP}", f"run_dir={args.run_dir}", *o])
            for side, (o, _) in sides.items()}  # a bad override fails here, before any run
    env_names = set(sides["base"][1]) | set(sides["new"][1])
    prepare_model(cfgs["base"], args.run_dir)  # warm-start once (cached), before any timing
    launcher = None if env_names else get_launcher("ray")  # with variables: a fresh instance per run

    def run(side: str, cfg, wl: str, steps: int) -> dict:
        job = _variant(cfg, wl, "async", steps, args.run_dir)
        if launcher is not None:
            return train(job, launcher=launcher, evaluate=False)
        with environment(sides[side][1], env_names):
            fresh = get_launcher("ray")
            try:
                return train(job, launcher=fresh, evaluate=False)
            finally:
                fresh.shutdown()

    try:
        for wl in args.workloads:
            speeds: dict[str, list[float]] = {"base": [], "new": []}
            print(f"\nworkload {wl}: async, steps of {PROMPTS_PER_STEP} prompts, {args.samples} samples a run; "
                  f"base: {args.base}; new: {args.new}")
            print(f"{'pair':>4} {'side':>5} {'samples/s':>10} {'actor busy':>11} {'rollout busy':>13} "
                  f"{'on a core':>10} {'actor cpu':>10} {'rollout cpu':>12} {'other cpu':>10}  pinned")
            for i in range(args.pairs):
                for side in (("base", "new") if i % 2 == 0 else ("new", "base")):
                    cfg = cfgs[side]
                    steps = max(2, args.samples // cfg.batch_size)
                    s = run(side, cfg, wl, steps)
                    speeds[side].append(s["steady_samples_per_s"])
                    cpu = s["cpu"] or {}
                    roles, busy, on = cpu.get("roles", {}), s["busy"], s.get("on_cpu", {})
                    on_core = f"{on.get('actor', 0):.0%}/{on.get('rollout', 0):.0%}"
                    print(f"{i + 1:>4} {side:>5} {s['steady_samples_per_s']:>10.1f} {busy.get('actor', 0):>11.0%} "
                          f"{busy.get('rollout', 0):>13.0%} {on_core:>10} {roles.get('actor', 0):>10.2f} "
                          f"{roles.get('rollout', 0):>12.2f} {cpu.get('other') or 0:>10.2f}  {s['pinned'] or '-'}",
                          flush=True)
            ratios = [n / b for n, b in zip(speeds["new"], speeds["base"])]
            mean_new, mean_base = statistics.mean(speeds["new"]), statistics.mean(speeds["base"])
            print(f"workload {wl}: new/base per pair " + " ".join(f"{r:.2f}" for r in ratios)
                  + f"; means {mean_new:.1f} / {mean_base:.1f} = {mean_new / mean_base:.2f}x; "
                  f"pairs faster with new: {sum(r > 1 for r in ratios)} of {len(ratios)}", flush=True)
    finally:
        if launcher is not None:
            launcher.shutdown()


if __name__ == "__main__":
    main()
