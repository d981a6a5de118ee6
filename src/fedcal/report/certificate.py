"""A calibration certificate per unit of a ``fedcal calibrate`` output (``fedcal certificate``).

The content is built once (:func:`build_certificate`, a :class:`Certificate` value) and
rendered twice: HTML (:func:`to_html`) and PDF (:mod:`fedcal.report.certificate_pdf`,
matplotlib's PDF backend). Vocabulary: GUM (JCGM 100:2008) and ISO/IEC 17025:2017 7.8.4.1.

**Expanded uncertainty.** U(x) = k·u(x) with k = 2 (:data:`K`), u(x) the unit's
predictive standard uncertainty at the reading x exactly as ``predict`` states it
(:meth:`fedcal.report.fleet.CalibratedFleet.predict_with_std`, the one prediction path of
``fedcal predict`` and ``CalibratedUnits.predict``: the posterior of the unit's coefficients
and its noise, plus the design's model error where the prior learned it). k = 2, not 1.96:
the convention of calibration certificates (EA-4/02, ILAC-P14: "k = 2, which for a normal
distribution corresponds to a coverage probability of approximately 95 %"); U is 2u, so a
reader recovers u = U/2 exactly. A unit whose σ the method declines (NaN) gets no U: the
certificate says why, and states no number.

**Valid range.** The range guard of ``predict`` (:func:`fedcal.report.export.in_range`):
each input within the unit's calibration span widened by 5 % of it. U is evaluated on a
grid of that box (:data:`GRID_SIDE`² points), kept where the calibrated value lies within
the span of the reference values (also widened by 5 %): the measurand's range the unit
was calibrated over.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path

import numpy as np
import pandas as pd

from fedcal.core import runnames
from fedcal.core.paths import read_regular
from fedcal.prior.legendre import legendre_products
from fedcal.prior.model import PriorModel
from fedcal.prior.qa import STATUS_REFUSED
from fedcal.report.export import RANGE_MARGIN, choose_method, range_bounds
from fedcal.report.rundir import plateaus, read_table
from fedcal.report.tables import UNITS

K = 2.0  # coverage factor of the expanded uncertainty U = K·u
GRID_SIDE = 41  # U over the valid range: GRID_SIDE points per input
ID_PREFIX = "FEDCAL"
RULES = {
    "guarded": (
        "guard-banded acceptance, guard band w = U (ILAC-G8:09/2019, 4.2.2; binary, the "
        "risk of a false accept at each point below about 2.5 %): the unit conforms when at "
        "every calibration point |error| + U <= S, and U(x) <= S everywhere in the valid range "
        "(where the expected error is 0); otherwise it is not shown to conform"
    ),
    "simple": (
        "simple acceptance, no guard band (ILAC-G8:09/2019, 4.2.1; shared risk, up to 50 % "
        "at a limit): the unit conforms when at every calibration point |error| <= S, and "
        "U(x) <= S everywhere in the valid range; otherwise it does not conform"
    ),
}
STATUS_MEANING = {
    "ok": "calibrated; the unit is like the fleet the prior was learned from",
    "unlike the fleet": (
        "a QA finding: the unit's coefficients lie beyond the 99.9 % threshold of the "
        "fleet's distribution (Hotelling's prediction law), so the prior may not describe "
        "it and its U may be too small; check it against more points before use"
    ),
    "failed": "no calibration: the unit's posterior is not finite; nothing is certified",
}


@dataclass(frozen=True)
class PriorInfo:
    """The fleet prior a unit was calibrated against: its file's hash and what it is."""

    path: str
    sha256: str
    method: str
    num_units: int | None
    terms: int
    orders: str
    designs: str = "not recorded"  # the fleet's calibration designs: units per point count


@dataclass(frozen=True)
class Conformity:
    """A statement of conformity to ±``spec`` (target unit) at k = 2 under ``rule``."""

    spec: float
    rule: str
    verdict: str  # "conforms", "not shown to conform", "does not conform", "not stated"
    worst_point: float  # max over points of |error| (+ U under the guarded rule)
    worst_range: float  # max U(x) over the valid range
    text: str


