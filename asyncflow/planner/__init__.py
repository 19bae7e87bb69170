"""Execution-time planner: simulate the dataflow, calibrate it, search the allocation.

* :mod:`~asyncflow.planner.des`: the discrete-event kernel (generator processes);
* :mod:`~asyncflow.planner.sim`: discrete-event simulation of sync / stream / async
  (continuous batching, long-tailed lengths, reward latency, micro-batched actor,
  staleness admission control, delayed weight swap, shared cores);
* :mod:`~asyncflow.planner.costs`: cost models: profiled curves of this machine
  (``asyncflow profile`` writes them) and analytic accelerator models (assumptions);
* :mod:`~asyncflow.planner.profile`: the short measured run behind the profiled curves;
* :mod:`~asyncflow.planner.search`: allocation search behind ``asyncflow plan``;
* :mod:`~asyncflow.planner.auto`: `plan=auto` (profile or reuse, search, apply);
* :mod:`~asyncflow.observe.trace`: Chrome traces and PNG Gantt charts;
* :mod:`~asyncflow.planner.whatif`: the table at the published scale (docs/planner.md).

Nothing here imports torch except :mod:`~asyncflow.planner.profile`.
"""

from asyncflow.planner.costs import ConstantCost
from asyncflow.planner.sim import Allocation, SimResult, Workload, simulate

__all__ = ["Allocation", "ConstantCost", "SimResult", "Workload", "simulate"]
