"""Cost models for the simulator: measured curves of this machine, or analytic accelerators.

:class:`ProfiledCost` reads the JSON written by ``asyncflow profile``: per torch-thread
count, linear fits of

* decode seconds per round ``a + b*n + c*n*ctx`` (``n`` live rows, ``ctx`` mean context),
* prefill seconds ``a + b*rows*prompt_len``,
* training seconds per micro-batch ``a + b*rows*padded_len`` (forward + backward),
* optimizer step, weight export, weight load (the swap), reward seconds per sample,
* ``pipeline``: a short real one-thread ``sync`` run on the job's launcher, decomposed
  with the roles' own busy timers (``calib.fit_pipeline``): per-role factors that
  correct the one-thread curves to what the roles do in the real launcher
  (``role_factor``, applied on one thread), and the per-step overhead the curves miss
  (driver round trip, data-plane calls across processes, prompt feeding: the step's
  time outside every role), measured step by step (:mod:`asyncflow.planner.calib`); for
  stream/async the same overhead measured where each role pays it
  (``pipeline_overheads_s``): the data-plane latency of a finished group on its way to the
  trainer (``data_latency_s``, from the sync run) and the actor's step boundary
  (``actor_overhead_s``, from a short async run); the weight store's publish -> staged
  latency gives ``transfer_s``,

and per-role calibration factors (role alone through the real role code over an
in-process data plane, divided by the curves' prediction: what the curves miss is data-
plane calls, sampling, bookkeeping). A thread count that was not profiled uses the
largest profiled count below it (more threads are assumed not to help).

:class:`AnalyticCost` models accelerators we do not have from a model size and a device
sheet. Every number in it is an **assumption**, listed in :data:`ASSUMPTIONS` and
repeated in ``docs/planner.md``: FLOPs ``2P`` per generated token and ``6P`` per trained
token (+ ``2P`` each for the old-policy and reference log-prob passes of a verl-style
step), decode bound by ``max(compute, weight + KV bytes / bandwidth)``, utilisations fixed.

Tensor parallelism of the trainer (``train.tp``; :func:`tp_pass_s`, kept simple): a training pass
split over ``tp`` ranks costs ``1 / tp`` of its compute on each (the matmuls divide evenly; the
norms and the vocabulary-parallel log-prob's small all-reduces are left out) plus Megatron's four
all-reduces a decoder layer (two forward, two backward) of the pass's activations
(``tokens x hidden`` float32 values), each a ring all-reduce: ``2 (tp - 1) / tp x bytes /
bandwidth + 2 (tp - 1) x latency`` (:meth:`allreduce_s`). The link is an assumption for every
model: gloo over loopback on a CPU (:data:`CPU_LINK`), an NVLink-class bus for the analytic
accelerators (``tp_link_gbs``, ``tp_latency_s`` in :data:`ASSUMPTIONS`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CPU_LINK = (2.0, 50e-6)  # assumed gloo all-reduce on one host: GB/s, seconds a hop (not measured)


def ring_allreduce_s(nbytes: float, ranks: int, gbs: float, latency_s: float) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``ranks`` (0 for one rank).

    >>> round(ring_allreduce_s(1e9, 2, 1.0, 0.0), 3)  # half the bytes sent and half received, twice
    1.0
    """
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / (gbs * 1e9) + 2 * (ranks - 1) * latency_s


def tp_pass_s(cost: Any, compute_s: float, tokens: int, tp: int, wl: Any) -> float:
    """A training pass of ``tokens`` (padded) split over ``tp`` tensor-parallel ranks (module doc):
    ``compute_s / tp`` plus ``4 x wl.layers`` all-reduces of ``tokens x wl.hidden`` float32 values."""
    if tp <= 1:
        return compute_s
    return compute_s / tp + 4 * wl.layers * cost.allreduce_s(tokens * wl.hidden * 4.0, tp)


