"""Storage units keep freed memory in their heap (glibc), so a put stops page-faulting.

A storage unit's bytes are the ZeroMQ messages it received: libzmq allocates each frame
with ``malloc`` on its I/O thread, and a ``clear`` frees them. By default glibc serves
such blocks from ``mmap``/an I/O-thread arena and hands the pages back on ``free``, so
the next put's frames land on fresh pages that the kernel must fault in and zero, at
roughly half the copy speed on the project's VMs (``benchmarks/data_plane.py``'s "cold
put"). :func:`keep_freed_pages`, called once at a unit's start before its ZeroMQ context
exists, sets one arena for every thread, a fixed mmap threshold and a trim threshold:
freed frames stay in the heap (up to :data:`KEEP_BYTES` above the live data) and the
next put reuses them, as the shared-memory path recycles its segments.

The price: a unit's resident memory stays at its peak (plus at most ``KEEP_BYTES`` of free
heap) instead of shrinking after a clear. ``ASYNCFLOW_PLANE_KEEP_HEAP=0`` in the unit's
environment turns it off; a no-op where glibc is absent.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["KEEP_BYTES", "keep_freed_pages"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # <malloc.h>
_MMAP_THRESHOLD = 32 << 20  # frames up to this come from the heap (glibc's largest fixed threshold)
KEEP_BYTES = 1 << 30  # free heap kept for the next put


def keep_freed_pages() -> bool:
    """Set this process's malloc to keep freed frames for reuse; True if it took effect."""
    if os.environ.get("ASYNCFLOW_PLANE_KEEP_HEAP", "1") == "0":
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt)
        return False
    return all(mallopt(opt, value) for opt, value in (
        (_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, KEEP_BYTES)))
