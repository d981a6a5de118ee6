"""A new unit's checks against a stored prior, in NumPy: the range guard, its distance from
the fleet and its status — what ``calibrate`` writes to ``units.csv``, without torch.

* :func:`check_columns`: a file whose columns are not the prior's is refused.
* :func:`refuse_out_of_range`: a unit calibrated outside the range the prior was learned over
  is refused alone (only its calibration rows; 5 % of each input's span of slack): no model,
  status "refused" with the reason; the others are calibrated as if the file held only them.
  :func:`check_inputs` (``calibrate --strict``, or every unit out of range): the whole file.
* :func:`fleet_distance`: d²_i = (m_i − μ)ᵀ(Σ − V_i)⁺(m_i − μ), computed in data space with
  C_i = Z_iΣZ_iᵀ + σ_i²I = LLᵀ, e = L⁻¹(y_i − Z_iμ), A = L⁻¹Z_i: d²_i = ‖P_A e‖², with rank(A)
  degrees of freedom (:func:`distances`; :func:`fedcal.calibration.fleet_distance` hands it
  the torch algorithm's design).
* :func:`distance_threshold`: Hotelling's prediction threshold of d² at ``QA_LEVEL``.
* :func:`unit_status`: "failed" (a posterior that is not finite), "unlike the fleet" (d²
  above its threshold) or "ok".
* :func:`sigma_over_range`: each unit's predictive σ over a tensor grid of the prior's
  calibrated input range (:func:`operating_grid`), its mean and max in the target's unit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from fedcal.data.fleet import SPLIT_COLUMN, Fleet
from fedcal.prior.model import PriorModel
from fedcal.prior.posterior import Units, design, predictive_std

QA_LEVEL = 0.999  # a unit beyond this χ² quantile of the fleet distance is flagged
RANGE_TOLERANCE = 0.05  # inputs may exceed the fleet's calibrated range by 5 % of its span
RANK_TOL = 1e-10  # singular values of A = L⁻¹Z kept (relative to the largest)
DISTANCE_CHUNK = 4096  # units per batched solve (memory bound)
GRID_POINTS = 2000  # σ over the operating range: a tensor grid of about this many points
GRID_CHUNK = 256  # units per σ grid evaluation: (units, grid, p) float64, ~8 MB at p = 20
STATUS_OK, STATUS_UNLIKE, STATUS_FAILED = "ok", "unlike the fleet", "failed"
STATUS_REFUSED = "refused"  # = fedcal.status.Status.REFUSED (tested): no model, a reason


def check_columns(prior: PriorModel, fleet: Fleet, source: str) -> None:
    """Refuse a file whose inputs and target are not the prior's (in the prior's order)."""
    if tuple(fleet.features) != prior.features or fleet.target != prior.target:
        raise ValueError(
            f"{source}: columns {list(fleet.features)} → {fleet.target} do not match the "
            f"prior's {list(prior.features)} → {prior.target}"
        )


@dataclass(frozen=True)
class Excess:
    """One input a unit's calibration rows exceed: their span ``low``…``high`` against the
    prior's range ``lo``…``hi`` (``index``: the input's place in the prior's inputs)."""

    index: int
    column: str
    low: float
    high: float
    lo: float
    hi: float

    def long(self) -> str:
        """The refusal's wording (``--strict``'s error, units.csv's ``status_reason``)."""
        return (
            f"{self.column} spans {self.low:.6g}…{self.high:.6g}, outside the prior fleet's "
            f"calibrated range {self.lo:.6g}…{self.hi:.6g} (±5 %)"
        )

    def brief(self) -> str:
        """The warning's short form."""
        return (
            f"{self.column} {self.low:.6g}…{self.high:.6g} outside {self.lo:.6g}…{self.hi:.6g} ±5 %"
        )


