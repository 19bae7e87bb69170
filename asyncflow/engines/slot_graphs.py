"""CUDA graphs of the decode step, one per (rows, columns) bucket.

Design
------
A decode step of a small model is hundreds of kernel launches (every op of every layer) that
each take microseconds of GPU time; launched one by one from Python the GPU idles between
them. :class:`StepGraphs` captures :meth:`SlotStep.decode(slice(0, B), T) <asyncflow.engines.slot_step.SlotStep.decode>`
once per bucket into a ``torch.cuda.CUDAGraph`` and replays it: one launch a step. Buckets
are powers of two for rows (:func:`bucket`, up to the slot count) and for columns up to 512,
then multiples of 256 (:func:`columns`, up to the cache capacity), so a handful of graphs
serve every batch; a bucket is captured the first time a step needs it.

Invariants
----------
* A graph reads and writes only tensors allocated before its capture: the model's
  parameters, the :class:`~asyncflow.engines.slot_cache.SlotCache` tensors and the
  :class:`~asyncflow.engines.slot_step.SlotState` tensors. So weights must be swapped **in
  place** (``param.copy_``, as :func:`~asyncflow.engines.inference.load_named_weights` does)
  and the graphs stay valid across the delayed parameter update; anything that replaces one of
  those tensors (the cache grows, the stop table widens) calls :meth:`StepGraphs.clear`.
* Capture does not run the step. The warm-up run before it does (on a side stream, as CUDA
  requires), and its effect on the state is undone from a snapshot; its cache writes are the
  ones the real step writes again (same inputs, same weights).
* Sampling parameters are Python constants in the captured step, so they are part of the key.
* All graphs share one memory pool: they run one at a time and keep nothing between runs
  (every output lands in the preallocated state).
* Captures use ``capture_error_mode="thread_local"``: another thread of the process (a
  colocated trainer) may use the GPU meanwhile.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncflow.engines.slot_step import SlotStep

MIN_COLUMNS = 16


def bucket(n: int, limit: int, least: int = 1) -> int:
    """The smallest power of two >= ``max(n, least)``, at most ``limit`` (itself when smaller)."""
    b = least
    while b < n:
        b *= 2
    return min(b, limit)


def columns(n: int, limit: int) -> int:
    """The attention width of a graph for ``n`` columns: a power of two up to 512, then the next
    multiple of 256 (every row reads the bucket's columns: coarser buckets above 512 would read
    up to twice the cache), at most ``limit``."""
    return bucket(n, limit, MIN_COLUMNS) if n <= 512 else min(-(-n // 256) * 256, limit)


class StepGraphs:
    """Replays ``step.decode(B, T)`` from a CUDA graph per (B, T, sampling) bucket (see module doc)."""

    def __init__(self, step: SlotStep):
        self.step = step
        self.graphs: dict[tuple, Any] = {}
        self.pool: Any = None
        self.captures = 0

    def run(self, B: int, T: int) -> None:
        sp = self.step.sampling
        key = (B, T, sp.temperature, sp.top_p)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._capture(B, T)
        graph.replay()

    def clear(self) -> None:
        self.graphs.clear()
        self.pool = None

    def _capture(self, B: int, T: int) -> Any:
        state = self.step.state
        snap = state.snapshot()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.step.decode(slice(0, B), T)  # warm-up: lazy inits, cuBLAS workspaces
        torch.cuda.current_stream().wait_stream(side)
        state.restore(snap)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self.step.decode(slice(0, B), T)
        self.pool = graph.pool()
        self.captures += 1
        return graph
