"""LoRA through ``peft``, the trainer's side: adapters on a frozen base, trained and exported alone.

Design
------
:func:`attach` injects ``peft`` LoRA layers into the policy's Hugging Face model *in place*
(``get_peft_model``): each target linear layer ``W0`` becomes ``W0 x + (alpha / r) B A x``
with ``A`` (r x in) and ``B`` (out x r) trainable and everything else frozen. The model
object stays the one the worker loaded, so every engine that holds it (the actor's, and in
``sync`` the rollout engine decoding with the actor's own model, and the worker's
evaluation) runs the LoRA forward without knowing; the returned ``PeftModel`` is kept for
what only peft does: its adapter folder, ``disable_adapter`` and ``merge_and_unload``.

:class:`LoraTrainEngine` is a :class:`~asyncflow.engines.training.TrainEngine` on that model
whose ``export_weights`` returns the adapter tensors only, under the names of peft's adapter
file (``base_model.model.<module>.lora_A.weight``, ``...lora_B.weight``): the delayed
parameter update then publishes, seals and ships a few MB instead of the whole model, and a
rollout worker merges them into its own copy of the base
(:class:`~asyncflow.engines.lora_merge.AdapterMerger`).

The reference policy of the KL term is the frozen base: :class:`BaseView` runs the policy's
own model inside ``disable_adapter`` (no copy of the model). It is used only where the
reference shares the actor's worker (``sync``), whose roles run their phases one after the
other on one compute thread: switching the adapters off never overlaps a training pass.

Checkpoints keep only what trains (:func:`trained_state`: the adapters; AdamW holds only
their moments): the base is reloaded from the model folder on resume, which ``--resume``
already requires to be the same config.

Invariants
----------
* ``B`` starts at zero, so the first policy is the base exactly; ``A`` starts as peft's
  (Kaiming uniform) but drawn from a generator seeded by ``LoraSpec.seed``, so every
  data-parallel rank (threads share the global RNG) starts from the same adapters.
* Only the adapters require gradients: the optimizer, the gradient sum over data-parallel
  ranks and the clip all see the adapters alone.

``peft`` is the optional ``[lora]`` extra: it is imported inside the functions that need it.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncflow.engines.training import TrainEngine, takes_logits_to_keep

MARK = "_asyncflow_lora"  # attribute of a model with adapters attached: its LoraSpec


@dataclass(frozen=True)
class LoraSpec:
    """The adapters: rank, scale numerator, dropout, target modules (peft's names), init seed."""

    r: int
    alpha: int = 16
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = "all-linear"
    seed: int = 0

    @property
    def scale(self) -> float:
        """What ``B A`` is multiplied by (peft's ``scaling``: ``alpha / r``)."""
        return self.alpha / self.r

    def peft_config(self) -> Any:
        from peft import LoraConfig  # lazy: peft is the optional [lora] extra

        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=targets,
                          bias="none", task_type="CAUSAL_LM")


def attach(model: torch.nn.Module, spec: LoraSpec) -> Any:
    """Inject adapters into ``model`` in place (the rest frozen); the ``PeftModel`` around it."""
    from peft import get_peft_model  # lazy: peft is the optional [lora] extra

    with warnings.catch_warnings():  # (transformers 5 deprecates is_gradient_checkpointing, which peft asks)
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = get_peft_model(model, spec.peft_config())
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for _, a, b in sorted(_adapter_pairs(model), key=lambda t: t[0]):  # (in name order)
            init = torch.empty(a.shape, dtype=a.dtype)
            torch.nn.init.kaiming_uniform_(init, a=math.sqrt(5), generator=gen)  # (peft's init, our generator)
            a.copy_(init)
            b.zero_()
    setattr(model, MARK, spec)
    return peft_model


