"""GPU check of the vLLM and SGLang adapters: generation, a weight swap mid-generation, recompute.

For each engine whose package is importable (and with a CUDA GPU): build the adapter on a
model folder (the tiny model built in code, or ``--model PATH``), start ``--requests``
answers (temperature 1, up to ``--max-new`` tokens), swap to new weights once every answer
has ``--swap-after`` tokens (vLLM streams them) or ``--swap-wait`` seconds have passed
(SGLang returns tokens at the end or at the swap's pause), continue every live answer
(``recompute_cache``) and let them finish. Then the training engine recomputes each
token's log-prob under the weights of the version that sampled it. One JSON line per engine:

* ``crossed``: answers with tokens of both versions (at least one is required);
* ``max_abs_diff_before`` / ``max_abs_diff_after``: worst |recorded - recompute| over the
  tokens of version 0 / 1 (float32 engine and recompute: expect < 0.05; a stale prefix cache
  after the swap shows in ``after``);
* ``load_s`` (the weight update), ``tokens_per_s`` (one run, not a benchmark);
* ``ok``: crossed and both diffs under ``--tol``.

A missing package or GPU prints ``{"engine": ..., "skipped": why}`` and exits 0.

    python benchmarks/adapters_gpu.py [--engines vllm,sglang] [--model PATH] [--requests 32]
    python benchmarks/adapters_gpu.py --fake --requests 4 --swap-wait 5   # CPU dry run over the test fakes
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
EOS_TINY = 2
ADAPTERS = {"vllm": ("vllm_engine", "VLLMEngine"), "sglang": ("sglang_engine", "SGLangEngine")}


def _model_folder(out: Path, model: str | None):
    """(path, model in float32, new weights as numpy, eos id): the tiny model, or ``model``
    with every weight scaled by 1 + 2% noise as the "trained" version."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    if model is None:
        from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model

        tok = build_char_tokenizer()
        build_tiny_model(tok, seed=0).save_pretrained(out / "m")
        tok.save_pretrained(out / "m")
        new = build_tiny_model(tok, seed=1)
        model, eos = str(out / "m"), EOS_TINY
        weights = {n: p.detach().numpy().copy() for n, p in new.named_parameters()}
    else:
        old = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        rng = np.random.default_rng(0)
        weights = {n: (p.detach().numpy() * (1 + 0.02 * rng.standard_normal(p.shape))).astype(np.float32)
                   for n, p in old.named_parameters()}
        eos = int(old.config.eos_token_id if isinstance(old.config.eos_token_id, int) else old.config.eos_token_id[0])
    return model, weights, eos


def _run(eng, prompts: list[list[int]], weights: dict, args) -> tuple[list, float, float]:
    """Generate, swap mid-generation, finish; (completions, load seconds, tokens/s)."""
    from asyncflow.engines.types import Request, SamplingParams
    from asyncflow.weights.store import seal

    batch = eng.new_batch(SamplingParams(temperature=1.0, max_new_tokens=args.max_new))
    batch.add([Request(i, p) for i, p in enumerate(prompts)])
    done, t0 = [], time.perf_counter()
    while len(batch) and time.perf_counter() - t0 < args.swap_wait:
        done += batch.step()
        if batch.rows and min(len(r.out) for r in batch.rows.values()) >= args.swap_after:
            break
    t = time.perf_counter()
    eng.load_weights(1, seal(weights))
    load_s = time.perf_counter() - t
    batch.version = eng.version
    batch.recompute_cache()
    deadline = time.perf_counter() + args.deadline
    while len(batch):
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{len(batch)} answers still live after {args.deadline:.0f} s")
        done += batch.step()
    tokens = sum(len(c.response_ids) for c in done)
    return done, load_s, tokens / max(time.perf_counter() - t0 - load_s, 1e-9)


def _diffs(done: list, path: str, weights: dict, device: str) -> tuple[float, float]:
    """Worst |recorded - recompute| over version-0 and version-1 tokens."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from asyncflow.engines.training import TrainEngine

    worst = [0.0, 0.0]
    for version in (0, 1):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
        if version:
            model.load_state_dict({n: torch.from_numpy(w) for n, w in weights.items()}, strict=False)
        rec = TrainEngine(model, pad_id=0).logprobs([c.prompt_ids for c in done], [c.response_ids for c in done])
        for c, r in zip(done, rec):
            mask = np.asarray(c.token_versions) == version
            if mask.any():
                worst[version] = max(worst[version], float(np.abs(np.asarray(c.logprobs)[mask] - r[mask]).max()))
    return worst[0], worst[1]


def check_adapter(lib: str, out: Path, args: argparse.Namespace | None = None) -> dict:
    """Run the check for one engine (its package importable); the report line as a dict."""
    import torch

    args = args or parse([])
    module, cls = ADAPTERS[lib]
    engine_cls = getattr(importlib.import_module(f"asyncflow.engines.{module}"), cls)
    path, weights, eos = _model_folder(out, args.model)
    kw: dict = {"weights_dir": str(out / "w")} if lib == "vllm" else {}
    if args.fake:
        kw["fake_knobs"] = {"hold": args.swap_after}
    eng = engine_cls(path, eos, max_batch=args.requests, dtype="float32", **kw)
    try:
        prompts = [[1, 5 + i % 20, 6 + i % 7, 7] for i in range(args.requests)]
        done, load_s, tps = _run(eng, prompts, weights, args)
    finally:
        eng.shutdown()
    before, after = _diffs(done, path, weights, "cuda" if torch.cuda.is_available() else "cpu")
    crossed = sum(1 for c in done if set(c.token_versions) == {0, 1})
    return {"engine": lib, "answers": len(done), "crossed": crossed, "max_abs_diff_before": before,
            "max_abs_diff_after": after, "load_s": round(load_s, 3), "tokens_per_s": round(tps, 1),
            "ok": crossed > 0 and before < args.tol and after < args.tol}


def _why_not(lib: str, fake: bool) -> str | None:
    if fake:
        return None
    if importlib.util.find_spec(lib) is None:
        return f"the {lib} package is not installed (pip install 'asyncflow[{lib}]')"
    import torch

    return None if torch.cuda.is_available() else "no CUDA GPU"


def _install_fakes() -> None:
    """``--fake``: the test stand-ins as the vllm / sglang modules (a CPU dry run of this script)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import fake_sglang
    import fake_vllm

    sys.modules["vllm"] = fake_vllm.module()
    sys.modules.update(fake_sglang.modules())


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engines", default="vllm,sglang")
    p.add_argument("--model", default=None, help="a model folder (default: the tiny model, built in code)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-new", type=int, default=96, help="the tiny model has 128 positions")
    p.add_argument("--swap-after", type=int, default=8, help="swap once every answer has this many tokens")
    p.add_argument("--swap-wait", type=float, default=0.1, help="... or after this many seconds")
    p.add_argument("--deadline", type=float, default=300.0)
    p.add_argument("--tol", type=float, default=0.05)
    p.add_argument("--fake", action="store_true", help="CPU dry run over the test fakes")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse(argv)
    if args.fake:
        _install_fakes()
    reports = []
    for lib in args.engines.split(","):
        why = _why_not(lib, args.fake)
        with tempfile.TemporaryDirectory(prefix=f"adapters-gpu-{lib}-") as tmp:
            report = {"engine": lib, "skipped": why} if why else check_adapter(lib, Path(tmp), args)
        print(json.dumps(report), flush=True)
        reports.append(report)
    return reports


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
