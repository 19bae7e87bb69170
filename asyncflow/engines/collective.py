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

Invariant (both): the ops of one *channel* (gradients, control) are called in the same
order by every rank; a rank that deviates blocks the others until ``timeout_s``.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch


class Collective(Protocol):
    rank: int
    world: int

    def all_reduce_sum(self, tensors: Sequence[torch.Tensor]) -> None: ...
    def broadcast(self, obj: Any) -> Any: ...
    def barrier(self) -> None: ...
    def abort(self) -> None: ...


def free_address(host: str | None = None) -> str:
    """``tcp://host:port`` with a port free on this machine now (rank 0 calls this)."""
    host = host or "127.0.0.1"
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


class TorchGroup:
    """Ranks as processes: ``torch.distributed`` (gloo) initialised at ``address``."""

    def __init__(self, address: str, rank: int, world: int, timeout_s: float = 900.0):
        import torch.distributed as dist

        self.rank, self.world, self._dist = rank, world, dist
        dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        self._ctrl = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def all_reduce_sum(self, tensors: Sequence[torch.Tensor]) -> None:
        for t in tensors:
            self._dist.all_reduce(t, op=self._dist.ReduceOp.SUM)

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
