"""The prior's model-form error as a function of a new unit's design (issue 33, parts 1–2).

A unit calibrated later from the stored prior (``fedcal calibrate``) has a design D (its
n calibration inputs X_D, scaled) that no unit of the federation may share. Its σ must
then come from the prior alone. The model (Kennedy & O'Hagan 2001; the GP with an
explicit basis, Rasmussen & Williams 2006 §2.7, O'Hagan 1978):

D1. y_i(x) = φ(x)ᵀc_i + δ_i(x) + ε, c_i ~ N(μ, Σ) (the fleet prior), ε ~ N(0, σ_i²),
    δ_i ~ GP(0, a²·k(x, x')), k(x, x') = exp(−½ Σ_j (x_j − x'_j)²/ℓ_j²) over the scaled
    inputs (the record keeps one ℓ_j per input; the reference units' emulation fits one
    ℓ shared by every input, so they are equal).
D2. The unit's prediction stays the basis's posterior mean ŷ(x) = φ(x)ᵀm_i (the
    coefficients every export carries). It is linear in the unit's readings:
    ŷ(x) − φ(x)ᵀμ = g(x)ᵀ(y_D − Z_Dμ), g(x) = A φ(x), A = Z_D V_i[:, c] / σ_i² (n × p; Z_D
    the unit's design rows, V_i its posterior covariance, [:, c] the columns of φ). Its
    error y(x) − ŷ(x) has variance v_c(x) + σ_i² + a² q(x) (:func:`smoother_q`),
        q(x) = 1 − 2 g(x)ᵀk_D(x) + g(x)ᵀK_DD g(x),
    v_c = φᵀV_iφ the basis part of the model's own variance (the cross terms of c and ε
    reduce to it exactly). q is small at the unit's points and grows between and beyond
    them. A factor β on v_c, learned with a², ℓ, corrects the fleet Σ's share (Σ is
    estimated from ~20 units in 9–20 dimensions): v(x) = β v_c(x) + σ_i² + a² q(x).
D3. A scale κ, learned with them from the reference units, makes the nominal 95 %
    interval hold on the designs they emulate: the stated variance is κ² s_i² v(x).
    κ depends on the design's size n (its number of points; ``kappa_points``, issue 33
    session 12): the references learn κ_k at knots n_k (the smallest κ whose 95 %
    interval covers 95 % of the held-out rows of the designs near n_k, each design
    weighted by its distance to n_k in log n), and
        log κ(n) = the linear interpolation of (log n_k, log κ_k) in log n,
    κ(n) = κ_1 below the first knot and κ_K beyond the last (:func:`kappa_at`). A record
    without knots (written before them) has one κ for every n. A design of more than
    ``max_points`` points (the largest the references emulated) is declined
    (:func:`fedcal.prior.design_span.design_reason`): its κ would be extrapolated.
D4. σ per unit (a scaled-inverse-χ² fleet prior on the unit's scale, s₀² = 1 since κ
    holds the fleet's): the unit's readings about the prior mean, r = y_D − Z_Dμ, have
    covariance C = βZ_DΣZ_Dᵀ + a²K_DD + σ_i²I under D1; if the unit's whole error is
    scaled by s_i², its n_i points give d_i² = rᵀC⁻¹r (:func:`prior_distance`) on n_i
    degrees of freedom, and the conjugate posterior is
        s_i² = (ν₀ s₀² + d_i²) / (ν₀ + n_i),
    the error Student-t with ν₀ + n_i degrees of freedom and scale κ s_i √v(x). The
    stated σ is the 95 % interval's half-width over 1.96 (:func:`interval_factor`), so
    ±1.96 σ is that interval. ν₀ = ∞ (s_i = 1) unless the references' emulation prefers
    a finite one by pooled held-out log score. (The residual form s_i² = (ν₀ s₀² +
    f_i/σ²)/(ν₀ + ν_i), ν_i = n_i − tr(G_iV_i)/σ² the residual degrees of freedom, has
    ν_i ≈ 0–2 at 6 points and a 9–12-term basis: a unit's own residuals cannot tell its
    error there; d² uses all n_i points. Measured: docs/uncertainty.md, "Deployment".)

How the reference units learn (a², ℓ), ν₀ and κ (sums only) and which designs they
emulate: :mod:`fedcal.algorithms.fedprior_deploy`. This module holds the fitted model as
a value (:class:`Discrepancy`, ``prior.json``'s ``"discrepancy"``) and the variance of
D2–D4; the rules that decline a design the references did not span (D5, its points and
levels) or whose reliance on the prior their emulation did not reach (D6):
:mod:`fedcal.prior.design_span`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from fedcal.models.families import Array, as_float64, namespace

VERSION = 1
Z95 = 1.959964
# The ranges the reference units' grids search (fedcal.algorithms.fedprior_deploy E3–E4) and
# the emulation's limit: a model outside them was not learned by fedcal (_check refuses it).
KAPPA_RANGE = (0.25, 8.0)  # κ
BETA_RANGE = (0.01, 10**0.5)  # β
AMP_RATIO_MAX = 1e10  # a² ≤ this × the fleet's σ² (scaled target: σ² ≤ 1, so a² ≤ this too)
LENGTH_RANGE = (1e-3, 1e3)  # ℓ, scaled inputs ([-1, 1])
MAX_POINTS = 64  # the most design rows a calibrated unit carries (max_points ≤ this)


class DiscrepancyError(ValueError):
    """prior.json's ``discrepancy`` is not a usable model (one line, naming the field)."""