@dataclass(frozen=True)
class Certificate:
    """Everything a unit's certificate states (both renderings read only this)."""

    certificate_id: str
    unit: str
    target: str
    symbol: str  # the target's unit of measure (hPa)
    features: tuple[str, ...]
    calibrated_on: str
    issued_on: str
    status: str
    status_meaning: str
    prior: PriorInfo
    reference: str
    points: pd.DataFrame  # readings, reference, as found, calibrated, error, U
    plateaus: list[float]
    coefficients: dict[str, float]
    noise_sd: float
    scaling: dict[str, tuple[float, float]]  # feature -> (offset, scale)
    span: dict[str, tuple[float, float]]  # calibrated span per input and the target
    guard: dict[str, tuple[float, float]]  # the range guard per input
    grid: pd.DataFrame | None  # U over the valid range: features, calibrated, U
    declined: str  # why no U is stated ("" when it is)
    recalibrate_at: float | None
    check: dict[str, float] = field(default_factory=dict)  # held-out rows: rmse, max_abs
    conformity: Conformity | None = None
    source: str = ""  # the calibrate output directory

    @property
    def u_max(self) -> float:
        return float(self.grid["U"].max()) if self.grid is not None else math.nan

    @property
    def u_mean(self) -> float:
        return float(self.grid["U"].mean()) if self.grid is not None else math.nan


NO_UNIT = "unit not stated"


def measurand_unit(target: str, given: str | None = None) -> str:
    """The measurand's unit: ``given``, else a known unit the column's name ends with
    (``pressure_hpa`` → hPa), else :data:`NO_UNIT` — never a guess from an unknown suffix
    (``pm25_ref`` is not in "ref")."""
    if given:
        return given
    suffix = target.rsplit("_", 1)[-1].lower() if "_" in target else ""
    return UNITS.get(suffix, NO_UNIT)


def as_found(prior: PriorModel, x: np.ndarray) -> np.ndarray | None:
    """The design's typical calibration (the prior mean μ) at raw inputs ``x``: what the unit
    reads before its own adjustment. None for a prior with a direction term (needs b)."""
    if prior.basis.branch_terms:
        return None
    terms = prior.basis.terms  # φ of coefficients.csv (fedcal.prior.legendre: the one basis)
    mu = np.asarray(prior.mean, float)[: len(terms)]
    y = legendre_products(prior.scaler.x(np.asarray(x, float)), terms) @ mu
    return prior.scaler.y_inverse(y.reshape(-1, 1))[:, 0]


def prior_info(path: Path, prior: PriorModel) -> PriorInfo:
    """The prior's identity: sha256 of its file's bytes (``sha256sum prior.json``)."""
    chosen = prior.selection.chosen.get("orders") if prior.selection is not None else None
    orders = chosen or prior.provenance.method_params.get("orders", [])
    counts = prior.provenance.design_counts or {}
    designs = "; ".join(f"{units} unit(s) of {points} points" for points, units in counts.items())
    return PriorInfo(
        path=str(path),
        sha256=hashlib.sha256(read_regular(path)).hexdigest(),
        method=prior.method,
        num_units=prior.num_units,
        terms=len(prior.basis.terms),
        orders=", ".join(map(str, orders)),
        designs=designs or "not recorded",
    )


def conformity(
    error: np.ndarray, u_points: np.ndarray, u_range: np.ndarray, spec: float, rule: str
) -> Conformity:
    """The statement of conformity to ±``spec`` under ``rule`` (:data:`RULES`).

    ``error`` after adjustment and ``u_points`` (U) at the calibration points, ``u_range``
    U over the valid range. No finite U: no statement (a conformity without uncertainty is
    not stated).
    """
    if rule not in RULES:
        raise ValueError(f"decision rule {rule!r}: expected one of {', '.join(RULES)}")
    if not (spec > 0 and math.isfinite(spec)):
        raise ValueError(f"--spec {spec}: expected a positive number")
    if not (np.isfinite(u_points).all() and len(u_range) and np.isfinite(u_range).all()):
        return Conformity(spec, rule, "not stated", math.nan, math.nan, "no uncertainty stated")
    guard = u_points if rule == "guarded" else 0.0
    worst_point = float(np.max(np.abs(error) + guard))
    worst_range = float(np.max(u_range))
    ok = worst_point <= spec and worst_range <= spec
    if ok:
        verdict = "conforms"
    elif rule == "guarded" and float(np.max(np.abs(error) - u_points)) <= spec:
        verdict = "not shown to conform"  # inside the spec, but not by the guard band
    else:
        verdict = "does not conform"
    text = (
        f"max over the calibration points of |error|{' + U' * (rule == 'guarded')} = "
        f"{worst_point:.3g}, max U over the valid range = {worst_range:.3g}, "
        f"specification S = {spec:g}"
    )
    return Conformity(spec, rule, verdict, worst_point, worst_range, text)


