"""LoRA's weight sync against full weights: bytes and seconds per sync, both measured in one run.

A model built in code (``--model``: ``tiny``, the built-in example's; ``small``; ``0.5b``, the
Qwen2-0.5B shape of ``benchmarks/gpu_scale.py``: ~494M parameters, ~2 GB in float32, random
weights). Each sync goes through the real path of the delayed update: the trainer's
``export_weights`` and ``seal`` (a CRC-32 per tensor), ``WeightStore.publish``, a
``WeightSubscriber``'s host copy and CRC check (LoRA: and ``AdapterMerger.prepare``, which
computes ``W0 + scale B A`` of every adapted weight from its kept base) until staged, and the
swap into the rollout model, the only part exposed to generation (full: ``load_named_weights``
of every parameter; LoRA: ``AdapterMerger.commit``, a copy of the adapted weights).
Rounds alternate full and LoRA (r = ``--rank``, all linear layers); per kind the median of
``--rounds``, then the ratios full / LoRA. One torch thread (``--threads``), as each role has
in ``stream``/``async`` by default.

LoRA against full fine-tuning's training step (time, peak memory on a GPU) is the ``lora``
phase of ``benchmarks/gpu_scale.py`` (``benchmarks/gpu_lora.py``).

    python benchmarks/lora_sync.py --model 0.5b                  # bytes and sync time (~12 GB of RAM)
    python benchmarks/lora_sync.py --model tiny --rounds 5

Seconds on a machine shared with other work are indicative only; bytes are exact.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

PARTS = ("bytes", "trainer_s", "transfer_s", "swap_s", "total_s")


def build(name: str):
    """The base model of ``name`` (random weights, float32)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model

    torch.manual_seed(0)
    if name == "tiny":
        tok = build_char_tokenizer()
        return build_tiny_model(tok)
    from gpu_scale import QWEN2_05B, SMALL

    dims = QWEN2_05B if name == "0.5b" else SMALL
    config = Qwen2Config(**dims, max_position_embeddings=4096, tie_word_embeddings=True, pad_token_id=0)
    return Qwen2ForCausalLM(config)


def one_sync(engine, store, subscriber, version: int) -> dict:
    """One sync of ``engine``'s weights into the subscriber's model through ``store``."""
    from asyncflow.weights.store import seal

    t0 = time.perf_counter()
    buffers = seal(engine.export_weights())
    t1 = time.perf_counter()
    store.publish(version, buffers)
    if not subscriber.wait_staged(600):
        raise TimeoutError(f"version {version} was not staged within 600 s")
    t2 = time.perf_counter()
    before = subscriber.swap_seconds
    if not subscriber.swap_if_ready():
        raise RuntimeError(f"version {version} was staged but not swapped in")
    swap = subscriber.swap_seconds - before
    size = sum(v.nbytes for v in buffers.values())
    return {"bytes": size, "trainer_s": t1 - t0, "transfer_s": t2 - t1, "swap_s": swap,
            "total_s": t2 - t0 + swap}


def sync_rounds(name: str, rank: int, rounds: int) -> dict[str, list[dict]]:
    from asyncflow.engines.inference import load_named_weights
    from asyncflow.engines.lora import LoraSpec, LoraTrainEngine, attach
    from asyncflow.engines.lora_merge import AdapterMerger
    from asyncflow.engines.training import TrainEngine
    from asyncflow.weights.store import WeightStore
    from asyncflow.weights.subscriber import WeightSubscriber

    base = build(name)
    rollout = copy.deepcopy(base)  # the rollout worker's own model, loaded from the same folder
    spec = LoraSpec(r=rank, alpha=2 * rank)
    engines = {"full": TrainEngine(base, pad_id=0), "lora": LoraTrainEngine(attach(copy.deepcopy(base), spec), 0)}
    merger = AdapterMerger(rollout, spec.scale)
    apply = {"full": lambda v, t: load_named_weights(rollout, t), "lora": lambda v, merged: merger.commit(merged)}
    prepare = {"full": None, "lora": merger.prepare}  # (as builders.build_rollout wires them)
    print(f"{name}: {sum(p.numel() for p in base.parameters()):,} parameters; LoRA r={rank} on all linear layers: "
          f"{sum(p.numel() for p in engines['lora'].model.parameters() if p.requires_grad):,} trained", flush=True)
    got: dict[str, list[dict]] = {"full": [], "lora": []}
    version = 0
    for r in range(rounds + 1):  # (round 0 warms up: first allocations, the merger's copy of W0)
        for kind in ("full", "lora"):
            store = WeightStore()
            sub = WeightSubscriber(store, apply[kind], start_version=version, poll_s=0.05, prepare=prepare[kind])
            version += 1
            try:
                m = one_sync(engines[kind], store, sub, version)
            finally:
                sub.close()
            if r:
                got[kind].append(m)
                print(f"  round {r} {kind:<4}  {m['bytes'] / 1e6:10.2f} MB  trainer {m['trainer_s']:.4f} s  "
                      f"transfer {m['transfer_s']:.4f} s  swap {m['swap_s']:.4f} s  total {m['total_s']:.4f} s",
                      flush=True)
    return got


def median(runs: list[dict], key: str) -> float:
    return statistics.median(m[key] for m in runs)


def main(argv: list[str] | None = None) -> dict[str, dict[str, list[dict]]]:
    """Run and print; the measurements (``sync``: per kind, one dict a round)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["tiny", "small", "0.5b"], default="0.5b")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="kept rounds (full, LoRA; after a warm-up round)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a role's default: 1)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    if args.rounds < 1:
        ap.error("--rounds: at least 1 (the median of the kept rounds)")
    got = sync_rounds(args.model, args.rank, args.rounds)
    print(f"\nweight sync, {args.model}, median of {args.rounds} rounds:")
    print(f"  {'':<6} {'MB':>10} {'trainer s':>10} {'transfer s':>11} {'swap s':>9} {'total s':>9}")
    for kind, runs in got.items():
        print(f"  {kind:<6} {median(runs, 'bytes') / 1e6:10.2f} {median(runs, 'trainer_s'):10.4f} "
              f"{median(runs, 'transfer_s'):11.4f} {median(runs, 'swap_s'):9.4f} {median(runs, 'total_s'):9.4f}")
    ratio = {p: median(got["full"], p) / max(median(got["lora"], p), 1e-12) for p in PARTS}
    print("  full / LoRA: " + ", ".join(f"{p} {ratio[p]:.1f}x" for p in PARTS), flush=True)
    return {"sync": got}

if __name__ == "__main__":
    main()
