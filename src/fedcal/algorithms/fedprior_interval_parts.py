"""fedprior_interval's pieces that are plain functions of tensors: a unit's rows as positions
in its own span (the hold-out's matching of designs, I2), the probe's unit, the moments of a
hold-out fit's kept rows (I2, I4), and the residual terms of the restricted noise update (I1)
(:mod:`fedcal.algorithms.fedprior_interval`)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fedcal.algorithms.fedprior_noise import weighted_moments
from fedcal.core.bayes import Moments, Posterior, moments
from fedcal.core.tree import Tree


def span_positions(x: Tensor, mask: Tensor) -> Tensor:
    """Each row's inputs as positions in [0, 1] of its unit's own span (min to max per input).

    A chamber design is a pattern over a unit's calibrated range (its ends included); units
    of one fleet read different input values there (each resonator its own frequencies), so
    the hold-out matches designs by these positions, not by raw inputs.
    """
    m = mask.unsqueeze(-1) > 0
    lo = torch.where(m, x, math.inf).amin(1, keepdim=True)
    hi = torch.where(m, x, -math.inf).amax(1, keepdim=True)
    return torch.where(m, (x - lo) / (hi - lo).clamp_min(1e-12), 0.0)


def probe_unit(n: Tensor) -> int | None:
    """The probe's unit (I2): the smallest design among the units that upload one (n > 0);
    ties by position in ``n`` (the server's canonical order). None: no unit uploads one."""
    small = n > 0
    if not bool(small.any()):
        return None
    return int(torch.argmin(torch.where(small, n, math.inf)))


def kept_moments(design: Tensor, y: Tensor, keep: Tensor, weight: Tensor | None) -> Moments:
    """The moments a hold-out fit reads (I2, I4): of the ``keep`` rows, weighted by the noise
    model's row weights (N5) when there are any."""
    return moments(design, y, keep) if weight is None else weighted_moments(design, y, keep, weight)


def residual_terms(post: Posterior, gram: Tensor, noise: Tensor, n: Tensor) -> Tree:
    """Residual degrees of freedom n_i − tr(G_i V_i)/σ_i² and the fit ‖y_i − Φ_i m_i‖²
    (= E‖y_i − Φ_i c_i‖² − tr(G_i V_i)): the restricted noise update's terms (fedprior_interval,
    I1)."""
    spent = (gram * post.cov).sum((-2, -1))
    return {"dof": (n - spent / noise).clamp_min(0.0), "fit": (post.rss - spent).clamp_min(0.0)}
