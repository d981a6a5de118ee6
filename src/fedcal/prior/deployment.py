"""New units calibrated from a prior's deployment discrepancy model, in NumPy (issue 33, 37.1).

A prior learned from reference units alone (``fedcal run`` with a calibrated interval on a
fleet of fully calibrated units) carries a design-dependent error model
(:mod:`fedcal.prior.discrepancy`, D1–D4). :func:`deploy` gives each new unit what
:func:`fedcal.algorithms.fedprior_deployed.deployed` gives it on the torch path, by the same
formulas (array-generic, :mod:`fedcal.prior.discrepancy`) on the posterior of
:func:`fedcal.prior.posterior.calibrate_units`: its design rows X_D (padded to
:data:`~fedcal.prior.discrepancy.MAX_POINTS`), the smoother A = Z_D V_i[:, c]/σ_i² (D2),
d_i² = rᵀC⁻¹r, r = y_D − Z_Dμ (D4), the factor κ(n_i)² s_i² (t/1.96)² (D3–D4), β, a², ℓ;
which units take that σ (:func:`~fedcal.prior.discrepancy.deployed_units`: fedprior's own
interval stands wherever it states one), and per unit why its design gets no σ
(:func:`~fedcal.prior.design_span.span_reasons`, D5–D6, "" if it gets one).
:func:`fedcal.prior.posterior.predictive_std` then states

    σ²(x) = κ² s_i² (t/1.96)² (β v_c(x) + σ_i² + a² q(x))   (D2–D4)

for those units. Equal to the torch path within rounding: tests/prior/test_torch_free.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedcal.prior.design_span import reliance, reliance_gram, span_reasons
from fedcal.prior.discrepancy import (
    AMP_RATIO_MAX,
    MAX_POINTS,
    Discrepancy,
    DiscrepancyError,
    deployed_units,
    prior_distance,
    smoother,
    unit_factor,
)
from fedcal.prior.model import PriorModel

GP_LEAVES = ("gp_x", "gp_mask", "gp_a", "gp_scale", "gp_amp", "gp_beta", "gp_len")


def model_of(prior: PriorModel) -> Discrepancy:
    """The prior's discrepancy model, checked against its noise (one-line error, as the torch
    path's :func:`~fedcal.algorithms.fedprior_deployed.deployed`)."""
    model = Discrepancy.from_dict(prior.discrepancy)
    fleet_noise = float(prior.noise.variance)
    if not model.amplitude <= AMP_RATIO_MAX * fleet_noise:
        raise DiscrepancyError(
            f"prior.json: discrepancy.amplitude: {model.amplitude!r} exceeds "
            f"{AMP_RATIO_MAX:g} × the prior's noise variance {fleet_noise:g} (the range learned)"
        )
    return model


def _pad(a: np.ndarray, rows: int) -> np.ndarray:
    """``a`` (units, r, ...) cut or zero-padded to ``rows`` rows (axis 1)."""
    out = np.zeros((a.shape[0], rows, *a.shape[2:]))
    k = min(rows, a.shape[1])
    out[:, :k] = a[:, :k]
    return out


def deploy(
    prior: PriorModel,
    units: Any,
    parts: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    weak: np.ndarray,
    model_mask: np.ndarray | None,
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, tuple[str, ...]]:
    """(the ``gp_*`` leaves, τ_i², declined, reasons) of units calibrated from ``prior``'s
    discrepancy model (module docstring). ``parts`` (x, y, mask, z): the units' padded rows
    (scaled) and their design rows [φ, b·ψ]; ``units`` their posterior with fedprior's own
    interval (:class:`fedcal.prior.posterior.Units`: σ_i², V_i, τ_i², declined); ``weak``
    I3's weakly identified units; ``model_mask`` 1 on the terms in the model (None: all)."""
    model = model_of(prior)
    x, y, mask, z = parts
    c, rows, p = len(mask), MAX_POINTS, len(prior.basis.terms)
    xd, km = _pad(x, rows), _pad(mask, rows)
    zd = _pad(z, rows) * km[..., None]
    sigma, mu = prior.covariance, prior.mean
    if model_mask is not None:
        sigma, mu = sigma * model_mask[:, None] * model_mask[None, :], mu * model_mask
    resid = (_pad(y, rows) - (zd * mu).sum(-1)) * km
    noise = units.noise_var
    lengths = np.asarray(model.lengths, dtype=np.float64)
    d2 = prior_distance(zd, model.beta * sigma, noise, xd, km, model.amplitude, lengths, resid)
    gram = reliance_gram(model.box_lo, model.box_hi, prior.basis.terms)
    u = reliance(units.cov[..., :p, :p], noise, gram)  # D6
    reasons = span_reasons(model, x, mask, list(prior.features), u, noise)
    iv = prior.interval
    n = mask.sum(1)
    use = deployed_units(
        n, float(iv.probe_rows), float(iv.declined), units.declined, weak, MAX_POINTS
    )
    gp = {
        "gp_x": xd,
        "gp_mask": km,
        "gp_a": smoother(zd, units.cov[..., :, :p], noise, km),
        "gp_scale": np.where(use, unit_factor(model, km.sum(1), d2), 1.0),
        "gp_amp": np.where(use, model.amplitude, 0.0),
        "gp_beta": np.where(use, model.beta, 1.0),
        "gp_len": np.broadcast_to(lengths, (c, len(lengths))).copy(),
    }
    spanned = np.array([not r for r in reasons], dtype=bool)
    declined = np.where(use, ~spanned, units.declined)
    disc = np.where(use, 0.0, units.disc_var)
    why = tuple(r if u else "" for u, r in zip(use, reasons, strict=True))
    return gp, disc, declined, why
