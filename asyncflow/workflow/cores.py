"""Core pinning: each compute role computes on cores of its own (``resources.pin_cores``).

In ``stream``/``async`` each compute worker (one requesting CPU: rollout, the trainer's
ranks, reference, critic) gets ``threads`` cores of its own when they all fit
(:func:`assign_cores`: the trainer's ranks first, the usual bottleneck, then the others,
rollout last), on distinct physical cores first (:func:`physical_first`: two hyperthreads
of one core share its execution units). The worker runs its compute thread and its roles'
loop threads (and the threads those start) there (:func:`pin_thread`), so two roles never
share a core or migrate between cores. The process's other threads (Ray's, the weight
prefetch) and the services (data plane, weight store, driver, Ray's daemons) are not
pinned: they run where a core is free. ``sync`` is never pinned: its one worker uses every
core in every phase.

The threads a pinned thread starts (the data-plane client's event loop and ZeroMQ's I/O
threads among them) inherit its pin on purpose: they serve that role's own blocking
calls, and a hand-off across cores costs 2-4x one on a core here
(``benchmarks/round_trip.py``). Unpinned, they ran 0.94x (compute-bound bench workload)
and 0.93x (remote reward) as fast, 7 of 8 interleaved pairs slower. Pinning every thread
of the role's process (Ray's too) gained nothing beyond the noise (docs/bench-log.md,
"Tried and dropped").

``auto`` (the default) pins only where the machine is the job's: the Ray launcher on a
local instance it started (``launcher.owns_host``). Measured on 2 cores
(``benchmarks/ab.py resources.pin_cores=off resources.pin_cores=on``): ``async`` 1.12x on
the compute-bound bench workload and 1.04x with the remote reward, each of 4 interleaved
pairs faster pinned.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from asyncflow.config import RunConfig
from asyncflow.workflow.launcher import Launcher

_T = TypeVar("_T")


def pinnable_cores(cfg: RunConfig, launcher: Launcher) -> list[int] | None:
    """The cores to pin ``cfg``'s workers to (``resources.pin_cores``), or None.

    ``auto`` pins only where the whole machine is the job's: the Ray launcher on a local
    instance it started (``launcher.owns_host``); never in ``sync`` (its one worker uses
    every core), nor where the OS has no ``sched_setaffinity``.
    """
    pin = cfg.resources.pin_cores
    if cfg.mode == "sync" or pin == "off" or not hasattr(os, "sched_setaffinity"):
        return None
    if pin == "auto" and not getattr(launcher, "owns_host", False):
        return None
    return physical_first(sorted(os.sched_getaffinity(0)))


def physical_first(cores: list[int], siblings: dict[int, tuple[int, ...]] | None = None) -> list[int]:
    """``cores`` reordered so that one hardware thread of every physical core comes before
    any second thread (SMT sibling): two roles pinned to the first two entries then get two
    physical cores, not the two hyperthreads of one. ``siblings`` maps a core to its
    physical core's threads (default: read from Linux sysfs; a core without that entry is
    its own physical core)."""
    siblings = _sysfs_siblings(cores) if siblings is None else siblings
    rank = {}
    for c in cores:
        group = sorted(x for x in siblings.get(c, (c,)) if x in cores) or [c]
        rank[c] = (group.index(c) if c in group else 0, c)
    return sorted(cores, key=rank.__getitem__)


def _sysfs_siblings(cores: list[int]) -> dict[int, tuple[int, ...]]:
    out = {}
    for c in cores:
        try:
            text = Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list").read_text().strip()
        except OSError:
            continue
        ids: list[int] = []
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            ids += range(int(lo), int(hi or lo) + 1)
        out[c] = tuple(ids)
    return out


def pin_thread(cores: Iterable[int]) -> None:
    """Pin the calling thread (and threads it starts later) to ``cores`` (no-op if empty)."""
    if cores:
        os.sched_setaffinity(0, set(cores))  # pid 0: the calling thread


def run_pinned(cores: Iterable[int], fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` on the calling thread pinned to ``cores`` (a thread's target)."""
    pin_thread(cores)
    return fn(*args)


@contextlib.contextmanager
def pinned(cores: Iterable[int] | None) -> Iterator[None]:
    """The calling thread on ``cores`` (if any) inside the block, as it was after it."""
    if not cores:
        yield
        return
    before = os.sched_getaffinity(0)
    pin_thread(cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
