"""The pause a resumable checkpoint costs a run (what the trainer waits for), in ``sync`` and ``async``.

Runs the default example (or a given config) with ``train.save_every=1`` (a checkpoint after
every step), in each mode asked (``--modes``, default ``async`` (the default example's own
mode) and ``sync``), ``--runs`` times each (default 3), and prints per run the median pause
(``checkpoint_pause_s`` in the summary: per checkpoint, the driver's time asking for it (the
next step is already queued on the trainer) plus the wait of the next step's optimizer step
for the host copy of the weights and AdamW's state, which runs beside that step's fetch,
forward and backward (``checkpoint_wait_s`` in ``metrics.jsonl``:
:mod:`asyncflow.workflow.hostcopy`); rollout's answers in flight are taken by rollout's loop
meanwhile, and the write runs in a background thread) and that median as a fraction of the
median step (from ``metrics.jsonl``'s ``elapsed_s``, step 1 left out); then per mode the median
over the runs. ``--baseline`` also runs each mode without checkpoints (``train.save_every=0``)
and prints the median step of both: the whole cost of checkpointing every step, the copy's
competition for the cores included (noisy on a busy machine).

    python benchmarks/checkpoint_cost.py                       # the default example, 120 steps
    python benchmarks/checkpoint_cost.py train.steps=40 run_dir=/tmp/ckc
    python benchmarks/checkpoint_cost.py my.yaml --modes async --runs 1 launcher=local

Timings need a quiet machine: the writing thread competes with the run for the cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def costs(run_dir: Path) -> dict:
    """Per-checkpoint pauses, the median pause and its fraction of the median step, of a finished run."""
    summary = json.loads((run_dir / "summary.json").read_text())
    elapsed = [json.loads(line)["elapsed_s"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [b - a for a, b in zip([0.0, *elapsed], elapsed)][1:] or elapsed  # (step 1 includes warm-up)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    waits = [m["checkpoint_wait_s"] for m in lines if "checkpoint_wait_s" in m]
    pauses = summary.get("checkpoint_pause_s") or []
    median = statistics.median(pauses) if pauses else 0.0
    step = statistics.median(steps) if steps else 0.0
    return {"pauses_s": pauses, "median_pause_s": median, "median_step_s": step,
            "median_wait_s": statistics.median(waits) if waits else 0.0,
            "pause_fraction": median / step if step else 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", help="YAML config (default: the built-in example)")
    p.add_argument("overrides", nargs="*", help="key=value overrides (after mode=<mode> train.save_every=1)")
    p.add_argument("--modes", default="async,sync", help="comma-separated modes to measure (default async,sync)")
    p.add_argument("--runs", type=int, default=3, help="runs per mode (default 3; the median is reported)")
    p.add_argument("--baseline", action="store_true", help="also run each mode without checkpoints and compare steps")
    args = p.parse_args()
    from asyncflow.api import train  # lazy: torch and the launchers, keeps --help fast
    from asyncflow.config import load_config  # lazy: with the run

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).exists():
        config, overrides = None, [config, *overrides]
    for mode in args.modes.split(","):
        runs, plain = [], []
        for r in range(args.runs):
            cfg = load_config(config, [f"mode={mode}", "train.save_every=1", "progress=false", *overrides])
            out = costs(Path(train(cfg)["run_dir"]))
            runs.append(out)
            print(f"{mode} run {r + 1}: median pause {out['median_pause_s'] * 1e3:.1f} ms per checkpoint (of which the "
                  f"next optimizer step's wait for the host copy {out['median_wait_s'] * 1e3:.1f} ms) = "
                  f"{out['pause_fraction']:.1%} of the median step ({out['median_step_s']:.3f} s) over "
                  f"{len(out['pauses_s'])} checkpoints", flush=True)
            if args.baseline:
                cfg = load_config(config, [f"mode={mode}", "train.save_every=0", "progress=false", *overrides])
                plain.append(costs(Path(train(cfg)["run_dir"]))["median_step_s"])
                print(f"{mode} run {r + 1} without checkpoints: median step {plain[-1]:.3f} s", flush=True)
        pause = statistics.median(o["median_pause_s"] for o in runs)
        frac = statistics.median(o["pause_fraction"] for o in runs)
        print(f"{mode}: median of {len(runs)} runs: PAUSE {pause * 1e3:.1f} ms per checkpoint = {frac:.1%} OF A STEP",
              flush=True)
        if plain:
            with_ckpt, without = (statistics.median(x) for x in ([o["median_step_s"] for o in runs], plain))
            print(f"{mode}: median step {with_ckpt:.3f} s with a checkpoint every step, {without:.3f} s without: "
                  f"{with_ckpt / without - 1:+.1%}", flush=True)

if __name__ == "__main__":
    main()
