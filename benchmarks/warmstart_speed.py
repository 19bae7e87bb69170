"""How fast does the SFT warm-start run, by torch thread count and device?

The warm-start (``asyncflow/tasks/warmstart.py``) trains the tiny model with batches of
256 short rows and evaluates it with greedy decoding every 50 steps: small matrices, many
kernels. This script times the same work under each setting, one after another in one
process (same data, same model, fresh weights each time):

* ``steps``: 40 SFT steps (after 5 untimed), in steps per second;
* ``eval``: one greedy evaluation of 500 held-out problems, in seconds.

It prints each setting's ratio to the first (the default: torch's own thread count, the
CPU). ``cuda`` appears when a GPU is there.

    python benchmarks/warmstart_speed.py            # threads: default, 8, 4, 2, 1 (those <= cores)
    python benchmarks/warmstart_speed.py --threads 0,2,1
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="0,8,4,2,1", help="torch thread counts to try (0 = torch's default)")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()

    import numpy as np
    import torch

    from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model
    from asyncflow.tasks.addition import AdditionTask
    from asyncflow.tasks.warmstart import _sft_step, evaluate, sft_tensors
    from asyncflow.tasks.warmstart_landing import epoch_batches

    default = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    settings = [("cpu", int(t) or default) for t in args.threads.split(",") if int(t) <= cores]
    settings = list(dict.fromkeys(settings)) + ([("cuda", default)] if torch.cuda.is_available() else [])
    tok = build_char_tokenizer()
    task = AdditionTask(digits=2, seed=0)
    ids0, labels0 = sft_tensors(tok, task.train)
    print(f"{cores} cores, torch {torch.__version__} (default {default} threads); {args.steps} SFT steps, "
          f"one evaluation of 500 problems")
    base = None
    for device, threads in settings:
        torch.set_num_threads(threads)
        model = build_tiny_model(tok, seed=0).to(device)
        ids, labels = ids0.to(device), labels0.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        batches = epoch_batches(len(task.train), 256, np.random.default_rng(0))
        for _ in range(5):
            _sft_step(model, opt, ids, labels, next(batches))
        t = time.perf_counter()
        for _ in range(args.steps):
            _sft_step(model, opt, ids, labels, next(batches))
        rate = args.steps / (time.perf_counter() - t)
        t = time.perf_counter()
        evaluate(model, tok, task.heldout[:500])
        ev = time.perf_counter() - t
        base = base or (rate, ev)
        print(f"{device:5s} {threads:3d} threads: {rate:7.1f} steps/s ({rate / base[0]:.2f}x), "
              f"eval {ev:6.2f} s ({base[1] / ev:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