@dataclass(frozen=True)
class CalibrationRun:
    """The files of a ``fedcal calibrate`` output that certificates read, read once."""

    path: Path
    prior: PriorModel
    prior_info: PriorInfo
    units: pd.DataFrame
    coefficients: pd.DataFrame
    points: pd.DataFrame
    per_sensor: pd.DataFrame
    ranges: dict
    models: object  # CalibratedFleet
    declined_note: str
    written: str  # the date units.csv was written (UTC)

    @cached_property
    def refused(self) -> dict[str, str]:
        """{unit: reason} of the units ``calibrate`` refused (no model: no certificate);
        formed once (the PDF asks it for every unit)."""
        units = self.units
        if "status_reason" not in units.columns:  # a folder written before refusals
            return {}
        rows = units[units["status"] == STATUS_REFUSED]
        return {str(u): str(why) for u, why in rows["status_reason"].items()}

    @classmethod
    def open(cls, run_dir: str | Path) -> CalibrationRun:
        from fedcal.report.export import load_models
        from fedcal.report.rundir import check_plausible, read_valid_ranges

        run_dir = Path(run_dir)
        if not (run_dir / runnames.UNITS).is_file():
            raise FileNotFoundError(
                f"{run_dir}: not a `fedcal calibrate` output (no units.csv): certificates are "
                "written for new units calibrated against a fleet prior"
            )
        method = choose_method(run_dir, None)
        prior_path = runnames.run_path(run_dir, method) / runnames.PRIOR
        prior = PriorModel.load(prior_path)  # validated (one line naming the field)
        ids = {"sensor_id": str}
        summary = read_table(run_dir / runnames.SUMMARY)
        note = summary.get("coverage_note", pd.Series([""])).fillna("").iloc[0]
        stamp = (run_dir / runnames.UNITS).stat().st_mtime
        # a failed unit: no model; without torch the NumPy path (report/served.py)
        models = load_models(run_dir, method, drop_diverged=True)
        ranges = read_valid_ranges(run_dir, method, 0, 0)
        check_plausible(models, ranges, prior_path.parent / runnames.MODEL)  # as predict
        return cls(
            path=run_dir,
            prior=prior,
            prior_info=prior_info(prior_path, prior),
            units=read_table(run_dir / runnames.UNITS, dtype=ids).set_index("sensor_id"),
            coefficients=read_table(run_dir / "coefficients.csv", dtype=ids).set_index("sensor_id"),
            points=read_table(run_dir / "calibration_points.csv", dtype=ids),
            per_sensor=read_table(run_dir / runnames.PER_SENSOR, dtype=ids).set_index("sensor_id"),
            ranges=ranges,
            models=models,
            declined_note=str(note),
            written=datetime.fromtimestamp(stamp, UTC).date().isoformat(),
        )


def _u_grid(run: CalibrationRun, unit: str, span: dict) -> pd.DataFrame:
    """U = K·σ of ``predict`` on a grid of the range guard's box, within the target's span."""
    models = run.models
    features = models.features
    lower, upper = range_bounds(span, features)
    axes = [np.linspace(lo, hi, GRID_SIDE) for lo, hi in zip(lower, upper, strict=True)]
    x = np.stack(np.meshgrid(*axes, indexing="ij"), -1).reshape(-1, len(features))
    mean, sd = models.predict_with_std(unit, x)
    lo, hi = span[models.target]
    margin = RANGE_MARGIN * (hi - lo)
    keep = (mean[:, 0] >= lo - margin) & (mean[:, 0] <= hi + margin)
    frame = pd.DataFrame(x[keep], columns=list(features))
    frame["calibrated"] = mean[keep, 0]
    frame["U"] = K * (sd[keep, 0] if sd is not None else np.full(int(keep.sum()), np.nan))
    return frame


def _points(run: CalibrationRun, unit: str) -> pd.DataFrame:
    """The unit's calibration points: readings, reference, as found, calibrated, error, U."""
    models, target = run.models, run.models.target
    rows = run.points[run.points["sensor_id"] == unit]
    x = rows[list(models.features)].to_numpy(float)
    mean, sd = models.predict_with_std(unit, x)  # the predict path, not the CSV's copy
    frame = rows[list(models.features)].reset_index(drop=True)
    frame["reference"] = rows[target].to_numpy(float)
    found = as_found(run.prior, x)
    if found is not None:
        frame["as_found_error"] = found - frame["reference"]
    frame["calibrated"] = mean[:, 0]
    frame["error"] = frame["calibrated"] - frame["reference"]
    frame["U"] = K * (sd[:, 0] if sd is not None else np.full(len(x), np.nan))
    return frame


def certificate_id(run: CalibrationRun, unit: str) -> str:
    """FEDCAL-<unit>-<8 hex>: the hash of the prior and of the unit's coefficients and points
    (the same calibration gives the same id; another calibration another one)."""
    digest = hashlib.sha256(run.prior_info.sha256.encode())
    digest.update(run.coefficients.loc[[unit]].to_csv().encode())
    digest.update(run.points[run.points["sensor_id"] == unit].to_csv(index=False).encode())
    return f"{ID_PREFIX}-{unit}-{digest.hexdigest()[:8].upper()}"


