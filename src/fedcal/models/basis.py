"""A physics-aware regressor: a shared basis with a linear per-sensor head.

Why this shape
--------------
A resonant barometer's calibration is a smooth surface P(f, T). For the
quartz family the Digiquartz equation, expanded, is a polynomial in f² with
temperature-dependent coefficients,

    P = C(1 − D) + C·T0²·(2D − 1)·f² − C·D·T0⁴·f⁴,   C, D, T0 polynomials in T,

and makers calibrate silicon resonators with a 2-D polynomial up to order
(4, 3) (docs/simulated-fleet.md). What differs between sensors is the
*coefficients*, not the form. So the model is

    features(x) = [ Q_ij(x) for (i, j) ≠ 0, i ≤ p_f, j ≤ p_T ]  ‖  h(x)
    y           = W · features(x) + b                             (the head φ)

* **Fixed polynomial terms** Q_ij = P̃_i(x_f)·P̃_j(x_T): products of
  normalized Legendre polynomials P̃_n = √(2n+1)·P_n of the scaled inputs
  (each has unit mean square on [-1, 1], so a uniform design gives an
  orthonormal basis). They carry the part of the physics every sensor shares:
  the form of the surface. They have no parameters (computed in ``apply``);
  the head's weights on them are one sensor's calibration coefficients, so a
  per-sensor least-squares polynomial fit is exactly a point of this model
  (tested). Legendre rather than monomials: monomials of degree 3 on [-1, 1]
  are close to collinear, which slows every gradient method.
* **Learned shared features** h(x): the last hidden layer of a small tanh MLP
  (the body ω that FedPer/FedRep/FedGMI share). It is for what a low-order
  polynomial cannot follow but the fleet has in common (higher-order or
  non-polynomial terms of the physics, common to the family); its output
  enters the head linearly, so each sensor chooses how much of it to use.
* **Linear head** (W, b): the private regressor φ under the default
  ``head_layers=1``; the constant term of the polynomial is the head bias.

With ``hidden=()`` there is no MLP: the model is a per-sensor polynomial
surface trained by gradient descent (an empty body).

Conditioning: what decides whether gradient descent gets there
---------------------------------------------------------------
The span is right from the start (a least-squares head reaches the
polynomial floor, ≈0.044 hPa on the default fleet); what a first-order
recipe reaches depends on the coordinates. One quartz sensor covers only
~0.6 of the scaled frequency axis, where Legendre terms of one input are
nearly collinear: the per-sensor Gram matrix of the (3, 3) terms has a
condition number ≈2·10⁵ on [-1, 1] (measured, default fleet), and SGD
stalls at ≈13 hPa after the seed's 3000 steps. Two fixes, both optional:

* ``poly_domain``: the interval of each scaled input that is mapped onto
  [-1, 1] (prior knowledge of the sensor family, e.g. quartz spans
  32.8–37.6 kHz ≈ [-0.05, 0.92] scaled): κ ≈ 2·10³.
* :func:`whitened`: centre and decorrelate the terms with the fleet's
  mean and covariance of φ(x), computed from per-client sums only (a
  federated statistic like the scaler's): κ ≈ 20 (max 69). With it a plain
  polynomial head trained by the seed's SGD reaches ≈0.05 hPa.

Inputs outside the domain are not clamped: Legendre terms grow quickly
there, which is honest extrapolation of a polynomial calibration, not hidden
by the model.

Initialisation: MLP layers like ``nn.Linear`` (uniform ±1/√fan_in); head
weights on the polynomial terms start at 0 (gradient descent from 0 on a
linear model moves only within the span of the data, the minimum-norm
solution when points are few); head weights on the learned features and the
bias like ``nn.Linear`` with fan_in = number of features.

Parameters: ``l{k}.weight`` (out, in), ``l{k}.bias`` (out,) for the MLP
layers, ``head.weight`` (out, terms + hidden[-1]) and ``head.bias`` (out,).
A hand-written backward pass (``mse_value_and_grad``) avoids building an
autograd graph at every step (equal to autograd, tested).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from fedcal.core.tree import Tree
from fedcal.models.families import (  # noqa: F401 (re-exported: callers import them here)
    FAMILIES,
    LEGENDRE,
    MONOMIAL,
    BasisFamily,
    any_beyond,
    basis_family,
    legendre,
    legendre_derivatives,
    monomial_products,
    register_family,
)
from fedcal.models.mlp import (
    ACTIVATIONS,
    DERIVATIVES,
    backprop,
    lowest_layer,
    mse_and_output_grad,
)


@functools.lru_cache(maxsize=64)
def _constants(
    center: tuple[float, ...], transform: tuple[tuple[float, ...], ...], dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    # The whitening as tensors, built once per model and dtype (not at every step).
    return torch.tensor(center, dtype=dtype), torch.tensor(transform, dtype=dtype)


#: The most terms a Legendre-product basis may have: a fleet prior's p × p covariance and
#: every unit's p × p Gram must stay small (500 terms: 2 MB a matrix). 8 inputs at total
#: degree 4 (495 terms) fit; an order-4 tensor over 8 inputs (390,625 terms) is refused.
MAX_TERMS = 500


def basis_size(
    num_inputs: int, orders: Sequence[int] | None = None, degree: int | None = None
) -> int:
    """Terms of the tensor basis Π(o_k + 1), or of the total-degree basis C(F + d, d)."""
    if orders is not None:
        return math.prod(int(o) + 1 for o in orders)
    return math.comb(num_inputs + int(degree), int(degree))


def legendre_exponents(
    num_inputs: int,
    orders: Sequence[int] | None = None,
    degree: int | None = None,
    max_terms: int = MAX_TERMS,
) -> tuple[tuple[int, ...], ...]:
    """The terms of a Legendre-product basis as exponent tuples, constant term first.

    ``orders`` (one per input): the tensor product, every (a_1..a_F) with a_k ≤
    orders[k]; ``degree``: the total-degree basis, every term with Σ a_k ≤ degree
    (for many inputs, where the tensor product grows as Π(orders+1)).
    Ordered by total degree, then lexicographically. A basis of more than
    ``max_terms`` terms is refused in one line before anything is enumerated.
    """
    if (orders is None) == (degree is None):
        raise ValueError("give either orders (one per input) or a total degree")
    if orders is not None:
        if len(orders) != num_inputs or any(o < 0 for o in orders):
            raise ValueError(f"orders needs one order >= 0 per input ({num_inputs}), got {orders}")
    elif degree < 0:
        raise ValueError(f"degree must be >= 0, got {degree}")
    size = basis_size(num_inputs, orders, degree)
    if size > max_terms:
        what = f"orders {list(orders)}" if orders is not None else f"total degree {degree}"
        raise ValueError(
            f"a Legendre basis of {what} over {num_inputs} inputs has {size:,} terms, more "
            f"than the {max_terms} a fleet's data can support; lower the orders or the degree"
        )
    if orders is not None:
        terms = list(itertools.product(*(range(o + 1) for o in orders)))
    else:
        terms = list(_total_degree(num_inputs, degree))
    return tuple(sorted(terms, key=lambda t: (sum(t), tuple(-a for a in t))))


def _total_degree(num_inputs: int, degree: int) -> Iterable[tuple[int, ...]]:
    """Every exponent tuple of length ``num_inputs`` with sum ≤ ``degree`` (no full grid)."""
    if num_inputs == 0:
        yield ()
        return
    for a in range(degree + 1):
        for rest in _total_degree(num_inputs - 1, degree - a):
            yield (a, *rest)


def orders_by_size(top: Sequence[int], lowest: int = 0) -> list[tuple[int, ...]]:
    """Every orders vector o with ``lowest`` ≤ o_k ≤ ``top[k]``, smallest basis first.

    Size is the tensor-product basis's number of terms Π(o_k + 1); ties are
    broken lexicographically. The candidate grid of a basis chosen by the data
    (fedprior's ``select``, the per-sensor polynomial's orders).
    """
    grid = itertools.product(*(range(lowest, t + 1) for t in top))
    return sorted(grid, key=lambda o: (math.prod(a + 1 for a in o), o))


def legendre_products(x: Tensor, exponents: Sequence[Sequence[int]]) -> Tensor:
    """φ_k(x) = Π_j P̃_{a_kj}(x_j) for each exponent tuple: (..., rows, F) → (..., rows, terms).

    Float64: these columns feed least-squares solves whose Gram matrices square
    their condition number.
    """
    return LEGENDRE.products(x, exponents)


#: How far beyond the fleet's inputs a prior's surface is trusted: its mean ± this many
#: standard deviations per input (with each unit's own range). Beyond: linearized.
SUPPORT_STDS = 2.5


def linearized_products(
    x: Tensor, exponents: Sequence[Sequence[int]], lo: Tensor, hi: Tensor
) -> tuple[Tensor, Tensor]:
    """The extrapolation guard ψ(x) = φ(x̄) + J_φ(x̄)·(x − x̄), x̄ = clamp(x, lo, hi), of the
    Legendre products (:meth:`fedcal.models.families.BasisFamily.linearized`: the one
    formula, for tensors and NumPy arrays). Returns (ψ (..., rows, terms), outside)."""
    return LEGENDRE.linearized(x, exponents, lo, hi)


@dataclass(frozen=True)
class Basis:
    """Fixed Legendre-product terms ‖ learned MLP features → linear head.

    ``poly_orders[k]`` is the highest Legendre order of input k (one entry per
    input; 0 leaves an input out of the polynomial); ``hidden`` the widths of
    the shared MLP (empty: no learned features); ``poly_domain[k]`` the
    interval of scaled input k that the Legendre terms map onto [-1, 1]
    (default [-1, 1]: the physical range of the scaler).
    """

    in_features: int = 2
    poly_orders: tuple[int, ...] = (3, 3)
    hidden: tuple[int, ...] = (16, 16)
    out_features: int = 1
    activation: str = "tanh"
    poly_domain: tuple[tuple[float, float], ...] | None = None
    poly_center: tuple[float, ...] | None = None
    poly_transform: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "poly_orders", tuple(int(p) for p in self.poly_orders))
        object.__setattr__(self, "hidden", tuple(int(h) for h in self.hidden))
        domain = self.poly_domain or ((-1.0, 1.0),) * self.in_features
        object.__setattr__(self, "poly_domain", tuple((float(a), float(b)) for a, b in domain))
        if len(self.poly_domain) != self.in_features or any(b <= a for a, b in self.poly_domain):
            raise ValueError("poly_domain needs one interval (low < high) per input")
        if (self.poly_center is None) != (self.poly_transform is None):
            raise ValueError("poly_center and poly_transform go together (see whitened())")
        if self.poly_transform is not None:
            n = len(self.terms)
            object.__setattr__(self, "poly_center", tuple(float(v) for v in self.poly_center))
            rows = tuple(tuple(float(v) for v in row) for row in self.poly_transform)
            object.__setattr__(self, "poly_transform", rows)
            if len(self.poly_center) != n or len(rows) != n or any(len(r) != n for r in rows):
                raise ValueError(f"poly_center/poly_transform must be ({n},) and ({n}, {n})")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}")
        if len(self.poly_orders) != self.in_features:
            raise ValueError(
                f"poly_orders needs one order per input ({self.in_features}), "
                f"got {self.poly_orders}"
            )
        if any(p < 0 for p in self.poly_orders):
            raise ValueError("polynomial orders must be >= 0")
        if basis_size(self.in_features, self.poly_orders) > MAX_TERMS:
            raise ValueError(
                f"poly_orders {list(self.poly_orders)}: "
                f"{basis_size(self.in_features, self.poly_orders):,} terms, more than {MAX_TERMS}"
            )

    # ---- structure ----------------------------------------------------
    @property
    def terms(self) -> list[tuple[int, ...]]:
        """Multi-indices (one order per input) of the fixed terms, constant excluded."""
        grid = itertools.product(*(range(p + 1) for p in self.poly_orders))
        return [idx for idx in grid if any(idx)]

    @property
    def num_features(self) -> int:
        """Inputs of the head: polynomial terms plus learned features."""
        return len(self.terms) + (self.hidden[-1] if self.hidden else 0)

    def layers(self) -> list[tuple[str, ...]]:
        body = [(f"l{k}.weight", f"l{k}.bias") for k in range(len(self.hidden))]
        return [*body, ("head.weight", "head.bias")]

    def init(self, generator: torch.Generator, dtype: torch.dtype = torch.float32) -> Tree:
        params: Tree = {}
        sizes = [self.in_features, *self.hidden]
        for k, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
            bound = 1.0 / math.sqrt(fan_in)
            w = torch.empty(fan_out, fan_in, dtype=torch.float64).uniform_(
                -bound, bound, generator=generator
            )
            b = torch.empty(fan_out, dtype=torch.float64).uniform_(
                -bound, bound, generator=generator
            )
            params[f"l{k}.weight"], params[f"l{k}.bias"] = w.to(dtype), b.to(dtype)
        bound = 1.0 / math.sqrt(self.num_features)
        head = torch.empty(self.out_features, self.num_features, dtype=torch.float64).uniform_(
            -bound, bound, generator=generator
        )
        head[:, : len(self.terms)] = 0.0  # polynomial coefficients start at 0
        bias = torch.empty(self.out_features, dtype=torch.float64).uniform_(
            -bound, bound, generator=generator
        )
        params["head.weight"], params["head.bias"] = head.to(dtype), bias.to(dtype)
        return params

    # ---- forward --------------------------------------------------------
    def polynomial_terms(self, x: Tensor) -> Tensor:
        """x (clients, batch, in) → the fixed terms (clients, batch, len(terms)).

        The outer product of the per-input Legendre columns, flattened in
        :attr:`terms` order (row-major, so the constant term is column 0 and dropped).
        """
        product = x.new_ones(*x.shape[:-1], 1)
        for k, (p, (low, high)) in enumerate(zip(self.poly_orders, self.poly_domain, strict=True)):
            u = (2.0 * x[..., k] - (low + high)) / (high - low)  # the domain → [-1, 1]
            column = torch.stack(legendre(u, p), -1)  # (clients, batch, p + 1)
            product = (product.unsqueeze(-1) * column.unsqueeze(-2)).flatten(-2)
        terms = product[..., 1:]
        if self.poly_transform is None:
            return terms
        center, transform = _constants(self.poly_center, self.poly_transform, x.dtype)
        return (terms - center) @ transform.T

    def _forward(self, params: Tree, x: Tensor) -> tuple[list[Tensor], list[Tensor], Tensor]:
        """MLP activations h_0 = x … h_L, pre-activations z_1 … z_L, and the head's features."""
        act = ACTIVATIONS[self.activation]
        hs, zs = [x], []
        for k in range(len(self.hidden)):
            w, b = params[f"l{k}.weight"], params[f"l{k}.bias"]
            z = torch.baddbmm(b.unsqueeze(1), hs[-1], w.transpose(1, 2))
            zs.append(z)
            hs.append(act(z))
        learned = [hs[-1]] if self.hidden else []
        features = torch.cat([self.polynomial_terms(x), *learned], -1)
        return hs, zs, features

    def apply(self, params: Tree, x: Tensor) -> Tensor:
        """params: client tree; x (clients, batch, in) → (clients, batch, out)."""
        features = self._forward(params, x)[2]
        w, b = params["head.weight"], params["head.bias"]
        return torch.baddbmm(b.unsqueeze(1), features, w.transpose(1, 2))

    def mse_value_and_grad(
        self, params: Tree, x: Tensor, y: Tensor, w: Tensor, wrt: Iterable[str] | None = None
    ) -> tuple[Tensor, Tree]:
        """Masked MSE (:func:`fedcal.core.task.masked_mse`) and its gradient, by hand.

        Layers below the lowest requested one are not visited. Equal to
        autograd's gradient (tested at float64).
        """
        wanted = set(params) if wrt is None else set(wrt)
        with torch.no_grad():
            hs, zs, features = self._forward(params, x)
            head_w = params["head.weight"]
            pred = torch.baddbmm(params["head.bias"].unsqueeze(1), features, head_w.transpose(1, 2))
            value, delta = mse_and_output_grad(pred, y, w)
            grads: Tree = {}
            if "head.weight" in wanted:
                grads["head.weight"] = torch.bmm(delta.transpose(1, 2), features)
            if "head.bias" in wanted:
                grads["head.bias"] = delta.sum(1)
            layers = len(self.hidden)
            lowest = lowest_layer(wanted, layers)
            if lowest < layers:
                deriv = DERIVATIVES[self.activation]
                # Into the learned features: only the head columns that read them.
                delta = torch.bmm(delta, head_w[:, :, len(self.terms) :]) * deriv(zs[-1], hs[-1])
                grads |= backprop(params, delta, hs, zs, range(lowest, layers), wanted, deriv)
        order = [n for layer in self.layers() for n in layer if n in grads]
        return value, {n: grads[n] for n in order}


