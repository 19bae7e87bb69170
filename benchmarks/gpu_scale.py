"""A realistically sized model on one GPU: the built-in engine against ``model.generate``,
and ``sync`` against ``async`` with rollout and trainer sharing the GPU.

The model is built in code, Qwen2-0.5B-shaped (24 layers, hidden 896, 14 heads / 2 KV
heads, MLP 4864, a 151,936-entry vocabulary, tied embeddings; ~494M parameters, random
weights), saved with ``save_pretrained`` beside a word-level tokenizer of the same
vocabulary (``tokenizers``), and loaded back through the framework's loading path.
Compute in bf16 autocast (``model.dtype=bfloat16``: float32 master weights and AdamW).
Answers are long-tailed: ``--short`` tokens (7 in 8) or ``--long`` (1 in 8), forced the
same way in both parts (``rollout.gen_len=longtail``: EOS masked until the length, then
stop), so every engine and mode produces the same useful tokens.

1. **Engines**: ``--requests`` requests at batch ``--batch``: the built-in engine
   (continuous batching: a finished row's slot is refilled at the next step) against
   Hugging Face ``model.generate`` (static batches, each runs to its longest answer), both
   under bf16 autocast, sampling at temperature 1. Useful tokens/s and peak GPU memory.
2. **Training**: ``asyncflow``'s driver (``launcher=local``: every role a thread of this
   process, all on the one GPU) for ``--steps`` steps of ``--prompts`` prompts x
   ``--group`` answers (GRPO), in ``sync`` (one colocated worker: generate, score, train)
   and ``async`` (rollout and trainer concurrently, staleness 1); steady samples/s (after
   step 1), tokens/s and peak GPU memory of the process. Rounds alternate the modes; the
   script stops starting rounds past ``--budget-s`` and writes each result as it comes
   (``--out``/results.json), so a time limit keeps what was measured.

    python benchmarks/gpu_scale.py --out /tmp/gpu             # on a GPU (minutes)
    python benchmarks/gpu_scale.py --small --out /tmp/gpu     # a CPU dry run of the same path
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936)
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000)
REWARD = '''"""The benchmark's reward: the share of answer words with an even number (varies within a group)."""


def score(prompt: str, response: str, sample: dict) -> float:
    words = response.split()
    return sum(w[1:].isdigit() and int(w[1:]) % 2 == 0 for w in words) / max(1, len(words))
