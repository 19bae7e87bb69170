"""Does evaluation beside training cost training time? The default example with and without
periodic evaluations, in interleaved rounds.

Runs ``asyncflow train`` with its defaults (each run a fresh process, as a user runs it:
its own local Ray instance, the cached warm-start) and ``train.eval_every=10`` against
``train.eval_every=0``; both evaluate before and after (blocking, the same on both sides). The
order alternates from round to round, so the machine's drift favours neither side. Prints
each run's wall time (the whole command), the RL loop's wall time and samples/s (``summary.json``:
``wall_s``, ``samples_per_s``), the evaluations done / skipped beside training, the medians and
the eval/no-eval ratios; and the cores the machine spent outside the job's roles after step 1
(``summary.json``'s ``cpu.other``: other users' jobs, Ray's daemons, the evaluator), to judge how
loaded it was. Target: the default example with evaluations every 10 steps within 5% of its
time without. The headline is the whole command (what a user waits for: it includes the
evaluator's start, which goes on beside the workers' build and the first steps); the RL loop's
ratio is printed too. Each evaluating run also says how its due evaluations went
(``heldout_evals``: done, skipped while one ran, not ready (its evaluator still starting),
superseded (would have ended after the last step), abandoned (in flight at the end)).

    python benchmarks/eval_overlap.py                  # 120 steps, 3 rounds
    python benchmarks/eval_overlap.py --steps 60 --rounds 2 -- train.eval_overlap=false   # the old way
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLI = "import sys; from asyncflow.cli import main; sys.exit(main(sys.argv[1:]))"


def run(every: int, steps: int, extra: list[str], root: Path) -> dict:
    """One ``asyncflow train`` in a fresh process; its wall time and what its summary says."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"every{every}-", dir=root))
    cmd = [sys.executable, "-c", CLI, "train", f"train.eval_every={every}", f"train.steps={steps}",
           f"run_dir={run_dir}", "progress=false", *extra]
    t = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t
    if done.returncode:
        raise SystemExit(f"eval_overlap: {' '.join(cmd[3:])} failed:\n{done.stderr[-2000:]}")
    summary = json.loads(next(run_dir.glob("*/summary.json")).read_text())
    evals = summary.get("heldout_evals") or {}
    return {"every": every, "cmd_s": wall, "rl_s": summary["wall_s"], "samples_per_s": summary["samples_per_s"],
            "before": summary["heldout_acc_before"], "after": summary["heldout_acc_after"],
            "evals": {k: evals.get(k, 0) for k in ("done", "skipped", "not_ready", "superseded", "abandoned", "late")},
            "other": (summary.get("cpu") or {}).get("other")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=120, help="train.steps of every run (the default example: 120)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (one run of each side per round)")
    ap.add_argument("--every", type=int, default=10, help="train.eval_every of the evaluating side")
    ap.add_argument("--root", default="runs/eval_overlap", help="where the run folders go")
    ap.add_argument("extra", nargs="*", help="overrides for both sides (after --)")
    args = ap.parse_args()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for r in range(args.rounds):
        for every in ((args.every, 0) if r % 2 == 0 else (0, args.every)):
            row = run(every, args.steps, args.extra, root)
            rows.append(row)
            print(f"round {r + 1} eval_every={every:<3} command {row['cmd_s']:7.1f} s  RL loop {row['rl_s']:7.1f} s  "
                  f"{row['samples_per_s']:7.1f} samples/s  held-out {row['before']:.1%} -> {row['after']:.1%}  "
                  f"beside training: {', '.join(f'{n} {k}' for k, n in row['evals'].items())}; "
                  f"cores used outside the job's roles {row['other'] or 0:.2f}", flush=True)
    med = {e: {k: statistics.median(x[k] for x in rows if x["every"] == e) for k in ("cmd_s", "rl_s", "samples_per_s")}
           for e in (args.every, 0)}
    for e, m in med.items():
        print(f"median eval_every={e:<3} command {m['cmd_s']:7.1f} s  RL loop {m['rl_s']:7.1f} s  "
              f"{m['samples_per_s']:7.1f} samples/s")
    a, b = med[args.every], med[0]
    print(f"ratio eval_every={args.every} / eval_every=0 (median of {args.rounds}): whole command "
          f"{a['cmd_s'] / b['cmd_s']:.3f} (headline; target <= 1.05); RL loop {a['rl_s'] / b['rl_s']:.3f}, "
          f"samples/s {a['samples_per_s'] / b['samples_per_s']:.3f}")


if __name__ == "__main__":
    main()
