"""Keep freed memory in the process: the allocator setting the engine runs under.

A cohort's step allocates and frees tensors of 0.1–10 MB thousands of times a
round. glibc's malloc serves blocks that size from fresh ``mmap`` pages (or trims
them back to the OS at ``free``), so every allocation pays its page faults again:
~0.8 ms for a 2 MB activation, 10–15 % of the seed protocol's time (measured with
``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_``, ``benchmarks/engine_speed.py``).
Raising both thresholds makes freed blocks reusable at once. The live set, hence
the peak, is unchanged; up to ``TRIM`` bytes of free memory may stay mapped.

The same effect as ``LD_PRELOAD``-ing jemalloc or tcmalloc (PyTorch's CPU tuning
advice), without a native dependency. Numbers do not depend on it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (glibc <malloc.h>)
MMAP = 32 * 2**20  # blocks above this still come from mmap (glibc's own dynamic cap)
TRIM = 256 * 2**20  # free memory at the top of the heap kept before returning it


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's thresholds once per process; False where there is no glibc (macOS,
    musl) or the user set them (``MALLOC_*_THRESHOLD_`` in the environment wins)."""
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM))
