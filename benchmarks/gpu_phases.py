"""The measured phases of ``benchmarks/gpu_scale.py``; each appends JSON lines as it goes and
stops starting work past its ``deadline`` (``time.monotonic()``).

* :func:`engines`: useful tokens/s of the built-in engine with and without CUDA graphs
  (``cuda_graphs``, when the engine has the switch), ``hf_paged`` and ``model.generate`` at
  each concurrency, long-tailed forced lengths, each run cut at its window (tokens of
  unfinished answers counted), beside the floor of a decode step;
* :func:`train_memory`: peak GPU memory, seconds and trained tokens/s of a forward+backward
  at ``train.max_tokens_per_micro`` with chunked log-probs, then without (an out-of-memory
  is recorded, not fatal), and the model-FLOPs utilisation;
* :func:`e2e`: one ``sync`` or ``async`` training run through the driver; steady samples/s
  (after step 1) from its ``metrics.jsonl``, so a run cut by its budget still gives a figure.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any

import gpu_floors as fl


class Results:
    """``results.jsonl`` under ``--out``: one JSON object a line, flushed and synced at once."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, row: dict) -> dict:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return row

    def rows(self) -> list[dict]:
        return [json.loads(x) for x in self.path.read_text().splitlines()] if self.path.exists() else []


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _peak_reset() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def graphs_switch() -> bool:
    """Does the built-in engine take ``cuda_graphs`` (issue 33 item 1's switch)?"""
    from asyncflow.engines.inference import InferenceEngine

    return "cuda_graphs" in inspect.signature(InferenceEngine.__init__).parameters


def _live_tokens(batch: Any) -> int:
    """Tokens generated so far by a batch's unfinished answers (built-in: partials; adapters: rows)."""
    if hasattr(batch, "partials"):
        return sum(len(p.response_ids) for p in batch.partials())
    return sum(len(r.out) for r in getattr(batch, "rows", {}).values())


def drive(engine: Any, reqs: list, concurrency: int, window_s: float, max_new: int) -> dict:
    """Keep ``concurrency`` answers in flight (refilled as they finish, as rollout does) until
    done or ``window_s`` passed; useful tokens = finished answers' + unfinished ones' so far."""
    from asyncflow.engines.types import SamplingParams

    batch = engine.new_batch(SamplingParams(temperature=1.0, max_new_tokens=max_new))
    pending, done, steps = deque(reqs), [], 0
    _sync()
    t = time.perf_counter()
    while (pending or len(batch)) and time.perf_counter() - t < window_s:
        free = concurrency - len(batch)
        if free and pending:
            done += batch.add([pending.popleft() for _ in range(min(free, len(pending)))])
        done += batch.step()
        steps += 1
    _sync()
    seconds = time.perf_counter() - t
    useful = sum(len(c.response_ids) for c in done) + _live_tokens(batch)
    cut = bool(pending or len(batch))
    batch.drop_all()
    return {"useful_tokens": useful, "seconds": seconds, "tokens_per_s": useful / seconds, "decode_steps": steps,
            "step_ms": 1e3 * seconds / max(steps, 1), "finished": len(done), "requests": len(reqs), "cut": cut}


def generate_static(model: Any, tok: Any, prompts: list, lengths: list, concurrency: int, window_s: float) -> dict:
    """``model.generate`` in static batches of ``concurrency``, each to its longest answer
    (``min_new_tokens`` = ``max_new_tokens``), stopped by ``max_time`` at the window."""
    import torch

    device = next(model.parameters()).device
    t, useful, steps = time.perf_counter(), 0, 0
    for i in range(0, len(prompts), concurrency):
        left = window_s - (time.perf_counter() - t)
        if left <= 0:
            break
        ps, ls = prompts[i:i + concurrency], lengths[i:i + concurrency]
        width = max(map(len, ps))
        ids = torch.full((len(ps), width), tok.pad_token_id)
        mask = torch.zeros_like(ids)
        for j, p in enumerate(ps):
            ids[j, width - len(p):], mask[j, width - len(p):] = torch.tensor(p), 1
        with torch.no_grad():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True,
                                 temperature=1.0, top_k=0, max_new_tokens=max(ls), min_new_tokens=max(ls),
                                 pad_token_id=tok.pad_token_id, max_time=left)
        made = out.shape[1] - width
        useful, steps = useful + sum(min(L, made) for L in ls), steps + made
    _sync()
    seconds = time.perf_counter() - t
    return {"useful_tokens": useful, "seconds": seconds, "tokens_per_s": useful / seconds, "decode_steps": steps,
            "step_ms": 1e3 * seconds / max(steps, 1), "requests": len(prompts), "cut": useful < sum(lengths)}


