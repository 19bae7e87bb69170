"""Does each example config raise held-out reward on its built-in task? Before -> after.

Runs shipped example configs one after another (each a full ``asyncflow train``: SFT
warm-start from the cache, or built once and cached, then RL), and prints per config the
held-out figure before and after RL (accuracy: exact match for addition and multistep,
a correct expression for countdown), the samples trained, the RL wall time and, with dynamic
sampling, the share of groups dropped. Each run is capped by ``--steps`` (default: the
config's own) so that it stays within about 5 minutes on a 2-core CPU; warm-start time is
reported separately (it is paid once, then cached).

    python benchmarks/learning.py                         # the default list below
    python benchmarks/learning.py dapo_addition countdown_grpo --steps 30
    python benchmarks/learning.py grpo_addition launcher=local     # extra key=value overrides

Wall times are as measured: on a shared machine they are noisy.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEFAULT = ["grpo_addition", "dapo_addition", "rloo_addition", "countdown_grpo", "multistep_grpo"]
CONFIGS = Path(__file__).resolve().parent.parent / "asyncflow" / "configs"


def run_one(name: str, overrides: list[str], steps: int | None, run_dir: str) -> dict:
    from asyncflow.config import load_config
    from asyncflow.api import train

    path = CONFIGS / f"{name}.yaml" if not name.endswith(".yaml") else Path(name)
    extra = ["progress=false", "train.eval_every=0", f"run_dir={run_dir}"]
    if steps:
        extra.append(f"train.steps={steps}")
    cfg = load_config(path, extra + overrides)
    t = time.perf_counter()
    s = train(cfg)
    s["total_s"] = time.perf_counter() - t
    s["task"] = cfg.task.name
    return s


def line(name: str, s: dict) -> str:
    a0, a1 = s["heldout_acc_before"], s["heldout_acc_after"]
    ws = s["init"]
    warm = f"{ws['seconds']:.0f}s{' (cached)' if ws.get('cached') else ''}" if ws.get("source") == "warmstart" else "-"
    drop = s.get("dynamic_sampling", {}).get("drop_rate")
    return (f"{name:<16} {s['task']:<10} {a0:7.1%} -> {a1:6.1%} {100 * (a1 - a0):+6.1f}  {s['samples']:>7}  "
            f"{s['wall_s']:7.1f}  {warm:>14}  {'-' if drop is None else f'{drop:.0%}':>5}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("items", nargs="*", help="config names (asyncflow/configs/<name>.yaml) and key=value overrides")
    ap.add_argument("--steps", type=int, default=None, help="RL steps per config (default: the config's)")
    ap.add_argument("--run-dir", default="runs/learning")
    args = ap.parse_intermixed_args()  # names, key=value overrides and options in any order
    names = [x for x in args.items if "=" not in x] or DEFAULT
    overrides = [x for x in args.items if "=" in x]
    rows = []
    for name in names:
        rows.append((name, run_one(name, overrides, args.steps, args.run_dir)))
        print(f"done: {line(*rows[-1])}", flush=True)
    print("\nconfig           task       held-out before -> after (points)  samples  RL wall s   warm-start  drop")
    for name, s in rows:
        print(line(name, s))


if __name__ == "__main__":
    main()
