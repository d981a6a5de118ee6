"""Local training, written once for every algorithm.

Gradients are taken of the *sum* of per-client losses with respect to a client
tree: since client c's loss depends only on row c of every leaf, the gradient
of the sum is, row by row, each client's own gradient. One autograd call thus
trains the whole cohort — the hand-batched alternative to ``vmap(grad)``.

:func:`run_steps` is the one loop over a minibatch plan: a client without a
batch at a step keeps its state, and losses are averaged over each client's
own steps. :func:`train` (SGD-like training of a parameter tree) is written on
it, and so is every algorithm whose local step is something else (APFL's
three updates, pFedMe's inner solver, FedBN's running statistics, …).
:class:`Proximal` is the proximal term μ/2·‖w − anchor‖² of FedProx, Ditto and
pFedMe.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Annotated

import torch
from pydantic import Field
from torch import Tensor

from fedcal.core.data import Batches
from fedcal.core.tree import Tree, per_client, select, sq_norm, sub, tree_map

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


# A proximal weight above this pins the model to its anchor; with lr·μ > 2 a plain gradient
# step on the term alone already diverges (μ = 1e3 needs lr < 2e-3).
MAX_PROXIMAL_WEIGHT = 1e3


# A proximal weight's declared range (FedProx μ, Ditto λ; see fedcal.core.algorithm)
ProximalWeight = Annotated[float, Field(ge=0.0, le=MAX_PROXIMAL_WEIGHT)]


@dataclass(frozen=True)
class Proximal:
    """The proximal term μ/2·‖w − anchor‖² per client, over the leaves of ``anchor``.

    FedProx's h_k (Li et al. 2020, §3), Ditto's personal objective (Li et al.
    2021, eq. 2) and pFedMe's inner problem (Dinh et al. 2020, §3). Called, it
    is a :data:`Penalty` (clients,) for :func:`train`; :meth:`grad` is its
    gradient μ·(w − anchor), for solvers that step by hand.
    """

    anchor: Tree
    mu: float

    def __call__(self, params: Tree) -> Tensor:
        return 0.5 * self.mu * sq_norm(sub({k: params[k] for k in self.anchor}, self.anchor))

    def grad(self, params: Tree) -> Tree:
        return {k: self.mu * (params[k] - a) for k, a in self.anchor.items()}


def keep_active(new: Tree, old: Tree, active: Tensor) -> Tree:
    """``new`` for clients with ``active`` > 0, ``old`` for the others (trees alike, nested)."""
    return tree_map(lambda n, o: torch.where(per_client(active, n) > 0, n, o), new, old)


StepFn = Callable[[Tree, int, Tensor | None], tuple[Tree, dict[str, Tensor]]]


def run_steps(
    batches: Batches, carry: Tree, step: StepFn, losses: tuple[str, ...] = ("loss",)
) -> tuple[Tree, dict[str, Tensor]]:
    """Every step of a minibatch plan: ``carry ← step(carry, s, active)``.

    ``carry`` is any client tree (parameters, optimizer state, mixing weights…).
    ``active`` is None when every client has a batch at step s (updates may then
    skip masking), else the (clients,) 0/1 mask, which optimizers take too; a
    client without a batch keeps its carry whatever the step computed for it.
    ``step`` returns the new carry and per-client values (clients,) named
    ``losses``; each is averaged over the steps the client was active (0 for
    a client with none). Returns the last carry and those means.
    """
    clients = batches.active.shape[1]
    totals = {k: torch.zeros(clients, dtype=batches.x.dtype) for k in losses}
    for s in range(batches.steps):
        active = None if batches.all_active[s] else batches.active[s]
        new, values = step(carry, s, active)
        carry = new if active is None else keep_active(new, carry, active)
        on = batches.active[s] > 0  # a value computed for an inactive client is not counted
        totals = {k: t + torch.where(on, values[k], 0.0) for k, t in totals.items()}
    steps = batches.active.sum(0).clamp_min(1.0)
    return carry, {k: t / steps for k, t in totals.items()}


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

    def step(carry: Tree, s: int, active: Tensor | None) -> tuple[Tree, dict[str, Tensor]]:
        params = carry["params"]
        value, grads = grad_fn(params, *batches.at(s), names)
        if penalty is not None:
            _, extra = value_and_grad(penalty, params, names)
            grads = {k: g + extra[k] for k, g in grads.items()}
        new, state = optimizer.update(select(params, names), grads, carry["opt"], active)
        return {"params": {**params, **new}, "opt": state}, {"loss": value}

    start = {"params": params, "opt": optimizer.init(select(params, names))}
    end, mean = run_steps(batches, start, step)
    return end["params"], mean["loss"]


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
