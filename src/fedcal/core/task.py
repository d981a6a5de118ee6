"""What is being learned: a model family and its loss, with a named head.

A :class:`Model` is a pair of pure functions over parameter trees —
``init`` draws server-side parameters, ``apply`` evaluates a client tree on a
cohort's inputs. The :class:`Task` binds a model to a loss and names the
parameters that form the private head φ (the rest is the shared feature
extractor ω of FedPer, FedRep and FedGMI); :meth:`Task.split` and
:meth:`Task.join` take a model apart into (ω, φ) and put it back together.

A model may carry a hand-written gradient of the masked squared error
(``mse_value_and_grad``, no autograd graph: the MLP and the basis). It is the
gradient of *that* loss only, so :meth:`Task.value_and_grad` uses it only when
the task's loss is :class:`Task`'s own; any task that changes the loss or its
criterion (classification, the SVM) is differentiated by autograd.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from fedcal.core.data import Batches
from fedcal.core.local import GradFn, value_and_grad
from fedcal.core.tree import Tree


class Model(Protocol):
    """A model family written for a clients axis (see :mod:`fedcal.core.tree`)."""

    def init(self, generator: torch.Generator, dtype: torch.dtype) -> Tree:
        """Fresh parameters, without a clients axis."""
        ...

    def apply(self, params: Tree, x: Tensor) -> Tensor:
        """``params`` a client tree, ``x`` (clients, batch, in) → (clients, batch, out)."""
        ...

    def layers(self) -> list[tuple[str, ...]]:
        """Parameter names grouped by layer, from input to output."""
        ...


def masked_mse(pred: Tensor, y: Tensor, w: Tensor) -> Tensor:
    """Per-client mean squared error over the real rows: (clients,).

    pred, y: (clients, batch, targets); w: (clients, batch) with 0 on padding.
    Clients without rows get 0 (and so a zero gradient).
    """
    err = (pred - y).pow(2).mean(-1)
    return (err * w).sum(1) / w.sum(1).clamp_min(1.0)


@dataclass(frozen=True)
class Task:
    """A model, its loss, and the split of its parameters into body ω and head φ."""

    model: Model
    head_layers: int = 1

    kind = "regression"
    primary_metric = "rmse"  # the metric summaries rank by (lower is better)

    @property
    def head(self) -> tuple[str, ...]:
        """Names of the head parameters φ: those of the last ``head_layers`` layers."""
        layers = self.model.layers()
        if not 0 <= self.head_layers <= len(layers):
            raise ValueError(f"head_layers={self.head_layers} but the model has {len(layers)}")
        chosen = layers[len(layers) - self.head_layers :]
        return tuple(name for layer in chosen for name in layer)

    @property
    def body(self) -> tuple[str, ...]:
        head = set(self.head)
        return tuple(n for layer in self.model.layers() for n in layer if n not in head)

    def split(self, params: Tree) -> tuple[Tree, Tree]:
        """(body ω, head φ) of a flat parameter tree (key order kept)."""
        head = set(self.head)
        body = {k: v for k, v in params.items() if k not in head}
        return body, {k: v for k, v in params.items() if k in head}

    def join(self, base: Tree, head: Tree) -> Tree:
        """``base`` (a body, or a whole model) with the head parameters of ``head``.

        Head leaves of ``base`` are replaced in place; key order is ``base``'s,
        then any head names ``base`` lacks. Only ``head``'s head names are read.
        """
        names = set(self.head)
        return {**base, **{k: v for k, v in head.items() if k in names}}

    def predict(self, params: Tree, x: Tensor) -> Tensor:
        return self.model.apply(params, x)

    def criterion(self, pred: Tensor, y: Tensor, w: Tensor) -> Tensor:
        """Per-client loss (clients,) of predictions ``pred`` = the model's output."""
        return masked_mse(pred, y, w)

    def loss(self, params: Tree, x: Tensor, y: Tensor, w: Tensor) -> Tensor:
        """Per-client training loss (clients,)."""
        return self.criterion(self.model.apply(params, x), y, w)

    @property
    def hand_gradient(self) -> GradFn | None:
        """The model's hand-written gradient if it is this task's loss's, else None.

        ``mse_value_and_grad`` differentiates ``masked_mse(model.apply(·))``:
        valid only while neither ``loss`` nor ``criterion`` is overridden.
        """
        cls = type(self)
        if cls.loss is not Task.loss or cls.criterion is not Task.criterion:
            return None
        return getattr(self.model, "mse_value_and_grad", None)

    def metrics(self, pred: Tensor, y: Tensor, mask: Tensor, y_scale: Tensor) -> dict[str, Tensor]:
        """Per-client RMSE, MAE and max |error| (clients,), in the target's unit.

        pred, y: (clients, rows, targets) in scaled units; mask: (clients, rows);
        y_scale: (targets,) undoes the scaling (offsets cancel in a difference).
        """
        err = (pred - y) * y_scale
        m = mask.unsqueeze(-1)
        n = (mask.sum(1) * err.shape[-1]).clamp_min(1.0)
        abs_err = err.abs() * m
        return {
            "rmse": ((err.pow(2) * m).sum((1, 2)) / n).sqrt(),
            "mae": abs_err.sum((1, 2)) / n,
            "max_abs": abs_err.amax((1, 2)),
        }

    def sgd_train(
        self, params: Tree, batches: Batches, lr: float, wrt: Iterable[str] | None = None
    ) -> tuple[Tree, Tensor] | None:
        """The model's fused plain-SGD loop over ``batches`` (same numbers as
        :func:`fedcal.core.local.train` with :class:`fedcal.core.optim.SGD`), or None
        when the model has none or the loss is not the one it differentiates."""
        fused = getattr(self.model, "sgd_train", None)
        if fused is None or self.hand_gradient is None:
            return None
        return fused(params, batches, lr, wrt)

    def head_input(self, params: Tree, x: Tensor) -> Tensor | None:
        """The input of a one-layer head under the body of ``params`` (the model's
        ``head_input``), or None when the task cannot differentiate the head from it
        (a deeper head, another loss, a model without the method)."""
        fn = getattr(self.model, "head_input", None)
        if self.head_layers != 1 or fn is None or self.hand_gradient is None:
            return None
        return fn(params, x)

    def head_value_and_grad(
        self, params: Tree, features: Tensor, y: Tensor, w: Tensor
    ) -> tuple[Tensor, Tree]:
        """``value_and_grad(params, x, y, w, self.head)`` from the head's input
        ``features`` = ``head_input(params, x)``: the same numbers, the body not rerun."""
        return self.model.head_value_and_grad(params, features, y, w)

    def value_and_grad(
        self, params: Tree, x: Tensor, y: Tensor, w: Tensor, wrt: Iterable[str] | None = None
    ) -> tuple[Tensor, Tree]:
        """``loss`` and its gradient w.r.t. ``wrt``: the model's hand-written
        backward pass when it is this loss's (:attr:`hand_gradient`), autograd otherwise."""
        by_hand = self.hand_gradient
        if by_hand is not None:
            return by_hand(params, x, y, w, wrt)
        return value_and_grad(lambda p: self.loss(p, x, y, w), params, wrt)