def _workload(args: argparse.Namespace, tok: Any, concurrency: int) -> tuple[list, list]:
    """``requests_per_slot x concurrency`` prompts of the data file and their forced lengths."""
    import numpy as np
    from engine import forced_lengths

    rows = [json.loads(x)["prompt"] for x in (Path(args.out) / "prompts.jsonl").read_text().splitlines()]
    n = args.requests_per_slot * concurrency
    prompts = [tok(r).input_ids for r in rows[:n]]
    return prompts, forced_lengths(np.random.default_rng(concurrency), n, args.short, args.long, args.long_frac)


def _engine_runs(args: argparse.Namespace, model: Any, model16: Any, tok: Any) -> list[tuple[str, Any]]:
    """(name, factory(concurrency) -> engine) of every engine side; ``None`` factory = skipped."""
    from asyncflow.engines.hf_paged import HFPagedEngine
    from asyncflow.engines.inference import InferenceEngine

    def builtin(graphs: bool | None) -> Any:
        kw = {} if graphs is None else {"cuda_graphs": graphs}
        return lambda c: InferenceEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch=c, seed=0,
                                         dtype=args.dtype, **kw)

    def paged(c: int) -> Any:
        return HFPagedEngine(model16, tok.eos_token_id, tok.pad_token_id, max_batch=c, seed=0, dtype=args.dtype,
                             kv_tokens=c * (args.prompt_words + args.long + 16))

    has = graphs_switch()
    return [("builtin+graphs" if has else "builtin", builtin(True if has else None)),
            ("builtin-eager", builtin(False) if has else None), ("hf_paged", paged), ("generate", None)]


