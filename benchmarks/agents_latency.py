"""Agents with a slow environment: ``async`` against the strongest ``sync`` when every environment
step waits 50-500 ms (a remote tool, a sandbox, a web call), in samples/s.

Each run is a fresh ``asyncflow train`` process (its own local Ray instance, as a user runs it) of
multi-turn episodes on the built-in tiny model (no warm-start: throughput only): ``TURNS`` turns an
episode, each answered by :func:`make`'s environment after ``env.latency_ms`` (default 50-500 ms,
uniform, awaited on the environment's event loop: a remote call holds no thread). Modes:

* ``sync``: one colocated worker on every core, phase after phase (rollout of the whole step,
  then training);
* ``sync:dp``: ``train.dp=2`` colocated ranks of one thread each, each generating its half of
  the step's prompts (``asyncflow bench``'s strongest synchronous baseline on 2 cores);
* ``async`` (staleness 1) and ``async:2``: rollout and trainer in their own workers, rollout
  running ahead; a turn's environment wait is filled by the other episodes' decoding and by
  training.

Rounds are interleaved (every mode once per round, the order rotating), so the machine's drift
favours no mode; the figure of a mode is the median over rounds of ``steady_samples_per_s`` (after
the first step: launcher start and the first step's fill are out). Prints each run, the medians and
``async`` / the faster ``sync``.

    python benchmarks/agents_latency.py                         # 3 rounds, 20 steps of 16 x 8 episodes
    python benchmarks/agents_latency.py --rounds 1 --steps 2 --prompts 2   # a dry run
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
HERE = Path(__file__).resolve()
TURNS = 3
MODES = {"sync": ["mode=sync"], "sync:dp": ["mode=sync", "train.dp=2", "resources.sync_threads=1"],
         "async": ["mode=async", "staleness=1"], "async:2": ["mode=async", "staleness=2"]}


class Remote:
    """The benchmark's environment: ``TURNS`` turns, each answered with a short text (the
    emulated latency is ``env.latency_ms``'s, applied around ``step``); reward = how many of the
    turn's characters are digits (something to learn, not the point here)."""

    def reset(self, sample: dict) -> str:
        self.n = 0
        return sample["prompt"]

    def step(self, turn) -> tuple:
        self.n += 1
        score = sum(c.isdigit() for c in turn.content) / max(1, len(turn.content))
        return (" next" if self.n < TURNS else None), score, self.n >= TURNS


def make() -> Remote:
    return Remote()


def run(mode: str, args: argparse.Namespace, root: Path) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"{mode.replace(':', '-')}-", dir=root))
    lo, hi = args.latency
    cmd = [sys.executable, "-c", CLI, "train", *MODES[mode], f"env.fn={HERE}:make", f"env.latency_ms=[{lo},{hi}]",
           f"env.max_turns={TURNS}", f"env.turn_tokens={args.turn_tokens}", f"env.max_tokens={4 * args.turn_tokens}",
           "env.concurrency=256", "warmstart.enabled=false", f"train.steps={args.steps}",
           f"train.prompts_per_step={args.prompts}", f"train.micro_prompts={min(4, args.prompts)}",
           "train.eval_every=0", "task.eval_n=16",
           f"run_dir={run_dir}", "progress=false", *args.extra]
    t = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t
    if done.returncode:
        raise SystemExit(f"agents_latency: {mode} failed:\n{done.stderr[-3000:]}")
    s = json.loads(next(run_dir.glob("*/summary.json")).read_text())
    return {"mode": mode, "steady_samples_per_s": s["steady_samples_per_s"], "samples_per_s": s["samples_per_s"],
            "rl_s": s["wall_s"], "cmd_s": wall, "episodes": s["episodes"]["episodes"], "env_errors": s["env_errors"],
            "other_cores": (s.get("cpu") or {}).get("other")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=16, help="train.prompts_per_step (x rollout.group_size 8)")
    ap.add_argument("--turn-tokens", type=int, default=8)
    ap.add_argument("--latency", type=float, nargs=2, default=(50.0, 500.0), metavar=("LO_MS", "HI_MS"))
    ap.add_argument("--modes", default="sync,sync:dp,async,async:2")
    ap.add_argument("--root", default="runs/agents_latency")
    ap.add_argument("extra", nargs="*", help="more key=value overrides for every run")
    args = ap.parse_args()
    modes = args.modes.split(",")
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes[r % len(modes):] + modes[: r % len(modes)]:  # (the order rotates)
            row = run(mode, args, root)
            rows[mode].append(row)
            print(f"round {r + 1} {mode:8s} {row['steady_samples_per_s']:7.1f} samples/s after step 1 "
                  f"({row['samples_per_s']:.1f} overall, RL {row['rl_s']:.1f} s, command {row['cmd_s']:.1f} s, "
                  f"{row['episodes']} episodes, {row['env_errors']} env errors, other cores {row['other_cores']})",
                  flush=True)
    med = {m: statistics.median(x["steady_samples_per_s"] for x in rows[m]) for m in modes}
    print("\nmedian samples/s after step 1: " + ", ".join(f"{m} {v:.1f}" for m, v in med.items()))
    syncs = [m for m in modes if m.startswith("sync")]
    if syncs:
        best = max(syncs, key=lambda m: med[m])
        for m in (m for m in modes if m.startswith("async")):
            print(f"{m} / {best} (the faster sync) = {med[m] / med[best]:.2f}x")


if __name__ == "__main__":
    main()
