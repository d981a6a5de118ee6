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

# ATen's element-wise kernels run whole SIMD vectors (two per iteration) and the last
# ``numel mod 2·width`` elements by a scalar loop; σ's vector exp (SLEEF) and the scalar
# one (libm) differ by an ulp. Which elements of a unit fall in that tail depends on the
# cohort's size, so a unit trained alone (a Flower site of one sensor) and in the fleet
# got different bits (1.1e-16 per σ, amplified to 1.2e-8 by fedgmi_bayes's
# ill-conditioned head posterior: issue 36). Buffers padded to a multiple of LANES
# elements have no tail: every element takes the vector path, wherever it sits.
LANES = 64  # ≥ 2 vectors of any x86-64 width (AVX-512: 8 doubles, 16 floats), a multiple


def padded_empty(shape: tuple[int, ...], like: Tensor) -> tuple[Tensor, Tensor]:
    """A zeroed buffer of ``shape`` (a view) and the flat tensor it starts, padded to a
    multiple of :data:`LANES` elements: an element-wise kernel on the flat one has no tail."""
    n = math.prod(shape)
    flat = like.new_zeros(n + (-n) % LANES)
    return flat[:n].view(shape), flat


def sigmoid_lanes(z: Tensor) -> Tensor:
    """σ(z), every element by ATen's vector path (see :data:`LANES`); differentiable."""
    n = z.numel()
    flat = torch.cat([z.reshape(-1), z.new_zeros((-n) % LANES)])
    return torch.sigmoid(flat)[:n].view(z.shape)


def _tanh(z: Tensor) -> Tensor:
    # tanh(z) = 2·σ(2z) − 1: the same function, but torch's CPU tanh kernel is
    # ~5× slower than sigmoid on this class of machine (measured), and the
    # activation dominates a tiny MLP's step.
    return sigmoid_lanes(2.0 * z).mul(2.0).sub(1.0)


def _silu(z: Tensor) -> Tensor:
    """silu(z) = z·σ(z), σ by :func:`sigmoid_lanes` (a product rounds the same anywhere)."""
    return z * sigmoid_lanes(z)


def _silu_derivative(z: Tensor, h: Tensor) -> Tensor:
    """silu'(z) = σ(z)·(1 + z·(1 − σ(z))), σ by :func:`sigmoid_lanes`."""
    s = sigmoid_lanes(z)
    return s * (1.0 + z * (1.0 - s))


def _twice_less_one(s: Tensor, minus_one: Tensor | None = None) -> Tensor:
    """2s − 1 in place, in one pass: 2s is exact, so the fused −1 + 2·s rounds once,
    as ``s.mul_(2).sub_(1)`` does in two."""
    minus_one = -_one(s) if minus_one is None else minus_one
    return torch.add(minus_one, s, alpha=2.0, out=s)


def _one(like: Tensor) -> Tensor:
    return torch.ones((), dtype=like.dtype, device=like.device)


