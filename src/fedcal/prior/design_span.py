"""Which new designs the references' emulation stands for (issue 33: D5–D6 of the deployment
model, :mod:`fedcal.prior.discrepancy`); NumPy or torch arrays alike, no torch import.

D5. **The span of the emulated designs** (:func:`design_reason`): at least ``min_points``
    and at most ``max_points`` points (beyond, κ(n) of D3 would be extrapolated), and per
    input at least ``min_levels`` levels spanning at least ``min_span`` of the references'
    span.
D6. **How much the design leaves to the prior** (:func:`reliance_reason`). A design D whose
    basis posterior covariance is V_D (the φ block of the unit's posterior under the prior,
    which depends on the design's inputs only, not on its readings) leaves the prior, on
    average over the references' input box B,

        u_D = E_{x∼B}[φ(x)ᵀV_Dφ(x)] / σ_i² = tr(V_D M) / σ_i²,   M = E_{x∼B}[φ(x)φ(x)ᵀ]

    (:func:`reliance`; M over :data:`RELIANCE_POINTS` Halton points of B,
    :func:`reliance_gram`): the basis part of D2's variance in noise units. The reference
    units learn β (D2) and κ(n) (D3) on the designs they emulate; u_ref (the record's
    ``max_reliance``) is the largest u at which their emulated designs with u_b ≥ u hold
    at least as many held-out rows as a knot of κ(n) needs
    (:data:`~fedcal.algorithms.fedprior_deploy_kappa.MIN_KNOT_HELD`: E6 of
    :mod:`fedcal.algorithms.fedprior_deploy`). Where u_D > u_ref, the design's error holds
    a part that no emulated design tested: by the prior's own Σ (β, learned on the tested
    part, does not apply to it) its variance is (u_D − u_ref) σ_i², against the stated
    variance's box mean (β u_D + 1 + a²/σ_i²) σ_i² (κ² cancels; q at its value 1 away from
    the design's points), the share

        s_D = max(u_D − u_ref, 0) / (β u_D + 1 + a²/σ_i²).

    Were the stated variance wrong by that part (missed, or counted twice), the 95 %
    interval would cover a normal's share within ±1.96/√(1 ± s_D): inside the target
    93–97 % only while s_D ≤ :data:`UNTESTED_SHARE` = min((1.96/z_0.965)² − 1,
    1 − (1.96/z_0.985)²) = 0.170. A unit whose s_D exceeds it is declined with the reason.
    Why: references without plateaus (a Latin hypercube) emulate a plateau design by their
    nearest rows, at as many temperatures as points, so their emulated designs leave the
    prior less than the real design (docs/uncertainty.md, "Deployment").
"""

from __future__ import annotations

import math
from functools import lru_cache
from statistics import NormalDist
from typing import TYPE_CHECKING, Any

import numpy as np

from fedcal.models.families import Array, as_float64, namespace
from fedcal.prior.legendre import legendre_products

if TYPE_CHECKING:
    from fedcal.prior.discrepancy import Discrepancy

Z95 = 1.959964
BAND = (0.93, 0.97)  # the target coverage of the nominal 95 % interval (issue 33)
UNTESTED_SHARE = min(
    (Z95 / NormalDist().inv_cdf(0.5 + BAND[0] / 2)) ** 2 - 1,
    1 - (Z95 / NormalDist().inv_cdf(0.5 + BAND[1] / 2)) ** 2,
)  # D6: 0.170
RELIANCE_POINTS = 256  # D6: Halton points of the references' box for M
PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53)


@lru_cache(maxsize=8)
def halton(count: int, dims: int) -> np.ndarray:
    """The first ``count`` points (from the second) of the Halton sequence in [0, 1]^dims
    (read-only: cached, the planner forms many designs' σ against one box)."""
    if dims > len(PRIMES):
        raise ValueError(f"halton: at most {len(PRIMES)} inputs, got {dims}")
    out = np.zeros((count, dims))
    for j, base in enumerate(PRIMES[:dims]):
        for i in range(count):
            k, f, v = i + 1, 1.0, 0.0
            while k:
                f /= base
                v += f * (k % base)
                k //= base
            out[i, j] = v
    out.flags.writeable = False
    return out


def reliance_gram(lo: Any, hi: Any, terms: Any, points: int = RELIANCE_POINTS) -> np.ndarray:
    """M = E_{x∼B}[φ(x)φ(x)ᵀ] (D6) over ``points`` Halton points of the box [lo, hi]
    (scaled inputs), φ the Legendre products of ``terms``: (p, p)."""
    lo, hi = np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64)
    phi = legendre_products(lo + halton(points, len(lo)) * (hi - lo), terms)
    return phi.T @ phi / points


def reliance(cov_c: Array, noise: Array, gram: Array) -> Array:
    """u = tr(V M)/σ_i² (D6) per unit: ``cov_c`` (units, p, p) the φ block of the units'
    posterior covariance, ``noise`` σ_i² (units,), ``gram`` M (p, p)."""
    xp = namespace(cov_c)
    m = xp.asarray(np.asarray(gram), dtype=xp.float64)  # M is computed in NumPy (both paths)
    return (as_float64(cov_c) * m).sum((-2, -1)) / as_float64(noise).reshape(-1)


