"""Built-in inference engine (continuous batching) vs Hugging Face ``model.generate``.

Same tiny model, same 512 requests with long-tailed answer lengths (most 8 tokens, 1 in 8
48 tokens, as in reasoning RL), batch 64, one torch thread, sampling at temperature 1.
Each answer's length is forced (EOS masked until it, then stop) so both engines produce
exactly the same useful tokens:

* ours: a finished answer's slot is refilled at the next decode step;
* ``model.generate``: static batches of 64; a batch runs until its longest answer is done,
  so the rows that are already finished keep occupying their slots (idle).

Prints useful tokens/s of each, the ratio, and the share of batch slots idle.

    python benchmarks/engine.py [--requests 512] [--batch 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--long", type=int, default=48)
    ap.add_argument("--long-frac", type=float, default=0.125)
    args = ap.parse_args()

    import numpy as np
    import torch

    from asyncflow.engines.inference import InferenceEngine, Request, SamplingParams
    from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model

    torch.set_num_threads(args.threads)
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, seed=0).eval()
    rng = np.random.default_rng(0)
    prompts = [[tok.bos_token_id, *tok(f"{a}+{b}=").input_ids] for a, b in rng.integers(0, 100, (args.requests, 2))]
    lengths = np.where(rng.random(args.requests) < args.long_frac, args.long, args.short)
    useful = int(lengths.sum())

    # ours: continuous batching
    engine = InferenceEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch=args.batch, seed=0)
    sp = SamplingParams(temperature=1.0, max_new_tokens=args.long)
    reqs = [Request(i, p, max_new_tokens=int(L), min_new_tokens=int(L)) for i, (p, L) in enumerate(zip(prompts, lengths))]
    engine.generate(reqs[: args.batch], sp)  # warm-up
    engine.busy_slots = engine.total_slots = 0
    t = time.perf_counter()
    out = engine.generate(reqs, sp)
    ours_s = time.perf_counter() - t
    assert sum(len(c.response_ids) for c in out) == useful
    ours_idle = 1 - engine.busy_slots / engine.total_slots

    # model.generate: static batches, each runs to its longest answer
    def hf_batch(batch_prompts, batch_lengths):
        width = max(len(p) for p in batch_prompts)
        ids = torch.full((len(batch_prompts), width), tok.pad_token_id)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(batch_prompts):
            ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
        L = int(max(batch_lengths))
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                           max_new_tokens=L, min_new_tokens=L, pad_token_id=tok.pad_token_id)
        return len(batch_prompts) * L

    hf_batch(prompts[: args.batch], lengths[: args.batch])  # warm-up
    slots = 0
    t = time.perf_counter()
    for i in range(0, args.requests, args.batch):
        slots += hf_batch(prompts[i:i + args.batch], lengths[i:i + args.batch])
    hf_s = time.perf_counter() - t
    hf_idle = 1 - useful / slots

    print(f"{args.requests} requests, batch {args.batch}, answers {args.short} tokens "
          f"({1 - args.long_frac:.0%}) or {args.long} ({args.long_frac:.0%}), {args.threads} thread(s)")
    print(f"{'engine':<28}{'useful tokens/s':>16}{'slots idle':>12}")
    print(f"{'asyncflow (continuous)':<28}{useful / ours_s:>16.0f}{ours_idle:>12.0%}")
    print(f"{'HF model.generate (static)':<28}{useful / hf_s:>16.0f}{hf_idle:>12.0%}")
    print(f"ratio asyncflow / model.generate: {hf_s / ours_s:.2f}x")


if __name__ == "__main__":
    main()
