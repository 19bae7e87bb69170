"""Collectives of a data-parallel trainer: the few operations its ranks exchange.

A data-parallel trainer of ``world`` ranks needs three things from its group:

* ``all_reduce_sum(tensors)``: every rank ends with the element-wise sum over ranks
  (gradients, before clipping);
* ``broadcast(obj)``: rank 0's picklable ``obj`` on every rank (the rows of a micro-batch);
* ``barrier()``: nobody returns before everybody arrived (before freeing a step's rows).

Two implementations with the same methods:

* :class:`TorchGroup`: ranks are processes joined by ``torch.distributed`` (gloo on CPU)
  at a TCP rendezvous (``tcp://host:port``, a free port chosen by rank 0's process:
  :func:`free_address`). Gradients use the default group; broadcasts and barriers use a
  second gloo group, because they are issued from the trainer's prefetch thread while
  gradients are reduced on its compute thread, and the ops of one group must be issued in
  the same order on every rank (one thread per group guarantees that).
* :class:`ThreadGroup`: ranks are threads of one process (the in-process launcher), sharing
  a :class:`ThreadRendezvous`. The sum is taken in rank order, so every rank gets the
  bit-identical result. ``abort()`` breaks its barriers (a failed rank must not leave
  the others waiting forever).

Gradient sums travel in buckets (:func:`all_reduce_buckets`): the tensors, in order, are
flattened into as few contiguous buffers of one dtype and device as fit ``bucket_bytes``
(32 MiB) each, one all-reduce a buffer, then copied back. One sum per parameter cost a
round trip each (26 per step on the tiny model; gloo's TCP thread then used ~8% of the
compute thread's CPU); element-wise sums are the same numbers either way.

Sharded weights (FSDP, tensor parallel: DTensors) leave the trainer whole, bucket by bucket
(:func:`full_buckets`): each bucket's shards all-gathered, copied to the host and handed on
before the next bucket is gathered, so no rank holds more than one bucket of gathered weights.

Invariant (both): the ops of one *channel* (gradients, control) are called in the same
order by every rank; a rank that deviates blocks the others until ``timeout_s``.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist


class Collective(Protocol):
    rank: int  # this process among the group's
    world: int
    shard: int  # the rows this rank trains: shard `shard` of `shards` (rank and world, but on a
    shards: int  # (dp, tp) mesh the tp ranks of one dp index train one shard: tensor_parallel.MeshGroup)

    def all_reduce_sum(self, tensors: Sequence[torch.Tensor]) -> None: ...
    def broadcast(self, obj: Any) -> Any: ...
    def barrier(self) -> None: ...
    def abort(self) -> None: ...


BUCKET_BYTES = 32 << 20


def buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> list[list[int]]:
    """Indices of ``tensors`` in consecutive groups of one dtype and device, each at most
    ``bucket_bytes`` (a tensor larger than that is a group of its own).

    >>> f = lambda n: torch.zeros(n)  # float32: 4 bytes an element
    >>> buckets([f(2), f(2), f(4), torch.zeros(1, dtype=torch.int64), f(1)], bucket_bytes=16)
    [[0, 1], [2], [3], [4]]
    """
    out: list[list[int]] = []
    size, key = 0, None
    for i, t in enumerate(tensors):
        n = t.numel() * t.element_size()
        k = (t.dtype, t.device)
        if out and k == key and size + n <= bucket_bytes:
            out[-1].append(i)
            size += n
        else:
            out.append([i])
            size, key = n, k
    return out


def all_reduce_buckets(tensors: Sequence[torch.Tensor], reduce: Callable[[torch.Tensor], Any],
                       bucket_bytes: int = BUCKET_BYTES) -> None:
    """``reduce`` (an in-place all-reduce of one tensor) over ``tensors`` in :func:`buckets`:
    a bucket of several tensors is flattened into one buffer, reduced, and copied back."""
    for idx in buckets(tensors, bucket_bytes):
        if len(idx) == 1:
            reduce(tensors[idx[0]])
            continue
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])
        reduce(flat)
        at = 0
        for i in idx:
            n = tensors[i].numel()
            tensors[i].copy_(flat[at: at + n].view_as(tensors[i]))
            at += n


@torch.no_grad()
def full_buckets(model: torch.nn.Module, bucket_bytes: int = BUCKET_BYTES) -> Iterator[dict[str, np.ndarray]]:
    """The model's parameters (tied ones once) as whole host numpy arrays by name, in buckets of
    about ``bucket_bytes`` of whole tensors (:func:`buckets`). A sharded parameter (a DTensor) is
    all-gathered: every rank holding a shard must iterate this, in the same order."""
    named = list(model.named_parameters())
    whole = [torch.empty(p.shape, dtype=p.dtype, device="meta") for _, p in named]  # (sizes, not shards)
    for idx in buckets(whole, bucket_bytes):
        out = {}
        for i in idx:
            name, p = named[i]
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name] = full.detach().to("cpu", copy=True).numpy()
        yield out


def free_address(host: str | None = None) -> str:
    """``tcp://host:port`` with a port free on this machine now (rank 0 calls this)."""
    host = host or "127.0.0.1"
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


