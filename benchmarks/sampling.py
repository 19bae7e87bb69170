"""Drawing one token per row: ``torch.multinomial`` against the built-in engine's ``draw``
(inverse CDF from ``INVERSE_CDF_MIN_VOCAB`` entries on; multinomial below), on a CPU.

Softmax rows of random logits, ``--rows`` rows (a decode step's batch), for each vocabulary size;
the two are timed in interleaved rounds, median of ``--rounds``, one torch thread. Prints the
milliseconds of each and the speed-up. The vocabularies: the tiny model's (308: both are
multinomial), a 32k one (Llama-2, Mistral) and Qwen2's 151,936.

    python benchmarks/sampling.py [--rows 64] [--rounds 21]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from asyncflow.engines.sampling import draw

VOCABS = (308, 32_000, 151_936)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=21)
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    print(f"{args.rows} rows, 1 torch thread, median of {args.rounds} interleaved rounds")
    print(f"{'vocabulary':>10}  {'multinomial ms':>14}  {'draw ms':>8}  speed-up")
    for v in VOCABS:
        probs = torch.softmax(torch.randn(args.rows, v, generator=g) * 3, -1)
        times: dict[str, list[float]] = {"multinomial": [], "draw": []}
        for _ in range(args.rounds):
            for name in times:
                t = time.perf_counter()
                if name == "draw":
                    draw(probs, g)
                else:
                    torch.multinomial(probs, 1, generator=g)
                times[name].append(time.perf_counter() - t)
        m, d = (statistics.median(times[k]) * 1e3 for k in ("multinomial", "draw"))
        print(f"{v:>10}  {m:>14.2f}  {d:>8.2f}  {m / d:.1f}x")


if __name__ == "__main__":
    main()
