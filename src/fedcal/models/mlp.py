"""The seed's fully connected regressor, hand-batched over a clients axis.

Each layer is one ``baddbmm`` over all clients, so a cohort of any size costs
a handful of kernel launches per step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from fedcal.core.data import Batches
from fedcal.core.tree import Tree, per_client


def _tanh(z: Tensor) -> Tensor:
    # tanh(z) = 2·σ(2z) − 1: the same function, but torch's CPU tanh kernel is
    # ~5× slower than sigmoid on this class of machine (measured), and the
    # activation dominates a tiny MLP's step.
    return torch.sigmoid(2.0 * z).mul(2.0).sub(1.0)


ACTIVATIONS = {"tanh": _tanh, "relu": torch.relu, "silu": torch.nn.functional.silu}
# Derivative of each activation written in terms of its input z and output h.
DERIVATIVES = {
    "tanh": lambda z, h: (h * h).neg_().add_(1.0),  # 1 − h², one temporary
    "relu": lambda z, h: (z > 0).to(h.dtype),
    "silu": lambda z, h: torch.sigmoid(z) * (1.0 + z * (1.0 - torch.sigmoid(z))),
}


def mse_and_output_grad(pred: Tensor, y: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """Masked MSE (clients,) (:func:`fedcal.core.task.masked_mse`) and its gradient w.r.t.
    ``pred`` (clients, batch, out): the start of every hand-written backward pass."""
    resid = pred - y  # (clients, batch, out)
    denom = w.sum(1).clamp_min(1.0)  # (clients,)
    value = (resid.pow(2).mean(-1) * w).sum(1) / denom
    # dL/d(output) for L = Σ_b w_b · mean_t r² / Σw
    delta = resid * (2.0 * w / (denom.unsqueeze(1) * resid.shape[-1])).unsqueeze(-1)
    return value, delta


def lowest_layer(wanted: set[str], layers: int) -> int:
    """The lowest of the linear layers l0…l{layers−1} with a requested parameter (else layers)."""
    requested = (k for k in range(layers) if {f"l{k}.weight", f"l{k}.bias"} & wanted)
    return min(requested, default=layers)


def backprop(
    params: Tree,
    delta: Tensor,
    hs: list[Tensor],
    zs: list[Tensor],
    layers: range,
    wanted: set[str],
    derivative,
) -> Tree:
    """Gradients of the requested parameters of linear layers ``l{k}``, k in ``layers``.

    ``delta`` = dL/dz of the top layer's output (clients, batch, width); h_k is
    layer k's input, z_{k−1} the pre-activation of h_k = act(z_{k−1}).
    """
    grads: Tree = {}
    for k in reversed(layers):
        if f"l{k}.weight" in wanted:
            # δᵀh (out, in); for a layer narrower at its input, (hᵀδ)ᵀ: the same dot
            # products, but MKL's batched GEMM is ~4× faster with the narrow side on the
            # left (measured on the 2-input first layer).
            grads[f"l{k}.weight"] = (
                torch.bmm(hs[k].transpose(1, 2), delta).transpose(1, 2)
                if hs[k].shape[-1] < delta.shape[-1]
                else torch.bmm(delta.transpose(1, 2), hs[k])
            )
        if f"l{k}.bias" in wanted:
            grads[f"l{k}.bias"] = delta.sum(1)
        if k > layers.start:
            delta = torch.bmm(delta, params[f"l{k}.weight"]).mul_(derivative(zs[k - 1], hs[k]))
    return grads


def _affine(b: Tensor, h: Tensor, w: Tensor) -> Tensor:
    """b + h·wᵀ per client: b (clients, out), h (clients, rows, in), w (clients, out, in)."""
    if h.shape[0] == 1 and w.shape[1] == 1:
        # One client and one output: torch would take MKL's matrix-vector path, whose sums
        # round differently from the batched GEMM. A batch of two (the client twice, as
        # a view) keeps a client's numbers the same alone, in a chunk or in the fleet.
        return torch.baddbmm(
            b.unsqueeze(1).expand(2, -1, -1),
            h.expand(2, -1, -1),
            w.transpose(1, 2).expand(2, -1, -1),
        )[:1]
    return torch.baddbmm(b.unsqueeze(1), h, w.transpose(1, 2))


@dataclass(frozen=True)
class MLP:
    """in → hidden… → out, fully connected.

    Parameters are named ``l{k}.weight`` (out, in) and ``l{k}.bias`` (out,) as
    in ``torch.nn.Linear``; initialised like ``nn.Linear`` (uniform ±1/√fan_in)
    so that a plain ``nn.Module`` reference reproduces it exactly.
    """

    in_features: int = 2
    hidden: tuple[int, ...] = (64, 64)
    out_features: int = 1
    activation: str = "tanh"

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}")

    @property
    def sizes(self) -> list[int]:
        return [self.in_features, *self.hidden, self.out_features]

    def layers(self) -> list[tuple[str, ...]]:
        return [(f"l{k}.weight", f"l{k}.bias") for k in range(len(self.sizes) - 1)]

    def init(self, generator: torch.Generator, dtype: torch.dtype = torch.float32) -> Tree:
        params: Tree = {}
        for k, (fan_in, fan_out) in enumerate(zip(self.sizes[:-1], self.sizes[1:], strict=True)):
            bound = 1.0 / math.sqrt(fan_in)
            w = torch.empty(fan_out, fan_in, dtype=torch.float64).uniform_(
                -bound, bound, generator=generator
            )
            b = torch.empty(fan_out, dtype=torch.float64).uniform_(
                -bound, bound, generator=generator
            )
            params[f"l{k}.weight"] = w.to(dtype)
            params[f"l{k}.bias"] = b.to(dtype)
        return params

    def apply(self, params: Tree, x: Tensor) -> Tensor:
        """params: client tree; x (clients, batch, in) → (clients, batch, out)."""
        return self._forward(params, x)[0][-1]

    def _forward(
        self, params: Tree, x: Tensor, body_only: bool = False
    ) -> tuple[list[Tensor], list[Tensor]]:
        """Activations h_0 = x … h_L = output, and pre-activations z_1 … z_{L-1}
        (``body_only``: up to h_{L-1}, the last layer's input)."""
        act = ACTIVATIONS[self.activation]
        # Without autograd, tanh runs in place on fresh buffers: the GEMM yields 2z
        # directly (scaling by 2 is exact) and 2σ(2z) − 1 needs no temporaries —
        # the same numbers as _tanh with three fewer passes and allocations.
        fused_tanh = self.activation == "tanh" and not torch.is_grad_enabled()
        hs, zs = [x], []
        last = len(self.sizes) - 2
        for k in range(last if body_only else last + 1):
            w, b = params[f"l{k}.weight"], params[f"l{k}.bias"]
            if k < last and fused_tanh:
                z2 = torch.baddbmm(b.unsqueeze(1), hs[-1], w.transpose(1, 2), beta=2.0, alpha=2.0)
                zs.append(z2)  # not z: tanh's derivative reads only the output h
                hs.append(torch.sigmoid_(z2).mul_(2.0).sub_(1.0))
                continue
            z = _affine(b, hs[-1], w)
            if k < last:
                zs.append(z)
                z = act(z)
            hs.append(z)
        return hs, zs

    def head_input(self, params: Tree, x: Tensor) -> Tensor:
        """The last layer's input (clients, rows, width): the body's features of ``x``."""
        with torch.no_grad():
            return self._forward(params, x, body_only=True)[0][-1]

    def head_value_and_grad(
        self, params: Tree, features: Tensor, y: Tensor, w: Tensor
    ) -> tuple[Tensor, Tree]:
        """:meth:`mse_value_and_grad` with respect to the last layer only, from its input
        ``features`` (:meth:`head_input`): the same numbers without the body's pass."""
        last = len(self.sizes) - 2
        names = {f"l{last}.weight", f"l{last}.bias"}
        with torch.no_grad():
            pred = _affine(params[f"l{last}.bias"], features, params[f"l{last}.weight"])
            value, delta = mse_and_output_grad(pred, y, w)
            hs = [features] * (last + 1)  # backprop reads only the last layer's input
            grads = backprop(params, delta, hs, [], range(last, last + 1), names, None)
        return value, {n: grads[n] for n in (f"l{last}.weight", f"l{last}.bias")}

    def mse_value_and_grad(
        self, params: Tree, x: Tensor, y: Tensor, w: Tensor, wrt: Iterable[str] | None = None
    ) -> tuple[Tensor, Tree]:
        """Masked MSE (see :func:`fedcal.core.task.masked_mse`) and its gradient, by hand.

        Backpropagation written out for this one architecture: no autograd
        graph is built, and layers below the lowest requested one are not
        visited. Equal to autograd's gradient (tested at float64).
        """
        with torch.no_grad():
            hs, zs = self._forward(params, x)
            value, delta = mse_and_output_grad(hs[-1], y, w)
            wanted = set(params) if wrt is None else set(wrt)
            layers = len(self.sizes) - 1
            span = range(lowest_layer(wanted, layers), layers)
            grads = backprop(params, delta, hs, zs, span, wanted, DERIVATIVES[self.activation])
        order = [n for layer in self.layers() for n in layer if n in grads]
        return value, {n: grads[n] for n in order}

    def sgd_train(
        self, params: Tree, batches: Batches, lr: float, wrt: Iterable[str] | None = None
    ) -> tuple[Tree, Tensor]:
        """Plain SGD (no momentum, no weight decay) over a minibatch plan, fused.

        The same numbers as :func:`fedcal.core.local.train` with
        :meth:`mse_value_and_grad` and :class:`fedcal.core.optim.SGD` (tested to the
        bit): p ← p − lr·∇p each step, a client without a batch keeping its
        parameters; returns the new tree and each client's mean batch loss over its
        own steps. Faster because the trained leaves are updated in place on one
        private copy (no new tree, optimizer state or masked copy per step) and
        the forward pass writes into buffers allocated once.
        """
        names = list(params) if wrt is None else [k for k in params if k in set(wrt)]
        wanted = set(names)
        live = {k: v.contiguous().clone() if k in wanted else v for k, v in params.items()}
        layers = len(self.sizes) - 1
        span = range(lowest_layer(wanted, layers), layers)
        derivative = DERIVATIVES[self.activation]
        active = batches.active
        total = torch.zeros(active.shape[1], dtype=batches.x.dtype)
        # The loss's per-row factors of every step at once (mse_and_output_grad's, element
        # by element: the same numbers), and the steps' masks.
        w = batches.w
        denom = w.sum(2).clamp_min(1.0)
        scale = (2.0 * w / (denom.unsqueeze(2) * batches.y.shape[-1])).unsqueeze(-1)
        on = active > 0
        fused = self.activation == "tanh" and active.shape[1] > 1
        step = _TanhSteps(self, live, span, wanted, lr) if fused else None
        with torch.no_grad():
            for s in range(batches.steps):
                if step is not None and batches.all_active[s]:
                    total.add_(step(batches.x[s], batches.y[s], w[s], denom[s], scale[s]))
                    continue
                hs, zs = self._forward(live, batches.x[s])
                resid = hs[-1] - batches.y[s]
                value = (resid.pow(2).mean(-1) * w[s]).sum(1) / denom[s]
                grads = backprop(live, resid * scale[s], hs, zs, span, wanted, derivative)
                if batches.all_active[s]:
                    for k in names:
                        live[k].add_(grads[k], alpha=-lr)
                    total.add_(value)
                    continue
                # As SGD.update then run_steps' keep_active: d zeroed for idle clients,
                # and their old values kept whatever the step computed.
                for k in names:
                    p, g = live[k], grads[k]
                    moved = torch.add(p, per_client(active[s], g) * g, alpha=-lr)
                    p.copy_(torch.where(per_client(active[s], moved) > 0, moved, p))
                total.add_(torch.where(on[s], value, 0.0))
        return live, total / active.sum(0).clamp_min(1.0)


class _TanhSteps:
    """One plain SGD step of a tanh MLP on a cohort of ≥ 2 clients, all with a batch.

    The very operations of ``MLP._forward`` (its in-place tanh), ``mse_and_output_grad``,
    :func:`backprop` and ``SGD.update``, in the same order — so the same numbers — but
    with the layers' transposed views made once, the activations written into buffers
    reused from step to step, and each layer's parameters updated in place as soon as
    the layer below no longer needs them.
    """

    def __init__(self, model: MLP, live: Tree, span: range, wanted: set[str], lr: float) -> None:
        n = len(model.sizes) - 1
        self.weights = [live[f"l{k}.weight"] for k in range(n)]
        self.biases = [live[f"l{k}.bias"].unsqueeze(1) for k in range(n)]
        self.w_t = [w.transpose(1, 2) for w in self.weights]
        self.train_w = [f"l{k}.weight" in wanted for k in range(n)]
        self.train_b = [f"l{k}.bias" in wanted for k in range(n)]
        self.span, self.lr = span, lr
        self.buffers: list[Tensor] | None = None
        self.square: list[Tensor] | None = None

    def __call__(self, x: Tensor, y: Tensor, w: Tensor, denom: Tensor, scale: Tensor) -> Tensor:
        last = len(self.weights) - 1
        if self.buffers is None or self.buffers[0].shape[1] != x.shape[1]:
            c, rows = x.shape[0], x.shape[1]
            widths = [self.weights[k].shape[1] for k in range(last)]
            self.buffers = [x.new_empty(c, rows, d) for d in widths]
            self.square = [x.new_empty(c, rows, d) for d in widths]
        hs = [x]
        for k in range(last):  # h = 2σ(2z) − 1, in place on the GEMM's 2z
            z2 = torch.baddbmm(
                self.biases[k], hs[-1], self.w_t[k], beta=2.0, alpha=2.0, out=self.buffers[k]
            )
            hs.append(z2.sigmoid_().mul_(2.0).sub_(1.0))
        pred = torch.baddbmm(self.biases[last], hs[-1], self.w_t[last])
        resid = pred - y
        value = (resid.pow(2).mean(-1) * w).sum(1) / denom
        delta = resid * scale
        for k in reversed(self.span):
            h = hs[k]
            grad_w = grad_b = None
            if self.train_w[k]:
                grad_w = (
                    torch.bmm(h.transpose(1, 2), delta).transpose(1, 2)
                    if h.shape[-1] < delta.shape[-1]
                    else torch.bmm(delta.transpose(1, 2), h)
                )
            if self.train_b[k]:
                grad_b = delta.sum(1)
            if k > self.span.start:  # δ of the layer below, through this layer's old weights
                slope = torch.mul(h, h, out=self.square[k - 1]).neg_().add_(1.0)
                delta = torch.bmm(delta, self.weights[k]).mul_(slope)
            if grad_w is not None:
                self.weights[k].add_(grad_w, alpha=-self.lr)
            if grad_b is not None:
                self.biases[k].squeeze(1).add_(grad_b, alpha=-self.lr)
        return value
