"""Keep freed memory in the process heap (glibc), so compute steps stop page-faulting.

glibc's ``malloc`` serves big blocks with ``mmap`` and gives them back with ``munmap`` on
``free``, and trims the top of the heap after frees. A training or decode step allocates
and frees the same activations every step, so every step maps fresh pages again and the
kernel zeroes each one: measured on the tiny model (one torch thread, one trainer step of
128 answers), 14,000-28,000 minor page faults and 30-80 ms of system time per step, about
a tenth of the step. With a fixed mmap threshold and no trimming, the heap keeps the
memory it had and the same steps fault ~0 times.

:func:`keep_heap` sets both (``mallopt``) for the calling process; workers call it at
start. It is a no-op where glibc is absent, and ``ASYNCFLOW_KEEP_HEAP=0`` turns it off.
Both settings hold for glibc's *main* arena. A thread with an arena of its own (a worker's
compute thread is not the main thread) still hands freed pages back: measured in a
bench run, the trainer's compute threads faulted ~9,700 times a second and spent ~10% of
their CPU in the kernel. So the Ray launcher starts each role's process with
``MALLOC_ARENA_MAX=1`` (one arena for every thread; ``ASYNCFLOW_ARENA_MAX`` sets another
count, ``0`` leaves glibc's default): 3,300 faults a second, 1.7% in the kernel.
The price: the process keeps its peak heap (as a caching allocator would) instead of
returning it to the system between steps. Blocks above ``mmap_threshold`` are still
mapped and unmapped per allocation.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = (1 << 31) - 1


def keep_heap() -> bool:
    """Set the calling process's malloc to keep freed memory; True if it took effect."""
    if os.environ.get("ASYNCFLOW_KEEP_HEAP", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt)
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
