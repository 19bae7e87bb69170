"""A preallocated KV cache of fixed slots, written in place: the built-in engine's decode cache.

Design
------
:class:`SlotCache` is a transformers ``Cache`` (the API every Llama/Qwen2-style model calls
from its attention layers: ``past_key_values.update(keys, values, layer_idx)``) whose storage
is one pair of tensors per layer, ``[slots, kv_heads, capacity + 1, head_dim]``, allocated
once (lazily, at the first forward, which fixes heads, head size and dtype) and written in
place. A sequence lives in one slot for its whole life; its tokens occupy columns
``0 .. length-1`` of that slot, so a finished sequence's slot is refilled without moving any
other sequence (continuous batching without re-allocation or re-padding).

Before each forward the caller :meth:`bind`\\ s the rows it feeds (a slice ``0:B`` for the
decode step, a tensor of slot ids for a prefill), the column each new token is written to
(``write``, ``[B, q]``) and how many columns attention reads (``length``). ``update`` then
scatters the layer's new keys/values into those columns and returns the rows' first
``length`` columns; the caller's 4-D attention mask says which of them each query sees.

Invariants
----------
* Column ``capacity`` (the last one) is scratch: rows that must not write (a finished or
  parked slot inside a decode step's range, a padding query of a prefill) write there. It is
  never attended (``length <= capacity``), so its garbage reaches nobody.
* Nothing here allocates after the first forward unless :meth:`grow` is called: the tensors
  keep their addresses, which is what a captured CUDA graph needs
  (:mod:`asyncflow.engines.slot_graphs`); :meth:`grow` (a longer sequence than the capacity)
  replaces them, and the caller drops its graphs.
* :meth:`fork` copies one slot's first ``n`` columns into other slots, in every layer: the
  primitive behind a GRPO group prefilled once (its prompt's keys/values copied into the
  group's other slots) and, later, tree rollouts that fork live rows (issue 36: copy the row's
  slot, then give each copy its own next token).
* Positions are the caller's business (``position_ids`` per row); the cache never reads them.
"""

from __future__ import annotations

import torch
from transformers import Cache


class SlotCache(Cache):
    """Per-layer keys/values of ``slots`` sequences of up to ``capacity`` tokens (see module doc)."""

    def __init__(self, slots: int, capacity: int):
        super().__init__(layers=[])
        self.slots, self.capacity = slots, capacity
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._rows: slice | torch.Tensor = slice(0, 0)
        self._index: torch.Tensor | None = None  # [B, 1] slot ids of the bound rows
        self._write: torch.Tensor | None = None  # [B, q] column of each new token
        self._length = 0

    @property
    def allocated(self) -> bool:
        return bool(self.keys)

    def bind(self, rows: slice | torch.Tensor, index: torch.Tensor, write: torch.Tensor, length: int) -> None:
        """The next forward feeds ``rows`` (slot ids ``index``, ``[B]``), writes its tokens at
        columns ``write`` (``[B, q]``) and attends to columns ``0 .. length-1``."""
        if length > self.capacity:
            raise ValueError(f"attention over {length} columns exceeds the slot capacity {self.capacity}")
        self._rows, self._index, self._write, self._length = rows, index[:, None], write, length

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the layer's new ``[B, kv_heads, q, head_dim]`` keys/values into the bound
        columns; return the bound rows' first ``length`` columns."""
        if layer_idx == len(self.keys):
            self._allocate(key_states, value_states)
        assert self._index is not None and self._write is not None, "bind() before a forward"
        k, v = self.keys[layer_idx], self.values[layer_idx]
        # Advanced indices around a slice put the broadcast [B, q] first: the value is [B, q, heads, dim].
        k[self._index, :, self._write] = key_states.transpose(1, 2).to(k.dtype)
        v[self._index, :, self._write] = value_states.transpose(1, 2).to(v.dtype)
        return k[self._rows, :, :self._length], v[self._rows, :, :self._length]

    def _allocate(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, heads, _, kdim = key_states.shape
        vdim = value_states.shape[-1]
        shape = (self.slots, heads, self.capacity + 1)
        # zeros, not empty: a dead row's query attends to column 0 of its slot, which must be finite
        self.keys.append(torch.zeros((*shape, kdim), dtype=key_states.dtype, device=key_states.device))
        self.values.append(torch.zeros((*shape, vdim), dtype=value_states.dtype, device=value_states.device))

    @torch.no_grad()
    def fork(self, src: int, dsts: list[int], n: int) -> None:
        """Copy slot ``src``'s first ``n`` columns into each slot of ``dsts`` (every layer)."""
        if not dsts or not n:
            return
        index = torch.tensor(dsts, dtype=torch.long, device=self.keys[0].device)
        for k, v in zip(self.keys, self.values):
            k[index, :, :n] = k[src, :, :n].clone()  # (a view of the written tensor may not be its own source)
            v[index, :, :n] = v[src, :, :n].clone()

    @torch.no_grad()
    def grow(self, capacity: int) -> None:
        """Make room for ``capacity`` tokens per slot (new tensors: captured graphs go stale)."""
        if capacity <= self.capacity:
            return
        old, self.capacity = self.capacity, capacity
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                new = t.new_zeros((t.shape[0], t.shape[1], capacity + 1, t.shape[3]))
                new[:, :, :old] = t[:, :, :old]
                store[i] = new

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    # The model reads lengths from the 4-D mask and positions from position_ids; a caller
    # asking the cache instead would get one number for rows of different lengths: refuse.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise NotImplementedError("SlotCache rows have their own lengths: pass position_ids and a 4-D mask")

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        raise NotImplementedError("SlotCache rows have their own lengths: pass a 4-D attention mask")