def _adapter_pairs(model: torch.nn.Module) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(module name, A, B) of every LoRA layer of ``model`` (its default adapter)."""
    out = []
    for name, module in model.named_modules():
        a, b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
        if isinstance(a, torch.nn.ModuleDict) and "default" in a and isinstance(b, torch.nn.ModuleDict):
            wa, wb = a["default"].weight, b["default"].weight
            assert isinstance(wa, torch.Tensor) and isinstance(wb, torch.Tensor)  # (peft's nn.Linear pair)
            out.append((name, wa, wb))
    return out


def lora_of(model: torch.nn.Module) -> LoraSpec | None:
    """The spec of the adapters :func:`attach` put on ``model`` (None: no adapters)."""
    spec = getattr(model, MARK, None)
    return spec if isinstance(spec, LoraSpec) else None


def adapter_tensors(peft_model: Any) -> dict[str, torch.Tensor]:
    """The adapters by the names of peft's adapter file, as tensors sharing the live parameters'
    storage (an optimizer step shows through them)."""
    from peft import get_peft_model_state_dict  # lazy: peft is the optional [lora] extra

    return {k: v.detach() for k, v in get_peft_model_state_dict(peft_model).items()}


class LoraTrainEngine(TrainEngine):
    """A :class:`~asyncflow.engines.training.TrainEngine` over a model with adapters
    (:func:`attach`): it trains the adapters (the only parameters that require gradients) and
    exports only them (module doc)."""

    def __init__(self, peft_model: Any, pad_id: int, **kwargs: Any):
        self.peft = peft_model
        super().__init__(peft_model.get_base_model(), pad_id, **kwargs)
        if self.fsdp:
            raise ValueError("LoRA with FSDP is not supported (model.lora with train.strategy=fsdp)")
        # (found once: peft walks the whole state_dict to find them, ~50 ms on the tiny model)
        self._adapters = adapter_tensors(peft_model)

    @torch.no_grad()
    def export_weights(self) -> dict[str, np.ndarray]:
        """The adapters only (float32 host copies, peft's names): what rollout merges into its base."""
        return {k: v.to("cpu", torch.float32, copy=True).numpy() for k, v in self._adapters.items()}


class BaseView(torch.nn.Module):
    """The frozen base of a LoRA policy without a copy: the policy's model run with its adapters
    off (peft's ``disable_adapter``), for the reference role of the same worker (module doc)."""

    def __init__(self, peft_model: Any):
        super().__init__()
        self.peft = peft_model
        self.config = peft_model.get_base_model().config
        # (token_logprobs asks this of the forward it calls: the base's, through ours)
        self._asyncflow_logits_to_keep = takes_logits_to_keep(peft_model.get_base_model())

    def forward(self, **kwargs: Any) -> Any:
        with self.peft.disable_adapter():
            return self.peft.get_base_model()(**kwargs)


def trained_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps of ``model``: its whole ``state_dict``, or with adapters only they
    (the frozen base comes back from the model folder)."""
    if lora_of(model) is None:
        return model.state_dict()
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def load_trained_state(model: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Put a :func:`trained_state` back; a checkpoint of other adapters (or none) is one line."""
    if lora_of(model) is None:
        model.load_state_dict(dict(weights))
        return
    want = {n for n, p in model.named_parameters() if p.requires_grad}
    if set(weights) != want:
        extra, missing = sorted(set(weights) - want), sorted(want - set(weights))
        raise ValueError(f"the checkpoint's weights are not this model's adapters (missing {missing[:2]}, "
                         f"unexpected {extra[:2]}): resume with the model.lora it was saved with")
    model.load_state_dict(dict(weights), strict=False)


def save_adapter(peft_model: Any, path: str | Path) -> None:
    """A PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``) that
    ``PeftModel.from_pretrained(base, path)`` loads; its ``base_model_name_or_path`` is the
    folder the base was loaded from."""
    peft_model.save_pretrained(str(path))


def write_adapter_folder(path: str | Path, tensors: Mapping[str, np.ndarray], spec: LoraSpec, base: str) -> None:
    """The PEFT adapter folder of published adapters (:meth:`LoraTrainEngine.export_weights`: they
    carry the names of peft's file already) on the base in folder ``base``, without a model that
    holds them: what :func:`save_adapter` writes for the trainer's own."""
    from safetensors.numpy import save_file  # (with peft: only a LoRA run writes one)

    config = spec.peft_config()
    config.base_model_name_or_path = base
    config.save_pretrained(str(path))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(Path(path) / "adapter_model.safetensors"))


def save_merged(peft_model: Any, path: str | Path) -> None:
    """A whole model folder with the adapters merged into a copy of the base (peft's
    ``merge_and_unload``); the trained model keeps its adapters."""
    merged = copy.deepcopy(peft_model).merge_and_unload()
    merged.__dict__.pop(MARK, None)  # (a plain model now)
    merged.save_pretrained(str(path))