class TorchGroup:
    """Ranks as processes: ``torch.distributed`` (gloo) initialised at ``address``."""

    def __init__(self, address: str, rank: int, world: int, timeout_s: float = 900.0):
        self.rank, self.world, self._dist = rank, world, dist
        self.shard, self.shards = rank, world
        dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        self._ctrl = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def all_reduce_sum(self, tensors: Sequence[torch.Tensor]) -> None:
        all_reduce_buckets(tensors, lambda t: self._dist.all_reduce(t, op=self._dist.ReduceOp.SUM))

    def broadcast(self, obj: Any) -> Any:
        box = [obj if self.rank == 0 else None]
        self._dist.broadcast_object_list(box, src=0, group=self._ctrl)
        return box[0]

    def barrier(self) -> None:
        self._dist.barrier(group=self._ctrl)

    def abort(self) -> None:
        if self._dist.is_initialized():
            self._dist.destroy_process_group()


class _Channel:
    """All-gather among ``world`` threads: each deposits a value, each gets every value."""

    def __init__(self, world: int, timeout_s: float):
        self.slots: list[Any] = [None] * world
        self.barrier = threading.Barrier(world, timeout=timeout_s)

    def gather(self, rank: int, value: Any) -> list[Any]:
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before everybody has read it
        return out


class ThreadRendezvous:
    """What the threads of one in-process data-parallel group share (one per group)."""

    def __init__(self, world: int, timeout_s: float = 900.0):
        self.world = world
        self.grads, self.ctrl = _Channel(world, timeout_s), _Channel(world, timeout_s)

    def abort(self) -> None:
        self.grads.barrier.abort()
        self.ctrl.barrier.abort()


class ThreadGroup:
    """Ranks as threads of this process (see :class:`ThreadRendezvous`)."""

    def __init__(self, rendezvous: ThreadRendezvous, rank: int):
        self.rdv, self.rank, self.world = rendezvous, rank, rendezvous.world
        self.shard, self.shards = rank, self.world

    def all_reduce_sum(self, tensors: Sequence[torch.Tensor]) -> None:
        mine = [t.detach().clone() for t in tensors]  # others read them while we write ours
        every = self.rdv.grads.gather(self.rank, mine)
        for i, t in enumerate(tensors):
            total = every[0][i].clone()
            for r in range(1, self.world):
                total += every[r][i]
            t.copy_(total)

    def broadcast(self, obj: Any) -> Any:
        return self.rdv.ctrl.gather(self.rank, obj if self.rank == 0 else None)[0]

    def barrier(self) -> None:
        self.rdv.ctrl.gather(self.rank, None)

    def abort(self) -> None:
        self.rdv.abort()


def join(rendezvous: str | ThreadRendezvous, rank: int, world: int, timeout_s: float = 900.0) -> Collective:
    """The group of rank ``rank``: processes at a ``tcp://`` address, or threads sharing a rendezvous."""
    if isinstance(rendezvous, ThreadRendezvous):
        if rendezvous.world != world:
            raise ValueError(f"rendezvous of {rendezvous.world} ranks joined as one of {world}")
        return ThreadGroup(rendezvous, rank)
    return TorchGroup(rendezvous, rank, world, timeout_s)
