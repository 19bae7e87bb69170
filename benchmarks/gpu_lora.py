"""The ``lora`` phase of ``benchmarks/gpu_scale.py``: LoRA against full fine-tuning's training
step on the setup phase's model (issue 37's GPU item: peak memory and step time).

Each side is a fresh model loaded from the setup folder through the framework's loading path
(``load_model``) and moved to the device: ``full`` is a :class:`TrainEngine` over every
parameter (float32 master weights, AdamW's two moments, every gradient), ``lora`` a
:class:`LoraTrainEngine` on the same model with ``peft`` adapters attached (``--lora-rank``,
all linear layers; the base frozen: no gradients or moments for it). A step is a
``forward_backward`` of the ``train_memory`` phase's micro-batch (``--micro-tokens`` of a
prompt and a long answer, the GRPO loss, bf16 autocast on a GPU) and an ``optimizer_step``.
Rounds alternate the sides (round 0 warms kernels and allocators up and is not kept;
``--small`` skips it); each round records the step's seconds and, on a GPU, the peak allocated
memory from before the engine was built (the model's weights included) to the end of the
optimizer step. The result line has each side's median and the ratios full / LoRA, measured
in the same process.

    python benchmarks/gpu_scale.py --phases setup lora --out /tmp/gs-lora     # a GPU (~1-2 min)
    python benchmarks/gpu_scale.py --small --phases setup lora --out /tmp/gs  # a CPU dry run (seconds)
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path
from typing import Any

from gpu_phases import Results, _peak_gib, _peak_reset, _sync, _train_rows


def _engine(args: argparse.Namespace, kind: str) -> tuple[Any, Any]:
    """A fresh model from the setup folder on the device, and the engine of ``kind`` over it."""
    from asyncflow.engines.lora import LoraSpec, LoraTrainEngine, attach
    from asyncflow.engines.training import TrainEngine
    from asyncflow.tasks.models import load_model

    model, tok = load_model(Path(args.out) / "model")
    model.to(args.device)
    kw: dict[str, Any] = {"lr": 1e-7, "dtype": args.dtype, "max_tokens_per_micro": args.micro_tokens,
                          "logprob_chunk_mib": args.chunk_mib}
    if kind == "full":
        return model, TrainEngine(model, tok.pad_token_id, **kw)
    peft = attach(model, LoraSpec(r=args.lora_rank, alpha=2 * args.lora_rank))
    return peft, LoraTrainEngine(peft, tok.pad_token_id, **kw)


def _one_step(args: argparse.Namespace, kind: str, batch: tuple) -> dict:
    """Build ``kind``'s engine and time one training step; its peak memory (on a GPU)."""
    _peak_reset()
    model, engine = _engine(args, kind)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    prompts, responses, extras, loss = batch
    _sync()
    t = time.perf_counter()
    engine.forward_backward(prompts, responses, extras, loss)
    engine.optimizer_step()
    _sync()
    row = {"step_s": time.perf_counter() - t, "peak_gib": _peak_gib(), "trained_parameters": trained}
    del engine, model
    if args.device == "cuda":  # (free the side's memory before the next one's peak; a CPU has no peak to keep clean)
        gc.collect()
    return row


def lora(args: argparse.Namespace, log: Results, deadline: float) -> None:
    """Full and LoRA steps, alternating, ``--lora-rounds`` kept rounds (module doc)."""
    import numpy as np

    from asyncflow.algorithms.algorithm import Algorithm

    prompts, responses = _train_rows(args)
    extras = {"logprobs": [np.full(len(r), -12.0, np.float32) for r in responses],
              "advantages": np.linspace(-1, 1, len(prompts)).astype(np.float32)}
    batch = (prompts, responses, extras,
             Algorithm(loss_agg="token-mean").loss(len(prompts), sum(map(len, responses))))
    got: dict[str, list[dict]] = {"full": [], "lora": []}
    first = 1 if args.small else 0  # (round 0 warms up; a dry run only proves the path)
    for r in range(first, args.lora_rounds + 1):
        if r > 1 and time.monotonic() > deadline - 20:  # (keep what was measured: at least one round)
            break
        for kind in ("full", "lora"):
            m = _one_step(args, kind, batch)
            if r:
                got[kind].append(m)
                log.write({"phase": "lora", "round": r, "side": kind, **m})
    if not got["full"]:
        log.write({"phase": "lora", "skipped": "phase budget spent before a kept round"})
        return
    med = {k: {p: (statistics.median(m[p] for m in v) if v[0][p] is not None else None)
               for p in ("step_s", "peak_gib")} for k, v in got.items()}
    peak = med["full"]["peak_gib"], med["lora"]["peak_gib"]
    log.write({"phase": "lora", "summary": True, "rounds": len(got["full"]), "rank": args.lora_rank,
               "rows": len(prompts), "tokens": sum(len(p) + len(x) for p, x in zip(prompts, responses)),
               "trained": {k: v[0]["trained_parameters"] for k, v in got.items()},
               "full_step_s": med["full"]["step_s"], "lora_step_s": med["lora"]["step_s"],
               "step_ratio": med["full"]["step_s"] / med["lora"]["step_s"],
               "full_peak_gib": peak[0], "lora_peak_gib": peak[1],
               "peak_ratio": peak[0] / peak[1] if peak[0] is not None and peak[1] else None})


def report_line(rows: list[dict]) -> str | None:
    """The summary line of the phase for gpu_scale's table (None: the phase did not run)."""
    s = next((r for r in rows if r.get("phase") == "lora" and r.get("summary")), None)
    if s is None:
        return None

    def gib(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f} GiB"

    peak = "" if s["peak_ratio"] is None else f", peak {s['peak_ratio']:.2f}x"
    return (f"lora r={s['rank']} vs full, {s['rows']} rows / {s['tokens']} tokens, median of {s['rounds']}: "
            f"step {s['full_step_s']:.3f} s / {s['lora_step_s']:.3f} s, peak {gib(s['full_peak_gib'])} / "
            f"{gib(s['lora_peak_gib'])}; full / LoRA: step {s['step_ratio']:.2f}x{peak}")
