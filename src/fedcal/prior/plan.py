"""A chamber design's forecast under a stored prior, in NumPy: what ``fedcal plan`` scores.

The criterion and the design search are :mod:`fedcal.planning`'s; this module gives them,
without torch, the three numbers they are made of (equations: :mod:`fedcal.planning`'s
docstring):

* a chamber point's model inputs: the response (frequency) the unit with coefficients
  ``coef`` (the prior mean μ for a new unit) gives at (P, T), φ(r, T)ᵀcoef_c = P solved
  for r by bisection (:func:`mean_inputs`);
* each design's expected posterior: the posterior ``calibrate`` forms
  (:func:`fedcal.prior.posterior.calibrate_units`, the same function ``calibrate`` runs
  without torch) from the base rows plus the design's rows read at the current mean, at the
  fleet's σ² (its docstring: the expected value of a unit's own noise fixed point), the h
  block of its covariance and h's mean set to the current belief's (E_y[m_h m_hᵀ + V_hh] =
  m_h m_hᵀ + Cov(h)), and its predictive variance E_y s²(x | D) =
  :func:`fedcal.prior.posterior.predictive_std`² (:class:`NumpyForecaster`);
* the units' RMSE over the range: the quadratic form E_x[(zᵀe)²] of the posterior error
  e ∼ N((0, m_h), C), drawn :data:`QUANTILE_DRAWS` times (``numpy.random.Generator``, seed
  :data:`QUANTILE_SEED`) and shifted to mean J (:func:`unit_rmse`).

Covered: the priors :func:`fedcal.prior.posterior.unsupported` covers (fedprior and its
configured variants, a prior's deployment discrepancy model: D2–D4's σ, a new unit's s_i² at
its expectation, the references' mean s² at the design's size, as
:func:`fedcal.calibration.expected_scale`); the others go through
:mod:`fedcal.planning_torch` (``fedcal[neural]``).
Equal to that path within rounding (tests/test_plan_numpy.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from fedcal.data.fleet import Fleet
from fedcal.prior import posterior, station
from fedcal.prior.deployment import model_of
from fedcal.prior.discrepancy import expected_scale
from fedcal.prior.legendre import legendre_products
from fedcal.prior.model import PriorModel

QUANTILE_DRAWS = 4000  # draws of the units' MSE distribution
QUANTILE_SEED = 0  # numpy.random.default_rng seed of those draws
BISECTIONS = 60  # halvings of the response bracket: 2⁻⁶⁰ of it, exact in float64
RESPONSE_MARGIN = 0.05  # the bracket: the prior's calibrated response range ± 5 %


@dataclass(frozen=True)
class Base:
    """What a design adds to: a unit's existing rows (scaled inputs ``x`` (n0, inputs), sweep
    signs ``b`` (n0,), readings ``y`` (n0,)) and its current belief (the coefficients' mean,
    the covariance of h, the noise variance). No rows: a new unit under the prior."""

    x: np.ndarray
    b: np.ndarray
    y: np.ndarray
    coef: np.ndarray
    cov_h: np.ndarray
    noise_var: float


@dataclass(frozen=True)
class Forecast:
    """C designs' (or units') posteriors as the planner reads them: ``coef`` (C, p), ``cov``
    (C, p, p), ``declined`` (C,) bool (no stated σ for a unit of that design), and
    ``variance(at)``: E_y s² at the scaled inputs ``at`` (G, inputs), (C, G), scaled units²."""

    coef: np.ndarray
    cov: np.ndarray
    declined: np.ndarray
    variance: Callable[[np.ndarray], np.ndarray]


def prior_base(prior: PriorModel) -> Base:
    """A new unit: no rows, the prior's mean, Cov(h) = Σ_hh and the fleet's σ²."""
    p = len(prior.basis.terms)
    width = len(prior.features)
    return Base(
        np.zeros((0, width)),
        np.zeros(0),
        np.zeros(0),
        np.asarray(prior.mean, dtype=np.float64),
        np.asarray(prior.covariance, dtype=np.float64)[p:, p:],
        float(prior.noise.variance),
    )


def mean_inputs(
    prior: PriorModel,
    inputs: tuple[int, int],
    pressure: np.ndarray,
    temperature: np.ndarray,
    coef: np.ndarray | None = None,
) -> np.ndarray:
    """Scaled inputs (n, 2) of chamber points (P, T): the response the unit with coefficients
    ``coef`` (default μ) gives there. ``inputs`` = (response, temperature) indices.

    Solves φ(r, T)ᵀ coef_c = P for the scaled response r by bisection over the prior's
    calibrated response range ± :data:`RESPONSE_MARGIN` (the model is monotone in its response
    there; a target outside it takes the nearer end). φ unguarded (no support box), as
    fedprior's ``predict`` of the bare coefficients.
    """
    response, temp = inputs
    scaler, terms = prior.scaler, prior.basis.terms
    pressure = np.asarray(pressure, float).ravel()
    temperature = np.asarray(temperature, float).ravel()
    n = len(pressure)
    raw = np.zeros((n, 2))
    raw[:, temp] = temperature
    scaled_t = scaler.x(raw)[:, temp]
    target = scaler.y(pressure.reshape(-1, 1))[:, 0]
    lo, hi = prior.input_range[prior.features[response]]
    ends = np.zeros((2, 2))
    ends[:, response] = [lo - RESPONSE_MARGIN * (hi - lo), hi + RESPONSE_MARGIN * (hi - lo)]
    a, b = scaler.x(ends)[:, response]
    c = np.asarray(prior.mean if coef is None else coef, dtype=np.float64)[: len(terms)]

    def value(r: np.ndarray) -> np.ndarray:
        x = np.zeros((n, 2))
        x[:, response], x[:, temp] = r, scaled_t
        return (legendre_products(x, terms) * c).sum(-1)

    lo_r, hi_r = np.full(n, float(a)), np.full(n, float(b))
    rising = value(hi_r) >= value(lo_r)
    for _ in range(BISECTIONS):
        mid = 0.5 * (lo_r + hi_r)
        above = (value(mid) >= target) == rising
        hi_r, lo_r = np.where(above, mid, hi_r), np.where(above, lo_r, mid)
    x = np.zeros((n, 2))
    x[:, response], x[:, temp] = 0.5 * (lo_r + hi_r), scaled_t
    return x


def _variance_at(units: posterior.Units) -> Callable[[np.ndarray], np.ndarray]:
    def variance(at: np.ndarray) -> np.ndarray:
        x = np.broadcast_to(at, (len(units.coef), *at.shape))
        return posterior.predictive_std(units, x) ** 2

    return variance


@dataclass(frozen=True)
class NumpyForecaster:
    """The forecasts of :mod:`fedcal.planning` for a prior the NumPy path covers (module
    docstring); :class:`fedcal.planning_torch.TorchForecaster` is the same for the others."""

    prior: PriorModel

    def designs(self, x: np.ndarray, b: np.ndarray, count: np.ndarray, base: Base) -> Forecast:
        """Each design's expected posterior (module docstring): ``x`` (C, n, inputs) scaled,
        ``b`` (C, n) sweep signs, ``count`` (C,) real rows (the rest padding)."""
        prior = self.prior
        c, n = b.shape
        n0 = len(base.x)
        xs = np.concatenate([np.broadcast_to(base.x, (c, *base.x.shape)), x], 1)
        bs = np.concatenate([np.broadcast_to(base.b, (c, n0)), b], 1)
        rows = np.arange(n)[None, :] < np.asarray(count)[:, None]
        mask = np.concatenate([np.ones((c, n0)), rows.astype(float)], 1)
        mean = posterior.design(prior, x, b) @ base.coef  # readings at the current mean
        ys = np.concatenate([np.broadcast_to(base.y, (c, n0)), mean], 1)
        units = posterior.calibrate_units(prior, xs, ys, mask, bs, noise_var=base.noise_var)
        if n0 == 0 and units.gp is not None:  # a new unit: the discrepancy model's s_i² at 1
            gp = units.gp
            args = (gp["gp_scale"], gp["gp_amp"], gp["gp_mask"])
            scale = expected_scale(model_of(prior), *args)
            units = replace(units, gp={**gp, "gp_scale": scale})
        # A declined interval (no σ) is kept aside: J still scores the design with τ².
        declined = np.zeros(c, bool) if units.declined is None else units.declined
        if prior.basis.branch_terms:  # E_y[m_h m_hᵀ + V_hh] = current m_h m_hᵀ + Cov(h)
            p = len(prior.basis.terms)
            cov = units.cov.copy()
            cov[:, p:, p:] = base.cov_h
            units = replace(units, cov=cov, coef=np.tile(base.coef, (c, 1)))
        units = replace(units, declined=None)
        return Forecast(units.coef, units.cov, declined, _variance_at(units))

    def unit(self, fleet: Fleet, source: str) -> tuple[Base, Forecast]:
        """The one unit of ``fleet`` calibrated against the prior (``calibrate``'s posterior,
        its own noise level): the base its next points add to, and its forecast now (σ NaN
        where its interval is declined)."""
        prior = self.prior
        units = station.calibrate_fleet(prior, fleet, source).units
        x, y, mask, branch = posterior.padded_rows(prior, fleet)
        n = int(mask[0].sum())
        p = len(prior.basis.terms)
        signs = np.zeros(n) if branch is None else branch[0, :n]
        base = Base(
            x[0, :n],
            signs,
            y[0, :n],
            units.coef[0],
            units.cov[0, p:, p:],
            float(units.noise_var[0]),
        )
        declined = np.zeros(1, bool) if units.declined is None else units.declined
        return base, Forecast(units.coef, units.cov, declined, _variance_at(units))


def unit_rmse(
    prior: PriorModel,
    cov: np.ndarray,
    shift: np.ndarray,
    field: np.ndarray,
    weights: np.ndarray,
    j: float,
) -> np.ndarray:
    """Draws of a unit's RMSE over the range (scaled units): MSE = E_x[(zᵀe)²] + the rest of
    s², e ∼ N(``shift``, ``cov``) (``shift`` = (0, m_h)), z = [φ, b·ψ] at the quadrature nodes
    ``field`` with the field's sweep b = ±1 at equal odds, weights ``weights``; the draws
    shifted so that their mean is ``j`` exactly (:mod:`fedcal.planning`'s docstring)."""
    # The symmetric root Q√ΛQᵀ, not Q√Λ: unique, so the draws move with C by rounding only
    # (an eigenbasis of near-equal eigenvalues is not, and would turn the draws with it).
    vals, vecs = np.linalg.eigh(0.5 * (cov + cov.T))
    root = (vecs * np.sqrt(np.maximum(vals, 0.0))) @ vecs.T
    gen = np.random.default_rng(QUANTILE_SEED)
    z = gen.standard_normal((QUANTILE_DRAWS, len(cov))) @ root.T + shift
    g = len(field)
    errs = []
    for sign in (1.0, -1.0):  # the field's unknown sweep, ±1 with equal odds
        rows = posterior.design(prior, field, np.full(g, sign))
        errs.append(((z @ rows.T) ** 2) @ weights)
    quad = 0.5 * (errs[0] + errs[1])
    return np.sqrt(np.maximum(j + quad - quad.mean(), 0.0))
