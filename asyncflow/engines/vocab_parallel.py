"""Log-probs from vocabulary-parallel logits without gathering them (``train.tp``).

Under tensor parallelism the LM head leaves each rank the logits of its slice of the
vocabulary: a ``Shard(-1)`` DTensor (:mod:`asyncflow.engines.tensor_parallel`). The loss needs
``log p(token) = z_token - logsumexp(z)`` of the sampled tokens (and the entropy
``logsumexp(z) - sum_v p_v z_v``), which :func:`vocab_parallel_logprobs` takes from the
shards with three all-reduces of ``[B, R]`` numbers, never a ``[B, R, V]`` one:

* the max over the vocabulary (``MAX``; no gradient: it only keeps ``exp`` in range);
* ``sum_v exp(z_v - max)`` (``SUM``), hence ``logsumexp``;
* the sampled token's logit, which one rank holds and the others count as 0 (``SUM``); with
  entropy also ``sum_v exp(z_v - lse) z_v`` (``SUM``).

Those sums go through :class:`_SumOverRanks`: all-reduce forward, identity backward. Every
rank then holds the same loss and back-propagates it itself, so the gradient reaching a
rank's partial sum is already the whole gradient (Megatron's "reduce from the model-parallel
region"; ``torch.distributed.nn.all_reduce`` would sum the gradient over ranks as well, ``tp``
times too much). That holds only while each partial sum is a function of the rank's own shard:
a partial sum that also read a reduced value (``sum_v p_v z_v`` with ``p_v = exp(z_v - lse)``)
would send that value only this rank's share of its gradient, so the entropy's sum is taken as
``sum_v exp(z_v - max) z_v``, divided by the reduced ``sum_v exp(z_v - max)`` afterwards.
torch's ``loss_parallel`` does the same for cross-entropy only; the policy loss needs the
per-token log-probs themselves.

The whole weights reach rollout gathered bucket by bucket:
:func:`asyncflow.engines.collective.full_buckets`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) over ``group`` forward; identity backward (module doc)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _vocab_slice(logits: DTensor) -> tuple[int, int]:
    """(first id, count) of the vocabulary this rank's shard of ``logits`` holds."""
    if len(logits.placements) != 1 or logits.placements[0] != Shard(logits.ndim - 1):
        raise ValueError(f"vocabulary-parallel logits must be Shard(-1) on a 1-D mesh, got {logits.placements}")
    mesh = logits.device_mesh
    vocab, n, rank = logits.shape[-1], mesh.size(), mesh.get_local_rank()
    size = -(-vocab // n)  # torch.chunk's split: equal shards, the last ones shorter
    start = min(rank * size, vocab)
    return start, logits.to_local().shape[-1]


def vocab_parallel_logprobs(logits: DTensor, index: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                            entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token ``log_softmax(logits / temperature)`` at ``targets`` (``[B, R]``), and the entropy of
    each position's distribution (``[B, R]``, or ``None``), from ``[B, T, V]`` logits sharded by
    vocabulary: positions ``index`` (``[B, R]``, into ``T``) are picked from the local shard first."""
    start, count = _vocab_slice(logits)
    group = logits.device_mesh.get_group()
    local = logits.to_local()
    z = local.gather(1, index[:, :, None].expand(-1, -1, count)).float()  # [B, R, V / tp]
    if temperature > 0 and temperature != 1.0:
        z = z / temperature
    top = z.detach().amax(-1)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    e = (z - top[:, :, None]).exp()
    total = _SumOverRanks.apply(e.sum(-1), group)
    lse = top + total.log()
    mine = (targets >= start) & (targets < start + count)
    at = (targets - start).clamp(0, count - 1)
    picked = z.gather(2, at[:, :, None])[:, :, 0] * mine
    logp = _SumOverRanks.apply(picked, group) - lse
    if not entropy:
        return logp, None
    # sum_v p_v z_v = sum_v e_v z_v / total: the sum's terms from this rank's shard alone (module doc)
    return logp, lse - _SumOverRanks.apply((e * z).sum(-1), group) / total


def sharded_logprobs(logits: DTensor, index: torch.Tensor, batch: Any, temperature: float,
                     entropy: bool) -> torch.Tensor:
    """:func:`~asyncflow.engines.training.token_logprobs` on vocabulary-parallel logits: the ``[B, R]``
    log-probs of ``batch.targets``, 0 where ``batch.mask`` is (with ``entropy`` also ``batch.entropy``)."""
    logp, ent = vocab_parallel_logprobs(logits, index, batch.targets, temperature, entropy)
    if ent is not None:
        batch.entropy = ent * batch.mask
    return logp * batch.mask
