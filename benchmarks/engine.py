"""Built-in inference engine (continuous batching) vs Hugging Face ``model.generate``.

Same tiny model, same 512 requests with long-tailed answer lengths (most 8 tokens, 1 in 8
48 tokens, as in reasoning RL), batch 64, one torch thread, sampling at temperature 1.
Each answer's length is forced (EOS masked until it, then stop) so both engines produce
exactly the same useful tokens:

* ours: a finished answer's slot is refilled at the next decode step;
* ours on its reference path (``--sides`` ``reference``): the former right-aligned
  ``DynamicCache`` batch (rows joined by concatenation, removed by selection), the before of
  issue 33's slot path;
* ``hf_paged`` (``rollout.engine=hf_paged``): transformers' own continuous batching over a
  paged KV cache, at most ``--batch`` answers in flight;
* ``model.generate``: static batches of 64; a batch runs until its longest answer is done,
  so the rows that are already finished keep occupying their slots (idle).

``--rounds`` rounds (default 3), the sides in a rotated order each round; prints the median
useful tokens/s of each, their ratios to the built-in engine, and the share of batch slots
idle (hf_paged: not counted).

    python benchmarks/engine.py [--requests 512] [--batch 64] [--threads 1] [--rounds 3]
    python benchmarks/engine.py --sides slots,reference --rounds 5   # the slot path vs the former one
    python benchmarks/engine.py --vocab 32000 [--sampler multinomial]

``--vocab`` widens the model's output layer to a real model's vocabulary (the prompts stay the
tiny tokenizer's ids), where sampling costs what it costs there; ``--sampler multinomial`` makes
the built-in engine draw with ``torch.multinomial`` at any vocabulary (as before
``asyncflow.engines.sampling``), for an A/B of the sampler.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from functools import partial

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def forced_lengths(rng, n: int, short: int, long: int, frac: float) -> list[int]:
    """Long-tailed answer lengths: ``long`` with probability ``frac``, else ``short`` (numpy ``rng``)."""
    import numpy as np

    return [int(x) for x in np.where(rng.random(n) < frac, long, short)]


def time_builtin(model, tok, prompts: list[list[int]], lengths: list[int], batch: int,
                 dtype: str = "float32", sync=lambda: None, path: str = "slots", **engine_kw) -> tuple[float, float]:
    """Seconds and share of slot-steps idle of the built-in engine (continuous batching) on
    ``prompts``, answer ``i`` forced to ``lengths[i]`` tokens (after a short warm-up); ``path``:
    its slot path (the default) or the reference path (the former right-aligned ``DynamicCache``)."""
    from asyncflow.engines.inference import InferenceEngine, Request, SamplingParams

    engine = InferenceEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch=batch, seed=0, dtype=dtype,
                             path=path, **engine_kw)
    sp = SamplingParams(temperature=1.0, max_new_tokens=max(lengths))
    reqs = [Request(i, p, max_new_tokens=L, min_new_tokens=L) for i, (p, L) in enumerate(zip(prompts, lengths))]
    engine.generate([Request(-1, prompts[0], max_new_tokens=8, min_new_tokens=8)], sp)  # warm-up
    engine.busy_slots = engine.total_slots = 0
    sync()
    t = time.perf_counter()
    out = engine.generate(reqs, sp)
    sync()
    seconds = time.perf_counter() - t
    assert sum(len(c.response_ids) for c in out) == sum(lengths), "the engine did not produce the forced lengths"
    return seconds, 1 - engine.busy_slots / engine.total_slots


def time_paged(model, tok, prompts: list[list[int]], lengths: list[int], batch: int,
               dtype: str = "float32", sync=lambda: None) -> tuple[float, float]:
    """Seconds of transformers' continuous batching (``rollout.engine=hf_paged``) on the same work,
    at most ``batch`` answers in flight (after a short warm-up); slots idle are not counted (nan).
    The model's own attention is given back afterwards (the library switches it)."""
    from asyncflow.engines.hf_paged import HFPagedEngine
    from asyncflow.engines.types import Request, SamplingParams

    engine = HFPagedEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch=batch, seed=0, dtype=dtype,
                           kv_tokens=batch * (max(map(len, prompts)) + max(lengths) + 8))
    try:
        sp = SamplingParams(temperature=1.0, max_new_tokens=max(lengths))
        reqs = [Request(i, p, max_new_tokens=L, min_new_tokens=L) for i, (p, L) in enumerate(zip(prompts, lengths))]
        engine.generate([Request(-1, prompts[0], max_new_tokens=8, min_new_tokens=8)], sp)  # warm-up
        sync()
        t = time.perf_counter()
        out = engine.generate(reqs, sp)
        sync()
        seconds = time.perf_counter() - t
    finally:
        engine.close()
    assert sum(len(c.response_ids) for c in out) == sum(lengths), "hf_paged did not produce the forced lengths"
    return seconds, float("nan")


