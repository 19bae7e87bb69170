"""Built-in inference engine: any Hugging Face causal LM, continuous batching on preallocated slots.

Design
------
:class:`InferenceEngine` is the :class:`~asyncflow.engines.types.Engine` the rollout role
drives. Its batches decode on **slots** (:class:`~asyncflow.engines.slot_batch.SlotBatch`):

* a KV cache preallocated once per batch (``[slots, kv_heads, capacity, head_dim]`` per layer,
  :mod:`asyncflow.engines.slot_cache`), written in place: a finished row's slot is refilled
  without moving any other row; the model writes into it through the transformers ``Cache``
  API, with per-row ``position_ids``, a 4-D per-slot attention mask and our SDPA attention
  function (grouped heads read each cached key once);
* the whole decode step (embedding, every layer, logits, sampling, log-prob, each row's stop
  check: EOS, ``stop_ids``, ``min_new_tokens``/``max_new_tokens``) on the model's device for
  every live row at once, tokens, log-probs and stop codes copied to the host as one small
  tensor per step (:mod:`asyncflow.engines.slot_step`);
* on CUDA the step is replayed from CUDA graphs, one per batch-size/length bucket
  (:mod:`asyncflow.engines.slot_graphs`; ``cuda_graphs=False`` runs it eagerly); weights are
  swapped **in place** (:func:`load_named_weights`), so the graphs stay valid across the
  delayed parameter update;
* a GRPO group (requests with the same prompt in one ``add``) is prefilled once, its prompt's
  keys/values forked into the group's slots;
* multi-turn: ``keep``/``extend``/``release``/``stop_ids``
  (:class:`~asyncflow.engines.types.MultiTurnBatch`).

``path="reference"`` (or a model the slots cannot drive: no Hugging Face config, sliding-window
layers) uses :class:`~asyncflow.engines.reference.GenerationBatch`, the former right-aligned
``DynamicCache`` path, which the slot path is tested against: same tokens and log-probs under
one seed. ``generate`` is a whole-list call on top of a batch (sync mode, evaluation).

The floor of a decode step of the 0.5B shape (what the hardware cannot beat: 0.99 GB of bf16
weights and the live tokens' KV, 12 KiB each, read once; ~0.43 ms at 256 answers on an H200)
and what this path moves beyond it (every row reads the longest live row's columns; float32
sampling passes over the vocabulary) are counted in docs/benchmarks.md ("The prepared GPU
command").

Invariants
----------
* The log-prob recorded for a sampled token is ``log_softmax(logits / temperature)`` at that
  token, under the weights that sampled it: the quantity the training engine recomputes.
* Every generated token records the batch ``version`` that sampled it; ``Completion.version``
  is the oldest of them.
* ``dtype="bfloat16"`` runs the forwards under bf16 autocast (the KV cache is then bf16);
  sampling and log-probs use float32 logits. A model whose parameters are bf16 already (a
  rollout-only copy) needs no autocast.
* Random draws come from one generator seeded with ``seed`` (on the host for the slot path:
  the GPU's draws are uniform numbers drawn ahead on the host, the same stream as the CPU's
  inverse-CDF sampler).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import numpy as np
import torch

from asyncflow.engines.device import model_device
from asyncflow.engines.reference import GenerationBatch, sample_tokens, token_logprob
from asyncflow.engines.slot_batch import SlotBatch, SlotPool
from asyncflow.engines.slot_step import attention_configs
from asyncflow.engines.types import Completion, Partial, Request, SamplingParams

__all__ = ["Completion", "GenerationBatch", "InferenceEngine", "Partial", "Request", "SamplingParams", "SlotBatch",
           "load_named_weights", "sample_tokens", "token_logprob"]


class InferenceEngine:
    """Inference over a Hugging Face causal LM (the built-in engine; see the module doc).

    ``generate`` runs a list of requests with continuous batching (at most ``max_batch``
    rows decode at once; a finished row's slot is refilled at the next step).
    ``load_weights`` swaps in host buffers tagged with a policy version.
    """

    def __init__(self, model: torch.nn.Module, eos_id: int, pad_id: int, max_batch: int = 64,
                 seed: int = 0, dtype: str = "float32", cuda_graphs: bool = True,
                 path: Literal["slots", "reference"] = "slots"):
        self.model = model.eval()
        self.dtype = dtype
        self.eos_id, self.pad_id = eos_id, pad_id
        self.max_batch = max_batch
        self.version = 0
        self.cuda_graphs = cuda_graphs
        self.path = path if attention_configs(model) is not None else "reference"
        device = model_device(model) if self.path == "reference" else torch.device("cpu")
        self.generator = torch.Generator(device).manual_seed(seed)
        self._pools: list[SlotPool] = []  # device resources of closed batches, for the next one
        self.busy_slots = 0  # accumulated rows decoded (for slot-utilisation metrics)
        self.total_slots = 0

    def new_batch(self, sampling: SamplingParams) -> GenerationBatch | SlotBatch:
        if self.path == "reference":
            b = GenerationBatch(self.model, self.eos_id, self.pad_id, sampling, self.generator, self.dtype)
            b.version = self.version
            return b
        pool = self._pools.pop() if self._pools else SlotPool(
            self.model, self.max_batch, self.eos_id, self.pad_id, self.dtype, self.generator,
            cuda_graphs=self.cuda_graphs)
        return SlotBatch(pool, sampling, self.version, on_close=self._pools.append)

    def generate(self, requests: Iterable[Request], sampling: SamplingParams,
                 on_done: Callable[[Completion], None] | None = None) -> list[Completion]:
        """Generate all ``requests`` with continuous batching; results in completion order."""
        pending = deque(requests)
        batch = self.new_batch(sampling)
        results: list[Completion] = []

        def emit(done: list[Completion]) -> None:
            results.extend(done)
            if on_done:
                for c in done:
                    on_done(c)

        try:
            while pending or len(batch):
                free = self.max_batch - len(batch)
                if free and pending:
                    emit(batch.add([pending.popleft() for _ in range(min(free, len(pending)))]))
                if len(batch):
                    self.busy_slots += len(batch)
                    self.total_slots += self.max_batch
                    emit(batch.step())
        finally:
            if isinstance(batch, SlotBatch):
                batch.close()
        return results

    @torch.no_grad()
    def load_weights(self, version: int, tensors: Mapping[str, np.ndarray | torch.Tensor]) -> None:
        load_named_weights(self.model, tensors)
        self.version = version


@torch.no_grad()
def load_named_weights(model: torch.nn.Module, tensors: Mapping[str, Any]) -> None:
    """Copy ``tensors`` (numpy or torch, by parameter name) into ``model``'s parameters, in
    place (each parameter keeps its storage, dtype and device: captured CUDA graphs stay valid).

    Every parameter must be present with the right shape; otherwise nothing is changed.
    """
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(tensors))
    if missing:
        raise ValueError(f"weights are missing {len(missing)} parameters, e.g. {missing[:3]}")
    converted = {}
    for name, p in params.items():
        t = tensors[name]
        t = torch.from_numpy(np.asarray(t)) if not isinstance(t, torch.Tensor) else t
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"weight '{name}' has shape {tuple(t.shape)}, model expects {tuple(p.shape)}")
        converted[name] = t
    for name, p in params.items():
        p.copy_(converted[name])
