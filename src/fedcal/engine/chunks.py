"""A cohort run in chunks of clients, on a chosen device.

Every algorithm treats its clients independently (the contract tests check that
a cohort at once equals each client alone), so the simulator may run a cohort
``chunk_size`` clients at a time. The memory of local training — minibatch
plans ``(steps, clients, batch, …)``, activations ``(clients, rows, hidden)``,
full-batch passes over every row — then stays bounded by the chunk, however
large the fleet; only the fleet's own parameters (private states, replies,
personal models: one row per client) grow with it.

A chunk can run on another device (``device="cuda"``): its inputs are copied
there, the algorithm runs under ``torch.device(device)`` so that tensors it
creates land there too, and its results come back to host memory, where the
fleet's state and the server live. ``"cpu"`` (the default) copies nothing.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

import torch
from torch import Tensor

from fedcal.core.algorithm import Algorithm, ClientResult
from fedcal.core.data import HOST, ClientData
from fedcal.core.tree import Tree, expand, gather, tree_map

T = TypeVar("T")


def resolve_device(name: str) -> torch.device:
    """``"cpu"``, ``"cuda"`` or ``"cuda:N"`` as a device this machine has (else ValueError)."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device {name!r}: expected 'cpu', 'cuda' or 'cuda:N'") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r}: expected 'cpu', 'cuda' or 'cuda:N'")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: no CUDA device here (torch.cuda.is_available())")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    return device


def is_host(device: torch.device) -> bool:
    """Whether ``device`` is where the fleet lives (then nothing is copied)."""
    return device == HOST


def spans(num_clients: int, chunk_size: int) -> Iterator[Tensor]:
    """Consecutive client positions ``[0, k), [k, 2k), …`` (one span of all when k = 0)."""
    size = chunk_size if chunk_size > 0 else max(num_clients, 1)
    for start in range(0, num_clients, size):
        yield torch.arange(start, min(start + size, num_clients))


def in_order(measured: Callable[[Tensor], T], every: Iterable[Tensor], workers: int) -> Iterator[T]:
    """``measured(rows)`` of each chunk, yielded in chunk order: computed here (``workers``
    = 1), or ahead on ``workers`` threads, at most ``workers`` + 1 chunks in flight.

    Why threads (a streamed round's pass 1, engine/streamed.py): its batched factorizations
    (Cholesky, eigenvalues, triangular solves of thousands of p × p matrices) run one
    matrix after another whatever torch's thread count, so on two cores half of such a
    round was one core's. Each chunk is computed alone, torch on one thread
    (:func:`torch_on_one_thread`), and taken in order: the same bits for any number of
    workers (tested). A chunk's work runs outside the GIL in torch's kernels mostly."""
    if workers <= 1:
        yield from (measured(rows) for rows in every)
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fedcal-chunk") as pool:
        ahead: deque[Future[T]] = deque()
        for rows in every:
            ahead.append(pool.submit(measured, rows))
            if len(ahead) > workers:
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()


