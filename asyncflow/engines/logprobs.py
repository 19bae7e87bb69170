"""Per-token log-probs and entropy of response tokens, computed through the LM head in chunks
of tokens: training memory that does not grow with ``tokens x vocabulary``.

Why
---
The plain pass (:func:`asyncflow.engines.training.token_logprobs` without a chunk) asks the
model for the logits of every response position, ``[B, R, V]``, takes a float32
``log_softmax`` of them and keeps both for backward; with a 151,936-entry vocabulary and
16,384 tokens a pass that is ~10 GB each, plus their gradients (the 73 GiB peak of the 0.5B
model in docs/benchmarks.md). Here the decoder runs without its head
(``model.base_model(...).last_hidden_state``), the hidden states of the valid response
tokens are gathered (``[N, H]``, ``N`` the real tokens, not the padded ``B x R``), and
:class:`ChunkedHeadLogprobs` applies ``lm_head`` + temperature + log-softmax + gather (and
the entropy) ``chunk`` tokens at a time:

* forward: per chunk ``z = (h W^T) / T`` in float32, ``lse = logsumexp(z)``,
  ``logp = z[target] - lse``, ``H = lse - sum(softmax(z) * z)``; only ``[N]`` vectors
  (``lse``, ``H``) are saved besides the inputs (the hidden states, already alive as an
  activation, and the weight, a parameter);
* backward: per chunk ``z`` and ``p = softmax(z)`` are recomputed and
  ``dz = g_logp (onehot - p) - g_H p (log p + H)``; ``dh = dz W / T`` and
  ``dW += dz^T h / T`` (float32 accumulator). Peak: a few ``[chunk, V]`` float32 tensors,
  whatever the micro-batch. The price: the head's matmul runs once more per token
  (``2 V H`` FLOPs, ~9% of a 0.5B Qwen2's training FLOPs, whose head is 136M of 494M parameters).

Torch 2.13 has ``F.linear_cross_entropy`` with chunking, but it returns no entropy (the
entropy bonus needs it) and the GPU machines this project is measured on run torch 2.11,
which has no such function; transformers has none. So this is ours, ~100 lines, tested
against the plain pass (values and gradients, float32 1e-5).

Invariants
----------
* Same quantity as the plain pass: ``log_softmax(logits / T)[target]`` (T = 1 when
  ``temperature <= 0``), entropy of that tempered distribution; 0 at masked positions.
* Precision follows autocast: under ``torch.autocast(bfloat16)`` the two matmuls of each
  chunk run in bf16 (as the autocast ``lm_head`` would), softmax and the rest in float32,
  and the weight gradient is accumulated in float32 (the master weights' dtype).
* Tied embeddings need nothing special: the head weight *is* the embedding parameter, and
  autograd adds this function's gradient to the embedding lookup's.
* :func:`head_parts` takes a model apart only when that is exactly what its ``forward``
  does: a Hugging Face ``PreTrainedModel`` with a distinct ``base_model``, a bias-free
  ``nn.Linear`` output embedding, no logit soft-capping or scaling, and no DTensor
  parameters (FSDP, tensor parallelism: their hooks live on the root module's forward).
  Anything else (a LoRA wrapper, a test double) returns ``None`` and takes the plain pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel


class ResponseBatch(Protocol):
    """What :func:`chunked_pass` reads of a batch (:class:`asyncflow.engines.training.TokenBatch`)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    entropy: torch.Tensor | None

    def gather_index(self) -> torch.Tensor: ...