# ---------------------------------------------------------------------------- profiled
@dataclass
class ProfiledCost:
    curves: dict[int, dict]  # threads -> {"decode": [a, b, c], "prefill": [a, b], "train": [a, b], "step_s": x}
    export_s_: float = 0.0
    load_s: float = 0.0
    reward_per_sample_s: float = 0.0
    calibration: dict[int, dict] = field(default_factory=dict)  # threads -> {role: measured / curves}
    interference: float = 1.0
    pipeline: dict = field(default_factory=dict)  # measured in a short real run: step_overhead_s, transfer_s

    @classmethod
    def load(cls, path: str | Path) -> ProfiledCost:
        return cls.from_dict(json.loads(Path(path).read_text()))

    @classmethod
    def from_dict(cls, d: dict) -> ProfiledCost:
        return cls(curves={int(k): v for k, v in d["curves"].items()}, export_s_=d["export_s"], load_s=d["load_s"],
                   reward_per_sample_s=d["reward_s_per_sample"],
                   calibration={int(k): v for k, v in d.get("calibration", {}).items()},
                   interference=d.get("interference", 1.0), pipeline=d.get("pipeline", {}))

    @staticmethod
    def _pick(table: dict, res: int) -> Any:
        ok = [t for t in table if t <= max(1, res)]
        return table[max(ok) if ok else min(table)]

    def _c(self, res: int) -> dict:
        return self._pick(self.curves, res)

    def _cal(self, role: str, res: int) -> float:
        f = self._pick(self.calibration, res).get(role, 1.0) if self.calibration else 1.0
        if res <= 1:  # the real one-thread sync run's correction (calib.fit_pipeline)
            f *= self.pipeline.get("role_factor", {}).get(role, 1.0)
        else:  # the real multi-thread sync run's (its teams share the cores with the framework's processes)
            by_threads = {int(t): v for t, v in self.pipeline.get("role_factor_threads", {}).items()}
            f *= self._pick(by_threads, res).get(role, 1.0) if by_threads else 1.0
        return f

    def decode_s(self, n: int, ctx: float, res: int) -> float:
        a, b, c = self._c(res)["decode"]
        return max(0.0, a + b * n + c * n * ctx) * self._cal("rollout", res)

    def prefill_s(self, n: int, prompt_len: float, res: int) -> float:
        a, b = self._c(res)["prefill"]
        return max(0.0, a + b * n * prompt_len) * self._cal("rollout", res)

    def train_s(self, rows: int, padded_len: int, res: int) -> float:
        a, b = self._c(res)["train"]
        return max(0.0, a + b * rows * padded_len) * self._cal("actor", res)

    def step_s(self, res: int) -> float:
        return self._c(res)["step_s"]

    def export_s(self) -> float:
        return self.export_s_

    def swap_s(self, n_live: int, ctx: float, res: int) -> float:
        return self.load_s + (self.prefill_s(n_live, ctx, res) if n_live else 0.0)

    def transfer_s(self) -> float:
        return self.pipeline.get("transfer_s", self.load_s)  # publish -> staged at the subscriber

    def reward_s(self, n: int) -> float:
        return self.reward_per_sample_s * n

    def allreduce_s(self, nbytes: float, ranks: int) -> float:
        return ring_allreduce_s(nbytes, ranks, *CPU_LINK)

    def step_overhead_s(self) -> float:
        return self.pipeline.get("step_overhead_s", 0.0)

    def pipeline_overheads_s(self) -> tuple[float, float, float]:
        p = self.pipeline
        if "actor_overhead_s" in p:  # measured piece by piece (asyncflow.planner.calib)
            return 0.0, p.get("data_latency_s", 0.0), p["actor_overhead_s"]
        return split_overhead(self.step_overhead_s())  # a profile from before: the sync overhead, split


ROLLOUT_SHARE = 0.5


def split_overhead(o: float) -> tuple[float, float, float]:
    """``(rollout per partition, data latency per group, actor per step)`` of stream/async for
    a cost model that knows only one per-step overhead ``o``: ``ROLLOUT_SHARE`` of it paid
    by rollout when it starts a partition, the rest by the actor (a modelling choice)."""
    return o * ROLLOUT_SHARE, 0.0, o * (1 - ROLLOUT_SHARE)


# ---------------------------------------------------------------------------- analytic
@dataclass(frozen=True)
class Device:
    name: str
    tflops: float  # dense bf16/fp16 peak, TFLOP/s
    hbm_gbs: float  # memory bandwidth, GB/s
    mem_gb: float


@dataclass(frozen=True)
class LLM:
    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2  # K and V, bf16


DEVICES = {
    "ascend-910b": Device("Ascend 910B (datasheet-class figures)", 313.0, 1600.0, 64.0),
    "h100": Device("NVIDIA H100 SXM", 989.0, 3350.0, 80.0),
    "h200": Device("NVIDIA H200", 989.0, 4800.0, 141.0),
}
MODELS = {
    "7b": LLM("Qwen2.5-7B", 7.6e9, 28, 4, 128),
    "32b": LLM("Qwen2.5-32B", 32.8e9, 64, 8, 128),
}
ASSUMPTIONS = {
    "mfu_train": (0.35, "model FLOPs utilisation of training (fwd+bwd)"),
    "mfu_prefill": (0.45, "FLOPs utilisation of prefill and log-prob forward passes"),
    "mfu_decode": (0.35, "FLOPs utilisation of a decode round when compute-bound"),
    "bw_util": (0.6, "fraction of HBM bandwidth a decode round achieves"),
    "decode_overhead_s": (0.012, "fixed per decode round (kernel launch, sampling, scheduler)"),
    "extra_forward_passes": (2, "forward passes besides training: old-policy and reference log-probs"),
    "reshard_gbs": (20.0, "sync: training -> inference weight resharding, GB/s per device"),
    "h2d_gbs": (25.0, "async: host -> device copy of the delayed update, GB/s per device"),
    "opt_bytes_per_param": (16.0, "optimizer step reads/writes (fp32 master, Adam m, v, grads)"),
    "step_overhead_s": (1.0, "per training step: driver, scheduling, logging, data-plane round trips"),
    "reward_s_per_sample": (0.0, "rule-based maths reward: negligible"),
    "tp_link_gbs": (300.0, "train.tp: all-reduce bus bandwidth per device within a node (NVLink-class), GB/s"),
    "tp_latency_s": (1e-5, "train.tp: latency of one hop of a ring all-reduce"),
}


