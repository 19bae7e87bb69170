"""Does LoRA learn the default task as full fine-tuning does? Held-out exact match before -> after.

For each seed, the default run (``asyncflow train``: SFT warm-start from the cache, then async
GRPO) twice from the same warm-started model and the same prompts: full fine-tuning at its
``train.lr``, and ``model.lora.r=R`` at ``--lora-lr`` (adapters want a larger step than the
whole model). Prints one line per run and the means. Accuracy does not depend on the
machine's load (a run's wall time does).

    python benchmarks/lora_learning.py                                   # seeds 0 1 2, 120 steps, LoRA lr 5e-4
    python benchmarks/lora_learning.py --seeds 0 --steps 40 --lora-lr 5e-4 2e-3 launcher=local  # overrides
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def run(overrides: list[str]) -> dict:
    from asyncflow.api import train
    from asyncflow.config import load_config

    t = time.perf_counter()
    s = train(load_config(None, ["progress=false", *overrides]))
    s["total_s"] = time.perf_counter() - t
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--rank", type=int, default=8, help="model.lora.r of the LoRA runs")
    ap.add_argument("--lora-lr", type=float, nargs="+", default=[5e-4], help="train.lr of the LoRA runs (each)")
    ap.add_argument("--skip-full", action="store_true", help="LoRA runs only")
    ap.add_argument("--run-dir", default="runs/lora_learning")
    args = ap.parse_args()
    gains: dict[str, list[float]] = {}
    print(f"{'seed':>4}  {'run':<22} {'before':>7} -> {'after':>6}  {'gain':>6}  {'wall s':>7}", flush=True)
    for seed in args.seeds:
        common = [f"seed={seed}", f"train.steps={args.steps}", f"run_dir={args.run_dir}", *args.overrides]
        variants = [] if args.skip_full else [("full", [])]
        variants += [(f"lora r={args.rank} lr={lr:g}", [f"model.lora.r={args.rank}", f"train.lr={lr}"])
                     for lr in args.lora_lr]
        for label, extra in variants:
            s = run(common + extra)
            a0, a1 = s["heldout_acc_before"], s["heldout_acc_after"]
            gains.setdefault(label, []).append(100 * (a1 - a0))
            print(f"{seed:>4}  {label:<22} {a0:7.1%} -> {a1:6.1%} {100 * (a1 - a0):+6.1f}  {s['wall_s']:7.1f}",
                  flush=True)
    for name, g in gains.items():
        each = ", ".join(f"{x:+.1f}" for x in g)
        print(f"mean gain {name}: {statistics.mean(g):+.1f} points over {len(g)} seed(s) ({each})")


if __name__ == "__main__":
    main()
