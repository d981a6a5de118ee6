"""The fleet prior's extrapolation guard (issue 26): its input support box.

The server keeps the fleet's input support, each input's
mean ± :data:`~fedcal.models.basis.SUPPORT_STDS` standard deviations from the summed Gram
(:meth:`SupportBox.fleet_box`), widened per unit to its own training range; beyond it the
prediction is ψ(x)ᵀm with ψ the basis continued along its tangent plane at the nearest
point of the box (:func:`~fedcal.models.basis.linearized_products`): linear growth, not
the d-th power. The predictive variance there is φᵀVφ + σ² + (φ(x)ᵀm − ψ(x)ᵀm)²: the
posterior term on the unguarded basis (wider than ψᵀVψ: the coefficients' uncertainty is
not linearized away, and the firmware export evaluates one form) and a one-σ model-form
allowance (what the polynomial and its linearization disagree by); such rows are
flagged (:meth:`SupportBox.beyond`, ``beyond_support`` in
per_sensor.csv and the summary).

:class:`SupportBox` is a part of :class:`~fedcal.algorithms.fedprior.FedPrior` (its
``support_box``), declared by the number of inputs and the basis terms φ: the server's box in
``server_update`` (:meth:`~SupportBox.fleet_box`), each unit's in ``personalize``
(:meth:`~SupportBox.unit_box`), the guarded basis in ``predict`` and ``predictive_std``
(:meth:`~SupportBox.guarded`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from fedcal.core.bayes import F64
from fedcal.core.data import ClientData
from fedcal.core.tree import Tree
from fedcal.models.basis import (
    SUPPORT_STDS,
    any_beyond,
    legendre_products,
    linearized_products,
)


@dataclass(frozen=True)
class SupportBox:
    """The extrapolation guard (:func:`fedcal.models.basis.linearized_products`) of the basis
    ``terms`` (exponent tuples, constant first) over ``inputs`` scaled inputs."""

    inputs: int
    terms: tuple[tuple[int, ...], ...]

    def open_box(self) -> Tensor:
        """(2, inputs): no support known yet (round 0): nothing is extrapolation."""
        inf = torch.full((self.inputs,), math.inf, dtype=F64)
        return torch.stack([-inf, inf])

    def fleet_box(self, gram: Tensor) -> Tensor:
        """The fleet's input support (2, inputs) from its summed Gram Σ_i Φ_iᵀΦ_i.

        Row/column 0 is the constant term and e_j the term P̃_1(x_j) = √3·x_j, so
        G[0,0] = Σn, G[0,e_j] = √3·Σx_j and G[e_j,e_j] = 3·Σx_j²: each input's fleet mean
        m_j and standard deviation s_j, from the sums the federation already adds (no
        unit's rows, nor its own range, leave it). The box is m_j ± SUPPORT_STDS·s_j; an
        input without a linear term stays open.
        """
        box = self.open_box()
        n = gram[0, 0]
        if not float(n) > 0:
            return box
        for j in range(self.inputs):
            e_j = tuple(int(k == j) for k in range(self.inputs))
            if e_j not in self.terms:
                continue
            k = self.terms.index(e_j)
            mean = gram[0, k] / (math.sqrt(3.0) * n)
            std = (gram[k, k] / (3.0 * n) - mean * mean).clamp_min(0.0).sqrt()
            box[0, j], box[1, j] = mean - SUPPORT_STDS * std, mean + SUPPORT_STDS * std
        return box

    @staticmethod
    def unit_box(fleet_box: Tensor | None, data: ClientData) -> Tensor:
        """(clients, 2, inputs): the fleet's box widened to each unit's own training range.

        Without a fleet box (a model saved before the guard): the unit's own range.
        ``fedcal calibrate`` and the planner broadcast the prior's calibrated input range
        (:func:`fedcal.calibration.prior_server`), not the federation's mean ± sd box.
        """
        real = data.mask.unsqueeze(-1) > 0
        x = data.x.to(F64)
        lo = torch.where(real, x, math.inf).amin(1)
        hi = torch.where(real, x, -math.inf).amax(1)
        if fleet_box is None:
            return torch.stack([lo, hi], 1)
        fleet_box = fleet_box.to(F64).expand(x.shape[0], 2, x.shape[-1])
        return torch.stack(
            [torch.minimum(lo, fleet_box[:, 0]), torch.maximum(hi, fleet_box[:, 1])], 1
        )

    def guarded(self, params: Tree, x: Tensor) -> tuple[Tensor, Tensor]:
        """(ψ(x), beyond): the basis linearized beyond the unit's box ``params["box"]``, per
        row (no box: φ(x), nothing beyond)."""
        if "box" not in params:
            phi = legendre_products(x, self.terms)
            return phi, torch.zeros(phi.shape[:-1], dtype=torch.bool)
        box = params["box"].to(F64)
        return linearized_products(x, self.terms, box[:, 0].unsqueeze(1), box[:, 1].unsqueeze(1))

    def beyond(self, params: Tree, x: Tensor) -> Tensor:
        """(clients, rows) bool: rows outside the unit's support box (linearized, flagged)."""
        return self.guarded(params, x)[1]

    def gap_var(self, params: Tree, x: Tensor) -> Tensor | None:
        """(clients, rows): beyond the unit's box, g(x)² with g the gap between the polynomial
        φ(x)ᵀc and its tangent-plane continuation ψ(x)ᵀc that is predicted there (the
        model-form variance fedprior's ``predictive_std`` adds); 0 inside; None: no row
        beyond."""
        phi, beyond = self.guarded(params, x)
        if not any_beyond(beyond):
            return None
        coef = params["coef"][..., : len(self.terms)].to(F64).unsqueeze(1)
        gap = ((legendre_products(x, self.terms) - phi) * coef).sum(-1)
        return torch.where(beyond, gap * gap, 0.0)
