"""Transformers' continuous batching (paged KV cache) as an inference engine: ``rollout.engine=hf_paged``.

Design
------
Hugging Face transformers ships continuous batching over a paged KV cache
(``ContinuousBatchingManager``, the engine behind ``model.generate_batch`` and
``transformers serve``; 5.17 on the GPU machines, 5.23 here). It normally decodes in a
background thread; :class:`PagedBackend` drives it step by step from the caller's thread
instead, with the manager's own loop body (``prepare_next_batch``, ``_generation_step``,
``update_batch``). So one ``EngineBatch.step`` is one generation step of the library, the
weights are copied in place between two steps while nothing runs (no ``pause()``, which 5.17
lacks), and CUDA graphs the library captures stay valid (the parameters keep their storage).

The batch protocol is the external adapters' :class:`~asyncflow.engines.adapters.StepBatch`
over this backend: ``add`` submits streaming requests, ``step`` runs one generation step,
``drop``/``drop_all`` cancel, ``recompute_cache`` cancels every live answer and submits it
again with its tokens appended to the prompt (the library prefills them under the new
weights, as the built-in engine's recompute does). ``partials``/``resume`` are not offered: on
a resumed run its answers restart from their prompts, as vLLM's and SGLang's do.

Sampling and log-probs: the library samples from ``softmax(processed logits)`` and, with
``return_logprobs``, reports the sampled token's log-prob under that processed distribution,
from the same forward. Its ``MinNewTokens`` processor is not supported in continuous
batching, so the manager gets one logits processor of ours instead of the library's
(:class:`PolicySampling`): temperature, EOS masked before ``min_new_tokens``, top-p and greedy
in one pass, recording per row ``c = logsumexp(processed) - logsumexp(logits / T)``. For the
sampled token (never masked) ``log_softmax(logits / T)[tok] = reported + c``: the untruncated,
unmasked policy's log-prob that the trainer recomputes and the built-in engine records, with
no second forward.

Invariants and limits
---------------------
* One manager (and one KV cache of ``kv_tokens`` tokens) per distinct (temperature, top_p)
  a batch asks for; the rollout role uses one. The cache is sized by tokens, not by a share
  of free memory, so two engines on one GPU do not fight over it.
* Prefix sharing is off (``allow_block_sharing=False``): cached prefix blocks would outlive a
  weight swap with the old weights' keys and values. Async batching is off: a step's tokens
  are known when ``step`` returns.
* The library switches the model's attention to a paged one (5.17: ``paged|sdpa``, which a
  plain forward rejects), so the engine owns its model: ``rollout.engine=hf_paged`` runs in
  ``stream``/``async`` (the rollout worker's own model copy), and :meth:`HFPagedEngine.close`
  restores the attention for a caller that reuses the model (the benchmarks).
* Without a flash-attention kernel installed the library attends with SDPA over all packed
  keys of the step under a dense mask (cost ~ rows x all cached tokens); with
  ``flash_attn`` it takes its block-table decode path and may capture CUDA graphs.
* ``torch.manual_seed`` is called once by the library when a manager is built (its
  sampling seed, ``seed``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessor,
    ContinuousBatchingLogitsProcessorList,
)
from transformers.generation.logits_process import LogitsProcessorList

from asyncflow.engines.adapters import CHECKSUMS, Loaded, StepBatch, StepEngine, Update
from asyncflow.engines.device import model_device
from asyncflow.engines.inference import load_named_weights
from asyncflow.engines.training import autocast
from asyncflow.engines.types import SamplingParams


class PolicySampling(ContinuousBatchingLogitsProcessor):
    """Temperature, EOS masked before ``min_new_tokens``, top-p and greedy in one logits
    processor of the library's continuous batching; records per row the log-prob correction
    ``c`` (module doc) in :attr:`correction`, row ``i`` being request :attr:`rows` ``[i]``.

    The per-row argument (one int32 a row, the library's storage) is 1 where EOS is masked;
    a request passes ``min_len = len(prompt) + min_new_tokens`` as its processor keyword.
    Temperature and top-p are constants of the manager (captured graphs bake them in)."""

    supported_kwargs: dict[str, type] = {"min_len": int}
    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self, sampling: SamplingParams, eos_id: int, max_rows: int, device: torch.device):
        self.greedy = sampling.temperature <= 0
        self.temperature = 1.0 if self.greedy else float(sampling.temperature)
        self.top_p, self.eos_id = float(sampling.top_p), eos_id
        self.correction = torch.zeros(max_rows, dtype=torch.float32, device=device)  # persistent: graph-safe
        self.rows: list[str] = []

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(0)

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        """Called on the host before each step with the rows that get a token, in row order."""
        self.rows = [fs.state.request_id for fs in requests_with_new_token]
        flags = [int(len(fs.state.initial_tokens) + fs.state.generated_len() < fs.state.logit_processor_kwargs.get(
            "min_len", 0)) for fs in requests_with_new_token]
        return torch.tensor(flags, dtype=torch.int32)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        n = scores.shape[0]
        s = scores / self.temperature
        lse = torch.logsumexp(s, -1)
        s[:, self.eos_id] = torch.where(tensor_arg[:n] > 0, float("-inf"), s[:, self.eos_id])
        if self.top_p < 1.0:  # as the built-in engine: keep the smallest set whose mass reaches top_p
            sorted_s, order = s.sort(-1, descending=True)
            p = sorted_s.softmax(-1)
            sorted_s = sorted_s.masked_fill(p.cumsum(-1) - p > self.top_p, float("-inf"))
            s = torch.full_like(s, float("-inf")).scatter(1, order, sorted_s)
        if self.greedy:
            s = s.masked_fill(s < s.max(-1, keepdim=True).values, float("-inf"))
        self.correction[:n].copy_(torch.logsumexp(s, -1) - lse)
        return s


def cb_config(**kw: Any) -> ContinuousBatchingConfig:
    """A ``ContinuousBatchingConfig`` from the fields this transformers has: ``page_size`` is
    called ``block_size`` before 5.2x; unknown fields are dropped."""
    names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    if "page_size" in kw and "page_size" not in names:
        kw["block_size"] = kw.pop("page_size")
    return ContinuousBatchingConfig(**{k: v for k, v in kw.items() if k in names})


class PagedBackend:
    """One continuous-batching manager driven step by step (an adapter ``Backend``, module doc)."""

    def __init__(self, model: Any, sampling: SamplingParams, eos_id: int, max_batch: int, kv_tokens: int,
                 page_size: int, seed: int, dtype: str):
        self.model, self.eos_id, self.dtype = model, eos_id, dtype
        self.device = model_device(model)
        gen = GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, eos_token_id=eos_id,
                               max_new_tokens=sampling.max_new_tokens)
        cfg = cb_config(return_logprobs=True, num_blocks=-(-kv_tokens // page_size), page_size=page_size,
                        max_batch_tokens=max(max_batch, 512), max_requests_per_batch=max_batch,
                        allow_block_sharing=False, use_async_batching=False, seed=seed,
                        auto_switch_to_flash=True, per_request_processors=False)
        self.manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cfg)
        self.policy = PolicySampling(sampling, eos_id, max(max_batch, 512) + 1, self.device)
        procs = ContinuousBatchingLogitsProcessorList(LogitsProcessorList([self.policy]), per_request_processors=False)
        procs.tensors_required = 1  # (counted by the library only for its own per-request processors)
        self.manager.logit_processor = procs
        self.processor = self.manager._create_batch_processor()
        self.manager.batch_processor = self.processor
        self.logprobs: dict[str, list[float]] = {}  # per live request: the corrected log-probs so far

    def submit(self, rid: str, prompt_ids: list[int], max_tokens: int, min_tokens: int,
               sampling: SamplingParams) -> None:
        self.logprobs[rid] = []
        self.manager.add_request(list(prompt_ids), request_id=rid, max_new_tokens=max_tokens, streaming=True,
                                 eos_token_id=self.eos_id, min_len=len(prompt_ids) + min_tokens)

    def abort(self, rids: Sequence[str]) -> None:
        for rid in rids:
            self.manager.cancel_request(rid)
            self.logprobs.pop(rid, None)

    @torch.no_grad()
    def poll(self) -> list[Update]:
        """One generation step of the library; an update for every request that moved."""
        if not self.processor.prepare_next_batch():  # (also takes in new requests and cancellations)
            return []
        with autocast(self.dtype, self.device):
            self.processor._generation_step(self.model)
        self.processor.update_batch()
        corr = dict(zip(self.policy.rows, self.policy.correction[: len(self.policy.rows)].tolist()))
        out = []
        queue = self.manager.output_router.output_queue
        while not queue.empty():
            o = queue.get_nowait()
            if o.error is not None:
                raise RuntimeError(f"transformers continuous batching failed request {o.request_id}: {o.error}")
            lps = self.logprobs.get(o.request_id)
            if lps is None:  # cancelled since
                continue
            lps += [lp + corr.get(o.request_id, 0.0) for lp in o.logprobs[len(lps):len(o.generated_tokens)]]
            done = bool(o.is_finished())
            out.append(Update(o.request_id, list(o.generated_tokens), list(lps), done, None))
            if done:
                del self.logprobs[o.request_id]
        return out

    def load(self, weights: list[tuple[str, Any]]) -> Loaded:
        load_named_weights(self.model, dict(weights))
        return Loaded("in place")


class HFPagedEngine(StepEngine):
    """The engine protocol over transformers' continuous batching (module doc). ``kv_tokens``:
    the paged cache's capacity in tokens (default: ``max_batch`` rows of up to 4,096 tokens or
    the model's context); ``dtype``: ``bfloat16`` runs each step under bf16 autocast."""

    def __init__(self, model: Any, eos_id: int, pad_id: int = 0, max_batch: int = 64, seed: int = 0,
                 dtype: str = "float32", kv_tokens: int | None = None, page_size: int = 32):
        super().__init__(None, eos_id, max_batch)  # type: ignore[arg-type]  # (a backend per sampling, below)
        self.model, self.pad_id, self.seed, self.dtype, self.page_size = model.eval(), pad_id, seed, dtype, page_size
        ctx = int(getattr(model.config, "max_position_embeddings", 4096) or 4096)
        self.kv_tokens = kv_tokens or max_batch * min(ctx, 4096)
        self.backends: dict[tuple[float, float], PagedBackend] = {}
        self._shells: dict[tuple[float, float], StepEngine] = {}  # one per backend: routes its updates

    def new_batch(self, sampling: SamplingParams) -> StepBatch:
        key = (sampling.temperature, sampling.top_p)
        if key not in self.backends:
            self.backends[key] = PagedBackend(self.model, sampling, self.eos_id, self.max_batch, self.kv_tokens,
                                              self.page_size, self.seed, self.dtype)
            self._shells[key] = StepEngine(self.backends[key], self.eos_id, self.max_batch)
        return StepBatch(self._shells[key], sampling, self.version)

    def load_weights(self, version: int, tensors: Mapping[str, Any]) -> None:
        """Copy host buffers into the parameters in place (between two steps) and set ``version``."""
        load_named_weights(self.model, {k: v for k, v in tensors.items() if k != CHECKSUMS})
        self.load_path = "in place"
        self.version = version

    def close(self) -> None:
        """Give the model back its own attention implementation (the library switched it)."""
        for b in self.backends.values():
            original = getattr(b.manager, "_original_attn_impl", None)
            if original is not None:
                self.model.set_attn_implementation(original)
                b.manager._original_attn_impl = None
        self.backends.clear()
        self._shells.clear()