def head_parts(model: torch.nn.Module) -> tuple[Callable[..., Any], torch.Tensor] | None:
    """``(decoder, head weight)`` of a plain Hugging Face causal LM, else ``None`` (module doc)."""
    if not isinstance(model, PreTrainedModel):
        return None
    base = getattr(model, "base_model", None)
    head = model.get_output_embeddings()
    if base is None or base is model or not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return None
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None) not in (None, 1, 1.0):
        return None
    if any(hasattr(p, "full_tensor") for p in model.parameters()):  # DTensor: FSDP / TP own the forward
        return None
    return base, head.weight


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The matmul dtype the LM head would use here: autocast's when it is on, else the weight's."""
    dev = t.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else t.dtype


class ChunkedHeadLogprobs(torch.autograd.Function):
    """``(logp [N], entropy [N])`` of ``targets`` under ``softmax(hidden @ weight.T / T)``,
    ``chunk`` rows at a time, recomputed in backward (module doc). ``temperature`` is the
    divisor itself (1.0 for none)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                temperature: float, chunk: int, dtype: torch.dtype, entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=torch.float32)
        ent, lse = torch.zeros_like(logp), torch.empty_like(logp)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for s in range(0, n, chunk):
                z = (hidden[s:s + chunk].to(dtype) @ w.t()).float().div_(temperature)
                lse[s:s + chunk] = torch.logsumexp(z, -1)
                logp[s:s + chunk] = z.gather(1, targets[s:s + chunk, None])[:, 0] - lse[s:s + chunk]
                if entropy:  # H = -sum p log p = lse - sum p z
                    p = (z - lse[s:s + chunk, None]).exp_()
                    ent[s:s + chunk] = lse[s:s + chunk] - torch.linalg.vecdot(p, z)
        ctx.set_materialize_grads(False)  # an unused output (the entropy) gets None, not zeros, in backward
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.temperature, ctx.chunk, ctx.dtype = temperature, chunk, dtype
        return logp, ent

    @staticmethod
    def backward(ctx: Any, g_logp: torch.Tensor | None,
                 g_ent: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_h = torch.zeros_like(hidden) if want_h else None
        g_w = torch.zeros_like(weight, dtype=torch.float32) if want_w else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(ctx.dtype)
            for s in range(0, hidden.shape[0], ctx.chunk):
                dz = _dlogits(hidden[s:s + ctx.chunk].to(ctx.dtype) @ w.t(), ctx.temperature, targets[s:s + ctx.chunk],
                              lse[s:s + ctx.chunk], ent[s:s + ctx.chunk],
                              None if g_logp is None else g_logp[s:s + ctx.chunk],
                              None if g_ent is None else g_ent[s:s + ctx.chunk]).to(ctx.dtype)
                if g_h is not None:
                    g_h[s:s + ctx.chunk] = dz @ w
                if g_w is not None and ctx.dtype == torch.float32:
                    g_w.addmm_(dz.t(), hidden[s:s + ctx.chunk])  # (no [V, H] temporary)
                elif g_w is not None:
                    g_w += (dz.t() @ hidden[s:s + ctx.chunk].to(ctx.dtype)).float()
        return g_h, None if g_w is None else g_w.to(weight.dtype), None, None, None, None, None


def _dlogits(raw: torch.Tensor, temperature: float, targets: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor,
             g_logp: torch.Tensor | None, g_ent: torch.Tensor | None) -> torch.Tensor:
    """Gradient w.r.t. one chunk's raw logits ``raw = h W^T`` (float32 ``[c, V]``):
    d logp_t / dz = onehot(t) - p and dH / dz = -p (log p + H), then through ``z = raw / T``."""
    z = raw.float().div_(temperature)
    logp_all = z.sub_(lse[:, None])  # (in place: z is not needed any more)
    p = logp_all.exp()
    if g_ent is not None:  # -g_H p (log p + H), in logp_all's memory
        dz = logp_all.add_(ent[:, None]).mul_(p).mul_(-g_ent[:, None])
    else:
        dz = logp_all.zero_()
    if g_logp is not None:
        dz.sub_(p.mul_(g_logp[:, None]))
        dz.scatter_add_(1, targets[:, None], g_logp[:, None])
    return dz.div_(temperature)


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                     chunk: int, entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies ``[N]`` of ``targets`` ``[N]`` under ``softmax(hidden @ weight.T / T)``
    (``hidden`` ``[N, H]``), ``chunk`` tokens at a time (:class:`ChunkedHeadLogprobs`); without
    ``entropy`` the entropies are zeros (and cost nothing)."""
    t = temperature if temperature > 0 else 1.0
    return ChunkedHeadLogprobs.apply(hidden, weight, targets, float(t), max(1, int(chunk)),
                                     _compute_dtype(weight), entropy)


def chunked_pass(model: torch.nn.Module, batch: ResponseBatch, temperature: float, entropy: bool,
                 chunk_mib: float) -> torch.Tensor | None:
    """:func:`~asyncflow.engines.training.token_logprobs` chunk by chunk: the ``[B, R]`` log-probs
    (float32, 0 where ``batch.mask`` is; with ``entropy`` also ``batch.entropy``) when the pass's
    float32 ``[B, R, V]`` logits would exceed ``chunk_mib`` MiB and the model can be taken apart
    (:func:`head_parts`), in chunks of that size; ``None`` otherwise (the caller takes the plain pass)."""
    parts = head_parts(model)
    if parts is None:
        return None
    decoder, weight = parts
    chunk = int(chunk_mib * 2**20 / (4 * weight.shape[0]))
    if batch.mask.numel() <= chunk:
        return None
    hidden = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).last_hidden_state
    rows, cols = batch.mask.nonzero(as_tuple=True)  # the real response tokens only, not the padded B x R
    logp, ent = chunked_logprobs(hidden[rows, batch.gather_index()[rows, cols]], weight, batch.targets[rows, cols],
                                 temperature, max(chunk, 1), entropy)
    zeros = torch.zeros(batch.mask.shape, dtype=torch.float32, device=batch.mask.device)
    if entropy:
        batch.entropy = zeros.index_put((rows, cols), ent)
    return zeros.index_put((rows, cols), logp)
