"""Role builders: one function per role, registered by name in :data:`BUILDERS`.

A worker (:mod:`asyncflow.workflow.worker`) loads the model, tokenizer and task once, puts
them in a :class:`RoleContext`, and calls the builder of each role it hosts, in
:data:`BUILD_ORDER`. A builder only wires: it makes the role's engine from the context and
returns the role; it starts nothing. Adding a role is one builder here and its name in the
worker plan (:mod:`asyncflow.workflow.plan`).

Sharing rules (why the order matters): the actor is built first and trains ``ctx.model``
itself; the rollout engine of a colocated (``sync``) worker decodes with that same model (no
weight copy); reference and critic take copies (a critic hosted alone takes the model). A
rollout worker that owns its model on a GPU with ``model.dtype=bfloat16`` holds it in bf16.
With ``model.lora`` the actor's worker has attached adapters to its model (``ctx.peft``): the
actor's engine trains and exports them alone, a colocated reference is that model with its
adapters off (:class:`~asyncflow.engines.lora.BaseView`, no copy), and a rollout worker of its
own merges each published adapter set into its base (:mod:`asyncflow.engines.lora_merge`).
Only the actor of rank 0 publishes weights, and only outside ``sync``. In ``sync`` (without
FSDP) the actor fetches a step's rows in one request (the rows are all ready by then) and its
engine trains them in length-sorted passes of ``train.micro_prompts`` groups' rows
(``rows_per_pass``): one data-plane round trip a step instead of one a micro-batch, and less
padding. A lone trainer in ``stream``/``async`` fetches every whole group ready (at least a
micro-batch's) and trains them in the same sorted passes (``greedy``). Data-parallel ``sync``
(``train.dp = N``): rank ``r``'s rollout and reference take only shard ``r``'s prompts and rows
(:func:`~asyncflow.workflow.plan.sync_share`), and so does its actor (``shard_rows``; a
batch-level estimator trains token-balanced chunks of the whole step).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from asyncflow.agents.calls import EnvCalls
from asyncflow.agents.episode import EpisodeRunner
from asyncflow.algorithms.algorithm import Algorithm
from asyncflow.algorithms.etmr import TreeShape
from asyncflow.config import RunConfig
from asyncflow.dataplane import ShardSampler
from asyncflow.engines.collective import Collective, TorchGroup
from asyncflow.engines.critic import CriticEngine
from asyncflow.engines.device import model_device
from asyncflow.engines.hf_paged import HFPagedEngine
from asyncflow.engines.inference import InferenceEngine, SamplingParams
from asyncflow.engines.lora import BaseView, LoraSpec, LoraTrainEngine
from asyncflow.engines.lora_merge import AdapterLoader
from asyncflow.engines.sglang_engine import SGLangEngine
from asyncflow.engines.training import TrainEngine, lr_multiplier
from asyncflow.engines.vllm_engine import VLLMEngine
from asyncflow.tasks.base import Task
from asyncflow.tasks.environments import env_factory, episode_limits
from asyncflow.tasks.majority import MajorityVote, load_extractor
from asyncflow.tasks.plugins import load_callable
from asyncflow.tasks.rewards import RewardFunction, load_reward_fn
from asyncflow.weights.store import publish_parts
from asyncflow.weights.subscriber import WeightSubscriber
from asyncflow.workflow.feeder import PromptFeeder
from asyncflow.workflow.plan import rewards_in_rollout, sync_ranks, sync_share, trainer_ranks
from asyncflow.workflow.roles.actor import ActorRole
from asyncflow.workflow.roles.base import Role
from asyncflow.workflow.roles.critic import CriticRole
from asyncflow.workflow.roles.reference import ReferenceRole
from asyncflow.workflow.roles.reward import GroupScorer, RewardRole
from asyncflow.workflow.rollout import RolloutRole
from asyncflow.workflow.tree_batch import TreeEngine


@dataclass
class RoleContext:
    """What a worker hands its role builders (built once per worker process)."""

    cfg: RunConfig
    plane: Any  # the data-plane client (:class:`~asyncflow.dataplane.api.DataPlaneClient`)
    weights: Any  # the weight store (None in a solo bench run)
    model: Any  # the policy this worker loaded (a Hugging Face causal LM)
    tokenizer: Any
    task: Task
    model_dir: str
    hosted: list[str]  # the roles of this worker
    rank: int = 0  # the actor's data-parallel rank
    peft: Any = None  # model.lora: the PeftModel around ``model`` (adapters attached by the actor's worker)
    group: Collective | None = None  # the actor's data-parallel group (set by join_dp)
    _reward: Callable | None = field(default=None, repr=False)

    def reward_fn(self) -> Callable:
        """The task's reward, or ``reward.fn`` wrapped with its timeout, error score and counters (one per worker)."""
        if not self.cfg.reward.fn:
            return self.task.reward
        if self._reward is None:
            r = self.cfg.reward
            assert r.fn is not None  # checked above
            self._reward = RewardFunction(load_reward_fn(r.fn), r.timeout_s, r.on_error, r.key, batched=r.batched)
        return self._reward

    def train_reward(self) -> Callable:
        """What scores answers for training: :meth:`reward_fn`, or with ``reward.mode=majority`` the
        group vote (label-free TTRL; evaluation keeps :meth:`reward_fn`, the labelled metric)."""
        if self.cfg.reward.mode == "majority":
            return MajorityVote(load_extractor(self.cfg.reward.extractor))
        return self.reward_fn()

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def passes(cfg: RunConfig) -> dict:
    """How every training engine (actor, reference, critic) runs its forward/backward passes."""
    t = cfg.train
    return {"max_tokens_per_micro": t.max_tokens_per_micro, "split_padding": t.split_padding,
            "dtype": cfg.model.dtype, "logprob_chunk_mib": t.logprob_chunk_mib}