def engines(args: argparse.Namespace, log: Results, deadline: float) -> None:
    """Every engine at every concurrency (module doc); a run's window shrinks to fit the deadline."""
    import torch

    from asyncflow.engines.types import Request
    from asyncflow.tasks.models import load_model

    model, tok = load_model(Path(args.out) / "model")
    model.to(args.device).eval()
    model16 = copy.deepcopy(model).to(torch.bfloat16) if args.dtype == "bfloat16" else model
    shape, hw = fl.Shape.of(args.dims, args.parameters), fl.card(args.device_name)
    ctx = fl.mean_context(args.prompt_words, args.short, args.long, args.long_frac)
    runs = [(c, name, make) for c in args.concurrency for name, make in _engine_runs(args, model, model16, tok)]
    for k, (c, name, make) in enumerate(runs):
        row: dict = {"phase": "engines", "engine": name, "concurrency": c}
        if name == "builtin-eager" and make is None:
            log.write({**row, "skipped": "the built-in engine has no cuda_graphs switch yet (issue 33 item 1)"})
            continue
        window = min(args.window_s, (deadline - time.monotonic()) / (len(runs) - k) - 5)
        if window < min(2.0, args.window_s):
            log.write({**row, "skipped": "phase budget spent"})
            continue
        prompts, lengths = _workload(args, tok, c)
        _peak_reset()
        try:
            if name == "generate":
                got = generate_static(model16, tok, prompts, lengths, c, window)
            else:
                engine = make(c)
                warm = [Request(-1 - i, p, max_new_tokens=8, min_new_tokens=8) for i, p in enumerate(prompts[:c])]
                drive(engine, warm, c, 60.0, 8)  # warm-up: graph capture, first-call allocations
                reqs = [Request(i, p, max_new_tokens=L, min_new_tokens=L) for i, (p, L) in
                        enumerate(zip(prompts, lengths))]
                got = drive(engine, reqs, c, window, args.long)
                getattr(engine, "close", lambda: None)()
        except Exception as e:  # one side failing must not cost the others their figures
            log.write({**row, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"})
            continue
        floor = fl.decode_step(shape, c, ctx, *hw) if hw else None
        log.write({**row, **got, "peak_gib": _peak_gib(), "window_s": window,
                   **({"floor_tokens_per_s": floor["floor_tokens_per_s"], "step_floor_ms": 1e3 * floor["floor_s"],
                       "of_floor": got["tokens_per_s"] / floor["floor_tokens_per_s"]} if floor else {})})


def _train_rows(args: argparse.Namespace) -> tuple[list, list]:
    """A micro-batch filling ``micro_tokens``: rows of a prompt and a long answer (the worst case)."""
    import numpy as np

    rng = np.random.default_rng(0)
    n = max(1, args.micro_tokens // (args.prompt_words + args.long))
    V = args.dims["vocab_size"]
    return ([rng.integers(3, V, args.prompt_words).tolist() for _ in range(n)],
            [rng.integers(3, V, args.long).tolist() for _ in range(n)])


def train_memory(args: argparse.Namespace, log: Results, deadline: float) -> None:
    """Chunked log-probs first, then the plain pass (module doc)."""
    import numpy as np
    import torch

    from asyncflow.algorithms.algorithm import Algorithm
    from asyncflow.engines.training import TrainEngine
    from asyncflow.tasks.models import load_model

    model, tok = load_model(Path(args.out) / "model")
    model.to(args.device)
    prompts, responses = _train_rows(args)
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    shape, hw = fl.Shape.of(args.dims, args.parameters), fl.card(args.device_name)
    flops = fl.train_flops(shape, lengths)
    extras = {"logprobs": [np.full(len(r), -12.0, np.float32) for r in responses],
              "advantages": np.linspace(-1, 1, len(prompts)).astype(np.float32)}
    loss = Algorithm(loss_agg="token-mean").loss(len(prompts), sum(map(len, responses)))
    for mib in (args.chunk_mib, 0.0):
        row: dict = {"phase": "train_memory", "logprob_chunk_mib": mib, "rows": len(prompts), "tokens": sum(lengths),
                     "max_tokens_per_micro": args.micro_tokens}
        if time.monotonic() > deadline - 10:
            log.write({**row, "skipped": "phase budget spent"})
            continue
        _peak_reset()
        te = TrainEngine(model, tok.pad_token_id, lr=1e-7, dtype=args.dtype, max_tokens_per_micro=args.micro_tokens,
                         logprob_chunk_mib=mib)
        times: list[float] = []
        try:
            while len(times) < args.passes and (not times or time.monotonic() < deadline - 10):
                _sync()
                t = time.perf_counter()
                te.forward_backward(prompts, responses, extras, loss)
                _sync()
                times.append(time.perf_counter() - t)
                te.optimizer_step()
        except torch.cuda.OutOfMemoryError as e:
            log.write({**row, "error": f"out of memory: {str(e).splitlines()[0][:200]}", "peak_gib": _peak_gib()})
        else:
            sec = statistics.median(times[1:] or times)  # the first pass pays for allocations
            log.write({**row, "peak_gib": _peak_gib(), "seconds": sec, "passes": len(times),
                       "trained_tokens_per_s": sum(lengths) / sec, "model_flops": flops,
                       **({"floor_s": flops / hw[1], "mfu": flops / sec / hw[1]} if hw else {})})
        del te
        model.zero_grad(set_to_none=True)


def steady_rate(run_dir: Path) -> dict:
    """Steady samples/s and tokens/s after step 1 from the ``metrics.jsonl`` lines a run has
    written (each step's line is written when the step ends, so a cut run has them too)."""
    files = sorted(run_dir.glob("*/metrics.jsonl"))
    lines = [json.loads(x) for x in files[-1].read_text().splitlines()] if files else []
    lines = [m for m in lines if "samples" in m and "elapsed_s" in m]
    out: dict = {"steps_done": len(lines)}
    if len(lines) >= 2:
        wall = lines[-1]["elapsed_s"] - lines[0]["elapsed_s"]
        out |= {"samples_per_s": sum(m["samples"] for m in lines[1:]) / wall,
                "tokens_per_s": sum(m["tokens"] for m in lines[1:]) / wall}
    return out


def e2e(args: argparse.Namespace, log: Results, deadline: float, mode: str) -> None:
    """One driver run of ``mode`` (every role a thread of this process, all on the one device)."""
    from asyncflow.config.load import load_config
    from asyncflow.launch.registry import get_launcher
    from asyncflow.workflow.driver import train

    root = Path(args.out)
    over = [f"mode={mode}", f"model.path={root / 'model'}", f"model.dtype={args.dtype}",
            f"resources.device={args.device}", "task.name=dataset", f"task.path={root / 'prompts.jsonl'}",
            "task.eval_n=1", f"reward.fn={root / 'reward.py'}:score", "warmstart.enabled=false",
            "rollout.gen_len=longtail", f"rollout.longtail_short={args.short}", f"rollout.longtail_long={args.long}",
            f"rollout.longtail_frac={args.long_frac}", f"rollout.max_new_tokens={args.long}",
            f"rollout.group_size={args.group}", f"rollout.max_batch={max(*args.concurrency, args.group)}",
            f"train.prompts_per_step={args.prompts}", f"train.micro_prompts={args.micro}",
            f"train.max_tokens_per_micro={args.micro_tokens}", f"train.logprob_chunk_mib={args.chunk_mib}",
            f"train.steps={args.steps}", "train.eval_every=0", "train.save_every=0", "progress=false",
            f"run_dir={root / f'runs-{mode}'}", "launcher=local", "seed=0"]
    launcher = get_launcher("local")
    _peak_reset()
    t = time.perf_counter()
    try:
        s = train(load_config(None, over), launcher=launcher, evaluate=False)
    finally:
        launcher.shutdown()
    log.write({"phase": "e2e", "mode": mode, "samples_per_s": s["steady_samples_per_s"],
               "tokens_per_s": s["steady_tokens_per_s"], "steps_done": args.steps, "wall_s": time.perf_counter() - t,
               "busy": s.get("busy"), "peak_gib": _peak_gib(), "cut": False})