# Every transcendental through sigmoid_lanes: a unit's bits do not depend on its cohort
# (relu has none: max(z, 0) and its step are exact on either path).
ACTIVATIONS = {"tanh": _tanh, "relu": torch.relu, "silu": _silu}
# Derivative of each activation written in terms of its input z and output h.
DERIVATIVES = {
    "tanh": lambda z, h: torch.addcmul(_one(h), h, h, value=-1.0),  # 1 − h², one pass
    "relu": lambda z, h: (z > 0).to(h.dtype),
    "silu": _silu_derivative,
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
                z2, flat = padded_empty((*hs[-1].shape[:2], w.shape[1]), hs[-1])
                torch.baddbmm(
                    b.unsqueeze(1), hs[-1], w.transpose(1, 2), beta=2.0, alpha=2.0, out=z2
                )
                flat.sigmoid_()  # no scalar tail (LANES)
                zs.append(z2)  # not z: tanh's derivative reads only the output h
                hs.append(_twice_less_one(z2))
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
        step = _TanhSteps(self, live, span, wanted, lr, batches) if fused else None
        xs, ys, ws, denoms, scales = (t.unbind(0) for t in (batches.x, batches.y, w, denom, scale))
        xs_t = batches.x.transpose(2, 3).unbind(0) if step is not None else None
        values: list[Tensor | None] = []  # each step's loss; None: the fused step's, below
        with torch.no_grad():
            for s in range(batches.steps):
                if step is not None and batches.all_active[s]:
                    step(s, xs[s], xs_t[s], ys[s], scales[s])
                    values.append(None)
                    continue
                hs, zs = self._forward(live, xs[s])
                resid = hs[-1] - ys[s]
                value = (resid.pow(2).mean(-1) * ws[s]).sum(1) / denoms[s]
                grads = backprop(live, resid * scales[s], hs, zs, span, wanted, derivative)
                if batches.all_active[s]:
                    for k in names:
                        live[k].add_(grads[k], alpha=-lr)
                    values.append(value)
                    continue
                # As SGD.update then run_steps' keep_active: d zeroed for idle clients,
                # and their old values kept whatever the step computed.
                for k in names:
                    p, g = live[k], grads[k]
                    moved = torch.add(p, per_client(active[s], g) * g, alpha=-lr)
                    p.copy_(torch.where(per_client(active[s], moved) > 0, moved, p))
                values.append(torch.where(on[s], value, 0.0))
            # The fused steps' losses from their stored residuals, all steps at once (the
            # same element-wise numbers), summed in step order as the generic loop does.
            fused_values = step.losses(w, denom) if step is not None else None
            for s, value in enumerate(values):
                total.add_(fused_values[s] if value is None else value)
        return live, total / active.sum(0).clamp_min(1.0)


class _TanhSteps:
    """One plain SGD step of a tanh MLP on a cohort of ≥ 2 clients, all with a batch.

    The very operations of ``MLP._forward`` (its in-place tanh), ``mse_and_output_grad``,
    :func:`backprop` and ``SGD.update``, in the same order — so the same numbers — but
    with the layers' transposed views made once, the activations written into buffers
    reused from step to step, each layer's parameters updated in place as soon as the
    layer below no longer needs them, and the loss left for :meth:`losses` (it is only
    reported: the step needs the residual, not its mean square).
    """

    def __init__(
        self, model: MLP, live: Tree, span: range, wanted: set[str], lr: float, batches: Batches
    ) -> None:
        n = len(model.sizes) - 1
        weights = [live[f"l{k}.weight"] for k in range(n)]
        biases = [live[f"l{k}.bias"] for k in range(n)]
        self.lr = -lr
        self.forward = [
            (b.unsqueeze(1), w.transpose(1, 2)) for w, b in zip(weights, biases, strict=True)
        ]
        # Residuals of every step (steps, clients, batch, out), as views per step; rows of
        # steps not run here stay 0 and are never read.
        self.resid = batches.y.new_zeros(batches.y.shape)
        self.resid_at = self.resid.unbind(0)
        self.one = _one(batches.x)
        self.minus_one = -self.one
        # Buffers reused from step to step, so that their transposed views are made once:
        # activations h_1 … h_{L−1}, δ = dL/dz of every layer, and 1 − h².
        c, rows = batches.x.shape[1], batches.x.shape[2]
        padded = [padded_empty((c, rows, w.shape[1]), batches.x) for w in weights[:-1]]
        self.hidden = [h for h, _ in padded]
        self.hidden_flat = [flat for _, flat in padded]  # σ over these: no tail (LANES)
        deltas = [  # none below the lowest trained layer: δ stops there
            batches.x.new_empty(c, rows, w.shape[1]) if k >= span.start else None
            for k, w in enumerate(weights)
        ]
        self.top = deltas[-1]
        # The backward pass, top layer first, one entry per layer k:
        # (k, δ_k, δ_kᵀ, W_k, W_kᵀ if its gradient is taken as (hᵀδ)ᵀ — a layer narrower
        # at its input, where MKL's batched GEMM is faster with the narrow side on the
        # left — train W_k?, b_k if trained, (δ_{k−1}, 1 − h_k²) below the lowest
        # trained layer: None).
        self.backward = [
            (
                k,
                deltas[k],
                deltas[k].transpose(1, 2),
                weights[k],
                weights[k].transpose(1, 2) if model.sizes[k] < model.sizes[k + 1] else None,
                f"l{k}.weight" in wanted,
                biases[k] if f"l{k}.bias" in wanted else None,
                (deltas[k - 1], torch.empty_like(deltas[k - 1])) if k > span.start else None,
            )
            for k in reversed(span)
        ]
        self.hidden_t = [h.transpose(1, 2) for h in self.hidden]

    def __call__(self, s: int, x: Tensor, x_t: Tensor, y: Tensor, scale: Tensor) -> None:
        """Step ``s`` on batch (x, y), ``x_t`` = xᵀ per client; ``scale`` from
        ``mse_and_output_grad``: δ of the output = (pred − y)·scale."""
        hs, hs_t = [x, *self.hidden], [x_t, *self.hidden_t]
        for k, (bias, w_t) in enumerate(self.forward[:-1]):  # h = 2σ(2z) − 1 on the GEMM's 2z
            z2 = torch.baddbmm(bias, hs[k], w_t, beta=2.0, alpha=2.0, out=hs[k + 1])
            self.hidden_flat[k].sigmoid_()
            _twice_less_one(z2, self.minus_one)
        bias, w_t = self.forward[-1]
        # pred − y, written where losses() will read it
        resid = torch.baddbmm(bias, hs[-1], w_t, out=self.resid_at[s]).sub_(y)
        torch.mul(resid, scale, out=self.top)
        lr = self.lr
        for k, delta, delta_t, weight, weight_t, train_w, bias, below in self.backward:
            h = hs[k]
            if below is not None:  # δ of the layer below, through this layer's old weights
                down, square = below
                slope = torch.addcmul(self.one, h, h, value=-1.0, out=square)
                if weight.shape[1] == 1:
                    # A one-wide layer's δW is an outer product: the GEMM's numbers (one
                    # term per sum), by one element-wise pass instead of a GEMM call.
                    torch.mul(delta, weight, out=down)
                else:
                    torch.bmm(delta, weight, out=down)
                down.mul_(slope)
            if train_w:
                if weight_t is not None:
                    weight_t.add_(torch.bmm(hs_t[k], delta), alpha=lr)
                else:
                    weight.add_(torch.bmm(delta_t, h), alpha=lr)
            if bias is not None:
                bias.add_(delta.sum(1), alpha=lr)

    def losses(self, w: Tensor, denom: Tensor) -> Tensor:
        """Every step's loss (steps, clients): ``mse_and_output_grad``'s value from the
        stored residuals (steps not run here give 0)."""
        return (self.resid.pow(2).mean(-1) * w).sum(2) / denom