'''


def build(folder: Path, dims: dict, max_pos: int, seed: int = 0) -> int:
    """A Qwen2-shaped model with random weights and a word-level tokenizer of its vocabulary
    (``w3`` ... ``w{V-1}``), saved into ``folder``; returns the parameter count."""
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


def _peak_reset(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(cuda: bool) -> float:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0


def engines(model_dir: Path, device: str, args: argparse.Namespace) -> dict:
    """Built-in engine vs ``model.generate`` (``benchmarks/engine.py``'s two sides, bf16
    autocast): useful tokens/s and peak memory of each."""
    import numpy as np
    import torch
    from engine import forced_lengths, time_builtin, time_generate

    from asyncflow.tasks.models import load_model

    model, tok = load_model(model_dir)
    model.to(torch.device(device))
    model.eval()
    rows = [json.loads(x)["prompt"] for x in (model_dir.parent / "prompts.jsonl").read_text().splitlines()]
    prompts = [tok(r).input_ids for r in rows[: args.requests]]
    lengths = forced_lengths(np.random.default_rng(0), len(prompts), args.short, args.long, args.long_frac)
    useful, cuda = sum(lengths), device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    got = {}
    for name, timed in (("ours", time_builtin), ("hf", time_generate)):
        _peak_reset(cuda)
        seconds, idle = timed(model, tok, prompts, lengths, args.batch, "bfloat16", sync)
        got |= {f"{name}_tokens_per_s": useful / seconds, f"{name}_s": seconds, f"{name}_idle": idle,
                f"{name}_peak_gib": _peak_gib(cuda)}
    return {"requests": len(prompts), "batch": args.batch, "useful_tokens": useful, **got,
            "ratio": got["hf_s"] / got["ours_s"]}


def train_run(root: Path, mode: str, rnd: int, args: argparse.Namespace, device: str) -> dict:
    from asyncflow.config.load import load_config
    from asyncflow.launch.registry import get_launcher
    from asyncflow.workflow.driver import train

    over = [f"mode={mode}", f"model.path={root / 'model'}", "model.dtype=bfloat16", f"resources.device={device}",
            "task.name=dataset", f"task.path={root / 'prompts.jsonl'}", "task.eval_n=1",
            f"reward.fn={root / 'reward.py'}:score", "warmstart.enabled=false",
            "rollout.gen_len=longtail", f"rollout.longtail_short={args.short}", f"rollout.longtail_long={args.long}",
            f"rollout.longtail_frac={args.long_frac}", f"rollout.max_new_tokens={args.long}",
            f"rollout.group_size={args.group}", f"rollout.max_batch={args.batch}",
            f"train.prompts_per_step={args.prompts}", f"train.micro_prompts={args.micro}",
            f"train.max_tokens_per_micro={args.micro_tokens}", f"train.steps={args.steps}", "train.eval_every=0",
            "train.save_every=0", "progress=false", f"run_dir={root / 'runs'}", "launcher=local", f"seed={rnd}"]
    cfg = load_config(None, over)
    launcher = get_launcher("local")
    _peak_reset(device == "cuda")
    t = time.perf_counter()
    try:
        s = train(cfg, launcher=launcher, evaluate=False)
    finally:
        launcher.shutdown()
    return {"mode": mode, "round": rnd, "samples_per_s": s["steady_samples_per_s"],
            "tokens_per_s": s["steady_tokens_per_s"], "wall_s": time.perf_counter() - t, "busy": s.get("busy"),
            "peak_gib": _peak_gib(device == "cuda")}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/asyncflow-gpu-scale")
    ap.add_argument("--small", action="store_true", help="a 2-layer model and short answers (a CPU dry run)")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--short", type=int, default=128)
    ap.add_argument("--long", type=int, default=1024)
    ap.add_argument("--long-frac", type=float, default=0.125)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--micro-tokens", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=400.0, help="start no round past this many seconds")
    ap.add_argument("--skip-engines", action="store_true")
    args = ap.parse_args(argv)
    if args.small:
        args.short, args.long, args.requests, args.batch, args.steps = 4, 16, 32, 16, min(args.steps, 3)
        args.micro_tokens = 4096

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    res_path = root / "results.json"
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": torch.cuda.get_device_name() if device == "cuda"
                 else "cpu", "torch": torch.__version__, "args": vars(args), "train": []}

    def save() -> None:
        res_path.write_text(json.dumps(res, indent=2))

    t0 = time.perf_counter()
    dims = SMALL if args.small else QWEN2_05B
    res["parameters"] = build(root / "model", dims, max_pos=args.long + 128)
    write_data(root, 4096, 32, dims["vocab_size"])
    print(f"model: {res['parameters']:,} parameters ({time.perf_counter() - t0:.0f} s to build and save)", flush=True)
    save()
    if not args.skip_engines:
        res["engines"] = e = engines(root / "model", device, args)
        print(f"engines ({e['requests']} requests, batch {e['batch']}, answers {args.short}/{args.long}): "
              f"built-in {e['ours_tokens_per_s']:.0f} tokens/s ({e['ours_peak_gib']:.1f} GiB peak), "
              f"model.generate {e['hf_tokens_per_s']:.0f} ({e['hf_peak_gib']:.1f} GiB, {e['hf_idle']:.0%} slots idle, "
              f"ours {e['ours_idle']:.0%}): "
              f"{e['ratio']:.2f}x", flush=True)
        save()
    for rnd in range(args.rounds):
        if rnd and time.perf_counter() - t0 > args.budget_s:
            print(f"budget: stopped after {rnd} round(s)", flush=True)
            break
        for mode in (("sync", "async") if rnd % 2 == 0 else ("async", "sync")):
            r = train_run(root, mode, rnd, args, device)
            res["train"].append(r)
            save()
            print(f"round {rnd + 1} {mode}: {r['samples_per_s']:.2f} samples/s, {r['tokens_per_s']:.0f} tokens/s, "
                  f"peak {r['peak_gib']:.1f} GiB, {r['wall_s']:.0f} s", flush=True)
    med = {m: statistics.median(r["samples_per_s"] for r in res["train"] if r["mode"] == m) for m in ("sync", "async")
           if any(r["mode"] == m for r in res["train"])}
    res["median_samples_per_s"] = med
    save()
    if len(med) == 2:
        print(f"median samples/s: sync {med['sync']:.2f}, async {med['async']:.2f} "
              f"({med['async'] / med['sync']:.2f}x) over {len(res['train']) // 2} round(s)")
    print(f"written {res_path} ({time.perf_counter() - t0:.0f} s)")
    return res


if __name__ == "__main__":
    main()