def whitened(
    model: Basis, client_inputs: Sequence[Tensor | np.ndarray], floor: float = 1e-12
) -> Basis:
    """``model`` with its polynomial terms centred and decorrelated over the whole fleet.

    Each client contributes only sums of its own fixed terms φ(x): n_i, Σφ,
    Σφφᵀ (what a secure aggregation adds up — the same footing as the
    federated statistics of :mod:`fedcal.data.scaling`, one moment higher).
    From the fleet's mean μ and covariance Σ = U·diag(λ)·Uᵀ the terms become
    φ' = U·diag(λ^-1/2)·Uᵀ·(φ − μ) (symmetric whitening: each φ'_k stays
    closest to its own φ_k), eigenvalues floored at ``floor``·λ_max.

    Why: one sensor spans only part of the frequency scale (quartz: about
    0.6 of [28, 38] kHz), where Legendre terms of one input are nearly
    collinear; the per-sensor design then has a condition number ~10⁵ and
    gradient descent stalls at hPa-level errors. Whitened over the fleet it is
    ~20. The span, hence the best fit, is unchanged — only the coordinates
    the head's gradient steps move in.
    """
    raw = replace(model, poly_center=None, poly_transform=None)
    sums = None
    for x in client_inputs:
        x = torch.as_tensor(x, dtype=torch.float64)
        if x.shape[0] == 0:
            continue
        phi = raw.polynomial_terms(x.unsqueeze(0))[0]  # (rows, terms)
        part = (x.shape[0], phi.sum(0), phi.T @ phi)
        sums = part if sums is None else tuple(a + b for a, b in zip(sums, part, strict=True))
    if sums is None:
        raise ValueError("no client has any rows to whiten with")
    n, s1, s2 = sums
    mean = s1 / n
    cov = s2 / n - torch.outer(mean, mean)
    lam, vec = torch.linalg.eigh((cov + cov.T) / 2)
    lam = lam.clamp_min(floor * lam.max())
    transform = vec @ torch.diag(lam.rsqrt()) @ vec.T
    return replace(
        model,
        poly_center=tuple(mean.tolist()),
        poly_transform=tuple(tuple(r) for r in transform.tolist()),
    )
