"""LoRA, the rollout's side: published adapters merged into a model's own copy of its base.

A LoRA trainer publishes its adapters alone (:mod:`asyncflow.engines.lora`), under the names
of peft's adapter file: ``base_model.model.<module>.lora_A.weight`` (``r x in``) and
``...lora_B.weight`` (``out x r``). A rollout worker, and the evaluator beside training, hold a
plain model loaded from the same folder as the trainer's base; :meth:`AdapterMerger.apply`
sets the weight of every adapted module to ``W0 + scale * B @ A``.

Design
------
``W0`` is a copy of the module's weight kept at the first merge: each version is computed
from the base, never from the previous merge, so swaps do not accumulate rounding error
and a version applied twice gives the same weights bit for bit. A merge is two halves:
:meth:`AdapterMerger.prepare` computes ``torch.addmm(W0, B, A, alpha=scale)`` per module into
new tensors without touching the model, so a rollout worker runs it on its weight
subscriber's background thread while decoding goes on; :meth:`AdapterMerger.commit` copies
them in, the only part exposed to generation (one copy of the adapted weights: less than a
full set's). Decoding then runs the model's own forward (no LoRA branch per token), and a
CUDA graph captured on ``W`` stays valid (written in place). The price is memory: ``W0`` and
one prepared set beside the model's weights for the adapted modules (``all-linear`` on a
Qwen2-0.5B shape: ~360M parameters, ~1.4 GB each in float32).

Invariants
----------
* ``apply`` is all or nothing: a set whose names, pairs or shapes do not fit the model
  raises ``ValueError`` naming the tensor before any weight changes;
* every set adapts the modules of the first one (a set with fewer would leave an older
  version merged in the others);
* ``Conv1D`` modules (GPT-2's ``in x out`` weights) get the transposed update.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers.pytorch_utils import Conv1D

PREFIX = "base_model.model."
A_SUFFIX, B_SUFFIX = ".lora_A.weight", ".lora_B.weight"


def is_adapter_set(tensors: Mapping[str, Any]) -> bool:
    """Whether a published weight set holds adapters (else whole weights)."""
    return any(k.endswith((A_SUFFIX, B_SUFFIX)) for k in tensors)


def adapter_pairs(tensors: Mapping[str, Any]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{module: (A, B)}`` of an adapter set; a stray or unpaired tensor is a one-line ``ValueError``."""
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name in sorted(tensors):
        if not (name.startswith(PREFIX) and name.endswith((A_SUFFIX, B_SUFFIX))):
            raise ValueError(f"'{name}' is not a LoRA adapter tensor (expected {PREFIX}<module>{A_SUFFIX} "
                             f"or {B_SUFFIX})")
        if name.endswith(A_SUFFIX):
            module = name[len(PREFIX): -len(A_SUFFIX)]
            partner = f"{PREFIX}{module}{B_SUFFIX}"
            if partner not in tensors:
                raise ValueError(f"adapter of '{module}' has lora_A but no lora_B")
            pairs[module] = (_tensor(tensors[name]), _tensor(tensors[partner]))
    if 2 * len(pairs) != len(tensors):
        lone = sorted(n for n in tensors if n.endswith(B_SUFFIX) and n[len(PREFIX): -len(B_SUFFIX)] not in pairs)
        raise ValueError(f"adapter tensor '{lone[0]}' has no lora_A")
    return pairs


def _tensor(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))


@dataclass
class Merged:
    """:meth:`AdapterMerger.prepare`'s result: (the model's weight, its new value) per adapted module."""

    weights: list[tuple[torch.Tensor, torch.Tensor]]


class AdapterMerger:
    """Merges adapter sets into ``model``'s own weights from its kept base (module doc)."""

    def __init__(self, model: torch.nn.Module, scale: float):
        self.model, self.scale = model, scale
        self.base: dict[str, torch.Tensor] = {}  # module -> W0 (copied at the first apply)
        self._modules = dict(model.named_modules())

    def _plan(self, tensors: Mapping[str, Any]) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(module, W, lhs, rhs)`` with ``W = W0 + scale * lhs @ rhs``, every one checked first."""
        pairs = adapter_pairs(tensors)
        if self.base and set(pairs) != set(self.base):
            gone = sorted(set(self.base) ^ set(pairs))
            raise ValueError(f"adapter set changes the adapted modules (e.g. '{gone[0]}'): every version must "
                             f"adapt the same modules")
        plan = []
        for module, (a, b) in pairs.items():
            target = self._modules.get(module)
            weight = getattr(target, "weight", None)
            if not isinstance(weight, torch.Tensor):
                raise ValueError(f"adapter of '{module}': the model has no such module with a weight")
            lhs, rhs = (a.T, b.T) if isinstance(target, Conv1D) else (b, a)
            if a.dim() != 2 or b.dim() != 2 or (lhs.shape[0], rhs.shape[1]) != tuple(weight.shape) \
                    or lhs.shape[1] != rhs.shape[0]:
                raise ValueError(f"adapter of '{module}': A {tuple(a.shape)} and B {tuple(b.shape)} do not fit "
                                 f"its weight {tuple(weight.shape)}")
            plan.append((module, weight, lhs, rhs))
        return plan

    @torch.no_grad()
    def prepare(self, tensors: Mapping[str, Any]) -> Merged:
        """The merged weights of a set, ``W0 + scale * B @ A`` per adapted module, in new tensors
        beside the model's (the model is not changed: this may run while it decodes)."""
        out = []
        for module, weight, lhs, rhs in self._plan(tensors):
            w0 = self.base.get(module)
            if w0 is None:  # (the first set: nothing is merged yet, the weight is the base's)
                w0 = self.base[module] = weight.detach().clone()
            lhs, rhs = (t.to(weight.device, weight.dtype) for t in (lhs, rhs))
            out.append((weight, torch.addmm(w0, lhs, rhs, alpha=self.scale)))
        return Merged(out)

    @torch.no_grad()
    def commit(self, merged: Merged) -> None:
        """Copy :meth:`prepare`'s weights into the model (in place: the swap itself)."""
        for weight, new in merged.weights:
            weight.data.copy_(new)

    def apply(self, tensors: Mapping[str, Any]) -> None:
        """Set every adapted weight to ``W0 + scale * B @ A`` (all or nothing: checked first)."""
        self.commit(self.prepare(tensors))


class AdapterLoader:
    """An inference engine's weight loading for adapter sets: :meth:`prepare` merges a set into
    copies of the base's weights (a :class:`~asyncflow.weights.subscriber.WeightSubscriber`'s
    ``prepare``, on its background thread), :meth:`load` copies them into ``engine.model`` and
    moves the engine's policy version, as ``load_weights`` does (its ``apply``, at the swap)."""

    def __init__(self, engine: Any, scale: float):
        self.engine, self.merger = engine, AdapterMerger(engine.model, scale)
        self.prepare: Callable[[Mapping[str, Any]], Merged] = self.merger.prepare

    def load(self, version: int, merged: Merged) -> None:
        self.merger.commit(merged)
        self.engine.version = version
