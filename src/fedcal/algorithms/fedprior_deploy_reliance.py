"""How much of the prior the reference units' emulated designs relied on (issue 33, E6 of
:mod:`fedcal.algorithms.fedprior_deploy`; the model's D6 in :mod:`fedcal.prior.design_span`).

E6. Each emulated design b (a pseudo-unit) has u_b = tr(V_b M)/σ² (D6: its basis posterior
    covariance under the unit's leave-one-out prior, M the box mean of φφᵀ over the
    references' input box, σ² the fleet's). A unit uploads, for every level u_g of
    :data:`RELIANCE_GRID`, its held-out rows of the designs with u_b ≥ u_g (a count per
    level: sums only, no design leaves the unit). The server's ``max_reliance`` u_ref is
    the largest u_g at which the pooled count reaches
    :data:`~fedcal.algorithms.fedprior_deploy_kappa.MIN_KNOT_HELD` (the rows a knot of κ(n)
    needs; with fewer held-out rows in all, the largest u_g any design reached): the most a
    new design may lean on the prior and still have been tested by the emulation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fedcal.algorithms.fedprior_deploy_kappa import MIN_KNOT_HELD
from fedcal.core.bayes import F64
from fedcal.prior.design_span import reliance

RELIANCE_GRID = torch.logspace(-4, 6, 1001, dtype=F64)  # E6: u levels, 0.01 decade apart


def reliance_sums(em: dict[str, Tensor], gram: Tensor, units: int) -> Tensor:
    """E6's upload per unit: (units, levels) held-out rows of its designs with u_b ≥ u_g.
    ``em`` the emulation (:func:`~fedcal.algorithms.fedprior_deploy._emulation`), ``gram``
    M (p, p)."""
    p = gram.shape[-1]
    u = reliance(em["cov"][..., :p, :p], em["noise"], gram)  # (designs,)
    rows = em["held"].sum(-1, keepdim=True)  # (designs, 1)
    at_least = (u.unsqueeze(-1) >= RELIANCE_GRID).to(F64) * rows
    out = torch.zeros(units, len(RELIANCE_GRID), dtype=F64)
    return out.index_add_(0, em["unit"], at_least)


def max_reliance(sums: Tensor) -> float:
    """E6's server step: u_ref from the pooled uploads (units, levels)."""
    pooled = sums.sum(0)
    ok = torch.nonzero(pooled >= MIN_KNOT_HELD)
    if ok.numel() == 0:  # fewer rows in all than a knot needs: the largest level reached
        ok = torch.nonzero(pooled > 0)
    return float(RELIANCE_GRID[int(ok[-1, 0])]) if ok.numel() else float(RELIANCE_GRID[0])