def build_certificate(
    run: CalibrationRun,
    unit: str,
    reference: str | None = None,
    spec: float | None = None,
    rule: str = "guarded",
    issued_on: str | None = None,
    calibrated_on: str | None = None,
    symbol: str | None = None,
) -> Certificate:
    """The certificate of ``unit`` (module docstring: U, the valid range, the rules)."""
    if unit not in run.units.index:
        raise KeyError(f"unit {unit!r} is not in {run.path}/units.csv")
    if unit in run.refused:
        raise ValueError(f"unit {unit} has no certificate: refused ({run.refused[unit]})")
    row, models = run.units.loc[unit], run.models
    status = str(row["status"])
    span = {c: tuple(map(float, v)) for c, v in run.ranges[unit].items()}
    points = _points(run, unit) if status != "failed" else pd.DataFrame()
    grid = _u_grid(run, unit, span) if status != "failed" else None
    stated = grid is not None and len(points) and np.isfinite(points["U"]).all()
    stated = bool(stated and np.isfinite(grid["U"]).all())
    declined = "" if stated else _why_declined(run, status)
    if not stated:
        grid = None
        if len(points):
            points["U"] = np.nan
    temp = next((f for f in models.features if "temp" in f.lower()), None)
    levels = []
    if temp is not None and len(points):
        groups = plateaus(points[temp].to_numpy(float))
        levels = [float(points[temp][groups == g].mean()) for g in np.unique(groups)]
    coef = run.coefficients.loc[unit]
    lower, upper = range_bounds(span, models.features)
    check = {}
    tested = run.per_sensor.loc[unit] if unit in run.per_sensor.index else pd.Series()
    if math.isfinite(float(tested.get("test_rmse", math.nan))):  # held-out rows were given
        check = {k: float(tested[f"test_{k}"]) for k in ("rmse", "max_abs")}
    recal = float(row["recalibrate_at"]) if "recalibrate_at" in row.index else math.nan
    verdict = None
    if spec is not None:
        u_range = grid["U"].to_numpy() if grid is not None else np.array([])
        err = points["error"].to_numpy() if len(points) else np.array([])
        u_pts = points["U"].to_numpy() if len(points) else np.array([np.nan])
        verdict = conformity(err, u_pts, u_range, spec, rule)
    scaler = models.scaler
    return Certificate(
        certificate_id=certificate_id(run, unit),
        unit=unit,
        target=models.target,
        symbol=measurand_unit(models.target, symbol),
        features=tuple(models.features),
        calibrated_on=calibrated_on or run.written,
        issued_on=issued_on or datetime.now(UTC).date().isoformat(),
        status=status,
        status_meaning=STATUS_MEANING.get(status, "see docs/statuses.md"),
        prior=run.prior_info,
        reference=reference or "not stated",
        points=points,
        plateaus=levels,
        coefficients={
            c: float(coef[c]) for c in run.coefficients.columns if c not in ("points", "noise_sd")
        },
        noise_sd=float(coef["noise_sd"]),
        scaling={
            f: (float(np.ravel(scaler.x_offset)[j]), float(np.ravel(scaler.x_scale)[j]))
            for j, f in enumerate(models.features)
        },
        span=span,
        guard={f: (float(lower[j]), float(upper[j])) for j, f in enumerate(models.features)},
        grid=grid,
        declined=declined,
        recalibrate_at=recal if math.isfinite(recal) else None,
        check=check,
        conformity=verdict,
        source=str(run.path),
    )


def _why_declined(run: CalibrationRun, status: str) -> str:
    if status == "failed":
        return "the unit's calibration failed (its posterior is not finite)"
    if run.declined_note:
        return f"the method declined this unit's interval: {run.declined_note}"
    return "the method states no predictive standard uncertainty for this unit"


def reference_ids(data: str | Path, sensor_column: str, column: str) -> dict[str, str]:
    """Per unit, the reference instrument(s) named in ``column`` of the calibration data file
    (CSV or Parquet, read under the run files' guards: a regular file, size limit)."""
    path = Path(data)
    blob = io.BytesIO(read_regular(path))
    try:
        if path.suffix.lower() in (".parquet", ".pq"):
            frame = pd.read_parquet(blob, columns=[sensor_column, column])
        else:
            frame = pd.read_csv(blob, usecols=[sensor_column, column], dtype=str)
    except (ValueError, KeyError) as err:
        raise ValueError(f"{path}: --reference-column {column!r}: {err}") from None
    frame = frame.dropna().astype(str)
    return {
        str(unit): ", ".join(sorted(set(rows[column])))
        for unit, rows in frame.groupby(sensor_column, sort=False)
    }
