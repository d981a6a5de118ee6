"""A design's forecast under the stored prior (the package docstring): the planner
(:class:`Planner`: the prior's forecaster and the operating range's quadrature and grid),
each design's expected posterior, the criterion J and a design's expected figures."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedcal.data.fleet import DIRECTION_SIGNS
from fedcal.planning.chamber import Chamber, Design
from fedcal.prior.model import PriorModel
from fedcal.prior.plan import Base, mean_inputs, prior_base, unit_rmse

GRID = (21, 11)  # (pressures, temperatures) of the regular grid the worst σ is taken on
QUADRATURE = (8, 6)  # Gauss–Legendre nodes (pressures, temperatures) J is integrated with
BATCH = 512  # designs per batched posterior


@dataclass(frozen=True)
class Expected:
    """A design's expected figures over the operating range (target units, e.g. hPa)."""

    rms: float  # √J: root of the range-averaged expected predictive variance
    worst: float  # max over the range of the predictive σ
    mean_rmse: float  # E over units of a unit's RMSE over the range
    quantile_rmse: float  # that RMSE's quantile over units (default 95th percentile)
    minutes: float  # chamber time
    plateaus: int
    points: int
    declined: bool = False  # the prior states no interval for a unit of this design


@dataclass(frozen=True)
class Planner:
    """A stored prior made ready to score designs (see :func:`planner`)."""

    prior: PriorModel
    forecaster: Any  # fedcal.prior.plan.NumpyForecaster, or planning_torch.TorchForecaster
    chamber: Chamber
    response: int  # index of the response input (frequency), inverted from the target
    temperature: int  # index of the temperature input
    field: np.ndarray  # (G, inputs) scaled quadrature nodes of the operating range
    weights: np.ndarray  # (G,) their weights (sum 1): J = Σ_g w_g E_y s²(x_g)
    grid: np.ndarray  # (G', inputs) scaled regular grid of the range (the worst σ)
    quantile: float
    coef: np.ndarray | None = None  # whose responses a chamber point gets (None: μ)
    # (P, T) → (row, scaled inputs) of chamber points solved so far, and those rows stacked
    cache: dict = field(default_factory=dict, compare=False, repr=False)
    table: list = field(default_factory=list, compare=False, repr=False)

    @property
    def y_scale(self) -> float:
        return float(np.asarray(self.prior.scaler.y_scale).ravel()[0])


def features(
    plan: Planner, pressure: np.ndarray, temperature: np.ndarray, coef: np.ndarray | None = None
) -> np.ndarray:
    """Scaled inputs (n, 2) of chamber points (P, T): the response the unit with
    coefficients ``coef`` (default the planner's, the prior mean μ) gives there
    (:func:`fedcal.prior.plan.mean_inputs`: bisection on φ(r, T)ᵀ coef_c = P)."""
    coef = plan.coef if coef is None else coef
    return mean_inputs(plan.prior, (plan.response, plan.temperature), pressure, temperature, coef)


def posteriors(plan: Planner, x: np.ndarray, b: np.ndarray, count: np.ndarray, base: Base):
    """Each design's expected posterior (package doc): ``calibrate``'s posterior of the base
    rows plus the design's rows read at the current mean, h-block of the covariance set to
    the current belief's (:class:`fedcal.prior.plan.Forecast`). ``x`` (C, n, 2), ``b`` (C, n),
    ``count`` (C,)."""
    return plan.forecaster.designs(x, b, count, base)


def pack(plan: Planner, designs: list[Design]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Designs → padded (x (C, n, 2), b (C, n), count (C,)); each chamber point's inputs
    solved once per planner (its cache)."""
    cache = plan.cache
    need = {(p, d.temperatures[k]) for d in designs for k, p, _ in d.points} - cache.keys()
    if need:
        keys = sorted(need)
        got = features(plan, np.array([k[0] for k in keys]), np.array([k[1] for k in keys]))
        for i, key in enumerate(keys):
            cache[key] = (len(cache), got[i])
        plan.table.clear()
    if not plan.table:  # the cached inputs as one array, row = the cache's index
        plan.table.append(np.stack([v for _, v in sorted(cache.values(), key=lambda r: r[0])]))
    rows = max([d.size for d in designs] + [1])
    idx = np.zeros((len(designs), rows), dtype=np.int64)
    sign = np.zeros((len(designs), rows))
    count = np.zeros(len(designs), dtype=np.int64)
    for i, d in enumerate(designs):
        n = d.size
        idx[i, :n] = [cache[(p, d.temperatures[k])][0] for k, p, _ in d.points]
        sign[i, :n] = [DIRECTION_SIGNS[s] for _, _, s in d.points]
        count[i] = n
    mask = (np.arange(rows)[None, :] < count[:, None]).astype(float)
    return plan.table[0][idx] * mask[..., None], sign, count


def expected_variance(
    plan: Planner, designs: list[Design], base: Base | None = None, at: np.ndarray | None = None
) -> np.ndarray:
    """E_y s²(x | D) at the quadrature nodes (or ``at``), (designs, G), scaled units²."""
    base = base or prior_base(plan.prior)
    at = plan.field if at is None else at
    out = [
        posteriors(plan, *pack(plan, designs[start : start + BATCH]), base).variance(at)
        for start in range(0, len(designs), BATCH)
    ]
    return np.concatenate(out) if out else np.zeros((0, len(at)))


def criterion(plan: Planner, designs: list[Design], base: Base | None = None) -> np.ndarray:
    """J(D) = E_{x∼U(R)} E_y s²(x | D) per design, scaled units² (package doc)."""
    return expected_variance(plan, designs, base) @ plan.weights


def evaluate(plan: Planner, design: Design, base: Base | None = None) -> Expected:
    """A design's expected RMS σ, worst σ, mean and quantile unit RMSE, chamber time."""
    base = base or prior_base(plan.prior)
    post = posteriors(plan, *pack(plan, [design]), base)
    j = float(post.variance(plan.field)[0] @ plan.weights)
    worst = float(post.variance(plan.grid)[0].max())
    # Units' MSE: a quadratic form of (e_c, h) ~ N((0, m_h), C), shifted to mean J (package doc).
    p = len(plan.prior.basis.terms)
    shift = np.zeros(len(base.coef))
    shift[p:] = base.coef[p:]
    rmse = unit_rmse(plan.prior, post.cov[0], shift, plan.field, plan.weights, j) * plan.y_scale
    return Expected(
        rms=j**0.5 * plan.y_scale,
        worst=worst**0.5 * plan.y_scale,
        mean_rmse=float(rmse.mean()),
        quantile_rmse=float(np.quantile(rmse, plan.quantile)),
        minutes=plan.chamber.minutes(design.plateaus, design.size),
        plateaus=design.plateaus,
        points=design.size,
        declined=bool(post.declined[0]),
    )


def meets(e: Expected, spec: float) -> bool:
    return e.rms <= spec and e.quantile_rmse <= spec