@dataclass(frozen=True)
class Discrepancy:
    """The fitted design-dependent error model (module doc, D1–D4), scaled units.

    ``amplitude`` a² and ``lengths`` ℓ_j of δ's kernel; ``kappa`` κ; ``nu0`` ν₀ (∞: no
    per-unit scale); ``box_lo``/``box_hi`` the reference units' input span (scaled);
    the designs the references emulated: at least ``min_points`` and at most
    ``max_points`` points, at least ``min_levels[j]`` distinct levels of input j (within
    ``level_tol`` of the span), spanning at least ``min_span[j]`` of input j's span;
    ``kappa_points`` the knots (n_k, κ_k) of κ(n) (D3; empty: ``kappa`` for every n;
    ``kappa`` is then the one κ pooled over all designs, kept as the summary);
    ``coverage``: per emulated design family (name, held-out rows, share inside the
    stated 95 % interval at the chosen κ): the selection record, in-sample (κ was chosen
    on those rows: the pooled share is 95 % by construction, not a held-out check);
    ``units``: how many reference units emulated; ``max_reliance`` u_ref of D6
    (:mod:`fedcal.prior.design_span`: the most basis variance, box mean over σ², that the
    emulated designs left to the prior in enough held-out rows; ∞ in a file without it);
    ``mean_scale2`` the emulated designs' mean s_i² (D4) per knot (no knots: one, pooled),
    the planner's :func:`mean_scale_at` (empty in a file written before it: s² = 1).
    """

    beta: float
    amplitude: float
    lengths: tuple[float, ...]
    kappa: float
    nu0: float
    box_lo: tuple[float, ...]
    box_hi: tuple[float, ...]
    min_points: int
    max_points: int
    min_levels: tuple[int, ...]
    min_span: tuple[float, ...]
    level_tol: float = 0.02
    coverage: tuple[tuple[str, float, float], ...] = ()
    units: int = 0
    kappa_points: tuple[tuple[float, float], ...] = ()
    max_reliance: float = math.inf
    mean_scale2: tuple[float, ...] = ()
    version: int = VERSION

    def __post_init__(self) -> None:
        _check(self)
        _check_reliance(self)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: ν₀ = ∞ is written as null (strict JSON has no infinity)."""
        out = asdict(self)
        out["nu0"] = None if math.isinf(self.nu0) else self.nu0
        out["max_reliance"] = None if math.isinf(self.max_reliance) else self.max_reliance
        for key in ("lengths", "box_lo", "box_hi", "min_levels", "min_span"):
            out[key] = list(out[key])
        out["coverage"] = [{"family": f, "held": h, "coverage": c} for f, h, c in self.coverage]
        out["kappa_points"] = [list(k) for k in self.kappa_points]
        out["mean_scale2"] = list(self.mean_scale2)
        return out

    @classmethod
    def from_dict(cls, raw: Any, where: str = "prior.json") -> Discrepancy:
        """The model of ``raw`` (prior.json's ``discrepancy``), or a one-line error."""
        if not isinstance(raw, dict):
            raise DiscrepancyError(f"{where}: discrepancy: expected an object")
        if raw.get("version") != VERSION:
            raise DiscrepancyError(
                f"{where}: discrepancy.version: {raw.get('version')!r} is not a known version "
                f"({VERSION})"
            )
        names = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise DiscrepancyError(f"{where}: discrepancy.{unknown[0]}: unknown field")
        optional = ("level_tol", "coverage", "units", "kappa_points", "max_reliance")
        optional += ("mean_scale2",)
        missing = sorted(n for n in names - set(raw) if n not in optional)
        if missing:
            raise DiscrepancyError(f"{where}: discrepancy.{missing[0]}: missing")
        args = dict(raw)
        try:
            args["nu0"] = math.inf if raw["nu0"] is None else _number(raw["nu0"], "nu0")
            u_ref = raw.get("max_reliance")
            args["max_reliance"] = math.inf if u_ref is None else _number(u_ref, "max_reliance")
            for key in ("lengths", "box_lo", "box_hi", "min_span"):
                args[key] = tuple(_number(v, key) for v in _list(raw[key], key))
            scales = _list(raw.get("mean_scale2", []), "mean_scale2")
            args["mean_scale2"] = tuple(_number(v, "mean_scale2") for v in scales)
            args["min_levels"] = tuple(
                _integer(v, "min_levels") for v in _list(raw["min_levels"], "min_levels")
            )
            for key in ("beta", "amplitude", "kappa", "level_tol"):
                if key in raw:
                    args[key] = _number(raw[key], key)
            for key in ("min_points", "max_points", "units"):
                if key in raw:
                    args[key] = _integer(raw[key], key)
            args["coverage"] = tuple(
                (
                    c["family"]
                    if isinstance(c["family"], str)
                    else _fail("coverage", "expected a family name (a string)"),
                    _number(c["held"], "coverage"),
                    _number(c["coverage"], "coverage"),
                )
                for c in _list(raw.get("coverage", []), "coverage")
                if isinstance(c, dict) or _fail("coverage", "expected objects")
            )
            args["kappa_points"] = tuple(
                tuple(_number(v, "kappa_points") for v in _list(k, "kappa_points"))
                for k in _list(raw.get("kappa_points", []), "kappa_points")
            )
            return cls(**args)
        except (KeyError, TypeError) as err:
            raise DiscrepancyError(f"{where}: discrepancy.coverage: {err}") from None
        except DiscrepancyError as err:
            raise DiscrepancyError(f"{where}: {err}") from None


def _fail(field: str, what: str) -> bool:
    raise DiscrepancyError(f"discrepancy.{field}: {what}")


def _list(v: Any, field: str) -> list:
    if not isinstance(v, list | tuple):
        _fail(field, f"expected a list, got {v!r}")
    return list(v)


def _number(v: Any, field: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        _fail(field, f"expected a finite number, got {v!r}")
    return float(v)


def _integer(v: Any, field: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        _fail(field, f"expected an integer, got {v!r}")
    return int(v)


def _within(m: Discrepancy, key: str, lo: float, hi: float) -> None:
    v = getattr(m, key)
    number = isinstance(v, int | float) and math.isfinite(v)
    if not (number and lo * (1 - 1e-9) <= v <= hi * (1 + 1e-9)):
        _fail(key, f"expected a number in [{lo:g}, {hi:g}] (the range learned), got {v!r}")


def _check(m: Discrepancy) -> None:
    """Every field within what the references' emulation can learn (κ, β in their grids'
    ranges, a² ≤ :data:`AMP_RATIO_MAX`, ν₀ > 0, then the named checks below in this order),
    sizes consistent: else a one-line error naming the field."""
    _within(m, "kappa", *KAPPA_RANGE)
    _within(m, "beta", *BETA_RANGE)
    _within(m, "level_tol", 1e-9, 1.0)
    a = m.amplitude
    if not (isinstance(a, int | float) and math.isfinite(a) and 0 < a <= AMP_RATIO_MAX):
        _fail("amplitude", f"expected a finite positive number ≤ {AMP_RATIO_MAX:g}, got {a!r}")
    if not (m.nu0 > 0 and not math.isnan(m.nu0)):
        _fail("nu0", f"expected a positive number or null (∞), got {m.nu0!r}")
    _check_inputs(m)
    _check_design(m)
    _check_knots(m)
    _check_scales(m)
    for family, held, share in m.coverage:  # the selection record
        if not isinstance(family, str):
            _fail("coverage", f"expected a family name (a string), got {family!r}")
        if not held >= 0:
            _fail("coverage", f"{family}: expected held rows ≥ 0, got {held!r}")
        if not 0 <= share <= 1:
            _fail("coverage", f"{family}: expected a share in [0, 1], got {share!r}")


def _check_inputs(m: Discrepancy) -> None:
    """One value per input in each per-input field, ℓ in :data:`LENGTH_RANGE`, a finite box."""
    d = len(m.lengths)
    if d == 0:
        _fail("lengths", "expected one length scale per input")
    for key in ("box_lo", "box_hi", "min_levels", "min_span"):
        if len(getattr(m, key)) != d:
            _fail(key, f"expected {d} values (one per input), got {len(getattr(m, key))}")
    lo, hi = LENGTH_RANGE
    if not all(math.isfinite(v) and lo <= v <= hi for v in m.lengths):
        _fail("lengths", f"expected length scales in [{lo:g}, {hi:g}], got {list(m.lengths)}")
    box = zip(m.box_lo, m.box_hi, strict=True)
    if not all(math.isfinite(a) and math.isfinite(b) and a < b for a, b in box):
        _fail("box_lo", "expected finite box_lo < box_hi per input")


def _check_design(m: Discrepancy) -> None:
    """The emulated designs: 1 ≤ min_points ≤ max_points ≤ :data:`MAX_POINTS`, at least one
    level and a span share in [0, 1] per input, a count of units ≥ 0."""
    least, most = m.min_points, m.max_points
    if not 1 <= least <= most:
        _fail("min_points", f"expected 1 <= min_points <= max_points, got {least}, {most}")
    if most > MAX_POINTS:
        _fail("max_points", f"expected at most {MAX_POINTS} (the emulation's limit), got {most}")
    if not all(v >= 1 for v in m.min_levels):
        _fail("min_levels", "expected at least 1 level per input")
    if not all(0 <= v <= 1 for v in m.min_span):
        _fail("min_span", "expected shares of the span in [0, 1]")
    if m.units < 0:
        _fail("units", f"expected a count ≥ 0, got {m.units}")


def _check_reliance(m: Discrepancy) -> None:
    """``max_reliance``: a positive number or ∞ (D6; not part of :func:`_check`)."""
    if not m.max_reliance > 0:
        _fail("max_reliance", f"expected a positive number or null (∞), got {m.max_reliance!r}")


def _check_knots(m: Discrepancy) -> None:
    """``kappa_points``: pairs (n, κ), n strictly ascending in [1, ``max_points``] (κ(n)
    is learned over the emulated sizes only), κ in :data:`KAPPA_RANGE`."""
    lo, hi = KAPPA_RANGE
    last = 0.0
    for k in m.kappa_points:
        if len(k) != 2:
            _fail("kappa_points", f"expected pairs (points, κ), got {list(k)}")
        n, kappa = k
        if not (last < n <= m.max_points and n >= 1):
            _fail(
                "kappa_points",
                f"expected design sizes ascending in [1, max_points = {m.max_points}], got {n!r}",
            )
        if not lo * (1 - 1e-9) <= kappa <= hi * (1 + 1e-9):
            _fail(
                "kappa_points", f"expected κ in [{lo:g}, {hi:g}] (the range learned), got {kappa}"
            )
        last = n


def _check_scales(m: Discrepancy) -> None:
    """``mean_scale2``: finite E[s²] > 0, one per knot of ``kappa_points`` (or none)."""
    count, knots = len(m.mean_scale2), len(m.kappa_points)
    if count and count != (knots or 1):
        _fail(
            "mean_scale2",
            f"expected one value per knot of kappa_points ({knots or 1}), got {count}",
        )
    for v in m.mean_scale2:
        if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
            _fail("mean_scale2", f"expected finite numbers > 0, got {v!r}")


def _like(xp: Any, values: Any) -> Array:
    """``values`` as a float64 array of the array module ``xp``."""
    return xp.asarray(values, dtype=xp.float64)


def kappa_at(model: Discrepancy, points: Array) -> Array:
    """κ(n) of D3 at design sizes ``points`` (any shape): log κ linear in log n between the
    knots ``kappa_points``, constant beyond them; no knots: ``kappa`` everywhere."""
    xp = namespace(points)
    n = as_float64(points)
    if not model.kappa_points:
        return xp.full_like(n, model.kappa)
    return _log_linear(model.kappa_points, n)


def mean_scale_at(model: Discrepancy, points: Array) -> Array:
    """E[s²](n), the references' mean per-unit scale (D4) at design sizes ``points``,
    interpolated as κ(n) (:func:`kappa_at`: log-linear in log n between the knots of
    ``kappa_points``, constant beyond); ν₀ = ∞ or a record without ``mean_scale2``: 1."""
    xp = namespace(points)
    n = as_float64(points)
    if math.isinf(model.nu0) or not model.mean_scale2:
        return xp.ones_like(n)
    if not model.kappa_points:
        return xp.full_like(n, model.mean_scale2[0])
    knots = [(k[0], s2) for k, s2 in zip(model.kappa_points, model.mean_scale2, strict=True)]
    return _log_linear(tuple(knots), n)


def _log_linear(points: tuple[tuple[float, float], ...], n: Array) -> Array:
    """``points`` (n_k, v_k) at ``n``: log v linear in log n between them, v_k beyond."""
    xp = namespace(n)
    knots = _like(xp, points)
    ln, lk = xp.log(knots[:, 0]), xp.log(knots[:, 1])
    x = xp.log(xp.clip(n, float(knots[0, 0]), float(knots[-1, 0])))
    if len(knots) == 1:
        return xp.full_like(n, float(knots[0, 1]))
    at = x.contiguous() if xp is not np else x
    i = xp.clip(xp.searchsorted(ln, at) - 1, 0, len(knots) - 2)
    w = (x - ln[i]) / (ln[i + 1] - ln[i])
    return xp.exp(lk[i] + w * (lk[i + 1] - lk[i]))


def kernel(a: Array, b: Array, lengths: Array) -> Array:
    """k(a, b) = exp(−½ Σ_j (a_j − b_j)²/ℓ_j²) for batches a (..., n, d), b (..., m, d)
    (tensors: ``torch.cdist``; NumPy arrays: the differences, equal within rounding)."""
    xp = namespace(a)
    la, lb = as_float64(a) / lengths, as_float64(b) / lengths
    if xp is not np:
        return xp.exp(-0.5 * xp.cdist(la, lb).square())
    d = la[..., :, None, :] - lb[..., None, :, :]
    return np.exp(-0.5 * (d * d).sum(-1))


def smoother(design: Array, cov_c: Array, noise: Array, mask: Array) -> Array:
    """A = Z_D V_i[:, c] / σ_i² (D2): (units, rows, p); padding rows 0."""
    a = as_float64(design) @ as_float64(cov_c) / as_float64(noise).reshape(-1, 1, 1)
    return a * as_float64(mask)[..., None]


def smoother_q(x: Array, phi: Array, xd: Array, mask: Array, a: Array, lengths: Array) -> Array:
    """q(x) = 1 − 2 gᵀk_D(x) + gᵀK_DD g, g = A φ(x) (D2), per query row: (units, rows).

    ``x`` (units, rows, d) and ``phi`` (units, rows, p) the queries; ``xd`` (units, n, d)
    the design's inputs, ``mask`` (units, n) its real rows, ``a`` (units, n, p) A.
    """
    xp = namespace(x)
    m = as_float64(mask)
    g = (as_float64(phi) @ xp.swapaxes(as_float64(a), -1, -2)) * m[:, None]  # (units, rows, n)
    k_dx = kernel(x, xd, lengths) * m[:, None]  # (units, rows, n)
    k_dd = kernel(xd, xd, lengths) * m[..., None] * m[..., None, :]
    quad = ((g @ k_dd) * g).sum(-1)
    return xp.clip(1.0 - 2.0 * (g * k_dx).sum(-1) + quad, 0.0, None)


def prior_distance(
    design: Array,
    sigma: Array,
    noise: Array,
    xd: Array,
    mask: Array,
    amplitude: float,
    lengths: Array,
    resid: Array,
) -> Array:
    """d_i² = rᵀC⁻¹r (D4) per unit: (units,). ``design`` Z_D (units, n, q), ``sigma`` the
    prior's (β-scaled) Σ, ``resid`` r = y_D − Z_Dμ (0 on padding rows, whose C is 1)."""
    xp = namespace(design)
    m = as_float64(mask)
    z = as_float64(design) * m[..., None]
    s2 = as_float64(noise).reshape(-1, 1, 1)
    pair = m[..., None] * m[..., None, :]
    c = z @ as_float64(sigma) @ xp.swapaxes(z, -1, -2)
    c = c + amplitude * kernel(xd, xd, lengths) * pair
    diag = m * s2[..., 0] + (1 - m)
    r = (as_float64(resid) * m)[..., None]
    if xp is not np:
        chol = xp.linalg.cholesky(c + xp.diag_embed(diag))
        w = xp.linalg.solve_triangular(chol, r, upper=False)
    else:
        chol = np.linalg.cholesky(c + diag[..., None] * np.eye(diag.shape[-1]))
        w = np.linalg.solve(chol, r)  # triangular: L⁻¹r
    return (w * w).sum((-2, -1))


def unit_scale(nu0: float, dof: Array, ratio: Array) -> Array:
    """s_i² = (ν₀ + n_i · d_i²/n_i)/(ν₀ + n_i) (D4, s₀² = 1; ``dof`` n_i, ``ratio`` d_i²/n_i);
    ν₀ = ∞: 1."""
    xp = namespace(dof)
    dof = as_float64(dof)
    if math.isinf(nu0):
        return xp.ones_like(dof)
    ratio = as_float64(ratio)
    return (nu0 + dof * ratio) / (nu0 + dof)


def interval_factor(nu0: float, dof: Array) -> Array:
    """(t_{0.975, ν₀+ν_i} / 1.96)²: what makes ±1.96 σ the Student-t's 95 % interval (D4)."""
    xp = namespace(dof)
    dof = as_float64(dof)
    if math.isinf(nu0):
        return xp.ones_like(dof)
    from scipy.stats import t as student

    total = np.maximum(np.asarray(nu0 + dof), 1e-3)
    return _like(xp, (student.ppf(0.975, total) / Z95) ** 2)


def unit_factor(model: Discrepancy, dof: Array, d2: Array) -> Array:
    """κ(n_i)² s_i² (t/1.96)² per unit (D3–D4): ``dof`` n_i its design's points, ``d2``
    d_i² (:func:`prior_distance`)."""
    xp = namespace(dof)
    s2 = unit_scale(model.nu0, dof, as_float64(d2) / xp.clip(as_float64(dof), 1.0, None))
    return kappa_at(model, dof) ** 2 * s2 * interval_factor(model.nu0, dof)


def deployed_variance(
    var: Array, noise: Array, beta: Array, amp: Array, q: Array, scale: Array
) -> Array:
    """D2–D4's stated variance κ² s_i² (t/1.96)² (β v_c + σ_i² + a² q), ``scale`` the
    factor of :func:`unit_factor`, v_c = ``var`` − σ_i² (the basis part of the model's own
    variance ``var``, cut at 0: rounding only)."""
    xp = namespace(var)
    return scale * (beta * xp.clip(var - noise, 0.0, None) + noise + amp * q)


def deployed_units(
    n: Array, probe: Array, code: Array, own: Array, weak: Array, rows: int
) -> Array:
    """Which units take D2–D4's σ (bool per unit), fedprior's own interval standing
    wherever it states one (:func:`fedcal.algorithms.fedprior_deployed.deployed`): units of
    ``n`` points with fedprior's own decline ``own`` or a prior without a probe (``probe``
    0: reference units only), of a design size the fleet did not learn (fewer points than
    the probe, or fewer than twice as many under the decline codes 2–3 of ``code``), not
    weakly identified (``weak``), not declined fleet-wide (code 1), at most ``rows``
    points."""
    unprobed = (probe == 0) & (n <= rows)
    unknown = (n < probe) | unprobed
    unlearned = unknown | ((n < 2 * probe) & ((code == 2) | (code == 3)))
    return (own | unprobed) & unlearned & ~weak & (code != 1) & (n <= rows)


def expected_scale(model: Discrepancy, scale: Array, amp: Array, mask: Array) -> Array:
    """The planner's factor with s_i² at its expectation E[s²](n_i) (D4,
    :func:`mean_scale_at`: the references' emulated units' mean s² at the design's size;
    1 in a record without it): a design read at the prior mean has d_i² = 0, s_i² =
    ν₀/(ν₀ + n_i), so :func:`unit_scale` at d² = 0 is divided out of ``scale`` (κ² s_i²
    (t/1.96)²) and E[s²](n_i) put in, for the units whose σ is D2–D4's (``amp`` > 0);
    ν₀ = ∞: unchanged (s_i² = 1). ``mask`` (units, rows) the design's rows. E[s²], not
    E[s]²: the forecast is the expected stated variance (the planner's J and RMS σ), linear
    in s_i²."""
    xp = namespace(scale)
    if math.isinf(model.nu0):
        return scale
    dof = as_float64(mask).sum(-1)
    at_mean = unit_scale(model.nu0, dof, xp.zeros_like(dof))
    scale = as_float64(scale)
    expected = mean_scale_at(model, dof)
    return xp.where(as_float64(amp) > 0, scale / at_mean * expected, scale)
