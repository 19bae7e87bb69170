"""Built-in training engine: per-token log-probs and optimizer steps on a HF causal LM.

Protocol (:class:`TrainingEngine`, what roles call; an engine never knows which algorithm runs):

* ``logprobs(prompts, responses) -> list[np.ndarray]``: per response token, under
  ``log_softmax(logits / temperature)`` (the quantity the inference engine records);
* ``forward_backward(prompts, responses, extras, loss_fn) -> metrics``: accumulates
  gradients of one micro-batch; the loss function receives per-token tensors (and
  ``batch.entropy``, the per-token entropy, when it sets ``needs_entropy``) and returns a
  scalar already normalised for the whole step (so accumulation over micro-batches equals
  one big batch);
* ``optimizer_step(grad_scale=1.0) -> metrics``: scale, clip, step, zero grads, bump the policy version;
* ``export_weights() -> dict[str, np.ndarray]``: host copies of every parameter.

:class:`TrainEngine` implements it (the actor's and the reference's engine). The critic's
:class:`~asyncflow.engines.critic.CriticEngine` shares the optimizer half
(``forward_backward``, ``optimizer_step``, ``export_weights``) but is not a
``TrainingEngine``: a value model has no log-probs (its ``logprobs`` raises ``TypeError``;
``values`` takes its place).

Sequences are packed right-padded in one tensor; response tokens are located by the
prompt length of each row, so ragged prompts and responses need no extra bookkeeping.

Token-budget micro-batches (dynamic batch size, ``max_tokens_per_micro``): the rows one
call receives are sorted by length (longest first) and packed greedily into chunks whose
*padded* size ``rows x longest row`` stays within the budget (:func:`token_budget_split`);
a row longer than the budget gets a chunk of its own. Each chunk is one forward/backward.
This is exact: every loss normalises by the step's totals (sequences, or tokens through
``grad_scale``), never by the chunk's, so the summed gradient of the chunks equals one
forward/backward over all rows (tested for every ``loss_agg``). Streaming granularity (how
many groups the actor fetches at once) and compute granularity (the budget) are thus
independent: a micro-batch of long answers runs as several small chunks.

Padding split (``split_padding``, without a budget): a micro-batch is cut, longest rows
first, only where a cut saves that many padded tokens (:func:`padding_split`), so a few long
answers among short ones no longer pad every row to their length, and similar rows stay
one pass. Exact for the same reason.

Passes of a fixed row count (``rows_per_pass``, without a budget; instead of the padding split):
a call's rows sorted by length, longest first, and cut into passes of at most that many rows
(:func:`~asyncflow.engines.passes.length_sorted_split`). A caller that has a whole step's
rows in hand (``sync``) hands them over in one call and gets passes of similar lengths (256
warm-start answers in passes of 32: 2,400 tokens run instead of 2,560 in arrival order, 2,351
of them real; 0.93x the thread CPU). Exact for the same reason. Not with FSDP (ranks must
run the same passes).

Background readers (``defer_updates``): a checkpoint's host copy of the weights and AdamW's
state runs beside the next step (:mod:`asyncflow.workflow.hostcopy`); ``optimizer_step``, the
first in-place change of either after a step boundary, waits for it first (gradients are not
read by it: ``forward_backward`` need not wait) and reports the wait (``checkpoint_wait_s``).

Precision (``dtype``): ``float32``, or ``bfloat16`` as mixed precision: the parameters,
their gradients and the AdamW states stay float32 (master weights), the forward runs under
``torch.autocast(bfloat16)``, and log-softmax is taken in float32. Exported weights are
float32; an inference engine casts them to its own precision.

Memory (``logprob_chunk_mib``): a pass whose float32 logits ``[B, R, V]`` would exceed that
many MiB runs the LM head in chunks of that size, recomputed in backward
(:mod:`asyncflow.engines.logprobs`), so its peak does not grow with ``tokens x vocabulary``.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F

from asyncflow.engines.collective import Collective, all_reduce_buckets
from asyncflow.engines.device import model_device
from asyncflow.engines.logprobs import chunked_pass
from asyncflow.engines.passes import length_sorted_split, merge_metrics, padding_split, take_rows, token_budget_split


@dataclass
class TokenBatch:
    """Right-padded packed sequences with a response mask.

    ``logp`` and friends have shape ``[B, R]`` where R is the longest response; entry
    ``[i, j]`` is response token j of row i, valid where ``mask[i, j]``.
    """

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    prompt_lens: list[int]
    response_lens: list[int]
    targets: torch.Tensor  # [B, R] response token ids (0 where padded)
    mask: torch.Tensor  # [B, R] float
    entropy: torch.Tensor | None = None  # [B, R] per-token entropy, set when the loss asks for it

    @staticmethod
    def build(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int,
              device: torch.device | str = "cpu") -> TokenBatch:
        """Padded on the host, then copied to ``device`` (the model's) in one go per tensor.

        A row's last token is a target only (no position reads the logits after it), so the
        input holds ``prompt + response[:-1]``: ``L = max(len(prompt) + len(response) - 1)``
        (one token a row fewer to run forward and backward, the same log-probs)."""
        B = len(prompts)
        plen = [len(p) for p in prompts]
        rlen = [len(r) for r in responses]
        L = max([p + max(r, 1) - 1 for p, r in zip(plen, rlen)] + [1])
        R = max(rlen) if rlen else 0
        ids = torch.full((B, L), pad_id, dtype=torch.long)
        att = torch.zeros((B, L), dtype=torch.long)
        targets = torch.zeros((B, R), dtype=torch.long)
        mask = torch.zeros((B, R), dtype=torch.float32)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            seq = (list(p) + list(r))[:L]
            ids[i, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
            att[i, : len(seq)] = 1
            targets[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
            mask[i, : len(r)] = 1.0
        return TokenBatch(ids.to(device), att.to(device), plen, rlen, targets.to(device), mask.to(device))

    def gather_index(self) -> torch.Tensor:
        """Index into the time axis of logits predicting each response token: [B, R]."""
        R = self.targets.shape[1]
        dev = self.targets.device
        base = torch.as_tensor(self.prompt_lens, dtype=torch.long, device=dev)[:, None] - 1
        idx = base + torch.arange(R, device=dev)[None, :]
        return idx.clamp(max=self.input_ids.shape[1] - 1)


def token_logprobs(model: torch.nn.Module, batch: TokenBatch, temperature: float = 1.0,
                   entropy: bool = False, chunk_mib: float = 0.0) -> torch.Tensor:
    """Per response token log-probs ``[B, R]`` (0 where masked). With ``entropy``, also sets
    ``batch.entropy``: the entropy ``-sum_v p_v log p_v`` of each position's (tempered)
    next-token distribution, differentiable, 0 where masked.

    With ``chunk_mib``, a pass whose float32 ``[B, R, V]`` logits would pass that many MiB
    goes through the LM head in chunks of that size instead, recomputed in backward
    (:mod:`asyncflow.engines.logprobs`; same values and gradients). Otherwise only the
    positions from the shortest prompt's last token on get logits (the model's
    ``logits_to_keep``, where its ``forward`` takes it): the LM head and its backward skip
    the prompt positions, whose logits no loss reads."""
    if chunk_mib > 0:
        got = chunked_pass(model, batch, temperature, entropy, chunk_mib)
        if got is not None:
            return got
    L = batch.input_ids.shape[1]
    kw: dict[str, Any] = {}
    keep = L - min(batch.prompt_lens, default=1) + 1
    if 0 < keep < L and takes_logits_to_keep(model):
        kw["logits_to_keep"] = keep
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False, **kw)
    logits = out.logits
    idx = (batch.gather_index() - (L - logits.shape[1])).clamp(min=0)  # into the kept positions
    if hasattr(logits, "to_local"):  # train.tp: logits sharded by vocabulary (a DTensor), never gathered
        # lazy: only with train.tp > 1 (torch.distributed.tensor takes seconds to import)
        from asyncflow.engines.vocab_parallel import sharded_logprobs
        return sharded_logprobs(logits, idx, batch, temperature, entropy)
    picked = logits.gather(1, idx[:, :, None].expand(-1, -1, logits.shape[-1]))  # [B, R, V]
    if temperature > 0 and temperature != 1.0:
        picked = picked / temperature
    logp_all = F.log_softmax(picked.float(), -1)
    if entropy:
        batch.entropy = -(logp_all.exp() * logp_all).sum(-1) * batch.mask
    logp = logp_all.gather(2, batch.targets[:, :, None])[:, :, 0]
    return logp * batch.mask


def takes_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether ``model.forward`` has a ``logits_to_keep`` parameter (HF causal LMs since 4.50)."""
    cached = getattr(model, "_asyncflow_logits_to_keep", None)
    if cached is None:
        cached = "logits_to_keep" in inspect.signature(model.forward).parameters
        model._asyncflow_logits_to_keep = cached  # type: ignore[assignment]  # (once per model)
    return bool(cached)


