"""How many SFT steps does the warm-start need to reach its target, seed by seed?

The warm-start (``asyncflow/tasks/warmstart.py: sft``) stops at the first evaluation
that reaches ``target_acc``, and lands close to it by rewinding an evaluation that
overshot. How long that takes depends on the seed (the model's init and the batch order):
with the recipe shipped until 2026-11-25 (lr 3e-3, no warmup) seed 0 needed 550 steps on one
CPU and 4,800 on another, seed 3 3,950; with the current one (lr 1e-3, landing) seeds 0-2
need 274-300 steps (docs/benchmarks.md). This script runs the SFT of each recipe on each seed and
prints the steps each one took and the accuracy it stopped at, with the median and the
worst. (What RL then makes of each model is ``asyncflow train seed=N`` with the recipe.)

A recipe is ``key=value`` pairs joined by commas, recipes are separated by ``;``. Keys:
``lr``, ``warmup`` (linear warmup steps), ``batch`` (rows per step), ``every`` (steps
between evaluations), ``near`` (steps between evaluations once one reached half the
target), ``land`` (steps between checks of a replay after an overshoot; 0 = no landing);
a key left out keeps the shipped value, and ``default`` is the
shipped recipe itself. Runs go in parallel processes (``--jobs``), each on one torch thread
(or on the GPU with ``--device cuda``).

    python benchmarks/warmstart_seeds.py --seeds 0-4      # the shipped recipe against a warmup
    python benchmarks/warmstart_seeds.py --device cuda --jobs 8 --seeds 0-9 \\
        --recipes "default;lr=3e-3,land=0;lr=1e-3,warmup=100,every=25,near=5"
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

KEYS = {"lr": float, "warmup": int, "batch": int, "every": int, "near": int, "land": int}


def parse_recipe(text: str) -> dict:
    out: dict = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if part == "default":  # the shipped recipe (warmstart.LR, WARMUP_STEPS, EVAL_EVERY)
            continue
        key, _, value = part.partition("=")
        if key not in KEYS:
            raise SystemExit(f"unknown recipe key {key!r} in {text!r}; valid keys: {sorted(KEYS)}")
        out[key] = KEYS[key](value)
    return out


def parse_seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds += list(range(int(lo), int(hi or lo) + 1))
    return seeds


def run_one(args: tuple[dict, int, float, int, str, int]) -> dict:
    recipe, seed, target, max_steps, device, threads = args
    import torch

    torch.set_num_threads(threads)
    from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model
    from asyncflow.tasks.addition import AdditionTask
    from asyncflow.tasks.warmstart import EVAL_EVERY, LAND_EVERY, LR, NEAR_EVERY, WARMUP_STEPS, sft

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, seed=seed).to(device)
    result = sft(model, tok, AdditionTask(digits=2, seed=0), target_acc=target, max_steps=max_steps, seed=seed,
                 lr=recipe.get("lr", LR), warmup_steps=recipe.get("warmup", WARMUP_STEPS),
                 batch_size=recipe.get("batch", 256), eval_every=recipe.get("every", EVAL_EVERY),
                 near_every=recipe.get("near", NEAR_EVERY), land_every=recipe.get("land", LAND_EVERY) or None)
    return {"seed": seed, "steps": result.steps, "acc": result.accuracy, "seconds": result.seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default="default;lr=3e-3,land=0",
                    help="';'-separated recipes; 'default' is the shipped one")
    ap.add_argument("--seeds", default="0-4", help="e.g. 0-4 or 0,3,7")
    ap.add_argument("--target", type=float, default=0.65)
    ap.add_argument("--max-steps", type=int, default=5000)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    args = ap.parse_args()
    recipes = [parse_recipe(r) for r in args.recipes.split(";")]
    seeds = parse_seeds(args.seeds)
    work = [(r, s, args.target, args.max_steps, args.device, args.threads) for r in recipes for s in seeds]
    print(f"{len(recipes)} recipes x {len(seeds)} seeds, target {args.target:.0%}, at most {args.max_steps} steps, "
          f"{args.jobs} jobs on {args.device}", flush=True)
    started = time.perf_counter()
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        results = list(pool.map(run_one, work))
    for i, recipe in enumerate(recipes):
        rows = results[i * len(seeds):(i + 1) * len(seeds)]
        steps = [r["steps"] for r in rows]
        missed = sum(r["acc"] < args.target for r in rows)
        label = ",".join(f"{k}={v}" for k, v in recipe.items()) or "default (shipped)"
        print(f"{label:32s} median {statistics.median(steps):6.0f}  worst {max(steps):5d}  missed {missed}  "
              + " ".join(f"s{r['seed']}:{r['steps']}/{r['acc']:.0%}" for r in rows), flush=True)
    print(f"wall {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
