"""asyncflow vs TRL's ``GRPOTrainer`` on the same model, task and batch, interleaved rounds.

Both sides train this project's warm-started tiny model (the cached default warm-start; TRL
loads the folder with transformers) on the addition task: 64 prompts x 8 answers a step, at
most 8 new tokens, lr 1e-4, no KL (beta 0), temperature 1.0, ``train.steps`` steps a run.
TRL gets the task's training problems as a ``datasets.Dataset`` built in code (the prompt
with ``<bos>`` in front: the same token layout ``[bos] + chars(prompt)`` as our rollout) and a
reward function wrapping ``AdditionTask.reward``; its ``GRPOConfig``: ``num_generations=8``,
``max_completion_length=8``, ``beta=0``, ``learning_rate=1e-4``, ``temperature=1.0``,
``loss_type="grpo"`` (our default aggregation: sequence mean of token means), ``use_cpu``,
logging, saving and reporting off. One optimizer step takes the whole 512 answers
(``per_device_train_batch_size`` = ``--trl-micro`` answers, gradient accumulation for the rest).

Sides, each at its best thread or process count on the machine's cores:

* ``trl-1t`` and ``trl-2t``: TRL with 1 and 2 torch threads (each run in a fresh process);
  the report takes the better median (``trl``);
* ``sync``: ``mode=sync launcher=local resources.sync_threads=<cores>``;
* ``sync-dp2``: ``mode=sync launcher=local train.dp=2`` (two colocated ranks as threads of one
  process: they share its GIL);
* ``sync-dp2-ray``: ``mode=sync launcher=ray train.dp=2`` (one colocated worker process per core,
  gradients all-reduced over ``torch.distributed``);
* ``async``: the default (``mode=async launcher=ray``; one Ray instance shared by the rounds);
* ``async-dp2``: ``async`` with ``train.dp=2`` (rollout and two trainer ranks, three processes
  on the two cores: the trainer, ~2/3 of the work here, is no longer held to one core).

Samples/s: steady state, the answers of the steps after the first over their wall time (TRL:
from a callback at each optimizer step's end; asyncflow: ``steady_samples_per_s``). The order
rotates from round to round. Prints each run, the medians, and asyncflow/TRL ratios.

    pip install -c constraints.txt -e '.[bench]'      # trl (and datasets, accelerate)
    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/vs_trl.py --rounds 3
    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/vs_trl.py --smoke      # 1 round of 2 steps

Extra ``key=value`` arguments override asyncflow's config on every asyncflow side.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

PROMPTS, STEPS = 64, 8
SIDES = ["trl-1t", "trl-2t", "sync", "sync-dp2", "sync-dp2-ray", "async", "async-dp2"]
RAY_SIDES = ("sync-dp2-ray", "async", "async-dp2")  # share one Ray instance for every round


def trl_run(model_dir: str, prompts: int, group: int, steps: int, max_new: int, lr: float, temperature: float,
            micro: int, threads: int, seed: int, out_dir: str) -> list[float]:
    """Train ``steps`` GRPO steps with TRL; return the wall-clock time at each optimizer step's end."""
    import torch

    torch.set_num_threads(threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    from asyncflow.tasks.addition import AdditionTask

    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers 5 renames TRL still calls
    task = AdditionTask()  # the default task config (digits 2, holdout 0.2, seed 0): the warm-start's
    # the folder's own tokenizer.json (AutoTokenizer would rebuild Qwen2's for this config), with "<bos>" in TRL's
    # prompt text read as the bos token (our tokenizer treats typed special-token names as text by default)
    tok = PreTrainedTokenizerFast.from_pretrained(model_dir, local_files_only=True, split_special_tokens=False)
    assert tok(tok.bos_token + "1+2=", add_special_tokens=False)["input_ids"][0] == tok.bos_token_id
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    data = Dataset.from_dict({"prompt": [tok.bos_token + p.prompt for p in task.train],  # [bos] + chars(prompt)
                              "answer": [p.answer for p in task.train]})

    batch = prompts * group
    if batch % micro:
        raise ValueError(f"--trl-micro {micro} must divide the step's {batch} answers")
    args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,
                      num_generations=group, max_completion_length=max_new, beta=0.0, learning_rate=lr,
                      temperature=temperature, loss_type="grpo", max_steps=steps, use_cpu=True, report_to=[],
                      logging_strategy="no", save_strategy="no", disable_tqdm=True, seed=seed, bf16=False)

    ends: list[float] = []

    class StepEnds(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            ends.append(time.perf_counter())

    rewards: list[float] = []  # (printed: TRL sees the task as our rollout does, e.g. ~the warm-start's accuracy)

    def addition_reward(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float]:
        out = [task.reward(p, c, a) for p, c, a in zip(prompts, completions, answer)]
        rewards.extend(out)
        return out

    trainer = GRPOTrainer(model=model, reward_funcs=addition_reward, args=args, train_dataset=data,
                          processing_class=tok, callbacks=[StepEnds()])
    trainer.train()
    print(f"    (TRL: mean reward {sum(rewards) / max(len(rewards), 1):.3f} over {len(rewards)} answers)", flush=True)
    return ends


def _trl_main(kwargs: dict, queue: Any) -> None:
    queue.put(trl_run(**kwargs))


def trl_in_process(**kwargs: Any) -> list[float]:
    """:func:`trl_run` in a fresh process (its own torch threads and allocator state)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    p = ctx.Process(target=_trl_main, args=(kwargs, queue))
    p.start()
    p.join()
    if p.exitcode:
        raise RuntimeError(f"the TRL process failed (exit code {p.exitcode})")
    return queue.get()


def steady(ends: list[float], batch: int) -> float:
    return batch * (len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) > 1 else 0.0


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("overrides", nargs="*", help="key=value overrides of asyncflow's config")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=PROMPTS)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--trl-micro", type=int, default=0, help="TRL: answers per forward/backward (0 = the whole step)")
    ap.add_argument("--sides", nargs="+", default=SIDES, choices=SIDES)
    ap.add_argument("--run-dir", default=None, help="run folders (default: a temporary folder)")
    ap.add_argument("--smoke", action="store_true", help="1 round of 2 steps of 8 prompts (proves it runs; no timing)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.rounds, args.steps, args.prompts = 1, 2, 8

    from asyncflow.api import train
    from asyncflow.config import load_config
    from asyncflow.tasks.models import prepare_model

    tmp = None
    if args.run_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="vs_trl_")
        args.run_dir = tmp.name
    cores = os.cpu_count() or 1
    base = [f"train.prompts_per_step={args.prompts}", f"train.steps={args.steps}", "train.eval_every=0",
            "train.lr=1e-4", "progress=false", f"run_dir={args.run_dir}", *args.overrides]  # (the lr)
    cfg = load_config(None, base)  # a bad override fails here
    model_dir, _ = prepare_model(cfg, Path(args.run_dir))  # the cached warm-start
    r = cfg.rollout
    extra = {"sync": ["mode=sync", "launcher=local", f"resources.sync_threads={cores}"],
             "sync-dp2": ["mode=sync", "launcher=local", "train.dp=2"],
             "sync-dp2-ray": ["mode=sync", "launcher=ray", "train.dp=2"], "async": [],
             "async-dp2": ["train.dp=2"]}
    launcher = None
    if any(s in args.sides for s in RAY_SIDES):
        from asyncflow.launch.registry import get_launcher

        launcher = get_launcher(load_config(None, [*base, *extra["async"]]).launcher)  # one Ray for every round
    speeds: dict[str, list[float]] = {s: [] for s in args.sides}
    print(f"{args.prompts} prompts x {r.group_size} answers a step, {args.steps} steps a run, at most "
          f"{r.max_new_tokens} new tokens, lr {cfg.train.lr}, temperature {r.temperature}; {cores} cores; "
          f"model {model_dir}", flush=True)
    print(f"{'round':>5} {'side':>9} {'samples/s':>10}", flush=True)
    try:
        for i in range(args.rounds):
            k = i % len(args.sides)
            for side in args.sides[k:] + args.sides[:k]:
                if side.startswith("trl"):
                    ends = trl_in_process(
                        model_dir=model_dir, prompts=args.prompts, group=r.group_size, steps=args.steps,
                        max_new=r.max_new_tokens, lr=cfg.train.lr, temperature=r.temperature,
                        micro=args.trl_micro or cfg.batch_size, threads=int(side[4]), seed=cfg.seed,
                        out_dir=str(Path(args.run_dir) / "trl"))
                    speed = steady(ends, cfg.batch_size)
                else:
                    s = train(load_config(None, [*base, *extra[side]]),
                              launcher=launcher if side in RAY_SIDES else None, evaluate=False)
                    speed = s["steady_samples_per_s"]
                speeds[side].append(speed)
                print(f"{i + 1:>5} {side:>9} {speed:>10.1f}", flush=True)
    finally:
        if launcher is not None:
            launcher.shutdown()
    med = {s: statistics.median(v) for s, v in speeds.items()}
    print("median samples/s: " + "; ".join(f"{s} {v:.1f}" for s, v in med.items()))
    trl = max((s for s in med if s.startswith("trl")), key=lambda s: med[s], default=None)
    if trl is not None and med[trl] > 0:
        print(f"TRL at its best: {trl} ({med[trl]:.1f} samples/s)")
        for s in ("sync", "sync-dp2", "sync-dp2-ray", "async", "async-dp2"):
            if s in med:
                print(f"asyncflow {s} / TRL: {med[s] / med[trl]:.2f}x")
    if tmp is not None:
        tmp.cleanup()
    return speeds


if __name__ == "__main__":
    main()