@contextmanager
def torch_on_one_thread() -> Iterator[None]:
    """Torch's intra-op threads set to one, then back: a chunk's numbers then do not depend
    on the thread count (a reduction may split its terms by threads), and ``workers``
    threads each leading a team of torch's would run workers × threads on the cores. The
    setting is the process's: other torch work running meanwhile in another thread of the
    same program also runs on one thread. Also a decorator (``@torch_on_one_thread()``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def to_device(tree: Tree, device: torch.device) -> Tree:
    return tree_map(lambda t: t.to(device), tree)


def data_to(data: ClientData, device: torch.device) -> ClientData:
    branch = None if data.branch is None else data.branch.to(device)
    time = None if data.time is None else data.time.to(device)
    derived = None if data.derived is None else to_device(data.derived, device)
    return dataclasses.replace(
        data,
        x=data.x.to(device),
        y=data.y.to(device),
        count=data.count.to(device),
        branch=branch,
        time=time,
        derived=derived,
    )


def _put(slot: Tensor, start: int | Tensor, rows: Tensor) -> None:
    """``rows`` into ``slot`` from row ``start`` on (an int) or at the rows it names."""
    if isinstance(start, Tensor):
        slot.index_copy_(0, start, rows.to(slot.dtype))
    else:
        slot.narrow(0, start, rows.shape[0]).copy_(rows)


class Assembly:
    """A cohort's client trees filled in chunk by chunk (:func:`client_update`).

    The cohort's tensors are allocated when the first chunk arrives and each chunk
    is copied in and dropped, so the chunks' outputs never coexist with their
    concatenation. Leaves that are one tensor in a chunk (a reply that is the new
    private state) stay one tensor of the cohort while every chunk shares them.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.slots: dict[tuple[str, ...], Tensor] = {}  # a leaf's path → its cohort tensor
        self.shape: dict[str, Tree] | None = None  # the first chunk's trees (their structure)

    def add(self, part: dict[str, Tree], start: int | Tensor) -> None:
        """Copy one chunk's trees into the cohort's rows ``start, start + 1, …`` (an int), or
        into the rows ``start`` names (a (k,) index tensor: a chunk of scattered clients)."""
        leaves = dict(_paths(part))
        if self.shape is None:
            self.shape = tree_map(lambda t: None, part)
            first: dict[int, Tensor] = {}
            for path, t in leaves.items():
                if id(t) not in first:
                    first[id(t)] = t.new_empty((self.size, *t.shape[1:]))
                self.slots[path] = first[id(t)]
        written: dict[int, int] = {}  # cohort tensor → the chunk leaf copied into it
        for path, t in leaves.items():
            slot = self.slots[path]
            owner = written.get(id(slot))
            if owner is None:
                _put(slot, start, t)
                written[id(slot)] = id(t)
            elif owner != id(t):
                # Shared so far but two tensors in this chunk: this path gets its own copy
                # of the rows written so far (equal, they were one tensor) and this chunk's.
                own = slot.clone()
                _put(own, start, t)
                self.slots[path] = own
                written[id(own)] = id(t)

    def trees(self) -> dict[str, Tree]:
        """The cohort's trees, shaped as the chunks' (empty sub-trees included)."""

        def build(node: Mapping, path: tuple[str, ...]) -> Tree:
            return {
                k: build(v, (*path, k)) if isinstance(v, Mapping) else self.slots[(*path, k)]
                for k, v in node.items()
            }

        return build(self.shape, ())


def assemble(parts: Iterable[tuple[int, dict[str, Tree]]], size: int) -> dict[str, Tree]:
    """``(first client, chunk's trees)`` pairs in order → the cohort's trees, each chunk
    copied in as it arrives (:class:`Assembly`); a single chunk of all is returned as is."""
    cohort = Assembly(size)
    for start, part in parts:
        if start == 0 and _clients(part) == size:
            return part
        cohort.add(part, start)
        del part  # the chunk's outputs go before the next chunk's are made
    return cohort.trees()


def _clients(part: dict[str, Tree]) -> int | None:
    first = next(_paths(part), None)
    return None if first is None else first[1].shape[0]


def _paths(tree: Mapping, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Tensor]]:
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _paths(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def on_device(device: torch.device, fn: Callable[..., Tree], *args: object) -> Tree:
    """``fn(*args)`` with tensors it creates placed on ``device``; results to the host."""
    if is_host(device):
        return fn(*args)
    with torch.device(device):
        out = fn(*args)
    return to_device(out, HOST)


def client_update(
    algorithm: Algorithm,
    down: Tree,
    states: Tree,
    data: ClientData,
    chunk_size: int = 0,
    device: torch.device = HOST,
) -> ClientResult:
    """``algorithm.client_update`` over a cohort, ``chunk_size`` clients at a time.

    ``down`` is the server's broadcast (no clients axis); ``states`` and ``data``
    are the cohort's. Equal to one call over the whole cohort (tested to the bit).
    """
    n = data.num_clients
    if is_host(device) and (chunk_size <= 0 or chunk_size >= n):
        return algorithm.client_update(expand(down, n), states, data)
    parts = (
        (
            int(rows[0]),
            on_device(
                device,
                lambda r=rows: algorithm.client_update(
                    expand(to_device(down, device), len(r)),
                    to_device(gather(states, r), device),
                    data_to(data.select(r), device),
                )._asdict(),
            ),
        )
        for rows in spans(n, chunk_size)
    )
    return ClientResult(**assemble(parts, n))