def lora_spec(cfg: RunConfig) -> LoraSpec | None:
    """``model.lora`` as the engines take it (None: full fine-tuning)."""
    lo = cfg.model.lora
    if not lo.on:
        return None
    assert lo.r is not None  # (on)
    targets = lo.target_modules if isinstance(lo.target_modules, str) else tuple(lo.target_modules)
    return LoraSpec(r=lo.r, alpha=lo.alpha, dropout=lo.dropout, target_modules=targets, seed=cfg.seed)


def lr_schedule(cfg: RunConfig) -> Callable[[int], float]:
    """The LR multiplier of ``train``'s schedule (actor and critic alike)."""
    t = cfg.train
    return partial(lr_multiplier, total=t.steps, warmup=t.warmup_steps, schedule=t.lr_schedule,
                   min_ratio=t.min_lr_ratio)


def algorithm(cfg: RunConfig) -> Algorithm:
    return Algorithm.from_config(cfg.algorithm, cfg.rollout.max_new_tokens)


def _tensor_parallel(ctx: RoleContext) -> Any:
    """``train.tp > 1``: the trainer's group on a ``(dp, tp)`` mesh, and the engine's plan (a user's by import path)."""
    # lazy: only with train.tp > 1 (torch.distributed.tensor takes seconds to import)
    from asyncflow.engines.tensor_parallel import MeshGroup, TensorParallel

    t = ctx.cfg.train
    if not isinstance(ctx.group, TorchGroup):
        raise ValueError(f"train.tp={t.tp} needs the trainer's ranks as processes (torch.distributed): "
                         "set launcher=ray")
    ctx.group = MeshGroup(ctx.group, t.dp, t.tp, ctx.cfg.resources.device.split(":")[0])
    plan = load_callable(t.tp_plan, "train.tp_plan") if t.tp_plan else None
    return TensorParallel(ctx.group.tp_mesh, plan)


