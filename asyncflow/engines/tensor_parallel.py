"""Megatron-style tensor parallelism of a Hugging Face causal LM (``train.tp``), through PyTorch's own API.

Design
------
Each decoder layer's matrices are split across the ``tp`` ranks of a device mesh with
``torch.distributed.tensor.parallel``: the attention's q/k/v and the MLP's gate/up
projections column-parallel (:class:`ColwiseParallel`: each rank computes its own heads, its
own slice of the MLP's hidden units), the attention's output and the MLP's down projection
row-parallel (:class:`RowwiseParallel`: partial sums, one all-reduce each in forward; the
column-parallel inputs' all-reduce in backward). So a layer costs two all-reduces forward
and two backward, as in the Megatron-LM paper. The token embedding is vocabulary-parallel
(each rank looks up its rows of the vocabulary, an all-reduce sums them) and so is the LM
head (each rank computes the logits of its slice of the vocabulary, never gathered: the
log-probs are taken from the shards, :mod:`asyncflow.engines.vocab_parallel`). Every other
parameter (the norms) is replicated: a ``Replicate()`` DTensor computed alike on every rank
(:class:`ReplicateParallel`), so every parameter is a DTensor and AdamW and gradient clipping
run on them as they are (DTensor's foreach kernels; the clip's norm sums shards over ranks).

The plan is keyed on module names (``fnmatch`` patterns, ``*`` for a layer's index) relative
to the causal LM; :data:`LLAMA_PLAN` fits Llama, Qwen2, Qwen3 and Mistral. A user gives a plan
for another architecture by import path (``train.tp_plan``): a function of the model returning
``{pattern: style}``, a style being one of :data:`STYLES`' names or a ``ParallelStyle``.
Sequence parallelism (norms on sequence shards) is not applied: on the short RL sequences
this trains, the activations it would save are small next to the weights and AdamW's state,
and Hugging Face's decoder layers pass the residual stream as plain tensors between blocks.

The attention heads are divided per rank: ``num_attention_heads`` and ``num_key_value_heads``
(GQA) must be divisible by ``tp``; the module's own ``num_heads`` / ``num_key_value_heads``
attributes (older transformers reshape by them) are divided, ``num_key_value_groups`` stays.
Current transformers reshape by ``-1`` heads, so the local q/k/v need nothing more.

Invariants
----------
* After :func:`apply_plan` every parameter is a DTensor on the ``tp`` mesh; names and tying
  are the model's (a tied LM head shares the embedding's parameter, both sharded by rows).
* Forward and backward give the single-process result up to float summation order
  (``tests/test_tensor_parallel.py``: losses, gradients and weights after 3 steps, rel 1e-5).
* Data parallelism composes on a 2-D mesh ``("dp", "tp")`` (:class:`MeshGroup`): rows are
  split over ``dp``; gradients are summed over ``dp`` by the engine, over ``tp`` by DTensor.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from asyncflow.engines.collective import TorchGroup, all_reduce_buckets

Plan = Mapping[str, "str | ParallelStyle"]

LLAMA_PLAN: dict[str, str] = {
    "model.embed_tokens": "vocab_embedding",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "vocab_head",
}


class ReplicateParallel(ParallelStyle):
    """A module computed alike on every rank: its own parameters become ``Replicate()`` DTensors,
    its tensor inputs (positional and keyword) are wrapped as replicated DTensors and its outputs
    unwrapped, so the rest of the model sees plain tensors. Backward needs no communication: its
    inputs' gradients arrive already summed (the column-parallel layers after it all-reduce theirs)."""

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        for key, p in list(module.named_parameters(recurse=False)):
            if not isinstance(p, DTensor):
                module.register_parameter(key, torch.nn.Parameter(distribute_tensor(p, device_mesh, [Replicate()]),
                                                                  requires_grad=p.requires_grad))

        def wrap(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
                return DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
            return x

        def unwrap(x: Any) -> Any:
            return x.to_local() if isinstance(x, DTensor) else x

        def before(mod: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return tuple(wrap(a) for a in args), {k: wrap(v) for k, v in kwargs.items()}

        def after(mod: torch.nn.Module, args: tuple, out: Any) -> Any:
            return tuple(unwrap(o) for o in out) if isinstance(out, tuple) else unwrap(out)

        module.register_forward_pre_hook(before, with_kwargs=True)
        module.register_forward_hook(after)
        return module


def _styles() -> dict[str, Callable[[], ParallelStyle]]:
    return {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        # input ids replicated; each rank looks up its rows of the vocabulary, an all-reduce sums them
        "vocab_embedding": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        # logits stay sharded by vocabulary (a DTensor): the log-probs are taken from the shards
        "vocab_head": lambda: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        "replicate": ReplicateParallel,
    }


STYLES = ("colwise", "rowwise", "vocab_embedding", "vocab_head", "replicate")


def default_plan(model: torch.nn.Module) -> dict[str, str]:
    """:data:`LLAMA_PLAN` (Llama, Qwen2, Qwen3, Mistral: ``model.layers.N.self_attn.q_proj`` ...)."""
    return dict(LLAMA_PLAN)


def resolve_plan(model: torch.nn.Module, plan: Plan) -> dict[str, ParallelStyle]:
    """``plan``'s patterns matched against the model's module names: ``{module name: style}``.
    Raises ``ValueError`` naming a pattern that matches no module or an unknown style."""
    names = [n for n, _ in model.named_modules() if n]
    styles = _styles()
    out: dict[str, ParallelStyle] = {}
    for pattern, style in plan.items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(f"train.tp plan: '{pattern}' matches no module of {type(model).__name__} "
                             f"(first modules: {', '.join(names[:4])}); give train.tp_plan for this architecture")
        if isinstance(style, str) and style not in styles:
            raise ValueError(f"train.tp plan: '{pattern}': unknown style '{style}' (known: {', '.join(STYLES)})")
        for n in hits:
            out[n] = styles[style]() if isinstance(style, str) else style
    return out


def check_heads(model: torch.nn.Module, tp: int) -> None:
    """The model's attention heads (and key/value heads, GQA) must divide among ``tp`` ranks."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg  # (multimodal configs keep the LM's under text_config)
    for key in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(cfg, key, None)
        if isinstance(n, int) and n % tp:
            raise ValueError(f"train.tp={tp}: the model's {key} ({n}) is not divisible by it; choose a train.tp "
                             f"that divides {n}")


def _divide_heads(model: torch.nn.Module, tp: int) -> None:
    """Per-rank head counts on modules that keep them (older transformers reshape by them)."""
    for mod in model.modules():
        for key in ("num_heads", "num_key_value_heads"):
            n = getattr(mod, key, None)
            if isinstance(n, int) and not isinstance(mod, torch.nn.MultiheadAttention) and hasattr(mod, "head_dim"):
                setattr(mod, key, n // tp)


def _tied(model: torch.nn.Module) -> tuple[Any, Any] | None:
    """(input embedding, LM head) when they share their weight (HF's tied embeddings), else None."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    emb, head = (get_in(), get_out()) if callable(get_in) and callable(get_out) else (None, None)
    return (emb, head) if emb is not None and head is not None and head.weight is emb.weight else None


def apply_plan(model: torch.nn.Module, mesh: DeviceMesh, plan: Plan) -> None:
    """Shard ``model`` in place over the 1-D ``mesh`` by ``plan`` (module doc); the rest replicated."""
    tp = mesh.size()
    check_heads(model, tp)
    tied = _tied(model)
    styles = resolve_plan(model, plan)
    _divide_heads(model, tp)
    parallelize_module(model, mesh, styles)
    if tied is not None:  # (each style distributed its own copy of the shared weight: share the embedding's again)
        emb, head = tied
        if not (isinstance(emb.weight, DTensor) and isinstance(head.weight, DTensor)
                and emb.weight.placements == head.weight.placements):
            raise ValueError("train.tp plan: the LM head is tied to the embedding, so both must be sharded "
                             "alike (vocab_embedding and vocab_head)")
        head.weight = emb.weight
    for name, mod in model.named_modules():
        own = [p for p in mod.parameters(recurse=False) if not isinstance(p, DTensor)]
        if not own:
            continue
        if any(True for c in mod.children() for _ in c.parameters()):
            raise ValueError(f"train.tp plan: module '{name}' holds parameters besides its children's; "
                             f"give it a style in train.tp_plan")
        parallelize_module(mod, mesh, ReplicateParallel())


class MeshGroup:
    """The trainer's ``dp x tp`` processes on a 2-D device mesh ``("dp", "tp")``, rank ``r`` at
    ``(r // tp, r % tp)``: a :class:`~asyncflow.engines.collective.Collective` whose ``rank`` and
    ``world`` are the processes' (rank 0 fetches and broadcasts every micro-batch to all of them)
    and whose ``shard`` / ``shards`` are the data-parallel index and count (the rows a rank
    trains: the ``tp`` ranks of one ``dp`` index train the same rows). ``all_reduce_sum`` sums
    over ``dp`` only (DTensors: their local shards), as the ``tp`` ranks hold different shards."""

    def __init__(self, base: TorchGroup, dp: int, tp: int, device: str = "cpu"):
        if base.world != dp * tp:
            raise ValueError(f"{base.world} trainer processes joined, but train.dp x train.tp = {dp} x {tp}")
        self.base, self.rank, self.world = base, base.rank, base.world
        self.mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))
        self.shard, self.shards = self.mesh.get_local_rank("dp"), dp
        self.tp_rank, self.tp = self.mesh.get_local_rank("tp"), tp
        self._dp = self.mesh["dp"].get_group() if dp > 1 else None

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    def all_reduce_sum(self, tensors: Sequence[torch.Tensor]) -> None:
        if self._dp is None:
            return
        local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
        all_reduce_buckets(local, lambda t: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self._dp))

    def broadcast(self, obj: Any) -> Any:
        return self.base.broadcast(obj)

    def barrier(self) -> None:
        self.base.barrier()

    def abort(self) -> None:
        self.base.abort()


class TensorParallel:
    """What a :class:`~asyncflow.engines.training.TrainEngine` needs to shard its model: the ``tp``
    mesh and the plan (a function of the model, :func:`default_plan` unless the user gave one)."""

    def __init__(self, mesh: DeviceMesh, plan: Callable[[torch.nn.Module], Plan] | None = None):
        self.mesh, self.plan = mesh, plan or default_plan

    def apply(self, model: torch.nn.Module) -> None:
        apply_plan(model, self.mesh, self.plan(model))
