"""Label-free RL on the built-in tasks: supervised GRPO vs TTRL vs TTRL+EAR, before -> after.

For each task and seed, from the task's default warm-start (built once per seed and cached in
``<run-dir>/warmstart``), one run per variant:

* ``grpo``: supervised GRPO, the task's own reward against the reference answers, on the
  training problems; evaluated on the held-out ones;
* ``ttrl``: test-time RL (``task.test_time=true``, ``reward.mode=majority``): the prompts are the
  evaluation problems themselves, rewarded by their answer groups' majority vote, no label used;
* ``ttrl_ear``: ``ttrl`` with EAR (``algorithm.ear=true``);
* ``ttrl_etmr``, ``ttrl_etmr_ear``: ``ttrl`` (and EAR) with ETMR's trees (``rollout.etmr=true``, the
  default shape: 2 roots, 1 round of 1 fork point x 3 branches a tree = 8 answers);
* ``ttrl_train``: label-free on the *training* problems (``reward.mode=majority`` alone): does
  what the vote teaches carry over to problems it never saw? (not in the default list)

Each variant starts from the same warm-started weights and evaluates the same ``task.eval_n``
held-out problems before and after (exact match on addition, accuracy on multistep). Printed
per task and variant, medians over the seeds (each seed's figures in the JSON): held-out
before -> after and the change in points; the pseudo-label accuracy over training (mean of the
first 10 steps -> of the last 10; TTRL variants only, where the rows' references are logged,
never used); answer tokens per step (the trained answers' lengths: what independent sampling
generates) and generated tokens per step (ETMR: what the trees sampled, a shared prefix once;
otherwise the same as the answer tokens, except that dynamic sampling also generates the groups
it drops, not counted); RL wall seconds (noisy on a shared machine).

    python benchmarks/ttrl.py                                   # addition and multistep, 3 seeds
    python benchmarks/ttrl.py --tasks addition --seeds 0 --steps 40
    python benchmarks/ttrl.py --tasks addition --warm-seed 0 --steps 60 --variants ttrl ttrl_etmr   # docs/ttrl.md
    python benchmarks/ttrl.py --smoke                           # 2 steps, no warm-start: the plumbing
    python benchmarks/ttrl.py --variants grpo ttrl mode=async launcher=ray   # extra overrides last
    python benchmarks/ttrl.py --report runs/a/results.json runs/b/results.json   # one table of several

``--warm-seed S`` starts every seed's runs from seed S's warm-start (``model.path``, no warm-start
of their own): a warm-start costs up to ~1.5 h on a shared 2-core machine. The task's
train/held-out split is drawn by the run's own seed, so for the other seeds the held-out set
overlaps the warm-start's training problems (their "before" is higher); seed S's is clean.

Runs are ``mode=sync launcher=local`` with one torch thread by default (reproducible given the
seed: held-out figures do not depend on machine load); the config of each task is the shipped one
(``asyncflow/configs/grpo_addition.yaml``, ``multistep_grpo.yaml``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CONFIGS = Path(__file__).resolve().parent.parent / "asyncflow" / "configs"
TASKS = {"addition": "grpo_addition.yaml", "multistep": "multistep_grpo.yaml"}
VARIANTS = {
    "grpo": [],
    "ttrl": ["reward.mode=majority", "task.test_time=true"],
    "ttrl_ear": ["reward.mode=majority", "task.test_time=true", "algorithm.ear=true"],
    "ttrl_etmr": ["reward.mode=majority", "task.test_time=true", "rollout.etmr=true"],
    "ttrl_etmr_ear": ["reward.mode=majority", "task.test_time=true", "rollout.etmr=true", "algorithm.ear=true"],
    "ttrl_train": ["reward.mode=majority"],
}
BASE = ["mode=sync", "launcher=local", "progress=false", "train.eval_every=0"]
SMOKE = ["warmstart.enabled=false", "train.prompts_per_step=4", "train.micro_prompts=2", "rollout.group_size=4",
         "task.eval_n=16", "rollout.max_batch=16", "algorithm.dynamic_sampling=false",
         "rollout.etmr_branches=1"]  # (ETMR trees of 2 roots x (1 + 1 branch) = the 4 answers)


def warm_model(task: str, seed: int, run_dir: Path, extra: list[str]) -> list[str]:
    """Overrides that start a run from the warm-start of ``seed`` (built once, cached): the
    folder as ``model.path``, no warm-start of its own."""
    from asyncflow.config import load_config
    from asyncflow.tasks.models import prepare_model

    over = BASE + [f"seed={seed}", f"warmstart.cache_dir={run_dir / 'warmstart'}"] + extra
    path, _ = prepare_model(load_config(CONFIGS / TASKS[task], over), run_dir)
    return [f"model.path={path}", "warmstart.enabled=false"]


def run_one(task: str, variant: str, seed: int, steps: int | None, run_dir: Path, extra: list[str]) -> dict:
    """One run; its summary plus the per-step series the table needs."""
    from asyncflow.api import train
    from asyncflow.config import load_config

    out = run_dir / f"{task}-{variant}-s{seed}"
    out.mkdir(parents=True, exist_ok=True)
    over = BASE + [f"seed={seed}", f"run_dir={out}", f"warmstart.cache_dir={run_dir / 'warmstart'}"]
    over += ([f"train.steps={steps}"] if steps else []) + VARIANTS[variant] + extra
    cfg = load_config(CONFIGS / TASKS[task], over)
    t = time.perf_counter()
    s = train(cfg, run_dir=out)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    plabel = [m["pseudo_label_acc"] for m in lines if "pseudo_label_acc" in m]
    return {"task": task, "variant": variant, "seed": seed, "before": s["heldout_acc_before"],
            "after": s["heldout_acc_after"], "metric": s.get("heldout_metric"), "steps": len(lines),
            "tokens_per_step": s["tokens"] / max(len(lines), 1), "wall_s": s["wall_s"],
            "generated_per_step": (statistics.fmean([m["generated_tokens"] for m in lines if "generated_tokens" in m])
                                   if s.get("etmr") else s["tokens"] / max(len(lines), 1)),
            "etmr": s.get("etmr"),
            "total_s": time.perf_counter() - t, "warmstart": s["init"],
            "pseudo_label_first": statistics.fmean(plabel[:10]) if plabel else None,
            "pseudo_label_last": statistics.fmean(plabel[-10:]) if plabel else None,
            "majority_ratio_last": statistics.fmean([m["majority_ratio"] for m in lines[-10:]
                                                     if "majority_ratio" in m] or [float("nan")]),
            "majority_vote": s.get("majority_vote")}


def _median(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def table(results: list[dict]) -> str:
    head = (f"{'task':<10} {'variant':<11} {'seeds':>5}  {'held-out before -> after':>24} {'change':>8}  "
            f"{'pseudo-label acc':>17}  {'answer tok/step':>15} {'generated':>9} {'RL wall s':>9}")
    out = [head, "-" * len(head)]
    for task in dict.fromkeys(r["task"] for r in results):
        for variant in dict.fromkeys(r["variant"] for r in results if r["task"] == task):
            rows = [r for r in results if r["task"] == task and r["variant"] == variant]
            b, a = _median(rows, "before"), _median(rows, "after")
            delta = statistics.median([(r["after"] - r["before"]) * 100 for r in rows])
            p0, p1 = _median(rows, "pseudo_label_first"), _median(rows, "pseudo_label_last")
            plab = f"{p0:.1%} -> {p1:.1%}" if p0 is not None and p1 is not None else "-"
            out.append(f"{task:<10} {variant:<11} {len(rows):>5}  {b:>11.1%} -> {a:>9.1%} {delta:>+7.1f}p  "
                       f"{plab:>17}  {_median(rows, 'tokens_per_step'):>15.0f} "
                       f"{_median(rows, 'generated_per_step'):>9.0f} {_median(rows, 'wall_s'):>9.0f}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    ap.add_argument("--variants", nargs="+", default=["grpo", "ttrl", "ttrl_ear"], choices=list(VARIANTS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=None, help="RL steps (default: the task config's)")
    ap.add_argument("--run-dir", default="runs/bench-ttrl")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the run (warm-start, sync worker): one "
                                                           "keeps a shared machine's cores from spinning")
    ap.add_argument("--warm-seed", type=int, default=None, help="start every seed's runs from this seed's "
                    "warm-start (default: each seed its own; one costs up to ~1.5 h on a shared 2-core machine)")
    ap.add_argument("--smoke", action="store_true", help="2 steps, no warm-start, tiny batches: the plumbing only")
    ap.add_argument("--report", nargs="+", metavar="RESULTS", help="print the table of these results.json files "
                                                                    "(runs split over processes) and exit")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides for every run")
    args = ap.parse_args(argv)
    if args.report:
        results = [r for f in args.report for r in json.loads(Path(f).read_text())]
        print(table(sorted(results, key=lambda r: (r["task"], list(VARIANTS).index(r["variant"]), r["seed"]))))
        return results
    import torch

    torch.set_num_threads(args.threads)  # (the warm-start runs here; the sync worker takes resources.sync_threads)
    steps, extra = (2, SMOKE + args.overrides) if args.smoke else (args.steps, args.overrides)
    extra = [f"resources.sync_threads={args.threads}", *extra]
    run_dir = Path(args.run_dir).resolve()
    results = []
    for task in args.tasks:
        for seed in args.seeds:  # (one seed's variants together: they share its warm-start)
            warm = [] if args.warm_seed is None else warm_model(task, args.warm_seed, run_dir, extra)
            for variant in args.variants:
                results.append(run_one(task, variant, seed, steps, run_dir, extra + warm))
                r = results[-1]
                print(f"{task} {variant} seed {seed}: {r['before']:.1%} -> {r['after']:.1%} "
                      f"({r['wall_s']:.0f} s)", flush=True)
                (run_dir / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    return results


if __name__ == "__main__":
    main()
