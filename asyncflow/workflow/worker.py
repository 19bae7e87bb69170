"""Worker: hosts one or more roles in one process (a thread, or a Ray actor via the launcher).

A worker is built from picklable inputs only (config, role names, model folder, data-plane
and weight-store clients), so the Ray launcher can construct it inside a fresh process:
``ray.remote(Worker)`` is applied there, never here.

Placement (``plan_workers``):

* ``sync``: one colocated worker with every role, sharing one model between the rollout
  and training engines (weight sync is free), using all cores in every phase;
* ``stream`` / ``async``: one worker per role, one torch thread each; the rollout worker
  receives weights through a :class:`~asyncflow.engines.weights.WeightSubscriber`.

The compute roles (rollout, actor, and reference / critic when the algorithm needs them)
share the CPUs: each requests ``min(1, ncpu / n_compute)``, so the requests never add up
to more than ``ncpu``; rewards are computed inside rollout (``reward.placement=rollout``,
the default), or by a reward worker of their own that requests no CPU (``separate``).

``train.dp = N`` gives the actor N workers (``actor``, ``actor.1``, ...: one rank each,
counted as N compute roles; more compute roles than CPUs is warned about, not refused); the
job joins them (``dp_address`` on rank 0, then ``join_dp`` on every rank) before the first
step. PPO's critic (:mod:`~asyncflow.workflow.critic`) gets its own copy of the initial policy as backbone.
Core pinning (``resources.pin_cores``): :mod:`asyncflow.workflow.cores`.
"""

from __future__ import annotations

import copy
import os
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from asyncflow.config import RunConfig
from asyncflow.workflow.cores import assign_cores, pin_thread, run_pinned


@dataclass
class WorkerSpec:
    name: str
    roles: list[str]
    threads: int
    cpus: float  # resource request for the launcher (may be fractional)
    rank: int = 0  # the actor's data-parallel rank (train.dp > 1)
    cores: tuple[int, ...] = ()  # pinned to these CPU cores (empty: not pinned)
    gpus: float = 0.0  # GPU request for the launcher (resources.device=cuda on Ray)


def rewards_in_rollout(cfg: RunConfig) -> bool:
    """Rollout scores its own groups (``reward.placement=rollout``; dynamic sampling needs it)."""
    return cfg.reward.placement == "rollout" or cfg.algorithm.dynamic_sampling


def plan_workers(cfg: RunConfig, ncpu: int | None = None, cores: list[int] | None = None,
                 ngpu: int = 0) -> list[WorkerSpec]:
    """The workers of ``cfg``'s mode on ``ncpu`` CPUs; pinned to ``cores`` (:func:`assign_cores`) if given.
    With ``resources.device=cuda`` the compute workers share ``ngpu`` GPUs as they share the
    CPUs; a vLLM / SGLang rollout worker gets its share whatever the device."""
    specs = _plan(cfg, ncpu or os.cpu_count() or 1)
    on_gpu = [s for s in specs if s.cpus > 0 and (cfg.resources.device != "cpu" or
                                                  ("rollout" in s.roles and cfg.rollout.engine != "builtin"))]
    for s in on_gpu if ngpu else []:
        s.gpus = min(1.0, round(ngpu / len(on_gpu), 4))  # Ray's fractional GPUs: 4 decimals
    return assign_cores(specs, cores) if cores and cfg.mode != "sync" else specs