def time_generate(model, tok, prompts: list[list[int]], lengths: list[int], batch: int,
                  dtype: str = "float32", sync=lambda: None) -> tuple[float, float]:
    """Seconds and share of slot-steps idle of Hugging Face ``model.generate`` on the same work:
    static batches of ``batch``, each run to its longest answer (the finished rows keep their slots)."""
    import torch

    from asyncflow.engines.device import model_device
    from asyncflow.engines.training import autocast

    device = model_device(model)

    def run(ps: list[list[int]], L: int) -> int:
        width = max(len(p) for p in ps)
        ids = torch.full((len(ps), width), tok.pad_token_id)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(ps):
            ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
        with torch.no_grad(), autocast(dtype, device):
            model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True, temperature=1.0,
                           top_k=0, max_new_tokens=L, min_new_tokens=L, pad_token_id=tok.pad_token_id)
        return len(ps) * L

    run(prompts[:1], 8)  # warm-up
    slots = 0
    sync()
    t = time.perf_counter()
    for i in range(0, len(prompts), batch):
        slots += run(prompts[i:i + batch], max(lengths[i:i + batch]))
    sync()
    return time.perf_counter() - t, 1 - sum(lengths) / slots


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median of each side is printed")
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--long", type=int, default=48)
    ap.add_argument("--long-frac", type=float, default=0.125)
    ap.add_argument("--sides", default="slots,reference,hf_paged,generate",
                    help="comma list of: slots (the built-in engine), reference (its former right-aligned "
                         "DynamicCache path), hf_paged, generate; slots always runs")
    ap.add_argument("--vocab", type=int, default=0, help="the model's vocabulary (0: the tokenizer's, 308)")
    ap.add_argument("--sampler", choices=("auto", "multinomial"), default="auto",
                    help="the built-in engine's draw: auto (inverse CDF from 4,096 entries) or always multinomial")
    args = ap.parse_args()
    if "slots" not in args.sides.split(","):
        args.sides = "slots," + args.sides

    import numpy as np
    import torch

    from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model

    torch.set_num_threads(args.threads)
    tok = build_char_tokenizer()
    if args.vocab:  # the tiny model's layers, a wider output layer
        from transformers import Qwen2ForCausalLM

        from asyncflow.engines.tiny import tiny_config

        config = tiny_config(tok)
        config.vocab_size = args.vocab
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).eval()
    else:
        model = build_tiny_model(tok, seed=0).eval()
    if args.sampler == "multinomial":
        from asyncflow.engines import sampling

        sampling.INVERSE_CDF_MIN_VOCAB = 1 << 62
    rng = np.random.default_rng(0)
    prompts = [[tok.bos_token_id, *tok(f"{a}+{b}=").input_ids] for a, b in rng.integers(0, 100, (args.requests, 2))]
    lengths = forced_lengths(rng, args.requests, args.short, args.long, args.long_frac)
    useful = sum(lengths)
    every = {"slots": ("asyncflow (continuous)", time_builtin),
             "reference": ("asyncflow reference path", partial(time_builtin, path="reference")),
             "hf_paged": ("hf_paged (transformers CB)", time_paged),
             "generate": ("HF model.generate (static)", time_generate)}
    sides = dict(every[k] for k in args.sides.split(","))
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    for r in range(args.rounds):  # interleaved: each round runs every side, starting one further along
        names = list(sides)[r % len(sides):] + list(sides)[:r % len(sides)]
        for name in names:
            runs[name].append(sides[name](model, tok, prompts, lengths, args.batch))
    med = {name: (statistics.median(s for s, _ in v), statistics.median(i for _, i in v)) for name, v in runs.items()}

    print(f"{args.requests} requests, batch {args.batch}, answers {args.short} tokens "
          f"({1 - args.long_frac:.0%}) or {args.long} ({args.long_frac:.0%}), {args.threads} thread(s), "
          f"vocabulary {model.config.vocab_size}, built-in sampler {args.sampler}, median of {args.rounds} round(s)")
    print(f"{'engine':<28}{'useful tokens/s':>16}{'slots idle':>12}{'vs asyncflow':>14}")
    ours = med["asyncflow (continuous)"][0]
    for name, (sec, idle) in med.items():
        idle_s = "-" if idle != idle else f"{idle:.0%}"
        print(f"{name:<28}{useful / sec:>16.0f}{idle_s:>12}{ours / sec:>13.2f}x")
    others = [name for name in med if name != "asyncflow (continuous)"]
    print("; ".join(f"ratio asyncflow / {name}: {med[name][0] / ours:.2f}x" for name in others))


if __name__ == "__main__":
    main()