def untested_share(model: Discrepancy, u: Any, noise: Any) -> np.ndarray:
    """s_D of D6 per unit (NumPy): the share of the stated variance (box mean) no emulated
    design tested; 0 where u ≤ u_ref (and for a record without ``max_reliance``)."""
    u = np.asarray(as_float64(u), dtype=np.float64).reshape(-1)
    s2 = np.asarray(as_float64(noise), dtype=np.float64).reshape(-1)
    if math.isinf(model.max_reliance):
        return np.zeros_like(u)
    stated = model.beta * u + 1 + model.amplitude / s2
    return np.maximum(u - model.max_reliance, 0.0) / stated


def span_reasons(
    model: Discrepancy, x: Array, mask: Array, names: list[str], u: Any, noise: Any
) -> list[str]:
    """Per unit, "" if the references' emulation stands for its design, else one line why
    not: D5 (:func:`design_reason`) first, then D6 (:func:`reliance_reason`; ``u`` its
    :func:`reliance`, ``noise`` σ_i²). The one rule of both paths (NumPy and torch)."""
    d5, d6 = design_reason(model, x, mask, names), reliance_reason(model, u, noise)
    return [a or b for a, b in zip(d5, d6, strict=True)]


def reliance_reason(model: Discrepancy, u: Any, noise: Any) -> list[str]:
    """Per unit, "" or D6's one line why its design gets no σ."""
    share = untested_share(model, u, noise)
    u = np.asarray(as_float64(u), dtype=np.float64).reshape(-1)
    return [
        ""
        if s <= UNTESTED_SHARE
        else (
            f"no σ: the design leaves the prior {v:.3g} σ² of basis variance (mean over the "
            f"references' range), the reference units' emulated designs at most "
            f"{model.max_reliance:.3g} σ²: the untested part is {s:.2g} × its stated "
            f"variance, more than the {UNTESTED_SHARE:.2f} × that keeps 93–97 % coverage"
        )
        for s, v in zip(share, u, strict=True)
    ]


def levels(x: Array, mask: Array, tol: float, span: Array) -> Array:
    """Distinct levels of each input among a unit's real rows: values closer than ``tol``
    of the input's ``span`` are one level. (units, d), integer-valued float."""
    xp = namespace(x)
    m = as_float64(mask)[..., None] > 0
    v = xp.sort(xp.where(m, as_float64(x) / span, math.inf), 1)
    v = v.values if xp is not np else v
    with np.errstate(invalid="ignore"):  # inf − inf beyond the real rows: not counted
        gap = (v[:, 1:] - v[:, :-1]) > tol
    real = xp.isfinite(v[:, 1:])
    return 1.0 + as_float64((gap & real).sum(1))


def design_reason(model: Discrepancy, x: Array, mask: Array, names: list[str]) -> list[str]:
    """Per unit, "" if the references' emulation spans its design, else one line why not.

    Spanned: at least ``min_points`` and at most ``max_points`` points (the largest design
    the references emulated: beyond it κ(n) of D3 would be extrapolated), and per input at
    least ``min_levels`` levels spanning at least ``min_span`` of the references' span.
    (A unit of more than 64 points, :data:`~fedcal.prior.discrepancy.MAX_POINTS`, keeps
    fedprior's own interval: not judged here.) ``x``, ``mask``: tensors or NumPy arrays.
    """
    x, mask = np.asarray(as_float64(x)), np.asarray(as_float64(mask))
    span = np.asarray(model.box_hi, dtype=np.float64) - np.asarray(model.box_lo, dtype=np.float64)
    n = mask.sum(1)
    lev = levels(x, mask, model.level_tol, span)
    m = mask[..., None] > 0
    width = (np.where(m, x, -math.inf).max(1) - np.where(m, x, math.inf).min(1)) / span
    return [_reason(model, n[i], lev[i], width[i], names) for i in range(x.shape[0])]


def _reason(model: Discrepancy, n: float, lev: Any, width: Any, names: list[str]) -> str:
    """One unit's line of :func:`design_reason` ("" if spanned)."""
    if n < model.min_points:
        return (
            f"no σ: {int(n)} points, fewer than the smallest design the reference "
            f"units emulated ({model.min_points})"
        )
    if n > model.max_points:
        return (
            f"no σ: {int(n)} points, more than the largest design the reference units "
            f"emulated ({model.max_points}), so how far its error exceeds the model's "
            "was not learned"
        )
    for j, name in enumerate(names):
        if lev[j] < model.min_levels[j]:
            return (
                f"no σ: the design has {int(lev[j])} level(s) of {name}; the reference "
                f"units emulated designs of at least {model.min_levels[j]}, so the error "
                "away from its levels was not learned"
            )
        if width[j] < model.min_span[j] - 1e-9:
            return (
                f"no σ: the design's {name} spans {100 * float(width[j]):.0f} % of the "
                f"references' range; they emulated designs spanning at least "
                f"{100 * model.min_span[j]:.0f} %, so the error far from its points was "
                "not learned"
            )
    return ""