def autocast(dtype: str, device: torch.device | str = "cpu") -> contextlib.AbstractContextManager:
    """The forward's precision context: ``bfloat16`` autocast, or nothing for ``float32``."""
    if dtype == "float32":
        return contextlib.nullcontext()
    if dtype != "bfloat16":
        raise ValueError(f"unknown dtype {dtype!r} (known: float32, bfloat16)")
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


def shard(model: torch.nn.Module) -> None:
    """FSDP2 over every rank: each decoder layer, then the root (which keeps the embeddings,
    tied head and final norm). FSDP averages gradients over ranks (a divide factor of 1
    would need ReduceOp.PREMUL_SUM, which gloo lacks): ``optimizer_step`` multiplies by the
    world size to get the sum."""
    from torch.distributed.device_mesh import init_device_mesh  # lazy: only with train.strategy=fsdp
    from torch.distributed.fsdp import fully_shard  # lazy: only with train.strategy=fsdp

    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise RuntimeError("fsdp=True needs torch.distributed initialised (init_process_group) first")
    device = next(model.parameters()).device.type
    mesh = init_device_mesh(device, (torch.distributed.get_world_size(),))
    base = getattr(model, "model", model)
    for layer in getattr(base, "layers", []):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _full(t):
    """A DTensor's full value (FSDP), anything else as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


LossFn = Callable[[torch.Tensor, TokenBatch, dict], tuple[torch.Tensor, dict]]


def lr_multiplier(step: int, total: int, warmup: int = 0, schedule: str = "constant",
                  min_ratio: float = 0.0) -> float:
    """Learning-rate factor at optimizer step ``step`` (0-based): linear warmup over
    ``warmup`` steps, then constant or cosine decay to ``min_ratio`` at step ``total``.

    >>> [round(lr_multiplier(s, 10, warmup=2, schedule="cosine"), 3) for s in (0, 1, 2, 6, 10)]
    [0.5, 1.0, 1.0, 0.5, 0.0]
    """
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@runtime_checkable
class TrainingEngine(Protocol):
    """What the actor and reference roles call on a training engine (see the module doc).

    Invariants (``tests/test_contracts_training.py`` checks each implementation):

    * ``logprobs`` returns one float32 array per response, of that response's length, of
      finite values ``<= 0``; it changes nothing (no gradient, no step);
    * ``forward_backward`` only accumulates gradients: the weights change at
      ``optimizer_step``, which also adds 1 to ``version`` and returns ``grad_norm`` and ``lr``;
    * ``export_weights`` returns host numpy copies by parameter name that, loaded into a
      fresh model of the same architecture
      (:func:`asyncflow.engines.inference.load_named_weights`), give the same ``logprobs``.
    """

    version: int  # optimizer steps taken (the policy version of the weights)

    def logprobs(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Per response token log-probs, one array per response."""

    def forward_backward(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                         extras: dict[str, Any], loss_fn: LossFn) -> dict:
        """Accumulate the gradient of ``loss_fn`` on these rows; their metrics."""

    def optimizer_step(self, grad_scale: float = 1.0) -> dict:
        """Scale, clip, step, zero the gradients, bump ``version``; ``{"grad_norm", "lr"}``."""

    def export_weights(self) -> dict[str, np.ndarray]:
        """Host copies of every parameter, by name."""


