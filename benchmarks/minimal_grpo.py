"""The physical limit of our engines: a plain GRPO loop vs asyncflow ``sync``, interleaved.

The plain loop (:func:`plain_run`, about 100 lines) drives the same engines asyncflow's
``sync`` mode does (:class:`~asyncflow.engines.inference.InferenceEngine`,
:class:`~asyncflow.engines.training.TrainEngine`, :class:`~asyncflow.algorithms.algorithm.Algorithm`)
on the same warm-started tiny model, built from the same config, with nothing around them:
no data plane, no roles, no Ray, no driver. Per step: sample P prompts, generate G answers
each (continuous batching, the rollout's sampling parameters), score each with the task's
reward, GRPO advantages per group, one optimizer step over the step's answers in length-sorted
passes of ``train.micro_prompts`` groups' answers (the engine's ``rows_per_pass``, as ``sync``'s
actor), and the inference model is the trained one (colocated: one
shared model, as in ``sync``). With N processes (``plain-Np``; ``--procs 1 2``, the default,
runs both as two sides) each process generates and trains its share of the step's prompts
(rank r: prompts r, r+N, ...) on cores/N torch threads, gradients summed by
``torch.distributed`` (gloo) in ``optimizer_step``; the ratios are over the faster plain side.

In each round it runs the plain loop, then ``asyncflow`` ``mode=sync launcher=local``,
``mode=sync launcher=local train.dp=2`` (two ranks as threads of one process) and
``mode=sync launcher=ray train.dp=2`` (``sync-dp2-ray``: one worker process per rank, as the
2-process plain loop; one Ray instance for every round) through :func:`asyncflow.api.train` on the same
config (the order rotates from round to round, so the machine's drift favours no side), and
prints steady samples/s (after step 1) of each run, the median of the rounds, the ratio
asyncflow / plain loop, and where each side's step time goes: asyncflow's rollout and actor
busy fractions (rank 0's, from the run summary), the rest being idle or framework overhead;
the plain loop's generating and training fractions, the rest being scoring and advantages;
and the seconds of each a step (the same engines: compare them side by side).

    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/minimal_grpo.py --rounds 3            # plain: 1 and 2 procs
    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/minimal_grpo.py --rounds 3 --procs 2   # 2 procs only
    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/minimal_grpo.py --smoke               # 1 round of 2 steps

Extra ``key=value`` arguments override the config of every side (e.g. ``train.micro_prompts=8``).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPTS, STEPS = 64, 8  # the workload: 64 prompts x 8 answers a step, 8 steps


def base_overrides(prompts: int, steps: int, run_dir: str, extra: list[str]) -> list[str]:
    return [f"train.prompts_per_step={prompts}", f"train.steps={steps}", "train.eval_every=0", "progress=false",
            "train.lr=1e-4", f"run_dir={run_dir}", *extra]  # (lr: as vs_trl.py, the workload)


# ---------------------------------------------------------------------------------------------- the plain loop
def plain_run(overrides: list[str], model_dir: str, threads: int, rank: int = 0,
              world: int = 1) -> list[tuple[float, float, float]]:
    """Train ``train.steps`` steps with a plain loop; per step: (wall-clock time at its end, seconds
    generating, seconds training: forward/backward and the optimizer step)."""
    import numpy as np
    import torch

    from asyncflow.algorithms.algorithm import Algorithm
    from asyncflow.config import load_config
    from asyncflow.engines.inference import InferenceEngine, Request, SamplingParams
    from asyncflow.engines.training import TrainEngine
    from asyncflow.tasks.models import load_model
    from asyncflow.tasks.registry import build_task
    from asyncflow.tasks.warmstart import prompt_ids
    from asyncflow.workflow.builders import lr_schedule, passes

    cfg = load_config(None, overrides)
    r, t = cfg.rollout, cfg.train
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)
    model, tok = load_model(model_dir)
    task = build_task(cfg)
    infer = InferenceEngine(model, tok.eos_token_id, tok.pad_token_id, r.max_batch, cfg.seed + rank,
                            dtype=cfg.model.dtype)
    # same model: colocated; the step's rows in length-sorted passes of micro_prompts groups' rows, as sync's actor
    engine = TrainEngine(model, tok.pad_token_id, lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip,
                         temperature=r.temperature, schedule=lr_schedule(cfg),
                         rows_per_pass=t.micro_prompts * r.group_size, **passes(cfg))
    algo = Algorithm.from_config(cfg.algorithm, r.max_new_tokens)
    sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens)
    loss = algo.loss(cfg.batch_size)  # normalised by the whole step's answers (every rank's)
    rng = np.random.default_rng(cfg.seed)  # the same prompts on every rank; each takes its share
    G = r.group_size
    ends: list[tuple[float, float, float]] = []
    for _ in range(t.steps):
        problems = [task.train[i] for i in rng.integers(len(task.train), size=t.prompts_per_step)][rank::world]
        ids = prompt_ids(tok, [p.prompt for p in problems])
        model.eval()
        t0 = time.perf_counter()
        done = infer.generate([Request((g, j), ids[g]) for g in range(len(problems)) for j in range(G)], sampling)
        gen_s = time.perf_counter() - t0
        done.sort(key=lambda c: c.key)  # group by group
        rewards = [task.reward(problems[c.key[0]].prompt, tok.decode(c.response_ids, skip_special_tokens=True),
                               problems[c.key[0]].answer) for c in done]
        data = {"reward": np.asarray(rewards, np.float32), "group": np.asarray([c.key[0] for c in done]),
                "response_ids": [c.response_ids for c in done]}
        adv = algo.advantages(data)
        t1 = time.perf_counter()
        extras = {"logprobs": [np.asarray(c.logprobs, np.float32) for c in done], "advantages": adv}
        engine.forward_backward([c.prompt_ids for c in done], [c.response_ids for c in done], extras, loss)
        tokens = sum(len(c.response_ids) for c in done)
        if loss.loss_agg == "token-mean":  # (normalised by the step's tokens: every rank's)
            n = torch.tensor([float(tokens)])
            if world > 1:
                torch.distributed.all_reduce(n)
            engine.optimizer_step(grad_scale=1.0 / max(float(n), 1.0))
        else:
            engine.optimizer_step()  # all-reduces the gradients when torch.distributed is up
        infer.version = engine.version  # the inference model is the trained one
        t2 = time.perf_counter()
        ends.append((t2, gen_s, t2 - t1))
    return ends


def _rank_main(rank: int, world: int, address: str, overrides: list[str], model_dir: str, threads: int,
               queue: Any) -> None:
    import torch.distributed as dist

    if world == 1:  # one process: no group, no all-reduce
        queue.put(plain_run(overrides, model_dir, threads))
        return
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world)
    try:
        ends = plain_run(overrides, model_dir, threads, rank, world)
        if rank == 0:
            queue.put(ends)
    finally:
        dist.destroy_process_group()


def plain(overrides: list[str], model_dir: str, procs: int, threads: int) -> list[float]:
    """Step end times of the plain loop in ``procs`` fresh processes (gloo between them). Never in
    this process, not even one: its OpenMP team would stay behind and spin beside the compute
    thread of the asyncflow sides that run here next."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    ps = [ctx.Process(target=_rank_main, args=(rank, procs, address, overrides, model_dir, threads, queue))
          for rank in range(procs)]
    for p in ps:
        p.start()
    for p in ps:
        p.join()
    if any(p.exitcode for p in ps):
        raise RuntimeError(f"a plain-loop process failed (exit codes {[p.exitcode for p in ps]})")
    return queue.get()