def out_of_range(prior: PriorModel, fleet: Fleet) -> dict[Any, list[Excess]]:
    """Per unit calibrated outside the range the fleet's prior was learned over (in the
    file's order), each input it exceeds (:class:`Excess`, in the prior's input order).

    Only calibration (train) rows are judged: a unit's held-out rows beyond the range are
    scored with the extrapolation guard (linearized, ``beyond_support`` in per_sensor.csv).
    """
    calibration_rows = fleet.frame[fleet.frame[SPLIT_COLUMN] == "train"]
    # Every sensor's span at once (one grouped min/max per column, not a loop over sensors).
    groups = calibration_rows.groupby(fleet.client_column, sort=False)
    found: dict[Any, list[Excess]] = {}
    for k, (c, (lo, hi)) in enumerate(prior.input_range.items()):
        slack = RANGE_TOLERANCE * (hi - lo)
        span = groups[c].agg(["min", "max"])
        bad = span[(span["min"] < lo - slack) | (span["max"] > hi + slack)]
        for sensor, (low, high) in zip(bad.index, bad.to_numpy(), strict=True):
            found.setdefault(sensor, []).append(Excess(k, c, low, high, lo, hi))
    order = {s: k for k, s in enumerate(pd.unique(fleet.frame[fleet.client_column]))}
    return dict(sorted(found.items(), key=lambda kv: order[kv[0]]))


def check_inputs(prior: PriorModel, fleet: Fleet, source: str) -> None:
    """Refuse a file with any unit calibrated outside the range the fleet's prior was learned
    over (``calibrate --strict``; :func:`out_of_range`) in one line (:func:`refusal_line`)."""
    found = out_of_range(prior, fleet)
    if found:
        raise ValueError(refusal_line(found, source))


def refusal_line(found: dict[Any, list[Excess]], source: str) -> str:
    """The whole file's one-line refusal: the first unit (in the file's order) out of range
    on the first of the prior's inputs any unit exceeds, and its span there."""
    first = min(found, key=lambda s: found[s][0].index)  # ties: the first in the file's order
    return f"{source}: sensor {first}: {found[first][0].long()}: {CANNOT}"


CANNOT = "this prior cannot calibrate it"


@dataclass(frozen=True)
class Refusal:
    """A unit ``calibrate`` refused (no model): its calibration points and why (the wording
    of ``--strict``'s error for that unit, ``reason``; ``brief``: the warning's short form)."""

    unit: str
    points: int
    reason: str
    brief: str = ""


def refuse_out_of_range(
    prior: PriorModel, fleet: Fleet, source: str, strict: bool = False
) -> tuple[Fleet, tuple[Refusal, ...]]:
    """(the units inside the range as a fleet of their own rows, the refused ones).

    A unit whose calibration rows lie outside the prior's range (:func:`out_of_range`) is
    refused alone: the others are the file without its rows, so they are calibrated as if
    the file held only them. ``strict``, or every unit out of range: the whole file is
    refused in one line (:func:`check_inputs`'s)."""
    found = out_of_range(prior, fleet)
    if not found:
        return fleet, ()
    units = fleet.num_clients
    if strict or len(found) == units:
        line = refusal_line(found, source)
        if len(found) > 1:
            line += f" (nor any of the file's other {units - 1} units)"
        raise ValueError(line)
    column = fleet.client_column
    counts = fleet.frame[fleet.frame[SPLIT_COLUMN] == "train"].groupby(column, sort=False).size()
    refused = tuple(
        Refusal(
            str(s),
            int(counts[s]),
            "; ".join(e.long() for e in why) + f": {CANNOT}",
            "; ".join(e.brief() for e in why),
        )
        for s, why in found.items()
    )
    kept = fleet.frame[~fleet.frame[column].isin(list(found))]
    return Fleet(kept, fleet.features, fleet.target, column, dict(fleet.meta)), refused


