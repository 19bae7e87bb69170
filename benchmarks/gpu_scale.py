"""The one command a GPU machine runs (within 8 minutes): rollout, training and the whole loop
of a 0.5B-shaped model, each figure beside its floor, every result written as it comes.

The model is built in code, Qwen2-0.5B-shaped (24 layers, hidden 896, 14 heads / 2 KV heads,
MLP 4864, a 151,936-entry vocabulary, tied embeddings; ~494M parameters, random weights),
saved with ``save_pretrained`` beside a word-level tokenizer of the same vocabulary and loaded
back through the framework's loading path. Compute in bf16 (autocast over float32 master
weights for training and the built-in engine; ``hf_paged`` and ``model.generate`` run a bf16
copy). Answers are long-tailed and forced: ``--short`` tokens (7 in 8) or ``--long`` (1 in 8).

Phases (``benchmarks/gpu_phases.py``), each with its own time budget, in a process of its own
(a phase past its budget is killed and the next one starts; ``--small`` runs them in this
process, unless ``--isolate``):

1. ``setup``: build and save the model, the prompts and the reward; the floors of each measured
   thing (``benchmarks/gpu_floors.py``: bytes and FLOPs of a decode step, of a training pass, of a
   ``sync`` step);
2. ``engines``: useful tokens/s of (a) the built-in engine with CUDA graphs, (b) without
   (``cuda_graphs=False``; skipped with the reason when the engine has no such switch yet),
   (c) ``hf_paged`` (transformers' continuous batching), (d) ``model.generate`` (static
   batches), at ``--concurrency`` answers in flight (64 and 256), ``--requests-per-slot`` x that
   many requests, each run cut at ``--window-s``;
3. ``train_memory``: peak GPU memory of a forward+backward at ``train.max_tokens_per_micro``
   (``--micro-tokens``) with chunked log-probs (``--chunk-mib``) and without, trained tokens/s
   and model-FLOPs utilisation;
4. ``e2e_sync``, ``e2e_async``: steady samples/s of the whole loop (``launcher=local``: rollout
   and trainer threads of one process on the one GPU).

Every result is a JSON line of ``--out``/results.jsonl, flushed and synced when measured, so a
run cut anywhere keeps what it measured; the table at the end prints each figure, its floor
and the ratio.

    python benchmarks/gpu_scale.py --out /tmp/gs            # a GPU (about 7-8 minutes)
    python benchmarks/gpu_scale.py --small --out /tmp/gs    # a CPU dry run of the same path (seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import gpu_floors as fl
from gpu_phases import Results

os.environ.setdefault("HF_HUB_OFFLINE", "1")

QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936)
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000)
# Seconds each phase may take on a GPU (its process included); together under 8 minutes.
BUDGETS = {"setup": 60, "engines": 170, "train_memory": 60, "e2e_sync": 80, "e2e_async": 80}
REWARD = '''"""The benchmark's reward: the share of answer words with an even number (varies within a group)."""


def score(prompt: str, response: str, sample: dict) -> float:
    words = response.split()
    return sum(w[1:].isdigit() and int(w[1:]) % 2 == 0 for w in words) / max(1, len(words))
