"""Choose a new unit's chamber points from the fleet prior (``fedcal plan``).

A fleet prior N(μ, Σ) over a unit's coefficients, with noise σ², is a
Gaussian linear model (:mod:`fedcal.algorithms.fedprior`). For such a model
the posterior covariance of a unit measured at the design D (its points'
features Φ_D, rows [φ(x), b·ψ(x)], b = +1 up, −1 down)

    V(D) = (Φ_Dᵀ Φ_D / σ² + Σ⁻¹)⁻¹

does not depend on the readings: before a unit enters the chamber, the prior
says how well each candidate design will calibrate it.

Criterion (I-optimality, integrated predictive variance). A calibrated unit
is used over its operating range R (the chamber's pressure range × the
temperature range the fleet was calibrated over), at a point x uniform over R
with an unknown sweep direction. Its expected squared error there is the
expected predictive variance

    J(D) = E_{x∼U(R)} E_y[ s²(x | D, y) ],
    s²(x | D, y) = φ(x)ᵀ V_cc φ(x) + σ² + τ²(D) + ψ(x)ᵀ (m_h m_hᵀ + V_hh) ψ(x)

(fedprior's predictive variance with the direction term, m_h the posterior
mean of the hysteresis coefficients, and with ``interval = "calibrated"`` the
discrepancy τ² the fleet's hold-out learned for designs of fewer than twice the
probe's points, 0 for larger ones: fedprior "Intervals", I2–I3). A design
smaller than the probe gets no stated interval from the model (declined); the
criterion still scores it with the probe's τ² (the greedy construction passes
through such designs) and :class:`Expected` says ``declined``. Averaged over the readings the unit
will give, E_y[m_h m_hᵀ + V_hh] = μ_h μ_hᵀ + Σ_hh (law of total variance), so
E_y s² is the predictive σ² ``calibrate`` states
(:func:`fedcal.prior.posterior.predictive_std`) evaluated at the posterior of the design
(:func:`fedcal.prior.posterior.calibrate_units`, ``calibrate``'s own function, on readings
equal to the prior mean, which leave the mean at μ) with the h-block of its covariance
set to the prior's Σ_hh (:mod:`fedcal.prior.plan`, NumPy). This module never writes the
variance formula itself: any term ``calibrate`` adds to its predictive variance flows in.
A prior that path does not cover (:func:`fedcal.prior.posterior.unsupported`) is
forecast by ``calibrate``'s torch path instead (:mod:`fedcal.planning_torch`,
``fedcal[neural]``).
The direction still matters: a point swept up sees c + h along ψ, one swept
down c − h, and the joint prior splits them; what h adds in the field does
not shrink with the design (its sign is unknown there).

R is the chamber's pressure range × the temperature range the fleet was
calibrated over (the prior's ``input_range``), whatever set points the
chamber can reach.

Why I-optimality: the figure a user is judged by is the RMSE over the range
(√J is its expected value's root); D-optimality would spend points on
coefficients that barely move the prediction inside R. The worst case over
the range, max_x s(x), is reported beside it (a minimax design would chase the
corners, where the range is rarely used). J is evaluated on a regular (P, T)
Gauss–Legendre product rule of R (:data:`QUADRATURE` nodes in P × T, exact for
polynomials of degree < 2·nodes in each; the worst case on a regular grid,
:data:`GRID`); the response input (frequency) of a chamber point
(P, T) is the one the prior-mean unit gives there (φ(x)ᵀμ_c = P solved by
bisection), so a design needs no unit's data.

Over the fleet's units. Under a Gaussian prior with one fleet noise level the
predictive variance is the same for every unit; units differ in their actual
error. A unit's mean squared error over R is

    MSE = E_x[(φᵀ e_c)² + (ψᵀh)²] + (the rest of s²),   (e_c, h) ∼ N((0, μ_h), C)

with e_c = c − m_c its posterior error and C the covariance above (V_cc, V_ch
and Σ_hh): a quadratic form of a Gaussian. Its distribution is drawn
(:data:`QUANTILE_DRAWS` fixed-seed draws) and shifted so that its mean is J
exactly; the design's figures are then E[√MSE] (the fleet's mean RMSE) and
its ``quantile`` (default 0.95, the 95th percentile: the "worst" of 20
units). With ``noise = "sensor"`` the stored prior does not hold the spread of
the units' noise levels, so every unit is given the fleet's σ² (said, not
hidden).

Optimizer. A design is K plateau temperatures (from the chamber's feasible
set points) and N points (a plateau, a pressure step, a direction), every
plateau at least one point. Greedy construction (add the point that lowers J
most; a new plateau is opened while fewer than K are) then a best-improvement
exchange (Fedorov 1972): each pass evaluates, in one batch, every move of one
plateau to another set point and of one point to another (plateau, pressure,
direction), and applies the best if it lowers J. Exchange starts from the
greedy design and from the standard grid (and from a given start); the best
is returned, so the result is never worse than any start.

Chamber time: K·plateau_minutes + N·point_minutes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd

from fedcal.data.fleet import DIRECTION_SIGNS
from fedcal.prior.model import PriorModel
from fedcal.prior.plan import (
    Base,
    Forecast,
    NumpyForecaster,
    mean_inputs,
    prior_base,
    unit_rmse,
)
from fedcal.prior.posterior import unsupported

DESIGN_COLUMNS = ("pressure_hpa", "temperature_c", "direction")
GRID = (21, 11)  # (pressures, temperatures) of the regular grid the worst σ is taken on
QUADRATURE = (8, 6)  # Gauss–Legendre nodes (pressures, temperatures) J is integrated with
DEFAULT_PRESSURES = tuple(float(p) for p in range(50, 1551, 100))  # the campaign's levels
MAX_PASSES = 100  # exchange passes (each applies one improving move; measured: < 20 used)
BATCH = 512  # designs per batched posterior


@dataclass(frozen=True)
class Chamber:
    """What the chamber can do: feasible set points, pressure steps, sweeps, and its time."""

    temperatures: tuple[float, ...]  # feasible plateau set points (°C), ascending
    pressures: tuple[float, ...]  # feasible pressure steps (hPa), ascending
    directions: tuple[str, ...] = ("up", "down")
    plateau_minutes: float = 90.0
    point_minutes: float = 5.0

    def __post_init__(self) -> None:
        for name in ("temperatures", "pressures"):
            values = tuple(sorted(float(v) for v in getattr(self, name)))
            if not values:
                raise ValueError(f"chamber: no feasible {name}")
            object.__setattr__(self, name, values)
        bad = [d for d in self.directions if d not in DIRECTION_SIGNS]
        if bad or not self.directions:
            raise ValueError(f"chamber: directions must be 'up'/'down', got {bad}")

    def minutes(self, plateaus: int, points: int) -> float:
        return plateaus * self.plateau_minutes + points * self.point_minutes


@dataclass(frozen=True)
class Design:
    """K plateau set points and N points (plateau index, pressure, direction)."""

    temperatures: tuple[float, ...]
    points: tuple[tuple[int, float, str], ...]

    @property
    def plateaus(self) -> int:
        return len(self.temperatures)

    @property
    def size(self) -> int:
        return len(self.points)

    def frame(self) -> pd.DataFrame:
        """design.csv: plateaus cold to hot; per plateau the up sweep, then the down sweep."""
        rows = []
        for k in np.argsort(self.temperatures, kind="stable"):
            mine = [(p, d) for j, p, d in self.points if j == k]
            up = sorted(p for p, d in mine if d == "up")
            down = sorted((p for p, d in mine if d == "down"), reverse=True)
            t = self.temperatures[k]
            rows += [(p, t, "up") for p in up] + [(p, t, "down") for p in down]
        return pd.DataFrame(rows, columns=list(DESIGN_COLUMNS))

    @staticmethod
    def from_frame(frame: pd.DataFrame, source: str = "design") -> Design:
        missing = [c for c in DESIGN_COLUMNS if c not in frame.columns]
        if missing:
            raise ValueError(f"{source}: missing column(s) {', '.join(missing)}")
        temps: list[float] = []
        points = []
        for i, row in enumerate(frame.itertuples(index=False), start=2):
            t, p = float(row.temperature_c), float(row.pressure_hpa)
            d = str(row.direction).strip().lower()
            if d not in DIRECTION_SIGNS or not (np.isfinite(t) and np.isfinite(p)):
                raise ValueError(f"{source}: line {i}: bad point ({p}, {t}, {row.direction!r})")
            if t not in temps:
                temps.append(t)
            points.append((temps.index(t), p, d))
        return Design(tuple(temps), tuple(points))


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


def default_chamber(
    prior: PriorModel,
    t_min: float | None = None,
    t_max: float | None = None,
    t_step: float = 5.0,
    pressures: tuple[float, ...] | None = None,
    plateau_minutes: float = 90.0,
    point_minutes: float = 5.0,
    directions: tuple[str, ...] | None = None,
) -> Chamber:
    """Set points every ``t_step`` within the limits (default: the prior's calibrated
    temperature range, snapped inward to the step); pressure steps (default the
    campaign's 50…1550 hPa by 100); both sweeps if the prior has a direction term."""
    _, temp = _inputs(prior)
    lo, hi = prior.input_range[prior.features[temp]]
    if t_step <= 0:
        raise ValueError(f"--t-step must be > 0, got {t_step}")
    t_min = float(np.ceil(lo / t_step - 1e-9) * t_step) if t_min is None else float(t_min)
    t_max = float(np.floor(hi / t_step + 1e-9) * t_step) if t_max is None else float(t_max)
    if t_max < t_min:
        raise ValueError(f"temperature limits {t_min}…{t_max} °C are empty")
    temps = np.arange(t_min, t_max + 1e-9, t_step)
    if directions is None:
        directions = ("up", "down") if prior.basis.branch_terms else ("up",)
    return Chamber(
        tuple(float(t) for t in temps),
        tuple(pressures) if pressures else DEFAULT_PRESSURES,
        tuple(directions),
        plateau_minutes,
        point_minutes,
    )


def _inputs(prior: PriorModel) -> tuple[int, int]:
    """(response, temperature) input indices; the target is what the chamber sets (P)."""
    names = list(prior.features)
    temps = [i for i, n in enumerate(names) if "temp" in n.lower()]
    if len(names) != 2 or len(temps) != 1:
        raise ValueError(
            f"plan needs a prior over (response, temperature) inputs, got {names}: "
            "a chamber sets the target and a temperature"
        )
    return 1 - temps[0], temps[0]


def forecaster(prior: PriorModel, source: str = "prior.json") -> Any:
    """What forms a design's posterior: NumPy (:class:`fedcal.prior.plan.NumpyForecaster`)
    for the priors it covers; for the others ``calibrate``'s torch path
    (:class:`fedcal.planning_torch.TorchForecaster`), which needs ``fedcal[neural]``."""
    from fedcal.report.served import NeedsTorch, torch_available

    why = unsupported(prior)
    if not why:
        return NumpyForecaster(prior)
    if not torch_available():
        raise NeedsTorch(f"{source}: plan of {why}")
    from fedcal.planning_torch import TorchForecaster

    return TorchForecaster(prior)


def planner(
    prior: PriorModel,
    chamber: Chamber | None = None,
    quantile: float = 0.95,
    temperature_range: tuple[float, float] | None = None,
    forecast: Any = None,
) -> Planner:
    """Everything a design is scored with: the prior's forecaster and the range's grid.

    The operating range R is [min, max] of the chamber's pressures × the
    temperature range the fleet was calibrated over (the prior's ``input_range``;
    or ``temperature_range``): limiting the set points does not shrink where
    the unit will be used. ``forecast``: the forecaster (default :func:`forecaster`).
    """
    chamber = chamber or default_chamber(prior)
    if not 0.0 < quantile < 1.0:
        raise ValueError(f"quantile must be in (0, 1), got {quantile}")
    response, temperature = _inputs(prior)
    empty = np.zeros((0, 2))
    base = Planner(
        prior, forecast or forecaster(prior), chamber, response, temperature, empty,
        np.zeros(0), empty, quantile,
    )  # fmt: skip
    p_lo, p_hi = chamber.pressures[0], chamber.pressures[-1]
    t_lo, t_hi = temperature_range or prior.input_range[prior.features[temperature]]
    pp, tt = np.meshgrid(
        np.linspace(p_lo, p_hi, GRID[0]), np.linspace(t_lo, t_hi, GRID[1]), indexing="ij"
    )
    (pn, pw), (tn, tw) = (np.polynomial.legendre.leggauss(n) for n in QUADRATURE)
    qp, qt = np.meshgrid(
        p_lo + (p_hi - p_lo) * (pn + 1) / 2, t_lo + (t_hi - t_lo) * (tn + 1) / 2, indexing="ij"
    )
    return replace(
        base,
        field=features(base, qp.ravel(), qt.ravel()),
        weights=np.outer(pw, tw).ravel() / 4.0,
        grid=features(base, pp.ravel(), tt.ravel()),
    )


def features(
    plan: Planner, pressure: np.ndarray, temperature: np.ndarray, coef: np.ndarray | None = None
) -> np.ndarray:
    """Scaled inputs (n, 2) of chamber points (P, T): the response the unit with
    coefficients ``coef`` (default the planner's, the prior mean μ) gives there
    (:func:`fedcal.prior.plan.mean_inputs`: bisection on φ(r, T)ᵀ coef_c = P)."""
    coef = plan.coef if coef is None else coef
    return mean_inputs(plan.prior, (plan.response, plan.temperature), pressure, temperature, coef)


def posteriors(plan: Planner, x: np.ndarray, b: np.ndarray, count: np.ndarray, base: Base):
    """Each design's expected posterior (module doc): ``calibrate``'s posterior of the base
    rows plus the design's rows read at the current mean, h-block of the covariance set to
    the current belief's (:class:`fedcal.prior.plan.Forecast`). ``x`` (C, n, 2), ``b`` (C, n),
    ``count`` (C,)."""
    return plan.forecaster.designs(x, b, count, base)


def _pack(plan: Planner, designs: list[Design]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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
        posteriors(plan, *_pack(plan, designs[start : start + BATCH]), base).variance(at)
        for start in range(0, len(designs), BATCH)
    ]
    return np.concatenate(out) if out else np.zeros((0, len(at)))


def criterion(plan: Planner, designs: list[Design], base: Base | None = None) -> np.ndarray:
    """J(D) = E_{x∼U(R)} E_y s²(x | D) per design, scaled units² (module doc)."""
    return expected_variance(plan, designs, base) @ plan.weights


def evaluate(plan: Planner, design: Design, base: Base | None = None) -> Expected:
    """A design's expected RMS σ, worst σ, mean and quantile unit RMSE, chamber time."""
    base = base or prior_base(plan.prior)
    post = posteriors(plan, *_pack(plan, [design]), base)
    j = float(post.variance(plan.field)[0] @ plan.weights)
    worst = float(post.variance(plan.grid)[0].max())
    # Units' MSE: a quadratic form of (e_c, h) ~ N((0, m_h), C), shifted to mean J (module doc).
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


# ---- standard grids ---------------------------------------------------------------
def _snap(values: np.ndarray, feasible: tuple[float, ...]) -> list[float]:
    grid = np.asarray(feasible)
    return [float(grid[np.argmin(np.abs(grid - v))]) for v in values]


def grid_design(
    chamber: Chamber, pressures: int, plateaus: int, sweeps: tuple[str, ...] = ("up",)
) -> Design:
    """The standard PxT grid: P pressures and T set points evenly spread, ends included
    (T = 1: the middle), snapped to the chamber's steps; one sweep per entry of ``sweeps``."""
    p_lo, p_hi = chamber.pressures[0], chamber.pressures[-1]
    t_lo, t_hi = chamber.temperatures[0], chamber.temperatures[-1]
    ps = _snap(np.linspace(p_lo, p_hi, pressures), chamber.pressures)
    ts = np.array([(t_lo + t_hi) / 2]) if plateaus == 1 else np.linspace(t_lo, t_hi, plateaus)
    temps = tuple(dict.fromkeys(_snap(ts, chamber.temperatures)))
    points = tuple((k, p, s) for k in range(len(temps)) for s in sweeps for p in ps)
    return Design(temps, points)


def standard_grids(chamber: Chamber) -> dict[str, Design]:
    """3×2, 2×3, 4×3 (one up sweep each) and the full campaign (every step and set point
    of the simulator's protocol: 16 pressures × 6 plateaus × up, down, up, down)."""
    out = {f"{p}x{t}": grid_design(chamber, p, t) for p, t in ((3, 2), (2, 3), (4, 3))}
    campaign = grid_design(chamber, len(chamber.pressures), 6, ("up", "down", "up", "down"))
    out["campaign"] = campaign
    return out


# ---- the optimizer ----------------------------------------------------------------
def _moves(plan: Planner, d: Design) -> list[Design]:
    """Every design one exchange away: one plateau to another free set point, or one point
    to another (plateau, pressure, direction) that leaves no plateau empty."""
    ch = plan.chamber
    out = []
    for k in range(d.plateaus):
        for t in ch.temperatures:
            if t not in d.temperatures:
                out.append(Design((*d.temperatures[:k], t, *d.temperatures[k + 1 :]), d.points))
    per = np.bincount([k for k, _, _ in d.points], minlength=d.plateaus)
    for j, (k0, p0, s0) in enumerate(d.points):
        for k in range(d.plateaus):
            if k != k0 and per[k0] == 1:
                continue
            for p in ch.pressures:
                for s in ch.directions:
                    if (k, p, s) != (k0, p0, s0):
                        pts = (*d.points[:j], (k, p, s), *d.points[j + 1 :])
                        out.append(Design(d.temperatures, pts))
    return out


def exchange(plan: Planner, start: Design, base: Base | None = None) -> tuple[Design, float]:
    """Best-improvement exchange from ``start``; never returns a worse design (module doc)."""
    best, value = start, float(criterion(plan, [start], base)[0])
    for _ in range(MAX_PASSES):
        moves = _moves(plan, best)
        if not moves:
            break
        scores = criterion(plan, moves, base)
        i = int(np.argmin(scores))
        if not float(scores[i]) < value * (1.0 - 1e-9):
            break
        best, value = moves[i], float(scores[i])
    return best, value


def greedy(plan: Planner, plateaus: int, points: int, base: Base | None = None) -> Design:
    """Add the point that lowers J most, N times; a new plateau may be opened (any free set
    point) while fewer than K are open, and must be when the remaining points require it."""
    ch = plan.chamber
    d = Design((), ())
    for step in range(points):
        must_open = points - step == plateaus - d.plateaus
        cands = []
        if not must_open:
            cands += [
                Design(d.temperatures, (*d.points, (k, p, s)))
                for k in range(d.plateaus)
                for p in ch.pressures
                for s in ch.directions
            ]
        if d.plateaus < plateaus:
            k = d.plateaus
            cands += [
                Design((*d.temperatures, t), (*d.points, (k, p, s)))
                for t in ch.temperatures
                if t not in d.temperatures
                for p in ch.pressures
                for s in ch.directions
            ]
        d = cands[int(np.argmin(criterion(plan, cands, base)))]
    return d


@dataclass(frozen=True)
class Plan:
    design: Design
    expected: Expected
    start: Design  # the standard grid (or given start) the optimizer had to beat
    start_expected: Expected


def optimize(plan: Planner, plateaus: int, points: int, start: Design | None = None) -> Plan:
    """The design of K plateaus and N points minimizing J (module doc)."""
    ch = plan.chamber
    if plateaus < 1 or points < plateaus:
        raise ValueError(f"need 1 <= plateaus <= points, got {plateaus} plateaus, {points} points")
    if plateaus > len(ch.temperatures):
        raise ValueError(f"{plateaus} plateaus but only {len(ch.temperatures)} feasible set points")
    if start is None:
        start = _even_start(ch, plateaus, points)
    check_design(ch, start, plateaus, points)
    # Exchange from the better of the two starts (greedy, the grid): J never exceeds it.
    starts = [start, greedy(plan, plateaus, points)]
    values = criterion(plan, starts)
    best = exchange(plan, starts[int(np.argmin(values))])[0]
    return Plan(best, evaluate(plan, best), start, evaluate(plan, start))


def _even_start(ch: Chamber, plateaus: int, points: int) -> Design:
    """The standard grid when N is a multiple of K; else its points shared out evenly."""
    temps = grid_design(ch, 2, plateaus).temperatures
    if len(temps) < plateaus:  # snapping merged set points: take the next free ones
        free = [t for t in ch.temperatures if t not in temps]
        temps = temps + tuple(free[: plateaus - len(temps)])
    counts = [points // plateaus + (k < points % plateaus) for k in range(plateaus)]
    pts = []
    for k, n in enumerate(counts):
        ps = _snap(np.linspace(ch.pressures[0], ch.pressures[-1], n), ch.pressures)
        if n == 1:
            ps = _snap(np.array([(ch.pressures[0] + ch.pressures[-1]) / 2]), ch.pressures)
        pts += [(k, p, ch.directions[0]) for p in ps]
    return Design(tuple(temps), tuple(pts))


def check_design(ch: Chamber, d: Design, plateaus: int | None = None, points: int | None = None):
    """Refuse a design outside the chamber (set points, pressures, directions) or of the
    wrong size, naming the offending value."""
    if plateaus is not None and d.plateaus != plateaus:
        raise ValueError(f"design has {d.plateaus} plateaus, expected {plateaus}")
    if points is not None and d.size != points:
        raise ValueError(f"design has {d.size} points, expected {points}")
    for t in d.temperatures:
        if not ch.temperatures[0] - 1e-9 <= t <= ch.temperatures[-1] + 1e-9:
            raise ValueError(f"set point {t} °C outside the chamber's limits")
    for k, p, s in d.points:
        if not (0 <= k < d.plateaus) or p not in ch.pressures or s not in ch.directions:
            raise ValueError(f"point ({p} hPa, plateau {k}, {s}) is not a feasible chamber point")
    if set(range(d.plateaus)) - {k for k, _, _ in d.points}:
        raise ValueError("design has a plateau without points")


def plan_design(
    prior: PriorModel,
    plateaus: int,
    points: int,
    *,
    chamber: Chamber | None = None,
    start: Design | None = None,
    quantile: float = 0.95,
) -> Plan:
    """From Python (what ``FleetPrior.plan`` wires to): the optimized design of K plateaus
    and N points for a new unit under the stored ``prior`` (a loaded prior.json)."""
    return optimize(planner(prior, chamber, quantile), plateaus, points, start)


def cheapest(plan: Planner, spec: float, max_plateaus: int = 4, max_points: int = 24) -> list[Plan]:
    """Per K ≤ ``max_plateaus``, the fewest points N ≤ ``max_points`` whose optimized design
    meets the spec (√J ≤ spec and the units' RMSE quantile ≤ spec), cheapest first.

    N is found by bisection: J of the optimized design falls with N (a design of N + 1
    points contains one of N). Returns the meeting plans sorted by chamber time.
    """
    out = []
    for k in range(1, min(max_plateaus, len(plan.chamber.temperatures)) + 1):
        lo, hi = k, max_points
        best = None
        while lo <= hi:
            n = (lo + hi) // 2
            result = optimize(plan, k, n)
            if meets(result.expected, spec):
                best, hi = result, n - 1
            else:
                lo = n + 1
        if best is not None:
            out.append(best)
    return sorted(out, key=lambda r: (r.expected.minutes, r.expected.quantile_rmse))


def meets(e: Expected, spec: float) -> bool:
    return e.rms <= spec and e.quantile_rmse <= spec


# ---- sequential mode --------------------------------------------------------------
@dataclass(frozen=True)
class NextStep:
    now: Expected  # the unit as it is (its actual posterior)
    done: bool  # its predicted RMS σ over the range meets the spec
    steps: tuple[tuple[float, float, str, float, float], ...]  # (P, T, dir, RMS σ after, min)


def _candidates(ch: Chamber, current: float | None) -> tuple[list, np.ndarray]:
    """Every chamber point (P, T, direction) and its cost in minutes: a point on the current
    plateau (set point ``current``) costs point_minutes, one on another also plateau_minutes."""
    cands, costs = [], []
    for t in ch.temperatures:
        same = current is not None and abs(t - current) < 1e-9
        for p in ch.pressures:
            for s in ch.directions:
                cands.append((p, t, s))
                costs.append(ch.point_minutes + (0.0 if same else ch.plateau_minutes))
    return cands, np.array(costs)


def next_points(
    plan: Planner,
    base: Base,
    now: Forecast,
    spec: float,
    count: int = 1,
    current: float | None = None,
) -> NextStep:
    """Whether the unit meets ``spec`` (its actual posterior ``now``'s RMS predictive σ over
    the range), and if not the next ``count`` points, chosen greedily by the reduction of J
    per chamber minute (:func:`_candidates`; ``current``: the unit's last temperature
    snapped to the chamber). Candidate points' responses are the unit's own posterior
    mean's."""
    var = float(now.variance(plan.field)[0] @ plan.weights)
    worst = float(now.variance(plan.grid)[0].max())
    nan = float("nan")
    state = Expected(
        var**0.5 * plan.y_scale, worst**0.5 * plan.y_scale, nan, nan, 0.0, 0, len(base.x)
    )
    if not math.isfinite(state.rms):  # the prior states no interval for this unit's design
        raise ValueError(
            "the prior states no predictive σ for this unit (its interval is declined: "
            "see the prior's interval reason), so no next point can be chosen by it"
        )
    if state.rms <= spec:
        return NextStep(state, True, ())
    # the unit's own coefficients solve its candidate points' inputs (a cache of its own)
    own = replace(plan, coef=base.coef, cache={}, table=[])
    value = var
    chosen: list[tuple[float, float, str]] = []
    steps = []
    for _ in range(count):
        cands, costs = _candidates(plan.chamber, current)
        designs = [_as_design([*chosen, c]) for c in cands]
        j = posteriors(plan, *_pack(own, designs), base).variance(plan.field) @ plan.weights
        i = int(np.argmax((value - j) / costs))
        chosen.append(cands[i])
        value = float(j[i])
        current = cands[i][1]
        steps.append((*cands[i], value**0.5 * plan.y_scale, float(costs[i])))
        if value**0.5 * plan.y_scale <= spec:
            break
    return NextStep(state, False, tuple(steps))


def _as_design(points: list[tuple[float, float, str]]) -> Design:
    temps = tuple(dict.fromkeys(t for _, t, _ in points))
    return Design(temps, tuple((temps.index(t), p, s) for p, t, s in points))


def unit_next(
    plan: Planner, fleet: Any, spec: float, count: int = 1, source: str = "unit"
) -> NextStep:
    """Sequential mode for the one unit of ``fleet`` (its calibration points so far): its
    actual posterior under the prior (``calibrate``'s: the planner's forecaster), whether it
    meets ``spec``, and else its next ``count`` points (:func:`next_points`). The current
    plateau is the set point nearest its last point's temperature."""
    if fleet.num_clients != 1:
        raise ValueError(f"{source}: holds {fleet.num_clients} units; --next takes one unit")
    base, now = plan.forecaster.unit(fleet, source)
    rows = fleet.frame[fleet.frame["split"] == "train"]
    last = float(rows[plan.prior.features[plan.temperature]].iloc[-1])
    current = _snap(np.array([last]), plan.chamber.temperatures)[0]
    return next_points(plan, base, now, spec, count, current)


def compare(plan: Planner, designs: dict[str, Design], spec: float | None = None) -> pd.DataFrame:
    """One row per named design: plateaus, points, chamber minutes, expected RMS σ, worst σ
    over the range, mean and quantile unit RMSE (target units), and whether it meets
    ``spec``."""
    rows = []
    for name, d in designs.items():
        e = evaluate(plan, d)
        row = {
            "design": name,
            "plateaus": e.plateaus,
            "points": e.points,
            "minutes": e.minutes,
            "rms_sd": e.rms,
            "worst_sd": e.worst,
            "mean_rmse": e.mean_rmse,
            f"q{round(100 * plan.quantile)}_rmse": e.quantile_rmse,
        }
        if spec is not None:
            row["meets_spec"] = meets(e, spec)
        if plan.prior.interval is not None:  # whether a unit of this design gets a stated interval
            row["interval"] = "declined" if e.declined else "stated"
        rows.append(row)
    return pd.DataFrame(rows)


def sigma_map(plan: Planner, design: Design) -> pd.DataFrame:
    """The design's expected predictive σ (target units) on the range's regular grid:
    columns ``pressure_hpa``, ``temperature_c``, ``sigma`` (for a figure of the plane)."""
    var = expected_variance(plan, [design], at=plan.grid)[0]
    scaler, k = plan.prior.scaler, plan.temperature
    temps = plan.grid[:, k] * scaler.x_scale[k] + scaler.x_offset[k]
    p_lo, p_hi = plan.chamber.pressures[0], plan.chamber.pressures[-1]
    pressures = np.repeat(np.linspace(p_lo, p_hi, GRID[0]), GRID[1])
    return pd.DataFrame(
        {"pressure_hpa": pressures, "temperature_c": temps, "sigma": np.sqrt(var) * plan.y_scale}
    )
