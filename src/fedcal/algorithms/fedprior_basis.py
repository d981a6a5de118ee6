"""The fleet prior's design and predictive form: [φ, b·ψ] and the variance z(x)ᵀQ z(x) + s.

:class:`DesignBasis` is a part of :class:`~fedcal.algorithms.fedprior.FedPrior` (its
``design_basis``), declared by the exponent tuples of φ (``terms``, constant first) and of ψ, the
sweep direction's term (``branch_terms``, empty when off): the design a unit's moments are
formed from (the chamber's sweep direction, below), the design of its
predictive variance (no sign b: unknown in use) and the one place of that variance,
:meth:`DesignBasis.variance_form`, that ``predictive_std``, the calibrated interval's
hold-out and the firmware/JSON exports read. Two functions of a broadcast that every part
reads the same way: :func:`model_mask` (the features in the model) and :func:`unit_noise`
(the σ² a unit's posterior uses).

The chamber's sweep direction (``branch_orders``, issue 10). A unit with
hysteresis reads differently on an ascending and a descending sweep, and the
chamber knows which it ran (the data's ``direction`` column, a sign b = +1 up,
−1 down, 0 unknown per row: :attr:`fedcal.core.data.ClientData.branch`). With
``branch_orders`` set, each unit's model gains a branch term

    y = φ(x)ᵀc_i + b·ψ(x)ᵀh_i + ε,   (c_i, h_i) ~ N(μ, Σ) jointly,

ψ the Legendre products up to ``branch_orders``: the design is [φ(x), b·ψ(x)]
and every step of fedprior's EM runs on it unchanged. Units calibrated up and down teach
the fleet the mean and spread of h and its correlation with c; a unit swept one
way sees only c + h along ψ, and the joint prior splits the two. In the field
the direction is unknown (±1 with equal odds, E[b] = 0, E[b²] = 1), so the
prediction is the branch average and the hysteresis widens the interval:

    ŷ = φ(x)ᵀm_c,   Var = φ(x)ᵀV_cc φ(x) + σ² + ψ(x)ᵀ(m_h m_hᵀ + V_hh)ψ(x).

Rows without a direction (b = 0) carry no branch term (today's model). A direction
term the fleet's data do not identify is out of the model (issue 20): when every unit
swept one way, or no row has a direction, the rows see c + h along ψ (or nothing of h),
and a split by the vague start put half of each unit's ψ part in h, which the field's
branch average drops (230–240 hPa on all-few fleets). Each unit uploads the data support
of the whole design (``branch_support``); the ψ coordinates J that the summed support's
weak subspace holds (fedprior_pins) are pinned, μ_J = 0 and
Σ_JJ = ``floor`` (masked out of every E-step), the M-step runs on the others, the EM
starts again from the vague start when J changes and its columns held data, and the
BIC counts no parameter for J: from then on the run is the run without the term, one
round later. With
``select = "bic"`` the candidates are φ's sub-bases; ψ is in every candidate,
unless ``branch_select``: then the candidates are φ's sub-bases × ψ's options
(no term, or any orders vector ≤ ``branch_orders``), and the fleet's BIC also
decides whether and which direction term the data support (a fleet without
directions gets none: its ψ columns are empty, same evidence, more parameters).
Measured by helper "hyst" (studies/fewpoint_direction.py) and here
(docs/results/sweep-direction.md).

Field networks (issue 26). ``basis = "auto"`` is the tensor basis of ``orders`` for the
barometer's (frequency, temperature) and, for any other named features, the total-degree
basis (the build sets it: :func:`fedcal.build._generic_basis`), its degree chosen by the
fleet's BIC among 0..``degree`` under ``select = "bic"``. A basis of more than
:data:`~fedcal.models.basis.MAX_TERMS` terms is refused in one line. Every Cholesky
factorization goes through :func:`~fedcal.core.bayes.safe_cholesky` (jitter, then an
eigenvalue floor, reported per unit and round as the ``jitter`` metric and in one printed
line), so a near-singular Gram (collinear features, thousands of rows, σ² → 0) cannot end
the run. Extrapolation guard (the fleet's input support box, and the basis continued along its
tangent plane beyond it): :mod:`fedcal.algorithms.fedprior_support`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from fedcal.core.bayes import F64, Moments, mixture_halfwidth, moments
from fedcal.core.data import ClientData
from fedcal.core.tree import Tree
from fedcal.models.basis import legendre_exponents, legendre_products

if TYPE_CHECKING:
    from fedcal.algorithms.fedprior_noise import NoiseModel


Terms = tuple[tuple[int, ...], ...]  # exponent tuples of Legendre products, constant first


def tensor_basis(basis: str, orders: tuple[int, ...], inputs: int) -> bool:
    """Whether φ is the tensor product up to ``orders`` (else every product up to a total
    degree): ``basis = "tensor"``, or ``"auto"`` with one order per input."""
    return basis == "tensor" or (basis == "auto" and len(orders) == inputs)


def phi_terms(basis: str, orders: tuple[int, ...], degree: int, inputs: int) -> Terms:
    """Exponent tuples of φ's Legendre products (constant first; fedprior.py's module doc)."""
    if tensor_basis(basis, orders, inputs):
        if len(orders) != inputs:
            raise ValueError(
                f"orders {list(orders)} needs one order per input ({inputs} inputs); "
                "or use basis = 'total' with a degree"
            )
        return legendre_exponents(inputs, orders=orders)
    return legendre_exponents(inputs, degree=degree)


def psi_terms(branch_orders: tuple[int, ...], inputs: int) -> Terms:
    """Exponent tuples of ψ, the sweep-direction term's basis (empty when off)."""
    return legendre_exponents(inputs, orders=branch_orders) if branch_orders else ()


