"""How steady is this machine? The same training step, timed again and again, alone and
beside a decoding neighbour.

``asyncflow bench`` divides each mode's throughput by a *bound* measured from solo runs,
so its efficiencies are only as good as the machine's speed is steady. This script times
one fixed unit of trainer work (8 forward-backward passes of the tiny model on 32 rows,
then an AdamW step; one torch thread) in blocks of steps:

* ``alone``: nothing else of ours running;
* ``beside``: a second process decodes with the built-in inference engine on one thread
  (what rollout does on the other core in ``async``).

Each block prints the mean wall and thread-CPU milliseconds per step. The drift between
``alone`` blocks is the machine's own (other tenants of the host); the gap between
``alone`` and ``beside`` blocks is what a neighbour on the other core costs (shared
caches and memory bandwidth); wall above CPU is time the step's thread was not running.

    python benchmarks/machine_drift.py --rounds 3
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time


def _decode_forever(ready) -> None:
    import torch

    torch.set_num_threads(1)
    from asyncflow.engines.inference import InferenceEngine, Request, SamplingParams
    from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    eng = InferenceEngine(build_tiny_model(tok), tok.eos_token_id, tok.pad_token_id, max_batch=256)
    sp = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=8)
    prompt = tok("12+34=")["input_ids"]
    ready.set()
    while True:
        eng.generate([Request(key=(i, 0), prompt_ids=prompt, max_new_tokens=8, min_new_tokens=8)
                      for i in range(128)], sp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="alone / beside pairs")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per block (after 2 warm-up steps)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model

    model = build_tiny_model(build_char_tokenizer())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(3, 20, (32, 24), generator=torch.Generator().manual_seed(0))

    def step() -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(8):
            model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        return (time.perf_counter() - wall) * 1e3, (time.thread_time() - cpu) * 1e3

    def block() -> tuple[float, float]:
        times = [step() for _ in range(args.steps + 2)][2:]
        return sum(w for w, _ in times) / len(times), sum(c for _, c in times) / len(times)

    ctx = mp.get_context("spawn")
    print("block    wall ms/step  cpu ms/step")
    for _ in range(args.rounds):
        wall, cpu = block()
        print(f"alone    {wall:12.1f} {cpu:12.1f}", flush=True)
        ready = ctx.Event()
        neighbour = ctx.Process(target=_decode_forever, args=(ready,), daemon=True)
        neighbour.start()
        ready.wait(60)
        time.sleep(1.0)
        wall, cpu = block()
        print(f"beside   {wall:12.1f} {cpu:12.1f}", flush=True)
        neighbour.kill()
        neighbour.join()


if __name__ == "__main__":
    main()