'''


def build(folder: Path, dims: dict, max_pos: int, device: str, seed: int = 0) -> int:
    """A Qwen2-shaped model with random weights (built on ``device``) and a word-level tokenizer of
    its vocabulary (``w3`` ... ``w{V-1}``), saved into ``folder``; returns the parameter count."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    specials = ["<|endoftext|>", "<|im_end|>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials)} | {f"w{i}": i for i in range(len(specials), dims["vocab_size"])}
    wl = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    wl.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=wl, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  unk_token="<unk>", padding_side="left")
    config = Qwen2Config(**dims, max_position_embeddings=max_pos, tie_word_embeddings=True,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    with torch.device(device):  # random init on the GPU: seconds instead of a minute on the host
        model = Qwen2ForCausalLM(config)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def write_data(folder: Path, n: int, prompt_words: int, vocab: int, seed: int = 0) -> None:
    import numpy as np

    rng = np.random.default_rng(seed)
    with open(folder / "prompts.jsonl", "w") as f:
        for row in rng.integers(3, vocab, (n, prompt_words)):
            f.write(json.dumps({"prompt": " ".join(f"w{i}" for i in row), "answer": "w4"}) + "\n")
    (folder / "reward.py").write_text(REWARD)


def setup(args: argparse.Namespace, log: Results, deadline: float) -> None:
    import torch

    t = time.perf_counter()
    root = Path(args.out)
    params = build(root / "model", args.dims, args.prompt_words + args.long + 64, args.device)
    write_data(root, 4096, args.prompt_words, args.dims["vocab_size"])
    import transformers

    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    log.write({"phase": "setup", "parameters": params, "device_name": name, "torch": torch.__version__,
               "transformers": transformers.__version__, "seconds": time.perf_counter() - t})


def floors(args: argparse.Namespace, log: Results) -> None:
    """The floor of each measured thing on this card (module doc of gpu_floors)."""
    hw = fl.card(args.device_name)
    if hw is None:
        log.write({"phase": "floors", "skipped": f"no datasheet figures for '{args.device_name}'"})
        return
    shape = fl.Shape.of(args.dims, args.parameters)
    ctx = fl.mean_context(args.prompt_words, args.short, args.long, args.long_frac)
    for c in args.concurrency:
        log.write({"phase": "floors", "what": "decode_step", "concurrency": c, "mean_context": ctx,
                   **fl.decode_step(shape, c, ctx, *hw)})
    log.write({"phase": "floors", "what": "sync_step", "answers": args.prompts * args.group,
               **fl.sync_step(shape, args.prompts * args.group, args.prompt_words, args.short, args.long,
                              args.long_frac, *hw)})


def _from_setup(args: argparse.Namespace, log: Results) -> argparse.Namespace:
    """The setup phase's parameter count and card name on ``args`` (every later phase needs them)."""
    row = next((r for r in log.rows() if r.get("phase") == "setup"), None)
    if row is None:
        raise RuntimeError(f"no setup line in {log.path}: run the setup phase first")
    args.parameters, args.device_name = row["parameters"], args.card or row["device_name"]
    return args


def run_phase(name: str, args: argparse.Namespace, log: Results, deadline: float) -> None:
    """One phase in this process (cooperative deadline; an exception is recorded, not raised)."""
    import gpu_phases as ph

    fns = {"setup": setup, "engines": ph.engines, "train_memory": ph.train_memory,
           "e2e_sync": lambda a, lg, d: ph.e2e(a, lg, d, "sync"),
           "e2e_async": lambda a, lg, d: ph.e2e(a, lg, d, "async")}
    if name != "setup":
        _from_setup(args, log)
    try:
        fns[name](args, log, deadline)
    except Exception as e:
        log.write({"phase": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"})
        if args.small:
            raise
    if name == "setup":
        floors(_from_setup(args, log), log)


def spawn_phase(name: str, argv: list[str], log: Results, budget: float) -> None:
    """One phase in a process of its own, killed (its process group) past ``budget`` seconds; a
    cut e2e run still gives its steady rate from the steps it finished."""
    t = time.monotonic()
    # the child's deadline on the same monotonic clock (system-wide on Linux), a few seconds
    # before the kill so that its last line gets written
    cmd = [sys.executable, __file__, *argv, "--phase", name, "--deadline-at", f"{t + budget - 3:.3f}"]
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        rc = proc.wait(timeout=budget)
        status = "done" if rc == 0 else f"exit {rc}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        status = "timeout"
    log.write({"phase": name, "status": status, "wall_s": time.monotonic() - t, "budget_s": budget})
    if name.startswith("e2e") and status != "done":
        import gpu_phases as ph

        mode = name.split("_")[1]
        log.write({"phase": "e2e", "mode": mode, "cut": True, **ph.steady_rate(log.path.parent / f"runs-{mode}")})


def _f(x: float | None, fmt: str = ".0f") -> str:
    return "-" if x is None else format(x, fmt)


def report(rows: list[dict]) -> str:
    """The table: every measured figure, its floor and the ratio (or why it is missing)."""
    setup_row = next((r for r in rows if r.get("phase") == "setup" and "parameters" in r), {})
    out = [f"gpu_scale on {setup_row.get('device_name', '?')} (torch {setup_row.get('torch', '?')}, transformers "
           f"{setup_row.get('transformers', '?')}), {setup_row.get('parameters', 0):,} parameters"]
    out.append(f"{'engine':<16}{'answers':>8}{'tokens/s':>11}{'step ms':>9}{'floor t/s':>11}{'of floor':>9}"
               f"{'peak GiB':>9}  note")
    for r in (r for r in rows if r.get("phase") == "engines" and "engine" in r):
        note = r.get("skipped") or r.get("error") or ("cut at the window" if r.get("cut") else "")
        of = r.get("of_floor")
        out.append(f"{r['engine']:<16}{r['concurrency']:>8}{_f(r.get('tokens_per_s')):>11}"
                   f"{_f(r.get('step_ms'), '.1f'):>9}{_f(r.get('floor_tokens_per_s')):>11}"
                   f"{'-' if of is None else f'{of:.2%}':>9}{_f(r.get('peak_gib'), '.1f'):>9}  {note}")
    out.append(f"{'training pass':<24}{'peak GiB':>9}{'tokens/s':>10}{'s':>8}{'floor s':>9}{'MFU':>7}  note")
    for r in (r for r in rows if r.get("phase") == "train_memory" and "logprob_chunk_mib" in r):
        label = f"chunks {r['logprob_chunk_mib']:g} MiB" if r["logprob_chunk_mib"] else "no chunks"
        mfu = r.get("mfu")
        out.append(f"{label:<24}{_f(r.get('peak_gib'), '.1f'):>9}{_f(r.get('trained_tokens_per_s')):>10}"
                   f"{_f(r.get('seconds'), '.3f'):>8}{_f(r.get('floor_s'), '.3f'):>9}"
                   f"{'-' if mfu is None else f'{mfu:.1%}':>7}  {r.get('skipped') or r.get('error') or ''}")
    sync_floor = next((r for r in rows if r.get("what") == "sync_step"), {})
    e2e = {r["mode"]: r for r in rows if r.get("phase") == "e2e" and "mode" in r}
    for mode in ("sync", "async"):
        r, floor = e2e.get(mode, {}), sync_floor.get(f"{mode}_samples_per_s")
        got = r.get("samples_per_s")
        ratio = f"{got / floor:.2%} of floor" if got and floor else ""
        out.append(f"{mode:<6} samples/s {_f(got, '.2f'):>8} (floor {_f(floor, '.1f')}) {ratio} "
                   f"{'[cut: ' + str(r.get('steps_done')) + ' steps]' if r.get('cut') else ''}")
    if e2e.get("sync", {}).get("samples_per_s") and e2e.get("async", {}).get("samples_per_s"):
        gpu = setup_row.get("device_name", "cpu") != "cpu"
        then = f"; sync vs 2.05 samples/s on the H200 of 2026-11-27: {e2e['sync']['samples_per_s'] / 2.05:.1f}x"
        out.append(f"async / sync: {e2e['async']['samples_per_s'] / e2e['sync']['samples_per_s']:.2f}x"
                   + (then if gpu else ""))
    for r in rows:
        if r.get("status") not in (None, "done"):
            out.append(f"phase {r['phase']}: {r['status']} after {r['wall_s']:.0f} s (budget {r['budget_s']:.0f} s)")
    return "\n".join(out)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/asyncflow-gpu-scale")
    ap.add_argument("--small", action="store_true", help="a 2-layer model, short answers, phases in this process "
                                                         "(a CPU dry run)")
    ap.add_argument("--isolate", action="store_true", help="with --small: phases in processes of their own too")
    ap.add_argument("--phases", nargs="+", default=list(BUDGETS), choices=list(BUDGETS))
    ap.add_argument("--total-s", type=float, default=470.0, help="start no phase past this many seconds")
    ap.add_argument("--budget", nargs="*", default=[], metavar="PHASE=SECONDS", help="override a phase's budget")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--requests-per-slot", type=int, default=2)
    ap.add_argument("--window-s", type=float, default=15.0, help="longest measured window of one engine run")
    ap.add_argument("--prompt-words", type=int, default=32)
    ap.add_argument("--short", type=int, default=128)
    ap.add_argument("--long", type=int, default=1024)
    ap.add_argument("--long-frac", type=float, default=0.125)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--micro-tokens", type=int, default=16384)
    ap.add_argument("--chunk-mib", type=float, default=256.0, help="train.logprob_chunk_mib of the chunked side")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--passes", type=int, default=4, help="training passes of each train_memory side")
    ap.add_argument("--card", help="the card whose datasheet gives the floors (default: the device's name; "
                                   "H200 or H100)")
    ap.add_argument("--phase", help=argparse.SUPPRESS)  # (a spawned phase)
    ap.add_argument("--deadline-at", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.small:
        args.short, args.long, args.prompt_words, args.concurrency = 4, 16, 8, [4]
        args.steps, args.micro_tokens, args.window_s, args.chunk_mib = min(args.steps, 2), 128, 1.0, 0.02
        args.passes = 2
    args.dims = SMALL if args.small else QWEN2_05B
    import torch  # (here, after --help: the orchestrator itself computes nothing on the device)

    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the phases (or, spawned, one of them); return every result line."""
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse(raw)
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    log = Results(root / "results.jsonl")
    if args.phase:  # a spawned phase
        run_phase(args.phase, args, log, args.deadline_at or time.monotonic() + 600.0)
        return log.rows()
    log.write({"phase": "start", "date": time.strftime("%Y-%m-%d %H:%M"), "argv": raw})
    t0 = time.monotonic()
    budgets = BUDGETS | {k: float(v) for k, v in (b.split("=") for b in args.budget)}
    for name in [p for p in BUDGETS if p in args.phases]:
        left = args.total_s - (time.monotonic() - t0)
        budget = min(budgets[name], left)
        if budget < 10 and name != "setup":
            log.write({"phase": name, "skipped": f"total budget spent ({args.total_s:.0f} s)"})
            continue
        if args.small and not args.isolate:
            run_phase(name, args, log, time.monotonic() + budget)
        else:
            spawn_phase(name, raw, log, budget)
    rows = log.rows()
    print(report(rows), flush=True)
    print(f"written {log.path} ({time.monotonic() - t0:.0f} s)")
    return rows


if __name__ == "__main__":
    main()