def steady(ends: list[tuple[float, float, float]], batch: int) -> tuple[float, dict[str, float]]:
    """Samples/s after step 1 (as asyncflow's ``steady_samples_per_s``), and the fractions of
    that wall time spent generating (``rollout``) and training (``actor``)."""
    if len(ends) < 2:
        return 0.0, {}
    wall = ends[-1][0] - ends[0][0]
    return batch * (len(ends) - 1) / wall, {"rollout": sum(e[1] for e in ends[1:]) / wall,
                                            "actor": sum(e[2] for e in ends[1:]) / wall}


# ---------------------------------------------------------------------------------------------- the rounds
def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("overrides", nargs="*", help="key=value config overrides of every side")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=PROMPTS, help="prompts per step (x rollout.group_size answers)")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 2],
                    help="plain loop: process counts to run, each a side (gloo all-reduce between processes)")
    ap.add_argument("--threads", type=int, default=0, help="plain loop: torch threads per process "
                                                             "(0 = the cores divided among the processes)")
    ap.add_argument("--sides", nargs="+", default=["plain", "sync", "sync-dp2", "sync-dp2-ray"],
                    choices=["plain", "sync", "sync-dp2", "sync-dp2-ray"])
    ap.add_argument("--run-dir", default=None, help="asyncflow's run folders (default: a temporary folder)")
    ap.add_argument("--smoke", action="store_true", help="1 round of 2 steps of 8 prompts (proves it runs; no timing)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.rounds, args.steps, args.prompts = 1, 2, 8

    from asyncflow.api import train
    from asyncflow.config import load_config
    from asyncflow.tasks.models import prepare_model

    tmp = None
    if args.run_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="minimal_grpo_")
        args.run_dir = tmp.name
    base = base_overrides(args.prompts, args.steps, args.run_dir, args.overrides)
    cfg = load_config(None, base)  # a bad override fails here, before any run
    model_dir, _ = prepare_model(cfg, Path(args.run_dir))  # the cached warm-start (made once if missing)
    cores = os.cpu_count() or 1
    threads = {p: args.threads or max(1, cores // p) for p in args.procs}
    sides: dict[str, list[str]] = {"sync": ["mode=sync", "launcher=local"],
                                   "sync-dp2": ["mode=sync", "launcher=local", "train.dp=2"],
                                   "sync-dp2-ray": ["mode=sync", "launcher=ray", "train.dp=2"]}
    launcher = None
    if "sync-dp2-ray" in args.sides:  # one Ray instance for every round (its start-up is not a step's cost)
        from asyncflow.launch.registry import get_launcher

        launcher = get_launcher("ray")
    order = [f"plain-{p}p" if s == "plain" else s for s in args.sides for p in (args.procs if s == "plain" else [0])]
    speeds: dict[str, list[float]] = {s: [] for s in order}
    busy: dict[str, list[dict]] = {s: [] for s in order}
    print(f"{args.prompts} prompts x {cfg.rollout.group_size} answers a step, {args.steps} steps a run, {cores} "
          f"cores; plain-Np: the plain loop in N process(es) of {'/'.join(str(threads[p]) for p in args.procs)} "
          f"thread(s); model {model_dir}", flush=True)
    print(f"{'round':>5} {'side':>9} {'samples/s':>10} {'rollout busy':>13} {'actor busy':>11} {'rest':>6} "
          f"{'rollout s/step':>15} {'actor s/step':>13}", flush=True)
    for i in range(args.rounds):
        k = i % len(order)
        for side in order[k:] + order[:k]:
            if side.startswith("plain"):
                procs = int(side[6:-1])
                speed, b = steady(plain(base, model_dir, procs, threads[procs]), cfg.batch_size)
            else:
                s = train(load_config(None, [*base, *sides[side]]), evaluate=False,
                          launcher=launcher if side == "sync-dp2-ray" else None)
                speed, b = s["steady_samples_per_s"], s["busy"]
            speeds[side].append(speed)
            busy[side].append(b)
            ro, ac = b.get("rollout", 0.0), b.get("actor", 0.0)
            step_s = cfg.batch_size / speed if speed else 0.0  # steady wall seconds a step
            print(f"{i + 1:>5} {side:>9} {speed:>10.1f} {ro:>13.0%} {ac:>11.0%} {1 - ro - ac:>6.0%} "
                  f"{ro * step_s:>15.3f} {ac * step_s:>13.3f}", flush=True)
    med = {s: statistics.median(v) for s, v in speeds.items()}
    print("median samples/s: " + "; ".join(f"{s} {v:.1f}" for s, v in med.items()))
    best = max((s for s in med if s.startswith("plain")), key=lambda s: med[s], default=None)
    if best is not None and med[best] > 0:
        print(f"the plain loop at its best: {best} ({med[best]:.1f} samples/s)")
        for s in ("sync", "sync-dp2", "sync-dp2-ray"):
            if s in med:
                ratios = [a / p for a, p in zip(speeds[s], speeds[best]) if p > 0]
                print(f"asyncflow {s} / plain loop: {med[s] / med[best]:.2f}x (medians; per round "
                      + " ".join(f"{r:.2f}" for r in ratios) + ")")
    for s in order:  # plain: generating / training / the rest (scoring, advantages, the loop)
        r = statistics.median(b.get("rollout", 0) for b in busy[s])
        a = statistics.median(b.get("actor", 0) for b in busy[s])
        step_s = cfg.batch_size / med[s] if med[s] else 0.0
        what = "idle, data plane, driver, other overhead" if s.startswith("sync") else "scoring, advantages"
        print(f"{s}: a step's wall time (medians of rounds; rank 0): {step_s:.3f} s, rollout busy {r:.0%} "
              f"({r * step_s:.3f} s), actor busy {a:.0%} ({a * step_s:.3f} s), the rest {1 - r - a:.0%} "
              f"({(1 - r - a) * step_s:.3f} s: {what})")
    if launcher is not None:
        launcher.shutdown()
    if tmp is not None:
        tmp.cleanup()
    return speeds


if __name__ == "__main__":
    main()
