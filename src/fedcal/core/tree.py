"""Parameter trees: nested ``dict[str, Tensor | Tree]`` and the few operations on them.

Conventions used across fedcal:

* A *client tree* carries a leading clients axis on every leaf:
  ``(clients, *shape)``. Algorithms are written against client trees and must
  treat clients independently; the simulator runs a whole cohort at once and
  the Flower adapter runs one client as a cohort of one.
* A *server tree* has no clients axis. :func:`expand` turns it into a client
  tree as a view (no copy).
* Trees are never mutated in place; every function returns a new tree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeAlias

import torch
from torch import Tensor

Tree: TypeAlias = dict[str, Any]  # values: Tensor or Tree


def tree_map(fn: Callable[..., Tensor], tree: Mapping, *rest: Mapping) -> Tree:
    """Apply ``fn`` leaf-wise over trees of identical structure."""
    out: Tree = {}
    for key, value in tree.items():
        others = [r[key] for r in rest]
        out[key] = (
            tree_map(fn, value, *others) if isinstance(value, Mapping) else fn(value, *others)
        )
    return out


def leaves(tree: Mapping) -> list[Tensor]:
    """Leaves in key order (depth first)."""
    out: list[Tensor] = []
    for value in tree.values():
        out.extend(leaves(value) if isinstance(value, Mapping) else [value])
    return out


def flatten(tree: Mapping, prefix: str = "") -> dict[str, Tensor]:
    """``{"a": {"b": t}}`` → ``{"a/b": t}``."""
    out: dict[str, Tensor] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "/"))
        else:
            out[name] = value
    return out


def unflatten(flat: Mapping[str, Tensor]) -> Tree:
    """Inverse of :func:`flatten`."""
    out: Tree = {}
    for name, value in flat.items():
        node = out
        *parents, last = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out


def select(params: Mapping[str, Tensor], keys: Iterable[str]) -> Tree:
    """The sub-tree of a flat parameter dict with only ``keys`` (in params order)."""
    wanted = set(keys)
    return {k: v for k, v in params.items() if k in wanted}


def drop(params: Mapping[str, Tensor], keys: Iterable[str]) -> Tree:
    """The sub-tree of a flat parameter dict without ``keys``."""
    unwanted = set(keys)
    return {k: v for k, v in params.items() if k not in unwanted}


def expand(tree: Mapping, num_clients: int) -> Tree:
    """Server tree → client tree: a leading clients axis, as a broadcast view."""
    return tree_map(lambda t: t.unsqueeze(0).expand(num_clients, *t.shape), tree)


def stack(trees: list[Mapping]) -> Tree:
    """Trees without a clients axis → one client tree."""
    return tree_map(lambda *ts: torch.stack(ts), trees[0], *trees[1:])


def unstack(tree: Mapping) -> list[Tree]:
    """One client tree → one tree per client."""
    n = leaves(tree)[0].shape[0] if leaves(tree) else 0
    return [tree_map(lambda t, i=i: t[i], tree) for i in range(n)]


def gather(tree: Mapping, index: Tensor) -> Tree:
    """Rows ``index`` of a client tree (a cohort out of the whole fleet)."""
    return tree_map(lambda t: t.index_select(0, index), tree)


def scatter(tree: Mapping, index: Tensor, rows: Mapping) -> Tree:
    """A copy of ``tree`` with the rows ``index`` replaced by ``rows``."""
    return tree_map(lambda t, r: t.index_copy(0, index, r.to(t.dtype)), tree, rows)


def per_client(scalar: Tensor, like: Tensor) -> Tensor:
    """Reshape a ``(clients,)`` tensor to broadcast against ``like`` of shape ``(clients, ...)``."""
    return scalar.reshape(scalar.shape[0], *([1] * (like.dim() - 1)))


def weighted_mean(replies: Mapping, weights: Tensor) -> Tree:
    """Σ_i w_i·x_i / Σ_i w_i over the clients axis of a client tree (the FedAvg aggregate)."""
    total = weights.sum()
    ones = bool((weights == 1).all())

    def mean(t: Tensor) -> Tensor:
        if ones and t.is_contiguous():
            # The plain mean: 1·x is x, so the same numbers without a fleet-sized product.
            return t.sum(0) / total
        return (per_client(weights.to(t.dtype), t) * t).sum(0) / total

    return tree_map(mean, replies)


def sq_norm(tree: Mapping) -> Tensor:
    """Per-client squared L2 norm over all leaves of a client tree → ``(clients,)``."""
    parts = [t.reshape(t.shape[0], -1).pow(2).sum(1) for t in leaves(tree)]
    return torch.stack(parts).sum(0)


def sub(a: Mapping, b: Mapping) -> Tree:
    return tree_map(torch.sub, a, b)


def add(a: Mapping, b: Mapping) -> Tree:
    return tree_map(torch.add, a, b)


def scale(tree: Mapping, factor: float | Tensor) -> Tree:
    return tree_map(lambda t: t * factor, tree)


def lerp(a: Mapping, b: Mapping, weight: Mapping | Tensor | float) -> Tree:
    """``a + weight·(b − a)`` leaf-wise; ``weight`` may itself be a tree."""
    if isinstance(weight, Mapping):
        return tree_map(lambda x, y, w: x + w * (y - x), a, b, weight)
    return tree_map(lambda x, y: x + weight * (y - x), a, b)


def zeros_like(tree: Mapping) -> Tree:
    return tree_map(torch.zeros_like, tree)


def clone(tree: Mapping) -> Tree:
    return tree_map(lambda t: t.clone(), tree)


def num_bytes(tree: Mapping, per_client_axis: bool = False) -> int:
    """Bytes a tree takes on the wire (for one client when ``per_client_axis``)."""
    total = 0
    for t in leaves(tree):
        n = t[0].numel() if per_client_axis else t.numel()
        total += n * t.element_size()
    return total


def allclose(a: Mapping, b: Mapping, rtol: float = 1e-6, atol: float = 1e-9) -> bool:
    fa, fb = flatten(a), flatten(b)
    if fa.keys() != fb.keys():
        return False
    return all(
        fa[k].shape == fb[k].shape and torch.allclose(fa[k], fb[k], rtol=rtol, atol=atol)
        for k in fa
    )