def refused_line(refused: Sequence[Refusal], units: int) -> str:
    """The warning: "2 of 20 units refused: U030 (frequency_hz 30720.5…33939.5 outside
    29805.7…33691.2 ±5 %), …" ("" if none)."""
    if not refused:
        return ""
    named = ", ".join(f"{r.unit} ({r.brief or r.reason})" for r in refused)
    return f"{len(refused)} of {units} units refused: {named}"


def fleet_distance(
    prior: PriorModel,
    x: np.ndarray,
    y: np.ndarray,
    mask: np.ndarray,
    branch: np.ndarray | None,
    noise_var: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """(d², dof) per unit (module docstring) of the prior's design at the units' rows."""
    real = (np.asarray(mask) > 0).astype(np.float64)
    zed = design(prior, x, branch) * real[..., None]
    return distances(zed, y, real, prior.mean, prior.covariance, noise_var)


def distances(
    zed: np.ndarray,
    y: np.ndarray,
    real: np.ndarray,
    mean: np.ndarray,
    covariance: np.ndarray,
    noise_var: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """(d², dof) per unit (module docstring) from its design ``zed`` (units, rows, p; 0 on
    padding), readings ``y`` (units, rows), ``real`` (1 on a unit's rows, 0 on padding), the
    prior N(μ, Σ) and each unit's σ_i²: both calibrate paths' (the torch one hands its
    algorithm's design here). NaN and 0 where C_i does not factor. Padding rows get Z = 0,
    r = 0 and variance 1: C_i is block-diagonal, A's extra singular values 0. Batched,
    :data:`DISTANCE_CHUNK` units at a time; a chunk with a C_i that does not factor goes one
    unit at a time."""
    mean, covariance = np.asarray(mean, np.float64), np.asarray(covariance, np.float64)
    resid = (y - zed @ mean) * real
    d2 = np.full(len(zed), np.nan)
    dof = np.zeros(len(zed), dtype=int)
    for i in range(0, len(zed), DISTANCE_CHUNK):
        rows = np.arange(i, min(i + DISTANCE_CHUNK, len(zed)))
        noise = np.where(real[rows] > 0, noise_var[rows, None], 1.0)
        cov = zed[rows] @ covariance @ np.swapaxes(zed[rows], -1, -2)
        cov = cov + noise[..., None] * np.eye(cov.shape[-1])
        try:
            _distances(cov, resid[rows], zed[rows], rows, d2, dof)
        except np.linalg.LinAlgError:
            for k, r in enumerate(rows):
                try:
                    _distances(cov[[k]], resid[[r]], zed[[r]], np.array([r]), d2, dof)
                except np.linalg.LinAlgError:
                    continue
    return d2, dof


def _distances(cov, resid, zed, rows, d2, dof) -> None:
    """d² and dof of a batch of units into ``d2``/``dof`` at ``rows`` (raises LinAlgError
    when a C_i does not factor); units with a non-finite residual stay NaN."""
    chol = np.linalg.cholesky(cov)
    e = np.linalg.solve(chol, resid[..., None])[..., 0]
    a = np.linalg.solve(chol, zed)
    u, sv, _ = np.linalg.svd(a, full_matrices=False)
    top = sv.max(-1, keepdims=True) if sv.shape[-1] else sv
    kept = sv > RANK_TOL * top
    proj = (np.swapaxes(u, -1, -2) @ e[..., None])[..., 0] * kept
    ok = np.isfinite(resid).all(-1)
    d2[rows[ok]] = np.square(proj).sum(-1)[ok]
    dof[rows[ok]] = kept.sum(-1)[ok]


def distance_threshold(
    d2: np.ndarray, dof: np.ndarray, num_units: int | None, level: float = QA_LEVEL
) -> tuple[np.ndarray, np.ndarray]:
    """The QA threshold of d² and its p-value, per unit.

    Σ is estimated from the fleet's N units, so a new unit's d² is Hotelling's prediction
    statistic: d² · N(N − d)/(d(N − 1)(N + 1)) ~ F(d, N − d) (d = dof); the threshold is the
    F quantile at ``level`` mapped back; for large N it tends to the χ²(d) quantile (used
    when N is not recorded). A fleet of N ≤ d units cannot judge a d-dimensional distance:
    NaN (not flagged). Measured (tests/report/test_calibration_report.py): a typical new unit
    of a 10-unit fleet reached d² = 38.5 with d = 6, above χ²(6)'s 99.9 % quantile 22.5;
    Hotelling's threshold is 750.
    """
    from scipy.stats import chi2, f

    d = np.maximum(dof, 1).astype(float)
    if num_units is None:
        threshold = np.where(dof > 0, chi2.ppf(level, d), np.nan)
        return threshold, np.where(dof > 0, chi2.sf(d2, d), np.nan)
    n = float(num_units)
    ok = (dof > 0) & (n > d)
    den = np.where(ok, n - d, 1.0)
    factor = d * (n - 1.0) * (n + 1.0) / (n * den)
    threshold = np.where(ok, factor * f.ppf(level, d, den), np.nan)
    p_value = np.where(ok, f.sf(d2 / factor, d, den), np.nan)
    return threshold, p_value


def unit_status(coef: np.ndarray, d2: np.ndarray, threshold: np.ndarray) -> np.ndarray:
    """Per unit "failed" (its coefficients not finite), "unlike the fleet" (d² above its
    threshold) or "ok" (object array, as ``units.csv`` writes it)."""
    finite = np.isfinite(coef).all(-1)
    unlike = np.isfinite(d2) & (d2 > threshold)
    status = np.where(~finite, STATUS_FAILED, np.where(unlike, STATUS_UNLIKE, STATUS_OK))
    return status.astype(object)


def operating_grid(prior: PriorModel, points: int = GRID_POINTS) -> np.ndarray:
    """A tensor grid over the prior fleet's calibrated input range (raw units)."""
    ranges = [prior.input_range[c] for c in prior.features]
    side = max(3, round(points ** (1 / len(ranges))))
    axes = [np.linspace(lo, hi, side) for lo, hi in ranges]
    return np.stack(np.meshgrid(*axes, indexing="ij"), -1).reshape(-1, len(ranges))


def sigma_over_range(prior: PriorModel, units: Units) -> tuple[np.ndarray, np.ndarray]:
    """(mean, max) per unit of the predictive σ over :func:`operating_grid`, in the target's
    unit (NaN for a unit whose interval was declined). The grid lies in the prior's range,
    inside every unit's support box: nothing on it is extrapolated."""
    grid = prior.scaler.x(operating_grid(prior))
    y_scale = abs(float(np.asarray(prior.scaler.y_scale).ravel()[0]))
    means, maxes = [], []
    for i in range(0, len(units.coef), GRID_CHUNK):
        part = units.rows(i, i + GRID_CHUNK)
        sigma = predictive_std(part, np.broadcast_to(grid, (len(part.coef), *grid.shape)))
        means.append(sigma.mean(-1))
        maxes.append(sigma.max(-1))
    return np.concatenate(means) * y_scale, np.concatenate(maxes) * y_scale


def units_qa(
    prior: PriorModel,
    units: Units,
    x: np.ndarray,
    y: np.ndarray,
    mask: np.ndarray,
    branch: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """``units.csv``'s QA columns: d2, dof, d2_threshold, p_value, unlike_fleet, status,
    sigma_mean, sigma_max."""
    d2, dof = fleet_distance(prior, x, y, mask, branch, units.noise_var)
    threshold, p_value = distance_threshold(d2, dof, prior.num_units)
    unlike = np.isfinite(d2) & (d2 > threshold)
    status = unit_status(units.coef, d2, threshold)
    sigma_mean, sigma_max = sigma_over_range(prior, units)
    return {"d2": d2, "dof": dof, "d2_threshold": threshold, "p_value": p_value,
            "unlike_fleet": unlike, "status": status, "sigma_mean": sigma_mean,
            "sigma_max": sigma_max}  # fmt: skip