class TrainEngine:
    """Training engine over a HF causal LM (AdamW, grad clipping, LR schedule).

    Data parallel: with ``torch.distributed`` initialised (gloo on CPU, NCCL on GPUs),
    each rank runs ``forward_backward`` on its own share of the step and
    ``optimizer_step`` sums the gradients over ranks before clipping, so every rank takes
    the same step as one process on the whole batch would (losses are normalised by the
    step's global batch, hence a sum, not a mean, across ranks). ``collective`` (an
    :mod:`asyncflow.engines.collective` group: processes or threads) replaces the default
    ``torch.distributed`` group for that sum.

    FSDP (``fsdp=True``, torch.distributed initialised): every decoder layer and then the
    root are wrapped with ``fully_shard`` (FSDP2) over all ranks, so each rank keeps 1/N of
    the parameters, gradients and AdamW states; gradients are reduce-scattered (a mean,
    scaled back to the sum above) instead of the all-reduce, and ``export_weights``
    all-gathers full tensors (every rank must call it). Checked on CPU with gloo in torch
    2.13: same weights as one process (tests/test_data_parallel.py).
    """

    def __init__(self, model: torch.nn.Module, pad_id: int, lr: float = 1e-3, weight_decay: float = 0.0,
                 grad_clip: float = 1.0, temperature: float = 1.0, betas: tuple[float, float] = (0.9, 0.99),
                 schedule: Callable[[int], float] | None = None, max_tokens_per_micro: int | None = None,
                 dtype: str = "float32", fsdp: bool = False, collective: Collective | None = None,
                 split_padding: int = 0, rows_per_pass: int | None = None, logprob_chunk_mib: float = 256.0,
                 tensor_parallel: Any = None):
        autocast(dtype)  # validates the name
        self.model = model.float()  # master weights stay float32 (bfloat16 = autocast)
        self.device = model_device(model)  # batches are built there (resources.device)
        self.fsdp, self.collective = fsdp, collective
        if fsdp:
            shard(self.model)
        if tensor_parallel is not None:  # train.tp: every parameter a DTensor (engines/tensor_parallel.py)
            tensor_parallel.apply(self.model)
        self.gathers = fsdp or tensor_parallel is not None  # sharded weights: every rank joins each all-gather
        self.dtype = dtype
        self.max_tokens_per_micro = max_tokens_per_micro
        self.split_padding = 0 if fsdp else split_padding  # FSDP: every rank runs the same passes
        self.rows_per_pass = None if fsdp else rows_per_pass
        self.pad_id = pad_id
        self.temperature = temperature if temperature > 0 else 1.0
        self.logprob_chunk_mib = logprob_chunk_mib  # (see token_logprobs; 0 = never chunk)
        self.grad_clip = grad_clip
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=betas)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, schedule) if schedule else None
        self.version = 0
        self._readers: list[tuple[threading.Event, float]] = []  # (see defer_updates)

    @torch.no_grad()
    def logprobs(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> list[np.ndarray]:
        was_training = self.model.training
        self.model.eval()
        out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(prompts)
        for idx in self._chunks(prompts, responses):
            batch = TokenBatch.build(take_rows(prompts, idx), take_rows(responses, idx), self.pad_id, self.device)
            with autocast(self.dtype, self.device):
                logp = token_logprobs(self.model, batch, self.temperature, chunk_mib=self.logprob_chunk_mib).cpu()
            for j, i in enumerate(idx):
                out[i] = logp[j, : batch.response_lens[j]].float().numpy().astype(np.float32)
        self.model.train(was_training)
        return out

    def _chunks(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> list[list[int]]:
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
        if self.max_tokens_per_micro is None and self.rows_per_pass:
            return length_sorted_split(lengths, self.rows_per_pass)
        if self.max_tokens_per_micro is None and self.split_padding:
            return padding_split(lengths, self.split_padding)
        return token_budget_split(lengths, self.max_tokens_per_micro)

    def _forward(self, batch: TokenBatch, entropy: bool = False) -> torch.Tensor:
        """The per-token ``[B, R]`` quantity the loss sees: log-probs here (a critic: values)."""
        return token_logprobs(self.model, batch, self.temperature, entropy, self.logprob_chunk_mib)

    def forward_backward(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], extras: dict,
                         loss_fn: LossFn) -> dict:
        """Accumulate the gradient of ``loss_fn`` on these rows (one backward per token-budget
        chunk, see module doc); return their metrics. A loss with ``needs_entropy = True`` also
        gets ``batch.entropy`` (per-token entropy)."""
        self.model.train()
        need_entropy = getattr(loss_fn, "needs_entropy", False)
        parts = []
        for idx in self._chunks(prompts, responses):
            batch = TokenBatch.build(take_rows(prompts, idx), take_rows(responses, idx), self.pad_id, self.device)
            with autocast(self.dtype, self.device):
                out = self._forward(batch, need_entropy)
            loss, metrics = loss_fn(out, batch, {k: take_rows(v, idx) for k, v in extras.items()})
            loss.backward()
            parts.append((len(idx), metrics))
        return merge_metrics(parts)

    def optimizer_step(self, grad_scale: float = 1.0) -> dict:
        """Clip, step, zero grads, bump the version. ``grad_scale`` multiplies the accumulated
        gradient first (a loss normalised by a count known only at the end of the step)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.fsdp:  # FSDP reduce-scatters a mean over ranks; the losses want the sum
            grad_scale *= torch.distributed.get_world_size()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # every rank must join every all-reduce
            if grad_scale != 1.0:
                p.grad.mul_(grad_scale)
        if self.collective is not None and not self.fsdp:
            self.collective.all_reduce_sum([p.grad for p in params if p.grad is not None])  # (all set above)
        elif not self.fsdp and torch.distributed.is_available() and torch.distributed.is_initialized():
            all_reduce_buckets([p.grad for p in params if p.grad is not None],  # (all set above)
                               lambda t: torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM))
        norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip)
        lr = self.opt.param_groups[0]["lr"]
        held = self.settle() if self._readers else None  # (only gradients changed so far)
        self.opt.step()
        if self.sched is not None:
            self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.version += 1
        out = {"grad_norm": float(_full(norm)), "lr": lr}
        return out if held is None else {**out, "checkpoint_wait_s": held}

    def defer_updates(self, done: threading.Event, timeout: float) -> None:
        """The next change of the weights or AdamW's state waits for ``done`` first (at most
        ``timeout`` s): a background reader of them, a checkpoint's host copy (module doc)."""
        self._readers.append((done, timeout))

    def settle(self) -> float:
        """Wait for the background readers (:meth:`defer_updates`); the seconds waited."""
        t = time.perf_counter()
        for done, timeout in self._readers:
            if not done.wait(timeout):
                raise TimeoutError(f"a checkpoint's host copy of the weights did not finish within {timeout:.0f} s")
        self._readers.clear()
        return time.perf_counter() - t

    @torch.no_grad()
    def export_weights(self) -> dict[str, np.ndarray]:
        """Host copies of every parameter (tied weights appear once), as numpy buffers."""
        return {n: _full(p).detach().to("cpu", copy=True).numpy() for n, p in self.model.named_parameters()}
