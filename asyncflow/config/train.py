"""The ``train`` and ``resources`` sections: the optimizer loop, data parallelism, checkpoints, cores and devices."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from asyncflow.config.base import Section


class TrainConfig(Section):
    steps: int = Field(120, gt=0, description="Optimizer steps (policy versions) of RL (120: the default example "
                                               "gains 8-19 points on seeds 0-4, mean 12; 40: 5-17 on seeds 0-2).")
    prompts_per_step: int = Field(16, gt=0, description="Prompts per step; the batch is "
                                                        "prompts_per_step x group_size answers.")
    micro_prompts: int = Field(4, gt=0, description="Prompts (whole groups) per streamed micro-batch of "
                               "the trainer, per data-parallel rank (a micro-batch of train.dp ranks: dp x "
                               "micro_prompts). mode=sync (not FSDP) fetches a step's rows at once and trains "
                               "them in length-sorted passes of micro_prompts x group_size rows.")
    lr: float = Field(5e-5, gt=0, description="AdamW learning rate (RL; the SFT warm-start has its own). 5e-5 "
                                            "since the warm-start recipe of 2026-11-25 (from it, 1e-4 lost 8 "
                                            "points in 16 sync steps).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="Learning rate after warmup.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup from 0 to lr over this many steps.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="cosine: the final lr as a fraction of lr.")
    max_tokens_per_micro: int | None = Field(
        None, gt=0, description="Token budget of one forward/backward: rows are sorted by length and packed so "
                                "rows x longest row <= budget (None = one pass per streamed micro-batch).")
    logprob_chunk_mib: float = Field(256.0, ge=0, description="Training's log-probs and entropy: a pass whose float32 "
                                     "logits (response tokens x vocabulary x 4 bytes) would exceed this many MiB runs "
                                     "the LM head in chunks of that size, recomputed in backward, so the peak grows "
                                     "with the chunk (about 3x it), not with the micro-batch (0 = never chunk).")
    split_padding: int = Field(128, ge=0, description="Without max_tokens_per_micro: cut a micro-batch (longest rows "
                               "first) into passes wherever a cut saves this many padded tokens (0 = one pass).")
    eval_every: int = Field(10, ge=0, description="Evaluate held-out accuracy every N "
                                                  "steps (0 = only before and after).")
    keep_best: bool = Field(False, description="Keep the weights of the best held-out evaluation (the periodic "
                            "ones and the final one): checkpoint/ is then the best version and the last goes to "
                            "checkpoint-last/ when it scored lower; the summary says which (workflow/best.py).")
    eval_overlap: bool = Field(True, description="stream/async: periodic evaluations run beside training on a "
                               "weight snapshot (a thread of the driver at nice 19; a due one is skipped while one "
                               "runs), logged with the version measured (heldout_version). false, or mode=sync: "
                               "training pauses for each.")
    dp: int = Field(1, ge=1, le=64, description="Data-parallel ranks of the trainer: each trains a "
                                               "token-balanced share of every micro-batch; gradients are summed, so "
                                               "a step equals the 1-rank step on the same rows. Ray: one process per "
                                               "rank (gloo); local launcher: one thread per rank. mode=sync: N "
                                               "colocated workers, rank r generating and scoring prompts r, r+N, ... "
                                               "of each step.")
    tp: int = Field(1, ge=1, le=64, description="Tensor-parallel ranks of the trainer (Megatron-style, through "
                    "torch.distributed.tensor.parallel): each decoder layer's attention heads and MLP units, the "
                    "embedding and the LM head's vocabulary split over tp processes; with dp > 1 a dp x tp device mesh "
                    "(dp x tp processes). Needs launcher=ray and mode=stream or async (docs/parallelism.md).")
    tp_plan: str | None = Field(None, description="train.tp > 1: the tensor-parallel plan for your model's "
                                "architecture, by import path ('package.module:fn' or 'file.py:fn'): fn(model) "
                                "returns {module-name pattern: style} (styles: colwise, rowwise, vocab_embedding, "
                                "vocab_head, replicate, or a torch ParallelStyle). None: the Llama/Qwen2 plan.")
    step_timeout_s: float = Field(
        600.0, gt=0, description="Watchdog: the run stops with one line naming the stuck role when no role makes "
                                 "progress (rows produced, a step done) for this many seconds; also the deadline "
                                 "of every other driver call to a worker (building it, evaluate, save). A dead or "
                                 "silent worker process is found within ~10 s whatever this is.")
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp", description="With dp > 1: 'ddp' (every rank holds the whole model; gradients all-reduced) or 'fsdp' "
                           "(FSDP2 sharding of parameters, gradients and AdamW states; needs launcher=ray).")
    save_every: int = Field(10, ge=0, description="Write a resumable checkpoint (RUN_DIR/checkpoints/step-N, atomic, "
        "in the background) every N steps and at the end (0 = only at the end); asyncflow train --resume RUN_DIR "
        "continues (stream/async: answers in flight continue from their saved tokens with the built-in engine "
        "where the staleness bound allows, the others restart from their prompts).")
    keep_checkpoints: int = Field(2, ge=1, description="Resumable checkpoints kept (the newest); older ones are "
        "deleted once a newer one is complete.")
    build_timeout_s: float = Field(
        600.0, gt=0, description="Seconds to wait for the workers to be built at the start (imports, model load, "
                                 "warm-up: slow on a loaded machine) before the run fails or restarts; a worker whose "
                                 "process dies while building is found at once whatever this is. A build slower than "
                                 "train.step_timeout_s prints one line and goes on.")
    max_restarts: int = Field(2, ge=0, description="When a worker or data-plane process is lost or a step stalls (not "
        "a user or config error), restart the run from its latest checkpoint up to this many times (0 = stop at once); "
        "past it, exit with the --resume command that continues.")


class ResourcesConfig(Section):
    threads_per_role: int = Field(1, gt=0, description="torch threads of each role process (stream/async).")
    sync_threads: int = Field(0, ge=0, description="torch threads of each colocated sync worker (0 = all cores, "
                                                   "divided among the train.dp ranks).")
    data_plane: Literal["auto", "ray", "zmq"] = Field("auto", description="ray launcher: zmq (controller + storage "
        "units: child processes on one host, Ray actors on each node of a cluster), ray (one actor), auto (zmq).")
    storage_units: int = Field(2, gt=0, description="data_plane=zmq: storage-unit processes (rows sharded over them).")
    handout_ttl_s: float = Field(60.0, gt=0, le=86400, description="Seconds rows handed to a consumer (get_meta) may "
        "stay unacknowledged before going back to their task (its consumer died or hung); raise it for slow consumers.")
    unit_deadline_s: float = Field(120.0, gt=0, le=86400, description="data_plane=zmq: seconds the controller waits "
        "for a storage unit to answer a save/load before failing it (DataPlaneUnavailable naming the unit).")
    pin_cores: Literal["auto", "on", "off"] = Field("auto", description="stream/async: each compute role computes on "
        "cores of its own (trainer first; when they fit). auto: with a local Ray instance the launcher started.")
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:[0-9]+)?)$", description="Where the built-in engines compute: "
        "cpu, cuda, or cuda:N (launcher=local). launcher=ray: each compute role asks Ray for its share of the GPUs.")

    @field_validator("pin_cores", mode="before")
    @classmethod
    def _on_off(cls, v: Any) -> Any:
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v  # YAML reads on/off as bools
