"""A batch of small LAPACK eigenvalue problems or inverses on every core torch may use.

torch runs a batched ``eigvalsh`` or ``inv_ex`` of many small matrices one matrix after
another, whatever ``torch.set_num_threads`` says (measured: 20,000 matrices of 20 × 20,
``eigvalsh`` 1.23 s on one thread, 1.17 on two). At 100,000 units the first round's
leave-one-out distances need every unit's eigenvalues (core/robust.py) and every round's
E-step inverts every unit's data-support matrix (core/bayes.py ``data_support``).

:func:`on_cores` splits the batch (the leading dimension) into contiguous parts, one per
thread torch may use, runs the same call on each part in a thread of its own (torch
releases the GIL inside the call) and concatenates the parts' results. Each matrix is
computed by the same LAPACK routine on the same numbers, so the result is bit-identical to
the one call's (tested); below :data:`MIN_BATCH` matrices, or with one thread, it is the
one call itself. Measured with two threads on the shared machine (load 6.5): ``eigvalsh``
1.17 → 0.81 s, ``inv_ex`` 1.02 → 0.88 s; Cholesky factors and solves were not faster split
(0.26 → 0.38 s, 0.86 → 0.92 s), so they stay one call.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

#: Batches smaller than this run as one call (a thread's start costs more than it saves).
MIN_BATCH = 512

# One pool per process and size: a forked child does not inherit its parent's threads.
_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}
_LOCK = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    key = (os.getpid(), workers)
    with _LOCK:
        if key not in _POOLS:
            _POOLS[key] = ThreadPoolExecutor(workers, thread_name_prefix="fedcal-lapack")
        return _POOLS[key]


def on_cores(fn: Callable[..., Any], *batches: Tensor) -> Any:
    """``fn(*batches)``, each of ``batches`` split along its leading dimension (all of one
    length) into one part per thread torch may use, the parts run in parallel and their
    results (a tensor, or a tuple of tensors each with that leading dimension: returned as a
    plain tuple) concatenated."""
    n = batches[0].shape[0]
    workers = torch.get_num_threads()
    one = batches[0].dim() < 3 or n < MIN_BATCH  # a single matrix, or a small batch
    if one or workers < 2 or threading.current_thread().name.startswith("fedcal-"):
        return fn(*batches)
    bounds = [n * k // workers for k in range(workers + 1)]
    parts = [tuple(b[lo:hi] for b in batches) for lo, hi in itertools.pairwise(bounds)]
    results = list(_pool(workers).map(lambda args: fn(*args), parts))
    first = results[0]
    if isinstance(first, Tensor):
        return torch.cat(results)
    return tuple(torch.cat([r[i] for r in results]) for i in range(len(first)))
