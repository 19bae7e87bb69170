"""Cross-field checks of a run config too long to sit in :class:`~asyncflow.config.schema.RunConfig`.

Each raises ``ValueError`` with one line naming the fields and the fix; pydantic turns it
into the config error the CLI prints. Called from ``RunConfig``'s validator only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the schema imports this module)
    from asyncflow.config.schema import RunConfig


def check_dp(cfg: RunConfig) -> None:
    """The checks of a data-parallel trainer (``train.dp > 1``)."""
    t = cfg.train
    if t.strategy == "fsdp" and cfg.launcher == "local":
        raise ValueError("train.strategy=fsdp needs the trainer's ranks as processes (torch.distributed), but "
                         "launcher=local runs them as threads: set launcher=ray, or train.strategy=ddp")
    if t.strategy == "fsdp" and t.max_tokens_per_micro is not None:
        raise ValueError("train.strategy=fsdp runs one pass per micro-batch on every rank (FSDP collectives), "
                         "so it cannot split by token budget: unset train.max_tokens_per_micro or use ddp")
    if t.strategy == "fsdp" and t.dp > cfg.rollout.group_size:
        raise ValueError(f"train.strategy=fsdp needs train.dp ({t.dp}) <= rollout.group_size "
                         f"({cfg.rollout.group_size}) so that every rank gets rows of every micro-batch")
    if cfg.mode == "sync":
        _check_sync_dp(cfg)
    rows = t.micro_prompts * cfg.rollout.group_size
    if t.dp > rows:
        raise ValueError(f"train.dp ({t.dp}) is more than the rows of a micro-batch (train.micro_prompts x "
                         f"rollout.group_size = {rows}): some ranks would never train; lower train.dp")


def _check_sync_dp(cfg: RunConfig) -> None:
    t = cfg.train
    if t.strategy == "fsdp":
        raise ValueError("mode=sync with train.strategy=fsdp: each rank's rollout decodes with its own whole "
                         "model, which FSDP would shard; use train.strategy=ddp")
    if cfg.algorithm.dynamic_sampling:
        raise ValueError("mode=sync with train.dp > 1 does not support algorithm.dynamic_sampling yet (rollout "
                         "feeds its own prompts then, one feeder per run); use train.dp=1 or mode=async")
    if t.dp > t.prompts_per_step:
        raise ValueError(f"mode=sync with train.dp={t.dp}: each rank generates whole prompt groups, so "
                         f"train.prompts_per_step ({t.prompts_per_step}) must be >= train.dp")


def check_test_time(cfg: RunConfig) -> None:
    """Test-time RL (``task.test_time``): trains on the evaluation problems, so never on their labels."""
    if cfg.reward.mode != "majority":
        raise ValueError("task.test_time=true trains on the evaluation problems, so their labels must not be the "
                         "reward: set reward.mode=majority (label-free TTRL), or task.test_time=false")
    if cfg.train.prompts_per_step > cfg.task.eval_n:
        raise ValueError(f"task.test_time=true draws each step's prompts from the task.eval_n ({cfg.task.eval_n}) "
                         f"evaluation problems: train.prompts_per_step ({cfg.train.prompts_per_step}) must be <= it")


def check_env(cfg: RunConfig) -> None:
    """The checks of a multi-turn run (``env.tools``, ``env.fn`` or ``env.agent``: :mod:`asyncflow.agents`)."""
    which = "env.tools" if cfg.env.tools else "env.fn" if cfg.env.fn else "env.agent"
    if cfg.algorithm.name == "ppo":
        raise ValueError(f"{which} with algorithm.name=ppo: the critic's values over observation tokens are not "
                         f"masked yet; use a critic-free algorithm (grpo, rloo, reinforce_pp, ...)")
    if cfg.algorithm.kl_in_reward:
        raise ValueError(f"{which} with algorithm.kl_in_reward: a per-token KL penalty would land on observation "
                         f"tokens; use algorithm.kl_coef as a loss term (masked) instead")
    if cfg.rollout.overprovision:
        raise ValueError(f"{which} with rollout.overprovision: restarting episodes mid-way is not supported; "
                         f"set rollout.overprovision=0")
    if cfg.rollout.on_swap != "continue":
        raise ValueError(f"{which} with rollout.on_swap={cfg.rollout.on_swap}: episodes continue across weight "
                         f"swaps (every token keeps its version); set rollout.on_swap=continue")
    if cfg.reward.placement != "rollout":
        raise ValueError(f"{which}: an episode's reward comes from its environment, inside rollout; set "
                         f"reward.placement=rollout")
    if cfg.env.max_tokens < (cfg.env.turn_tokens or cfg.rollout.max_new_tokens) and cfg.env.max_turns > 1:
        raise ValueError(f"env.max_tokens ({cfg.env.max_tokens}) leaves no room for a second turn of "
                         f"{cfg.env.turn_tokens or cfg.rollout.max_new_tokens} tokens: raise env.max_tokens")


def check_tp(cfg: RunConfig) -> None:
    """The checks of a tensor-parallel trainer (``train.tp > 1``)."""
    t = cfg.train
    if cfg.launcher == "local":
        raise ValueError(f"train.tp={t.tp} needs the trainer's ranks as processes (DTensor), but "
                         "launcher=local runs them as threads: set launcher=ray, or train.tp=1")
    if cfg.mode == "sync":
        raise ValueError(f"mode=sync with train.tp={t.tp}: the colocated rollout decodes with the trainer's own "
                         "model, which tensor parallelism shards; set mode=async (or stream), or train.tp=1")
    if t.dp > 1 and t.strategy == "fsdp":
        raise ValueError(f"train.tp={t.tp} with train.strategy=fsdp: the dp x tp mesh replicates over dp "
                         "(gradients all-reduced); set train.strategy=ddp")
    m = cfg.model
    for key, n in (("num_heads", m.num_heads), ("num_kv_heads", m.num_kv_heads)):
        if not m.path and n % t.tp:  # (a model folder's heads are checked when the trainer loads it)
            raise ValueError(f"train.tp={t.tp} must divide model.{key} ({n}): each rank computes its share of "
                             "the attention heads; choose a train.tp that divides it")
    if cfg.resources.device != "cpu":
        raise ValueError(f"resources.device={cfg.resources.device} with train.tp={t.tp}: tensor-parallel ranks need "
                         "a device each, which the worker plan does not assign yet; set resources.device=cpu")