def _plan(cfg: RunConfig, ncpu: int) -> list[WorkerSpec]:
    extra = (["reference"] if cfg.algorithm.kl_coef > 0 else []) + (["critic"] if cfg.algorithm.name == "ppo" else [])
    reward = [] if rewards_in_rollout(cfg) else ["reward"]
    if cfg.mode == "sync":
        roles = ["rollout"] + reward + extra + ["actor"]
        return [WorkerSpec("colocated", roles, cfg.resources.sync_threads or ncpu, float(ncpu))]
    n_compute = 1 + cfg.train.dp + len(extra)  # rollout, the actor's ranks and the extras
    share = min(1.0, ncpu / n_compute)
    t = cfg.resources.threads_per_role
    if n_compute * t > ncpu and cfg.train.dp > 1:
        warnings.warn(f"train.dp={cfg.train.dp}: {n_compute} compute roles x {t} thread(s) on {ncpu} CPUs "
                      f"oversubscribe them (each asks for {share:.2f} CPU); expect no speed-up", stacklevel=2)
    specs = [WorkerSpec("rollout", ["rollout"], t, share)] + [WorkerSpec(n, [n], 1, 0.0) for n in reward]
    specs += [WorkerSpec(name, [name], t, share) for name in extra]
    specs += [WorkerSpec(f"actor.{i}" if i else "actor", ["actor"], t, share, rank=i) for i in range(cfg.train.dp)]
    return specs


def _passes(cfg: RunConfig) -> dict:
    """How every training engine (actor, reference, critic) runs its forward/backward passes."""
    t = cfg.train
    return {"max_tokens_per_micro": t.max_tokens_per_micro, "split_padding": t.split_padding,
            "dtype": cfg.model.dtype}


def _lr_schedule(cfg: RunConfig):
    """The LR multiplier of ``train``'s schedule (actor and critic alike)."""
    from functools import partial

    from asyncflow.engines.training import lr_multiplier

    t = cfg.train
    return partial(lr_multiplier, total=t.steps, warmup=t.warmup_steps, schedule=t.lr_schedule,
                   min_ratio=t.min_lr_ratio)


