"""One batch's device resources, and the slot-fork primitive.

A :class:`SlotPool` is allocated once and reused by the engine's next batch (a closed
:class:`~asyncflow.engines.slot_batch.SlotBatch` gives it back): a
:class:`~asyncflow.engines.slot_cache.SlotCache` of ``max_batch`` slots, the per-slot
:class:`~asyncflow.engines.slot_step.SlotState`, the :class:`~asyncflow.engines.slot_step.SlotStep`
and, on CUDA, its :class:`~asyncflow.engines.slot_graphs.StepGraphs`.

:meth:`SlotPool.fork` copies slot ``s``'s cached tokens and its state (next token, position,
lengths, stop table) into slots ``d1 .. dk``: after it the copies are live rows that continue
from the same point, their keys/values never recomputed. A GRPO group's prompt is prefilled
once and forked this way; a tree rollout forks live rows (issue 36).

Invariants: :meth:`SlotPool.ensure` is the only place the cache or the stop table grows, and it
drops the captured graphs when it does (they hold the old tensors' addresses).
"""

from __future__ import annotations

import torch

from asyncflow.engines.device import model_device
from asyncflow.engines.slot_cache import SlotCache
from asyncflow.engines.slot_graphs import StepGraphs, bucket
from asyncflow.engines.slot_step import SlotState, SlotStep


class SlotPool:
    """One batch's device resources, reusable by the next (see module doc)."""

    def __init__(self, model: torch.nn.Module, slots: int, eos_id: int, pad_id: int, dtype: str,
                 generator: torch.Generator, uniform: bool | None = None, cuda_graphs: bool = True):
        device = model_device(model)
        self.slots, self.eos_id, self.generator = slots, eos_id, generator
        self.cache = SlotCache(slots, capacity=0)
        self.state = SlotState.allocate(slots, 1, eos_id, device)
        self.step = SlotStep(model, self.cache, self.state, dtype,
                             uniform=device.type != "cpu" if uniform is None else uniform,
                             generator=generator, pad_id=pad_id)
        self.graphs = StepGraphs(self.step) if cuda_graphs and device.type == "cuda" else None
        self.u_host = torch.zeros(slots, dtype=torch.float64, pin_memory=device.type == "cuda")

    def ensure(self, capacity: int, stop_width: int) -> None:
        """Room for ``capacity`` tokens a slot and ``stop_width`` stop-table columns."""
        if capacity > self.cache.capacity:
            self.cache.grow(bucket(capacity, 1 << 40, least=64))
            if self.graphs:
                self.graphs.clear()
        if stop_width > self.state.stops.shape[1]:
            self.state.widen(stop_width, self.eos_id)
            if self.graphs:
                self.graphs.clear()

    @torch.no_grad()
    def fork(self, src: int, dsts: list[int]) -> None:
        """Copy slot ``src`` (its cached tokens and its state row) into every slot of ``dsts``."""
        if not dsts:
            return
        st = self.state
        self.cache.fork(src, dsts, int(st.pos[src]))
        idx = torch.tensor(dsts, dtype=torch.long, device=st.tok.device)
        for t in (st.tok, st.pos, st.live, st.n_gen, st.min_new, st.max_new, st.stops):
            t[idx] = t[src].clone()  # (a view of the written tensor may not be its own source)
