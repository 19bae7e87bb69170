"""The typed configuration: every section and field, validated at construction.

Every field is documented here and nowhere else; ``asyncflow train --dry-run`` prints the
resolved config. User mistakes raise :class:`ConfigError` with one line that names the
field, the bad value and the fix; the CLI prints it without a traceback.

This module must stay light: it does not import torch (the CLI parses configs before any
heavy import).
"""

from __future__ import annotations

import difflib
import importlib.util
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from asyncflow.config.checks import check_dp
from asyncflow.config.outputs import EvalConfig, LogConfig
from asyncflow.config.warmstart import WarmStartConfig


class ConfigError(ValueError):
    """A user mistake in a config file or override. The message is one line."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    path: str | None = Field(None, description="Local Hugging Face model folder; None = the built-in tiny model. "
                                               "Relative, in a YAML file: to that file's folder.")
    hidden_size: int = Field(128, gt=0, description="Built-in model: hidden size.")
    num_layers: int = Field(2, gt=0, description="Built-in model: transformer layers.")
    num_heads: int = Field(4, gt=0, description="Built-in model: attention heads.")
    num_kv_heads: int = Field(2, gt=0, description="Built-in model: key/value heads (GQA).")
    intermediate_size: int = Field(512, gt=0, description="Built-in model: MLP width.")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Compute precision of training and inference: float32, or bfloat16 (autocast; "
                               "float32 master weights and AdamW states).")

    @model_validator(mode="after")
    def _heads(self) -> ModelConfig:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads}) "
                             f"and num_heads by num_kv_heads ({self.num_kv_heads})")
        return self

    def dims(self) -> dict:
        return dict(hidden_size=self.hidden_size, num_layers=self.num_layers, num_heads=self.num_heads,
                    num_kv_heads=self.num_kv_heads, intermediate_size=self.intermediate_size)


BUILTIN_TASKS = ("addition", "countdown", "multistep", "dataset")  # asyncflow.tasks.registry.FACTORIES' keys


class TaskConfig(_Section):
    name: str = Field(
        "addition", description="Built-in: 'addition' (12+34=), 'countdown' (reach a target with given numbers: "
                                "3,5,2:13=), 'multistep' (3+4*2-5=); 'dataset': prompts and answers from task.path. Or "
                                "your own: 'package.module:factory' / 'path/to/file.py:factory', factory(cfg) -> task "
                                "(a relative file in a YAML file: relative to that file's folder).")
    path: str | None = Field(None, description="dataset: local .jsonl or .parquet file, or a folder saved by "
                                               "datasets' save_to_disk, of training rows (relative, in a YAML "
                                               "file: to that file's folder; on the command line: to the "
                                               "working directory).")
    heldout_path: str | None = Field(None, description="dataset: held-out rows (None = hold out holdout_frac of path); "
                                                       "relative like path.")
    split: str = Field("train", description="dataset: the split of a DatasetDict folder at path.")
    heldout_split: str = Field("test", description="dataset: the split of a DatasetDict folder at heldout_path.")
    fields: dict[str, str] = Field(default_factory=dict,
                                   description="dataset: our field -> the file's, e.g. "
                                               "{prompt: question, answer: answer}.")
    prompt_template: str | None = Field(None, description="dataset: the prompt as a Python format string over the "
                                                          "row's fields, e.g. 'reverse {word}=' (None = the "
                                                          "prompt field).")
    on_bad_row: Literal["raise", "skip"] = Field("raise", description="dataset: stop at a bad "
                                                                      "row, or skip and count it.")
    chat_template: bool = Field(False, description="Wrap each prompt as a user message "
                                                   "with the tokenizer's chat template.")
    digits: int = Field(2, ge=1, le=4, description="Operand digits of the addition task.")
    terms: int | None = Field(None, ge=2, le=5, description="countdown: numbers given; multistep: operands "
                                                          "(None = 3 for countdown, 4 for multistep).")
    holdout_frac: float = Field(0.2, gt=0, lt=1, description="Fraction of problems held out for evaluation.")
    eval_n: int = Field(500, gt=0, description="Held-out problems scored at each evaluation.")

    @field_validator("name")
    @classmethod
    def _known_task(cls, v: str) -> str:
        if v in BUILTIN_TASKS or ":" in v:
            return v
        near = difflib.get_close_matches(v, BUILTIN_TASKS, n=1)
        hint = f"did you mean '{near[0]}'? " if near else ""
        raise ValueError(f"unknown task '{v}': {hint}choose {', '.join(BUILTIN_TASKS)}, or name your own as "
                         "'package.module:factory' or 'path/to/file.py:factory'")

class RolloutConfig(_Section):
    group_size: int = Field(8, ge=2, description="Answers sampled per prompt (GRPO group).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (also used by the trainer's log-probs).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    max_new_tokens: int = Field(8, gt=0, description="Longest answer, in tokens.")
    max_batch: int = Field(128, gt=0, description="Continuous-batching slots of one rollout worker (a decode step of "
                                                  "the tiny model costs about the same for 64 or 128 rows on a CPU).")
    recompute_on_swap: bool = Field(True, description="At a weight swap, rebuild the KV cache of "
                                                      "unfinished answers under the new weights.")
    engine: Literal["builtin", "vllm", "sglang"] = Field(
        "builtin", description="Inference engine of the rollout role: builtin (torch, any device), vllm or sglang "
                               "(optional extras for CUDA machines: pip install 'asyncflow[vllm]' / '[sglang]').")
    on_swap: Literal["continue", "discard"] = Field(
        "continue", description="At a weight swap: 'continue' unfinished answers under the new weights (partial "
                                "rollout), or 'discard' them and restart their whole groups from the prompt.")
    overprovision: int = Field(
        0, ge=0, description="Extra prompt groups rollout may run beyond the staleness bound's admission (APRIL "
                             "over-provisioning): a step fills with its fastest groups and the stragglers continue "
                             "into the next step; one that would break the staleness bound is restarted from its "
                             "prompt (with staleness 0, every straggler is). 0 = off.")
    gen_len: Literal["natural", "longtail"] = Field(
        "natural", description="'longtail' forces each answer's length from a "
                               "long-tailed distribution (benchmark workload emulation).")
    longtail_short: int = Field(8, gt=0, description="longtail: length of most answers.")
    longtail_long: int = Field(48, gt=0, description="longtail: length of the long answers.")
    longtail_frac: float = Field(0.125, ge=0, le=1, description="longtail: fraction of long answers.")


    @model_validator(mode="after")
    def _engine_installed(self) -> RolloutConfig:
        if self.engine != "builtin" and not engine_installed(self.engine):
            raise ValueError(f"rollout.engine={self.engine} needs the {self.engine} package, which is not installed: "
                             f"pip install 'asyncflow[{self.engine}]' on a CUDA machine, or set rollout.engine=builtin")
        return self


def engine_installed(name: str) -> bool:
    """Is the optional inference engine ``name`` importable? (find_spec: nothing is imported)"""
    return importlib.util.find_spec(name) is not None


class RewardConfig(_Section):
    latency_ms: tuple[float, float] | None = Field(
        None, description="Emulated remote verifier: each call waits uniform(lo, hi) ms. None = local reward.")
    concurrency: int = Field(64, gt=0, description="Reward calls in flight at once.")
    fn: str | None = Field(None, description="Reward function 'package.module:function' or "
                                             "'path/to/file.py:function' (relative like task.path), called "
                                             "(prompt, response, sample) -> float or dict of "
                                             "named scores; None = the task's built-in reward.")
    key: str | None = Field(None, description="fn returns a dict: the named score used "
                                              "as the reward (None = sum of all).")
    timeout_s: float | None = Field(10.0, gt=0, description="fn: seconds per call before it "
                                                            "scores on_error (None = no limit).")
    on_error: float = Field(0.0, description="fn: score of a call that raises, times "
                                             "out or returns a non-number (counted).")
    batched: bool = Field(False, description="fn takes lists (prompts, responses, samples) -> list "
                                             "of scores, called once per micro-batch (timeout_s "
                                             "per call; a wrong-length list scores on_error).")
    placement: Literal["rollout", "separate"] = Field(
        "rollout", description="Where rewards are computed: 'rollout' = inside the rollout process, each answer group "
                               "as it finishes (remote/async calls in flight there; no reward process, no data-plane "
                               "round trip); 'separate' = a reward worker of its own that streams rows from the data "
                               "plane (for a heavy local reward that should not take rollout's CPU).")

    @model_validator(mode="after")
    def _fn_path(self) -> RewardConfig:
        if self.fn is not None and (self.fn.count(":") != 1 or not all(self.fn.split(":"))):
            raise ValueError(f"fn = '{self.fn}' is not an import path: write 'package.module:function' "
                             f"(e.g. asyncflow.tasks.rewards:math_answer)")
        if self.batched and self.fn is None:
            raise ValueError("batched = true needs fn: name your batched function with "
                             "reward.fn=package.module:function")
        if self.batched and self.latency_ms is not None:
            raise ValueError("batched = true with latency_ms: the emulated remote latency applies to "
                             "per-sample functions only; drop one of them")
        return self


class AlgorithmConfig(_Section):
    name: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "ppo"] = Field(
        "grpo", description="Advantage estimator: grpo (group mean/std), dr_grpo (group mean), rloo (leave-one-out), "
                            "reinforce_pp (batch-whitened returns), reinforce_pp_baseline (group mean, then "
                            "batch-whitened), ppo (GAE on the values of a critic role, trained beside the policy).")
    clip_eps: float = Field(0.2, gt=0, lt=1, description="PPO clip range (both sides unless "
                                                         "clip_low/clip_high are set).")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL to the reference model (0 = no reference role).")
    std_normalize: bool = Field(True, description="Divide group advantages by the group std (False = Dr.GRPO).")
    clip_low: float | None = Field(None, gt=0, lt=1, description="Lower clip: ratio >= 1 - clip_low (None = clip_eps).")
    clip_high: float | None = Field(None, gt=0, description="Upper clip: ratio <= 1 + clip_high (None "
                                                            "= clip_eps; DAPO clip-higher: 0.28).")
    dual_clip: float | None = Field(None, gt=1, description="Dual-clip bound c > 1 on the loss of "
                                                            "negative-advantage tokens (None = off; typical 3).")
    ratio_level: Literal["token", "sequence"] = Field("token", description="'sequence' = GSPO: one "
                                                                           "length-normalised ratio per answer.")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = Field(
        "seq-mean-token-mean", description="Loss aggregation over the step: token-mean (DAPO), "
                                           "seq-mean-token-mean (GRPO), seq-mean-token-sum.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator (k1 = log-ratio, k2 = "
                                                                      "squared/2, k3 = exp(d) - d - 1).")
    kl_in_reward: bool = Field(False, description="Subtract kl_coef x KL from the reward (per "
                                                  "token) instead of adding a loss term.")
    correction: Literal["none", "tis", "mask", "decoupled"] = Field(
        "none", description="Off-policy correction: tis (truncated IS weight), mask "
                            "(drop extreme ratios), decoupled (decoupled PPO).")
    correction_level: Literal["token", "geo"] = Field("token", description="tis/mask: per-token ratio, or "
                                                                           "per-sequence geometric mean (geo).")
    is_cap: float | None = Field(2.0, gt=1, description="tis: truncate the IS weight here; decoupled: drop "
                                                        "tokens whose weight exceeds it (None = no cap).")
    mask_low: float = Field(0.5, gt=0, lt=1, description="mask: drop tokens whose IS ratio is below this.")
    mask_high: float = Field(2.0, gt=1, description="mask: drop tokens whose IS ratio is above this.")
    gamma: float = Field(1.0, ge=0, le=1, description="ppo: GAE discount per response token.")
    lam: float = Field(1.0, ge=0, le=1, description="ppo: GAE lambda (1 = Monte-Carlo "
                                                    "return minus value, 0 = one-step TD).")
    value_clip: float | None = Field(0.2, gt=0, description="ppo: clip the new value to old value +- value_clip "
                                                            "in the value loss (None = no clipping).")
    vf_coef: float = Field(0.5, gt=0, description="ppo: weight of the value loss (the critic has its own "
                                                  "optimizer: this scales its gradient before clipping).")
    critic_lr: float | None = Field(None, gt=0, description="ppo: critic AdamW learning rate (None = train.lr).")
    critic_epochs: int = Field(1, ge=1, description="ppo: critic optimizer steps per training step, each a pass "
                                                    "over the step's answers (value_clip acts from the second on).")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus: add -entropy_coef x (token "
                                                       "entropy of the current policy, aggregated by "
                                                       "loss_agg) to the loss (0 = off; typical 0.001).")
    dynamic_sampling: bool = Field(False, description="DAPO dynamic sampling: drop groups whose rewards are all "
                                                      "equal (no signal) and keep generating until the step is full.")
    overlong_buffer: int = Field(0, ge=0, description="DAPO soft overlong punishment: answers "
                                                      "longer than max_new_tokens - overlong_buffer "
                                                      "tokens lose reward linearly (0 = off).")
    overlong_penalty: float = Field(1.0, ge=0, description="Reward lost by an answer of max_new_tokens "
                                                           "tokens (the overlong penalty's full size).")

    @model_validator(mode="after")
    def _algorithm(self) -> AlgorithmConfig:
        if self.kl_in_reward and self.kl_coef <= 0:
            raise ValueError("kl_in_reward = true needs kl_coef > 0 (set algorithm.kl_coef=0.01, "
                             "or algorithm.kl_in_reward=false)")
        if self.correction == "tis" and self.is_cap is None:
            raise ValueError("is_cap = null with correction = tis: truncated IS needs a cap (set algorithm.is_cap=2.0)")
        if self.correction_level == "geo" and self.correction not in ("tis", "mask"):
            raise ValueError(f"correction_level = geo applies to correction tis or mask, not "
                             f"'{self.correction}' (set algorithm.correction_level=token)")
        if self.name != "grpo" and not self.std_normalize:
            raise ValueError(f"std_normalize = false only applies to name=grpo (it makes Dr.GRPO); with "
                             f"name={self.name} remove algorithm.std_normalize")
        return self


class TrainConfig(_Section):
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
    split_padding: int = Field(128, ge=0, description="Without max_tokens_per_micro: cut a micro-batch (longest rows "
                               "first) into passes wherever a cut saves this many padded tokens (0 = one pass).")
    eval_every: int = Field(10, ge=0, description="Evaluate held-out accuracy every N "
                                                  "steps (0 = only before and after).")
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
    max_restarts: int = Field(2, ge=0, description="When a worker or data-plane process is lost or a step stalls (not "
        "a user or config error), restart the run from its latest checkpoint up to this many times (0 = stop at once); "
        "past it, exit with the --resume command that continues.")


class ResourcesConfig(_Section):
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


class RunConfig(_Section):
    """The whole job."""

    mode: Literal["sync", "stream", "async"] = Field("async", description="sync: colocated phases; stream: "
                                                                          "overlapped, on-policy; async: "
                                                                          "stream + bounded staleness.")
    staleness: int = Field(1, ge=0, description="async: a sample generated by policy version w is "
                                                "trained at version v only if v - w <= staleness.")
    plan: Literal["off", "auto"] = Field(
        "off", description="auto: before training, profile this machine (or reuse <run_dir>/profile.json) and apply "
                           "the simulated best mode, staleness, micro_prompts and threads (asyncflow/planner/auto.py).")
    launcher: Literal["local", "ray"] = Field("ray", description="local: roles as threads in this "
                                                                 "process; ray: roles as Ray actors.")
    seed: int = Field(0, description="Random seed.")
    run_dir: str = Field("runs", description="Parent folder of run folders.")
    progress: bool = Field(True, description="Show a progress bar.")
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    warmstart: WarmStartConfig = WarmStartConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    train: TrainConfig = TrainConfig()
    resources: ResourcesConfig = ResourcesConfig()
    eval: EvalConfig = EvalConfig()
    log: LogConfig = LogConfig()

    @field_validator("plan", mode="before")
    @classmethod
    def _plan_off(cls, v: Any) -> Any:
        return "off" if v is False else v  # YAML reads a bare `off` as false

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        if self.task.name == "dataset" and not self.task.path:
            raise ValueError("task.name=dataset needs task.path (a local .jsonl "
                             "or .parquet file, or a save_to_disk folder)")
        if self.rollout.max_batch < self.rollout.group_size:
            raise ValueError(f"rollout.max_batch ({self.rollout.max_batch}) must be >= rollout.group_size "
                             f"({self.rollout.group_size}): a prompt's whole group decodes together")
        if self.rollout.engine != "builtin" and self.mode == "sync":
            raise ValueError(f"rollout.engine={self.rollout.engine} needs mode=stream or async (sync shares one torch "
                             f"model between rollout and training); set mode=async or rollout.engine=builtin")
        if self.rollout.engine == "sglang" and self.rollout.on_swap == "continue":
            raise ValueError("rollout.engine=sglang returns an answer only when it finishes, so it cannot be "
                             "continued after a weight swap: set rollout.on_swap=discard")
        if self.algorithm.overlong_buffer >= self.rollout.max_new_tokens:
            raise ValueError(f"algorithm.overlong_buffer ({self.algorithm.overlong_buffer}) must be < "
                             f"rollout.max_new_tokens ({self.rollout.max_new_tokens}): lower algorithm.overlong_buffer")
        if self.algorithm.dynamic_sampling and self.reward.placement != "rollout":
            raise ValueError("algorithm.dynamic_sampling scores rewards inside rollout (a group "
                             "is kept or dropped when it finishes): set reward.placement=rollout")
        if self.train.dp > 1:
            check_dp(self)
        if self.resources.device != "cpu" and self.train.dp > 1:
            raise ValueError(f"resources.device={self.resources.device} with train.dp={self.train.dp}: data-parallel "
                             f"trainer ranks run on CPU only so far; set train.dp=1 or resources.device=cpu")
        if self.resources.device.startswith("cuda:") and self.launcher == "ray":
            raise ValueError(f"resources.device={self.resources.device}: on Ray each role gets its GPU from Ray; "
                             f"set resources.device=cuda")
        if self.train.micro_prompts > self.train.prompts_per_step:
            raise ValueError(f"train.micro_prompts ({self.train.micro_prompts}) must be <= train.prompts_per_step "
                             f"({self.train.prompts_per_step})")
        return self

    @property
    def effective_staleness(self) -> int:
        """0 for sync and stream (on-policy), the configured bound for async."""
        return self.staleness if self.mode == "async" else 0

    @property
    def batch_size(self) -> int:
        return self.train.prompts_per_step * self.rollout.group_size