class Worker:
    """Roles of one process; the launcher calls its methods (directly or as a Ray actor)."""

    def __init__(self, cfg: RunConfig, roles: list[str], model_dir: str, dp, weights, threads: int,
                 rank: int = 0, cores: tuple[int, ...] = ()):
        import torch

        from asyncflow.engines.allocator import keep_heap
        from asyncflow.engines.device import resolve_device
        from asyncflow.engines.inference import InferenceEngine, SamplingParams
        from asyncflow.engines.training import TrainEngine
        from asyncflow.engines.weights import WeightSubscriber
        from asyncflow.tasks import build_task, load_model

        torch.set_num_threads(threads)
        keep_heap()  # no page faults per step (they were ~10% of a solo trainer step)
        torch.manual_seed(cfg.seed)
        self.cores = tuple(cores)  # the compute thread and the role loops run here (see pin_thread)
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="compute", initializer=pin_thread,
                                           initargs=(self.cores,))
        self._order = threading.Condition()  # steps enter the compute queue in order (see _in_order)
        self._expect = 0
        self.cfg, self.dp = cfg, dp
        self.model, self.tokenizer = load_model(model_dir)
        self.model.to(resolve_device(cfg.resources.device))  # every engine below computes where its model is
        self.task = build_task(cfg)
        self.roles: dict = {}
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._subscriber = None
        tok = self.tokenizer
        r, t, a = cfg.rollout, cfg.train, cfg.algorithm
        k = cfg.effective_staleness
        self.rank, self.weights, self.group, self._full = rank, weights, None, None
        if "actor" in roles and cfg.train.dp == 1:
            self._build_actor()  # with train.dp > 1: built by join_dp, once the ranks are joined
        if "rollout" in roles:
            from asyncflow.workflow.rollout import RolloutRole

            # Colocated: the rollout engine shares the trainer's model (no weight copy).
            engine = self._inference_engine(model_dir) if r.engine != "builtin" else \
                InferenceEngine(self.model, tok.eos_token_id, tok.pad_token_id, r.max_batch, cfg.seed,
                                dtype=cfg.model.dtype)
            if cfg.mode != "sync":
                self._subscriber = WeightSubscriber(weights, engine.load_weights, start_version=0)
            sp = SamplingParams(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens)
            self.roles["rollout"] = RolloutRole(engine, dp, sp, r.group_size, t.prompts_per_step, k,
                                                self._subscriber, r.recompute_on_swap, r.on_swap,
                                                overprovision=r.overprovision,
                                                **(self._scoring() if rewards_in_rollout(cfg) else {}))
        if "reward" in roles:
            from asyncflow.workflow.reward import RewardRole

            decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
            self.roles["reward"] = RewardRole(dp, self.reward_fn(), decode, micro=cfg.batch_size,
                                              concurrency=cfg.reward.concurrency,
                                              latency_ms=cfg.reward.latency_ms, seed=cfg.seed)
        if "reference" in roles:
            import copy

            from asyncflow.workflow.reference import ReferenceRole

            ref_model = copy.deepcopy(self.model).eval()
            self.roles["reference"] = ReferenceRole(TrainEngine(
                ref_model, tok.pad_token_id, temperature=r.temperature, **_passes(cfg)), dp)
        if "critic" in roles:
            import copy

            from asyncflow.algorithms.algorithm import Algorithm
            from asyncflow.engines.critic import CriticEngine
            from asyncflow.workflow.critic import CriticRole

            # the policy's weights as backbone; a copy unless this worker hosts the critic alone
            lm = self.model if list(roles) == ["critic"] else copy.deepcopy(self.model)
            engine = CriticEngine(lm, tok.pad_token_id, lr=a.critic_lr or t.lr, weight_decay=t.weight_decay,
                                  grad_clip=t.grad_clip, schedule=_lr_schedule(cfg), **_passes(cfg))
            self.roles["critic"] = CriticRole(engine, dp, Algorithm.from_config(a, r.max_new_tokens), cfg.batch_size,
                                              epochs=a.critic_epochs)
        self.started = time.perf_counter()

    def _build_actor(self) -> None:
        """The actor role (its engine sums gradients over ``self.group`` when there is one);
        only rank 0 publishes weights."""
        from asyncflow.algorithms.algorithm import Algorithm
        from asyncflow.engines.training import TrainEngine
        from asyncflow.workflow.actor import ActorRole

        cfg, r, t, a = self.cfg, self.cfg.rollout, self.cfg.train, self.cfg.algorithm
        fsdp = t.dp > 1 and t.strategy == "fsdp"
        if fsdp:
            from asyncflow.engines.collective import TorchGroup

            if not isinstance(self.group, TorchGroup):
                raise ValueError("train.strategy=fsdp needs the trainer's ranks as processes (torch.distributed): "
                                 "set launcher=ray, or train.strategy=ddp")
            self._full = copy.deepcopy(self.model)  # rank 0 evaluates and saves this gathered copy
        engine = TrainEngine(self.model, self.tokenizer.pad_token_id, lr=t.lr, weight_decay=t.weight_decay,
                             grad_clip=t.grad_clip, temperature=r.temperature, schedule=_lr_schedule(cfg),
                             collective=self.group, fsdp=fsdp, **_passes(cfg))
        publish = self.weights.publish if (self.weights is not None and cfg.mode != "sync" and self.rank == 0) \
            else None
        self.roles["actor"] = ActorRole(engine, self.dp, cfg.batch_size, r.group_size, t.micro_prompts,
                                        cfg.effective_staleness, a.clip_eps, a.kl_coef, a.std_normalize,
                                        publish=publish, algorithm=Algorithm.from_config(a, r.max_new_tokens),
                                        group=self.group)

    # ------------------------------------------------------------------ data-parallel trainer
    def dp_address(self) -> str:
        """Rank 0: a ``tcp://`` rendezvous address with a free port on this machine."""
        import socket

        from asyncflow.engines.collective import free_address

        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = "127.0.0.1"
        return free_address(host)

    def join_dp(self, rendezvous) -> None:
        """Join the trainer's ``train.dp`` ranks (blocks until every rank joins), then build
        the actor role on the group. ``rendezvous``: a ``tcp://`` address (processes) or a
        :class:`~asyncflow.engines.collective.ThreadRendezvous` (threads of this process)."""
        from asyncflow.engines.collective import join

        def build() -> None:
            self.group = join(rendezvous, self.rank, self.cfg.train.dp)
            self._build_actor()

        self._on_compute(build)

    def _whole(self):
        """The model with whole weights: the trainer's own, or (FSDP) the gathered copy."""
        return self._full if self._full is not None else self.model

    def gather_full(self) -> None:
        """``train.strategy=fsdp``: every rank calls this at once; rank 0's ``_full`` copy then
        holds the whole current weights (what ``evaluate`` and ``save`` use)."""
        from asyncflow.engines.inference import load_named_weights

        def gather() -> None:
            weights = self.roles["actor"].engine.export_weights()  # an all-gather: every rank joins
            if self.rank == 0:
                load_named_weights(self._full, weights)

        self._on_compute(gather)

    def _inference_engine(self, model_dir: str):
        """rollout.engine=vllm|sglang: the adapter, loading the same model folder on the GPU."""
        r, eos = self.cfg.rollout, self.tokenizer.eos_token_id
        dtype = "float32" if self.cfg.model.dtype == "float32" else "bfloat16"
        if r.engine == "vllm":
            from asyncflow.engines.vllm_engine import VLLMEngine

            return VLLMEngine(model_dir, eos, r.max_batch, dtype, self.cfg.seed)
        from asyncflow.engines.sglang_engine import SGLangEngine

        return SGLangEngine(model_dir, eos, r.max_batch, dtype, self.cfg.seed)

    def _scoring(self) -> dict:
        """Rollout's extras when it computes rewards: a :class:`GroupScorer` (over a RewardRole
        that is never run as a role: its calls, remote calls and error counting only); with
        DAPO dynamic sampling also the algorithm's reward shaping, the keep-or-drop rule and a
        prompt feeder (drops consume prompts faster than one partition a step)."""
        from asyncflow.workflow.reward import GroupScorer, RewardRole

        tok, cfg = self.tokenizer, self.cfg
        decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
        role = RewardRole(self.dp, self.reward_fn(), decode, concurrency=cfg.reward.concurrency,
                          latency_ms=cfg.reward.latency_ms, seed=cfg.seed)
        extras = {"scorer": GroupScorer(role)}
        if cfg.algorithm.dynamic_sampling:
            from asyncflow.algorithms.algorithm import Algorithm
            from asyncflow.workflow.driver import PromptFeeder

            algorithm = Algorithm.from_config(cfg.algorithm, cfg.rollout.max_new_tokens)
            extras.update(shape=algorithm.shaped_rewards, drop_flat=True,
                          feed=PromptFeeder(cfg, tok, self.task, self.dp, unlimited=True).fill)
        return extras

    # ------------------------------------------------------------------ stream / async
    def start(self) -> None:
        """Run every non-actor role's poll loop in its own thread."""
        self.started = time.perf_counter()
        for name, role in self.roles.items():
            if name == "actor":
                continue
            th = threading.Thread(target=run_pinned, args=(self.cores, role.run, self._stop), name=name, daemon=True)
            th.start()
            self._threads.append(th)

    def affinity(self) -> list[int]:
        """The cores this worker's compute thread may run on."""
        return self._on_compute(lambda: sorted(os.sched_getaffinity(0)))

    def _on_compute(self, fn, *args):
        """Run ``fn`` on this worker's one compute thread.

        Callers arrive on any thread (a Ray actor serves calls from a thread pool; the local
        launcher from its own pool). Each thread that runs multi-threaded torch ops gets its
        own OpenMP team, and idle teams spinning beside the busy one cost a measured ~60%
        of a colocated step on 2 cores; one compute thread keeps one team.
        """
        return self._compute.submit(fn, *args).result()

    def _in_order(self, v: int, fn, *args):
        """Run step ``v`` on the compute thread after step ``v - 1``, whatever order the calls
        arrive in: the driver queues step ``v + 1`` before ``v`` returns, and a Ray actor that
        serves calls on several threads does not keep their order."""
        with self._order:
            if not self._order.wait_for(lambda: self._expect == v, timeout=600):
                raise RuntimeError(f"step {v} called but step {self._expect} never came: steps must be consecutive")
            fut = self._compute.submit(fn, *args)
            self._expect = v + 1
            self._order.notify_all()
        return fut.result()

    def train_step(self, v: int, prefetch_next: bool = False) -> dict:
        return self._in_order(v, self.roles["actor"].train_step, v, prefetch_next)

    def critic_metrics(self, v: int, timeout: float = 2.0) -> dict | None:
        """The critic's metrics of step ``v`` once its update is done (None if not within ``timeout``)."""
        return self.roles["critic"].wait_step(v, timeout)

    # ------------------------------------------------------------------ sync (colocated)
    def sync_step(self, v: int) -> dict:
        """One colocated step: generate all, score all, reference all, value all and update the
        critic (PPO), train, sync weights."""
        return self._in_order(v, self._sync_step, v)

    def _sync_step(self, v: int) -> dict:
        B, roles = self.cfg.batch_size, self.roles
        target = (v + 1) * B  # rows each role has produced once partition v is done
        while roles["rollout"].produced[v] < B:
            roles["rollout"].poll(0.05)
        for name in ("reward", "reference", "critic"):
            if name in roles:
                while roles[name].items < target:
                    roles[name].poll(0.05)
        out = roles["actor"].train_step(v)
        if "critic" in roles:  # valued by critic version v, updated on step v before the actor's step
            out.update(roles["critic"].wait_step(v, 0))
        roles["rollout"].set_version(v + 1)
        return out

    # ------------------------------------------------------------------ common
    def evaluate(self, n: int | None = None) -> float:
        from asyncflow.tasks.warmstart import evaluate

        problems = self.task.heldout[: n or self.cfg.task.eval_n]
        # a task's own held-out metric (countdown/multistep: accuracy), unless reward.fn replaces the reward
        score = getattr(self.task, "eval_score", None) if not self.cfg.reward.fn else None
        if score is None:
            score = self.reward_fn() if self.task.greedy_eval_tokens else None  # None: exact-match accuracy
        return self._on_compute(evaluate, self._whole(), self.tokenizer, problems, 512, self.task.greedy_eval_tokens,
                                score, self.cfg.task.chat_template)

    def reward_fn(self):
        """The task's reward, or ``reward.fn`` wrapped with its timeout, error score and counters."""
        if not self.cfg.reward.fn:
            return self.task.reward
        if getattr(self, "_reward_fn", None) is None:
            from asyncflow.tasks.rewards import RewardFunction, load_reward_fn

            r = self.cfg.reward
            self._reward_fn = RewardFunction(load_reward_fn(r.fn), r.timeout_s, r.on_error, r.key,
                                             batched=r.batched)
        return self._reward_fn

    def save(self, path: str) -> str:
        def save() -> str:
            self._whole().save_pretrained(path)
            self.tokenizer.save_pretrained(path)
            return path

        return self._on_compute(save)

    def health(self) -> None:
        """Raise the first error of a background role, if any."""
        for name, role in self.roles.items():
            if role.error is not None:
                raise RuntimeError(f"role '{name}' failed: {role.error!r}") from role.error

    def stats(self) -> dict:
        wall, cpu = time.perf_counter() - self.started, time.process_time()  # cpu: this whole process
        return {self._key(name): {**role.stats(), "wall_s": wall, "cpu_s": cpu, "pid": os.getpid()}
                for name, role in self.roles.items()}

    def _key(self, role: str) -> str:
        """A role's name in stats and traces: ``actor.1`` for the actor of trainer rank 1."""
        return f"{role}.{self.rank}" if self.rank else role

    def spans(self) -> dict[str, list[tuple[float, float]]]:
        """Each role's computing spans (wall-clock start, seconds), for the timeline trace."""
        return {self._key(name): list(role.spans) for name, role in self.roles.items()}

    def stop(self) -> None:
        self._stop.set()
        if self.group is not None:  # a rank still waiting in a collective gives up
            self.group.abort()
        for th in self._threads:
            th.join(timeout=5)
        if self._subscriber is not None:
            self._subscriber.close()
        self._compute.shutdown(wait=False)
        if "reward" in self.roles:
            self.roles["reward"].close()
        scorer = getattr(self.roles.get("rollout"), "scorer", None)
        if scorer is not None:
            scorer.close()