def build_actor(ctx: RoleContext) -> Role:
    cfg, r, t = ctx.cfg, ctx.cfg.rollout, ctx.cfg.train
    fsdp = t.dp > 1 and t.strategy == "fsdp"
    # sync (not FSDP): the step's rows are all ready at once, so the actor fetches each rank's
    # share in one go and the engine cuts it into length-sorted passes of micro_prompts groups' rows
    whole = cfg.mode == "sync" and not fsdp
    # a lone trainer outside sync: greedy fetches (every ready group) trained in the same sorted passes
    greedy = not whole and trainer_ranks(cfg) == 1
    tp = _tensor_parallel(ctx) if t.tp > 1 else None
    kind, model = (LoraTrainEngine, ctx.peft) if ctx.peft is not None else (TrainEngine, ctx.model)
    engine = kind(model, ctx.tokenizer.pad_token_id, lr=t.lr, weight_decay=t.weight_decay,
                  grad_clip=t.grad_clip, temperature=r.temperature, schedule=lr_schedule(cfg),
                  collective=ctx.group, fsdp=fsdp, tensor_parallel=tp,
                  rows_per_pass=t.micro_prompts * r.group_size if whole or greedy else None, **passes(cfg))
    publish = partial(publish_parts, ctx.weights) if (ctx.weights is not None and cfg.mode != "sync"
                                                      and ctx.rank == 0) else None
    fetch_prompts = -(-t.prompts_per_step // t.dp) if whole else t.micro_prompts
    # data-parallel sync: each rank trains the rows of its own shard (those it generated and scored)
    own = sync_share(cfg, ctx.rank) * r.group_size if whole and sync_ranks(cfg) > 1 else None
    return ActorRole(engine, ctx.plane, cfg.batch_size, r.group_size, fetch_prompts, cfg.effective_staleness,
                     algorithm=algorithm(cfg), publish=publish, group=ctx.group, shard_rows=own, greedy=greedy,
                     masked=cfg.env.enabled)


def _inference_engine(ctx: RoleContext) -> Any:
    """The built-in engine on ``ctx.model``, transformers' continuous batching on it
    (``rollout.engine=hf_paged``: stream/async, where the rollout worker owns its model), or
    (``rollout.engine=vllm|sglang``) the adapter loading the same model folder on the GPU."""
    cfg, r, tok = ctx.cfg, ctx.cfg.rollout, ctx.tokenizer
    if r.engine == "builtin":
        if cfg.model.dtype == "bfloat16" and set(ctx.hosted) <= {"rollout", "reward"} \
                and model_device(ctx.model).type == "cuda":
            # rollout owns this copy: hold it in bf16 (half the bytes a decode step reads, no
            # autocast casts; the weight swap converts in place); shared with a trainer it stays float32
            ctx.model.to(torch.bfloat16)
        return InferenceEngine(ctx.model, tok.eos_token_id, tok.pad_token_id, r.max_batch, cfg.seed,
                               dtype=cfg.model.dtype, cuda_graphs=r.cuda_graphs)
    if r.engine == "hf_paged":
        return HFPagedEngine(ctx.model, tok.eos_token_id, tok.pad_token_id, r.max_batch, cfg.seed,
                             dtype=cfg.model.dtype)
    dtype = "float32" if cfg.model.dtype == "float32" else "bfloat16"
    adapter = VLLMEngine if r.engine == "vllm" else SGLangEngine
    return adapter(ctx.model_dir, tok.eos_token_id, r.max_batch, dtype, cfg.seed)


def _scoring(ctx: RoleContext) -> dict:
    """Rollout's extras when it computes rewards: a :class:`GroupScorer` (over a RewardRole
    that is never run as a role: its calls, remote calls and error counting only); with
    DAPO dynamic sampling also the algorithm's reward shaping, the keep-or-drop rule and a
    prompt feeder (drops consume prompts faster than one partition a step)."""
    cfg = ctx.cfg
    role = RewardRole(ctx.plane, ctx.train_reward(), ctx.decode, concurrency=cfg.reward.concurrency,
                      latency_ms=cfg.reward.latency_ms, seed=cfg.seed, group_size=cfg.rollout.group_size)
    extras: dict = {"scorer": GroupScorer(role)}
    if cfg.algorithm.dynamic_sampling:
        extras.update(shape=algorithm(cfg).shaped_rewards, drop_flat=True,
                      feed=PromptFeeder(cfg, ctx.tokenizer, ctx.task, ctx.plane, unlimited=True))
    return extras


def _episodes(ctx: RoleContext) -> EpisodeRunner | None:
    """Multi-turn (``env``): the episode runner of a rollout role (its environments' calls in threads)."""
    cfg = ctx.cfg
    if not cfg.env.enabled:
        return None
    make = env_factory(cfg, ctx.tokenizer, ctx.reward_fn(), seed=cfg.seed + ctx.rank)
    return EpisodeRunner(ctx.tokenizer, make, episode_limits(cfg, ctx.tokenizer),
                         EnvCalls(cfg.env.concurrency, cfg.env.timeout_s))


def build_rollout(ctx: RoleContext) -> Role:
    cfg, r = ctx.cfg, ctx.cfg.rollout
    engine = base = _inference_engine(ctx)
    if r.etmr:  # each prompt group decodes as entropy-fork trees (rollout sees an engine like any other)
        engine = TreeEngine(engine, TreeShape(r.etmr_roots, r.etmr_forks, r.etmr_branches, r.etmr_rounds,
                                              r.etmr_budget), r.group_size)
    subscriber = None
    if cfg.mode != "sync":
        lora = lora_spec(cfg)  # (the trainer publishes adapters: merged into the base engine's model, off the swap)
        loader = AdapterLoader(base, lora.scale) if lora is not None else None
        subscriber = WeightSubscriber(ctx.weights, engine.load_weights, start_version=0) if loader is None else \
            WeightSubscriber(ctx.weights, loader.load, start_version=0, prepare=loader.prepare)
    sp = SamplingParams(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens)
    shard = ctx.rank if sync_ranks(cfg) > 1 else None
    return RolloutRole(engine, ctx.plane, sp, r.group_size, sync_share(cfg, ctx.rank), cfg.effective_staleness,
                       subscriber, r.recompute_on_swap, r.on_swap, overprovision=r.overprovision, shard=shard,
                       by_prompt_id=True, episodes=_episodes(ctx), **(_scoring(ctx) if rewards_in_rollout(cfg) else {}))


def build_reward(ctx: RoleContext) -> Role:
    cfg = ctx.cfg
    return RewardRole(ctx.plane, ctx.train_reward(), ctx.decode, micro=cfg.batch_size,
                      concurrency=cfg.reward.concurrency, latency_ms=cfg.reward.latency_ms, seed=cfg.seed,
                      group_size=cfg.rollout.group_size)


def build_reference(ctx: RoleContext) -> Role:
    # the frozen base; beside a LoRA actor (sync) the actor's own model with its adapters off: no copy
    ref_model = BaseView(ctx.peft) if ctx.peft is not None else copy.deepcopy(ctx.model).eval()
    engine = TrainEngine(ref_model, ctx.tokenizer.pad_token_id, temperature=ctx.cfg.rollout.temperature,
                         **passes(ctx.cfg))
    return ReferenceRole(engine, ctx.plane, sampler=ShardSampler(ctx.rank) if sync_ranks(ctx.cfg) > 1 else None)


def build_critic(ctx: RoleContext) -> Role:
    cfg, t, a = ctx.cfg, ctx.cfg.train, ctx.cfg.algorithm
    # the policy's weights as backbone; a copy unless this worker hosts the critic alone
    lm = ctx.model if ctx.hosted == ["critic"] else copy.deepcopy(ctx.model)
    engine = CriticEngine(lm, ctx.tokenizer.pad_token_id, lr=a.critic_lr or t.lr, weight_decay=t.weight_decay,
                          grad_clip=t.grad_clip, schedule=lr_schedule(cfg), **passes(cfg))
    return CriticRole(engine, ctx.plane, algorithm(cfg), cfg.batch_size, epochs=a.critic_epochs)


BUILDERS: dict[str, Callable[[RoleContext], Role]] = {
    "actor": build_actor,
    "rollout": build_rollout,
    "reward": build_reward,
    "reference": build_reference,
    "critic": build_critic,
}
BUILD_ORDER = ("actor", "rollout", "reward", "reference", "critic")  # the actor's model first (see above)


def link_local(cfg: RunConfig, roles: dict[str, Any]) -> None:
    """``sync`` (not FSDP): when this worker's rollout writes every field its actor reads (rewards
    in rollout, no reference, no critic), hand the step's rows over in memory
    (:class:`~asyncflow.workflow.rollout.RolloutRole` ``local``), not through the data plane."""
    if not ({"rollout", "actor"} <= set(roles) and cfg.mode == "sync" and rewards_in_rollout(cfg)):
        return
    if set(roles) - {"rollout", "actor"} or (cfg.train.dp > 1 and cfg.train.strategy == "fsdp"):
        return
    if {"ref_logprobs", "advantages"} & set(roles["actor"].fields):  # (another role writes them: PPO's rank 1 too)
        return
    if roles["actor"].world == 1 or roles["actor"].own:  # (token-balanced chunks of the whole step need the plane)
        roles["rollout"].local = roles["actor"].local = {}
