"""Local training, written once for every algorithm.

Gradients are taken of the *sum* of per-client losses with respect to a client
tree: since client c's loss depends only on row c of every leaf, the gradient
of the sum is, row by row, each client's own gradient. One autograd call thus
trains the whole cohort — the hand-batched alternative to ``vmap(grad)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from fedcal.core.data import Batches
from fedcal.core.tree import Tree, select

LossFn = Callable[[Tree, Tensor, Tensor, Tensor], Tensor]
Penalty = Callable[[Tree], Tensor]


def value_and_grad(
    fn: Callable[[Tree], Tensor],
    params: Tree,
    wrt: Iterable[str] | None = None,
    create_graph: bool = False,
) -> tuple[Tensor, Tree]:
    """``fn(params)`` → (clients,) and its gradient w.r.t. the ``wrt`` leaves of a flat tree.

    Leaves outside ``wrt`` are treated as constants. With ``create_graph`` the
    gradient stays differentiable (for Hessian-vector products).
    """
    names = list(params) if wrt is None else [k for k in params if k in set(wrt)]
    with torch.enable_grad():
        live = {
            k: (v if create_graph and v.requires_grad else v.detach().requires_grad_(True))
            if k in names
            else v.detach()
            for k, v in params.items()
        }
        value = fn(live)
        grads = torch.autograd.grad(
            value.sum(),
            [live[k] for k in names],
            create_graph=create_graph,
            materialize_grads=True,  # a leaf the objective ignores gets a zero gradient
        )
    if not create_graph:
        value = value.detach()
    return value, dict(zip(names, grads, strict=True))


GradFn = Callable[[Tree, Tensor, Tensor, Tensor, list[str]], tuple[Tensor, Tree]]


def autograd_of(loss: LossFn) -> GradFn:
    """A gradient function for any loss ``(params, x, y, w) → (clients,)``, by autograd."""

    def grad_fn(
        params: Tree, x: Tensor, y: Tensor, w: Tensor, wrt: list[str]
    ) -> tuple[Tensor, Tree]:
        return value_and_grad(lambda p: loss(p, x, y, w), params, wrt)

    return grad_fn


def train(
    grad_fn: GradFn,
    params: Tree,
    batches: Batches,
    optimizer,
    wrt: Iterable[str] | None = None,
    penalty: Penalty | None = None,
) -> tuple[Tree, Tensor]:
    """Run every step of ``batches``; return new params and the mean batch loss (clients,).

    ``grad_fn(params, x, y, w, wrt)`` gives the per-client loss and its
    gradient (e.g. ``task.value_and_grad`` or :func:`autograd_of`). Only the
    ``wrt`` leaves are trained (all when None); ``penalty(params)`` (clients,)
    is added to the objective at every step (proximal terms), its gradient by
    autograd. The reported loss excludes the penalty.
    """
    names = list(params) if wrt is None else [k for k in params if k in set(wrt)]
    state = optimizer.init(select(params, names))
    total = torch.zeros(batches.active.shape[1], dtype=batches.x.dtype)
    for s in range(batches.steps):
        value, grads = grad_fn(params, batches.x[s], batches.y[s], batches.w[s], names)
        if penalty is not None:
            _, extra = value_and_grad(penalty, params, names)
            grads = {k: g + extra[k] for k, g in grads.items()}
        active = None if batches.all_active[s] else batches.active[s]
        new, state = optimizer.update(select(params, names), grads, state, active)
        params = {**params, **new}
        total = total + value * batches.active[s]
    steps = batches.active.sum(0).clamp_min(1.0)
    return params, total / steps


def clip_by_norm(grads: Tree, max_norm: float) -> Tree:
    """Scale each client's gradient to L2 norm ≤ ``max_norm`` (``clip_grad_norm_`` per client).

    The norm is over every leaf of the client's gradient; a non-finite norm
    gives a non-finite gradient (the divergence is reported, not hidden).
    """
    parts = [g.reshape(g.shape[0], -1).pow(2).sum(1) for g in grads.values()]
    if not parts:
        return grads
    norm = torch.stack(parts).sum(0).sqrt()
    factor = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # torch's clip_grad_norm_ formula
    return {k: g * factor.reshape(-1, *([1] * (g.dim() - 1))) for k, g in grads.items()}


@dataclass(frozen=True)
class GradClip:
    """An optimizer whose gradients are clipped per client first (gradient-norm clipping)."""

    inner: object
    max_norm: float

    @property
    def lr(self) -> float:
        return self.inner.lr

    def init(self, params: Tree) -> Tree:
        return self.inner.init(params)

    def update(
        self, params: Tree, grads: Tree, state: Tree, active: Tensor | None = None
    ) -> tuple[Tree, Tree]:
        return self.inner.update(params, clip_by_norm(grads, self.max_norm), state, active)
