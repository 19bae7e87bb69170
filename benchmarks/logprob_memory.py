"""Peak memory of a training forward+backward with and without chunked log-probs
(``train.logprob_chunk_mib``), on a 2-layer Qwen2 with a 151,936-entry vocabulary, on the CPU.

The peak is the most bytes the CPU allocator had handed out at once while the pass ran,
read from ``torch.profiler``'s memory events (tracemalloc does not see torch's allocations),
so it does not depend on the machine's load; the seconds do (only a functional figure here).
The loss reads the log-probs and the entropy (as an entropy bonus does).

    python benchmarks/logprob_memory.py [--tokens 128 512 1024] [--chunk-mib 0 256 32]
"""

from __future__ import annotations

import argparse
import functools
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def peak_bytes(fn) -> int:
    """Peak of live bytes the CPU allocator handed out while ``fn`` ran (profiler memory events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak


def _step(model, batch, mib: float, token_logprobs) -> None:
    """One forward+backward of a loss over the log-probs and the entropy."""
    lp = token_logprobs(model, batch, entropy=True, chunk_mib=mib)
    (lp.sum() + batch.entropy.sum()).backward()
    model.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 1024], help="response tokens of the pass")
    ap.add_argument("--chunk-mib", type=float, nargs="+", default=[0.0, 256.0, 32.0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=64)
    args = ap.parse_args(argv)

    import numpy as np
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncflow.engines.training import TokenBatch, token_logprobs

    torch.set_num_threads(1)
    config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max(args.tokens) // 4 + 64, tie_word_embeddings=True,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    rng = np.random.default_rng(0)
    rows = []
    print(f"2-layer Qwen2, hidden {args.hidden}, vocabulary {args.vocab:,}; 4 rows of 8 prompt tokens; "
          f"loss = sum(logp) + sum(entropy)")
    print(f"{'tokens':>7}{'chunk MiB':>11}{'peak MB':>10}{'logits MB':>11}{'s':>8}")
    for n in args.tokens:
        batch = TokenBatch.build([list(rng.integers(3, args.vocab, 8)) for _ in range(4)],
                                 [list(rng.integers(3, args.vocab, n // 4)) for _ in range(4)], 0)
        for mib in args.chunk_mib:
            t = time.perf_counter()
            peak = peak_bytes(functools.partial(_step, model, batch, mib, token_logprobs))
            row = {"tokens": n, "chunk_mib": mib, "peak_bytes": peak, "logits_bytes": n * args.vocab * 4,
                   "seconds": time.perf_counter() - t}
            rows.append(row)
            print(f"{n:>7}{mib:>11g}{peak / 1e6:>10.0f}{row['logits_bytes'] / 1e6:>11.0f}{row['seconds']:>8.2f}",
                  flush=True)
    return rows


if __name__ == "__main__":
    main()
