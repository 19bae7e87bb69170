"""The pause a resumable checkpoint costs a ``mode=sync`` run (what the driver waits for).

Runs the default example (or a given config) with ``mode=sync train.save_every=1`` (a
checkpoint after every step; only ``sync`` writes resumable ones) and prints the pause of
each checkpoint (``checkpoint_pause_s`` in the summary: the host snapshot; the write runs
in a background thread) and, over the checkpoints, the median pause and the median pause
as a fraction of the median step (from ``metrics.jsonl``'s ``elapsed_s``).

    python benchmarks/checkpoint_cost.py                       # the default example, 120 steps
    python benchmarks/checkpoint_cost.py my.yaml train.steps=20 launcher=local

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
    pauses = summary.get("checkpoint_pause_s") or []
    median = statistics.median(pauses) if pauses else 0.0
    step = statistics.median(steps) if steps else 0.0
    return {"pauses_s": pauses, "median_pause_s": median, "median_step_s": step,
            "pause_fraction": median / step if step else 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", help="YAML config (default: the built-in example)")
    p.add_argument("overrides", nargs="*", help="key=value overrides (after mode=sync train.save_every=1)")
    args = p.parse_args()
    from asyncflow.api import train  # lazy: torch and the launchers, keeps --help fast
    from asyncflow.config import load_config  # lazy: with the run

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).exists():
        config, overrides = None, [config, *overrides]
    cfg = load_config(config, ["mode=sync", "train.save_every=1", "progress=false", *overrides])
    summary = train(cfg)
    out = costs(Path(summary["run_dir"]))
    for i, s in enumerate(out["pauses_s"], 1):
        print(f"checkpoint {i:4d}: pause {s * 1e3:8.1f} ms")
    print(f"median pause {out['median_pause_s'] * 1e3:.1f} ms = {out['pause_fraction']:.1%} of the median step "
          f"({out['median_step_s']:.3f} s) over {len(out['pauses_s'])} checkpoints")


if __name__ == "__main__":
    main()
