"""Local optimizers as pure ``(init, update)`` pairs over client trees.

Every update takes ``active`` (clients,): a client that has no batch at a
step keeps its parameters and optimizer state unchanged, so clients with
fewer rows simply stop early, as they would training alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fedcal.core.tree import Tree, per_client, tree_map, zeros_like


@dataclass(frozen=True)
class SGD:
    """``torch.optim.SGD`` semantics: v ← μ·v + (g + λ·p); p ← p − lr·v (dampening 0)."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0

    def init(self, params: Tree) -> Tree:
        return zeros_like(params) if self.momentum else {}

    def update(
        self, params: Tree, grads: Tree, state: Tree, active: Tensor | None = None
    ) -> tuple[Tree, Tree]:
        if self.weight_decay:
            grads = tree_map(lambda g, p: g + self.weight_decay * p, grads, params)
        if self.momentum:
            # torch initialises the buffer with the first gradient; a zero buffer
            # gives the same first step (μ·0 + g).
            new_state = tree_map(lambda v, g: self.momentum * v + g, state, grads)
            direction = new_state
        else:
            new_state, direction = state, grads
        if active is None:
            # One fused call for all leaves: the common case of a full cohort step.
            keys = list(params)
            moved = torch._foreach_add(
                [params[k] for k in keys], [direction[k] for k in keys], alpha=-self.lr
            )
            return dict(zip(keys, moved, strict=True)), new_state
        # The same kernel as the fused call (p + (−lr)·d), on d zeroed for idle clients: an
        # active client's numbers do not depend on who else is idle at this step.
        step = tree_map(
            lambda p, d: torch.add(p, per_client(active, d) * d, alpha=-self.lr), params, direction
        )
        if self.momentum:
            new_state = tree_map(
                lambda new, old: torch.where(per_client(active, new) > 0, new, old),
                new_state,
                state,
            )
        return step, new_state


@dataclass(frozen=True)
class Adam:
    """``torch.optim.Adam`` semantics with per-client step counts."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def init(self, params: Tree) -> Tree:
        first = next(iter(params.values()))
        return {
            "m": zeros_like(params),
            "v": zeros_like(params),
            "t": torch.zeros(first.shape[0], dtype=first.dtype),
        }

    def update(
        self, params: Tree, grads: Tree, state: Tree, active: Tensor | None = None
    ) -> tuple[Tree, Tree]:
        b1, b2 = self.betas
        on = torch.ones_like(state["t"]) if active is None else active
        t = state["t"] + on

        def moment(old: Tensor, new: Tensor) -> Tensor:
            a = per_client(on, old)
            return a * new + (1 - a) * old

        m = tree_map(lambda m, g: moment(m, b1 * m + (1 - b1) * g), state["m"], grads)
        v = tree_map(lambda v, g: moment(v, b2 * v + (1 - b2) * g * g), state["v"], grads)
        c1 = 1 - b1 ** t.clamp_min(1)
        c2 = 1 - b2 ** t.clamp_min(1)

        def step(p: Tensor, m: Tensor, v: Tensor) -> Tensor:
            upd = per_client(on * self.lr / c1, m) * m / ((v / per_client(c2, v)).sqrt() + self.eps)
            return p - upd

        return tree_map(step, params, m, v), {"m": m, "v": v, "t": t}


def plain_sgd_lr(optimizer: object) -> float | None:
    """The learning rate of an :class:`SGD` without momentum or weight decay, else None
    (what a model's fused SGD loop, e.g. ``MLP.sgd_train``, implements)."""
    if type(optimizer) is SGD and not optimizer.momentum and not optimizer.weight_decay:
        return optimizer.lr
    return None


def make_optimizer(name: str, lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
    """``"sgd"`` (the seeds' choice) or ``"adam"``."""
    if name == "sgd":
        return SGD(lr, momentum, weight_decay)
    if name == "adam":
        return Adam(lr)
    raise ValueError(f"unknown optimizer {name!r}; choose 'sgd' or 'adam'")