@dataclass(frozen=True)
class DesignBasis:
    """φ's terms and ψ's (module doc)."""

    terms: tuple[tuple[int, ...], ...]
    branch_terms: tuple[tuple[int, ...], ...]

    def design(self, x: Tensor, branch: Tensor | None = None) -> Tensor:
        """[φ(x), b·ψ(x)]: (clients, rows, inputs) → (clients, rows, features), float64.

        ``branch`` (clients, rows): each row's sweep sign b; None reads as 0 (no
        direction known). Without a direction term: φ(x) only.
        """
        phi = legendre_products(x, self.terms)
        if not self.branch_terms:
            return phi
        psi = legendre_products(x, self.branch_terms)
        b = torch.zeros(x.shape[:-1], dtype=F64) if branch is None else branch.to(F64)
        return torch.cat([phi, psi * b.unsqueeze(-1)], -1)

    @cached_property
    def key(self) -> int:
        """A fingerprint of the design [φ, b·ψ]: its terms and branch terms (56 bits)."""
        text = repr((self.terms, self.branch_terms)).encode()
        return int.from_bytes(hashlib.sha256(text).digest()[:7], "big")

    def derived(self, data: ClientData) -> dict[str, Tensor]:
        """The units' unweighted moments (Φ_iᵀΦ_i, Φ_iᵀy_i, y_iᵀy_i, n_i) as
        ``ClientData.derived`` tensors (``fedprior/…``), with the :attr:`key` of the design
        that formed them (a fleet derived for another basis is not read: :meth:`moments`)."""
        full = self.moments(dataclasses.replace(data, derived=None))
        out = {f"fedprior/{k}": v for k, v in full._asdict().items()}
        out["fedprior/design"] = torch.full((data.num_clients,), self.key)
        return out

    def moments(
        self, data: ClientData, noise: NoiseModel | None = None, down: Tree | None = None
    ) -> Moments:
        """A unit's moments of the design [φ, b·ψ] (fedprior's step 1); with a noise model
        in the inputs or Student-t rows (``noise`` under the broadcast ``down``), its rows
        weighted (fedprior_noise, N1). The unweighted ones from :meth:`derived` when the
        engine formed them for this design (the same function of the same data)."""
        cached = data.derived or {}
        made_by = cached.get("fedprior/design")  # the design that formed them (derived)
        mine = made_by is not None and bool((made_by == self.key).all())
        weighted = noise is not None and noise.weighted
        if mine and "fedprior/gram" in cached and (down is None or not weighted):
            return Moments(*(cached[f"fedprior/{k}"] for k in Moments._fields))
        design = self.design(data.x, data.branch)
        rw = None if down is None or noise is None else noise.row_weights(down, data, design)
        if rw is None:
            return moments(design, data.y[..., 0], data.mask)
        return noise.moments(design, data, rw)

    def variance_design(self, x: Tensor) -> Tensor:
        """z(x) = [φ(x), ψ(x)] (clients, rows, features), float64: no sign b (unknown in use)."""
        phi = legendre_products(x, self.terms)
        if not self.branch_terms:
            return phi
        return torch.cat([phi, legendre_products(x, self.branch_terms)], -1)

    def mean(self, coef: Tensor, x: Tensor) -> Tensor:
        """φ(x)ᵀm_c per row (clients, rows), float64: the prediction on φ's coefficients."""
        p = len(self.terms)
        return (legendre_products(x, self.terms) * coef.to(F64)[..., :p].unsqueeze(1)).sum(-1)

    def halfwidth(self, params: Tree, x: Tensor, std: Tensor) -> Tensor:
        """The central 95 % interval's half-width per row (clients, rows, 1) for σ(x) =
        ``std``: 1.96 σ; with a direction term the field's unknown sweep b = ±1 makes the
        error the mixture ½N(ψᵀm_h, s²) + ½N(−ψᵀm_h, s²), s² = σ² − (ψᵀm_h)²
        (:func:`~fedcal.core.bayes.mixture_halfwidth`), narrower than 1.96 σ."""
        if not self.branch_terms:
            return 1.959964 * std
        p = len(self.terms)
        psi = legendre_products(x, self.branch_terms)
        m = (psi * params["coef"][..., p:].to(F64).unsqueeze(1)).sum(-1).unsqueeze(-1)
        s = (std * std - m * m).clamp_min(0.0).sqrt()
        return mixture_halfwidth(m, s)

    def variance_form(self, params: Tree) -> tuple[Tensor, Tensor]:
        """(Q, s): the predictive variance as z(x)ᵀQ z(x) + s, z = :meth:`variance_design`.

        Q = blockdiag(V_cc, m_h m_hᵀ + V_hh) — the posterior covariance of c and,
        with a direction term, E[h hᵀ] (b unknown: E[b] = 0, E[b²] = 1; fedprior's module
        doc) — and s = Σ of the unit's additive variances: every per-unit scalar
        parameter named ``*_var`` (σ_i² = ``noise_var``; a further additive term
        stored the same way is included); NaN where the unit's interval is declined.
        """
        p = len(self.terms)
        cov = params["cov"].to(F64)
        q = torch.zeros_like(cov)
        q[..., :p, :p] = cov[..., :p, :p]
        if self.branch_terms:
            m_h = params["coef"][..., p:].to(F64)
            q[..., p:, p:] = m_h.unsqueeze(-1) * m_h.unsqueeze(-2) + cov[..., p:, p:]
        batch = cov.shape[:-2]
        s = torch.zeros(batch, dtype=F64)
        for key, value in params.items():
            if key.endswith("_var") and tuple(value.shape) == tuple(batch):
                s = s + value.to(F64)  # σ_i², and τ_i² (disc_var) with a calibrated interval
        if "declined" in params:  # no interval stated for this unit (fedprior, "Intervals")
            s = torch.where(params["declined"].to(F64) > 0, math.nan, s)
        return q, s


def model_mask(down: Tree) -> Tensor | None:
    """The features in the model (the chosen basis without the ψ coordinates J out of it:
    fedprior_pins); None: all of them."""
    if "mask" in down:
        return down["mask"]
    return 1.0 - down["pinned"] if "pinned" in down else None


def unit_noise(noise: str, down: Tree, state: Tree) -> Tensor:
    """The σ² a unit's posterior uses: its own σ_i² (``noise = "sensor"``) or the fleet's."""
    return state["noise_var"] if noise == "sensor" else down["noise_var"]