@dataclass
class AnalyticCost:
    """Accelerator cost model. ``res`` of a role = its devices; ``tp`` devices per
    rollout instance (an instance's decode round serves ``n / instances`` rows)."""

    model: LLM
    device: Device
    tp: int = 1
    a: dict = field(default_factory=lambda: {k: v for k, (v, _) in ASSUMPTIONS.items()})
    colocated: bool = False  # sync: weights reshard in place every step
    interference: float = 1.0

    def _flops(self, res: int, util: float) -> float:
        return res * self.device.tflops * 1e12 * util

    def decode_s(self, n: int, ctx: float, res: int) -> float:
        inst = max(1, res // self.tp)
        per = n / inst
        compute = 2 * self.model.params * per / (self.tp * self.device.tflops * 1e12 * self.a["mfu_decode"])
        mem = (2 * self.model.params + per * ctx * self.model.kv_bytes_per_token) / (
            self.tp * self.device.hbm_gbs * 1e9 * self.a["bw_util"])
        return max(compute, mem) + self.a["decode_overhead_s"]

    def prefill_s(self, n: int, prompt_len: float, res: int) -> float:
        return 2 * self.model.params * n * prompt_len / self._flops(res, self.a["mfu_prefill"])

    def train_s(self, rows: int, padded_len: int, res: int) -> float:
        tokens = rows * padded_len
        return (6 * self.model.params * tokens / self._flops(res, self.a["mfu_train"])
                + self.a["extra_forward_passes"] * 2 * self.model.params * tokens
                / self._flops(res, self.a["mfu_prefill"]))

    def step_s(self, res: int) -> float:
        opt = self.a["opt_bytes_per_param"] * self.model.params / (res * self.device.hbm_gbs * 1e9 * self.a["bw_util"])
        reshard = 2 * self.model.params / (res * self.a["reshard_gbs"] * 1e9) if self.colocated else 0.0
        return opt + reshard

    def export_s(self) -> float:
        return 0.0  # device -> host copy overlaps the next step (delayed update)

    def swap_s(self, n_live: int, ctx: float, res: int) -> float:
        return 2 * self.model.params / (self.tp * self.a["h2d_gbs"] * 1e9)  # each instance loads its shard

    def transfer_s(self) -> float:
        return 2 * self.model.params / (self.a["reshard_gbs"] * 1e9)  # background, not on either critical path

    def step_overhead_s(self) -> float:
        return self.a["step_overhead_s"]

    def pipeline_overheads_s(self) -> tuple[float, float, float]:
        return split_overhead(self.step_overhead_s())

    def reward_s(self, n: int) -> float:
        return self.a["reward_s_per_sample"] * n

    def allreduce_s(self, nbytes: float, ranks: int) -> float:
        return ring_allreduce_s(nbytes, ranks, self.a["tp_link_gbs"], self.a["tp_latency_s"])


@dataclass
class ConstantCost:
    """Hand-set costs (tests and quick what-ifs): every call costs a fixed number of seconds."""

    decode: float = 0.0  # per decode round (any batch size)
    decode_per_row: float = 0.0
    prefill: float = 0.0
    train_per_row: float = 0.0
    step: float = 0.0
    export: float = 0.0
    swap: float = 0.0
    transfer: float = 0.0
    reward: float = 0.0
    overhead: float = 0.0
    pieces: tuple[float, float, float] | None = None  # stream/async overheads (rollout, data, actor); None: split
    interference: float = 1.0
    allreduce: float = 0.0  # seconds of one all-reduce (train.tp)

    def decode_s(self, n: int, ctx: float, res: int) -> float:
        return self.decode + self.decode_per_row * n

    def prefill_s(self, n: int, prompt_len: float, res: int) -> float:
        return self.prefill

    def train_s(self, rows: int, padded_len: int, res: int) -> float:
        return self.train_per_row * rows

    def step_s(self, res: int) -> float:
        return self.step

    def export_s(self) -> float:
        return self.export

    def swap_s(self, n_live: int, ctx: float, res: int) -> float:
        return self.swap

    def transfer_s(self) -> float:
        return self.transfer

    def reward_s(self, n: int) -> float:
        return self.reward * n

    def allreduce_s(self, nbytes: float, ranks: int) -> float:
        return self.allreduce if ranks > 1 else 0.0

    def step_overhead_s(self) -> float:
        return self.overhead

    def pipeline_overheads_s(self) -> tuple[float, float, float]:
        return self.pieces if self.pieces is not None else split_overhead(self.overhead)
