"""``fedcal calibrate``'s output folder written without torch (issue 37.1).

The files :func:`fedcal.calibration.write` writes through the training algorithm, here from
:mod:`fedcal.prior.station`'s NumPy posterior: ``config.json`` (the prior's method and
columns in the default run record, :data:`TEMPLATE`), ``runs/<method>_tp0_seed0/``
(``prior.json``, ``model.safetensors`` by ``safetensors.numpy`` with the same tree, metadata
and checksum, ``valid_range.json``), ``coefficients.csv``, ``per_sensor.csv`` (test errors
and the stated interval's coverage when the file marks test rows), ``units.csv``,
``calibration_points.csv`` and ``summary.csv``. The same names, columns and values as the
torch path's within rounding (tests/prior/test_calibrate_dir.py: config.json byte-equal, the
numbers to 1e-10 relative), for the variants :func:`fedcal.prior.posterior.unsupported`
covers.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fedcal.core import runnames
from fedcal.core.arrayfile import FORMAT, META_KEY, digest
from fedcal.core.atomic import write_bytes, write_text
from fedcal.core.csvfile import write_table
from fedcal.core.summarystats import fleet_stat
from fedcal.data.fleet import Fleet
from fedcal.data.ranges import valid_ranges
from fedcal.prior import posterior
from fedcal.prior.discrepancy import MAX_POINTS
from fedcal.prior.model import PriorModel
from fedcal.prior.qa import QA_LEVEL, STATUS_REFUSED, Refusal, refused_line
from fedcal.prior.station import Station

TEMPLATE = Path(__file__).with_name("calibrate_record.json")
# = fedcal.algorithms.fedprior_interval.DECLINE[4] and NO_PROBE (tested equal)
DECLINE_SMALL = (
    "no interval for units with fewer points than the fleet's smallest design ({n} points): "
    "their model error was not learned"
)
NO_PROBE = (
    "no interval for units of at most {n} points (probe_rows): the fleet had no unit with so "
    "few points, so the model error of such a design was not learned"
)


def template() -> dict[str, Any]:
    """The shipped defaults (:func:`fedcal.calibration.record_template`; ``python -m
    fedcal.calibration`` rewrites them)."""
    return json.loads(TEMPLATE.read_text(encoding="utf-8"))


def fixed_params(prior: PriorModel) -> dict[str, Any]:
    """The method's parameters with the fleet's chosen sub-basis fixed (``select = "none"``)
    and a registered variant on its base: what rebuilds this prior's calibration, here and
    in :func:`fedcal.calibration.prior_config` (which adds what only the torch path runs); with
    the prior's deployment discrepancy model, ``deploy_rows``: the design rows each unit
    carries (:data:`fedcal.prior.discrepancy.MAX_POINTS`, :mod:`fedcal.prior.deployment`)."""
    params = dict(prior.provenance.method_params)
    if prior.selection is not None:
        params.update(prior.selection.chosen, select="none")
    if posterior.deploys(prior):
        params["deploy_rows"] = MAX_POINTS
    if prior.method not in ("fedprior", "fedprior_drift"):
        params["base"] = "fedprior"
    return params


def method_params(prior: PriorModel) -> dict[str, Any]:
    """:func:`fixed_params` with ``choose = "auto"`` resolved for data without a time column
    (the variants this path covers)."""
    params = fixed_params(prior)
    if params.get("choose") == "auto":
        params["choose"] = "off"
    return params


def config_record(prior: PriorModel, record: dict[str, Any]) -> dict[str, Any]:
    """config.json: the template's run record with the prior's columns and method."""
    out = copy.deepcopy(record["config"])
    out["data"].update(
        features=list(prior.features), target=prior.target, client_column=prior.sensor_column
    )
    params = method_params(prior)
    out["methods"] = {prior.method: params}
    out["run"]["methods"] = [prior.method]
    # the values the method runs with: a variant's base is the layout's, not a value
    out["resolved"]["methods"] = {prior.method: {k: v for k, v in params.items() if k != "base"}}
    return out


def model_bytes(prior: PriorModel, fleet: Fleet, done: Station, record: dict) -> bytes:
    """model.safetensors: :func:`fedcal.experiment.save_models`'s file of the units'
    posteriors (the tree ``params``: coef, cov, noise_var[, disc_var, declined], box[, the
    ``gp_*`` leaves of the deployment discrepancy model])."""
    from safetensors.numpy import save

    n = str(len(prior.features))
    if n not in record["model_repr"]:
        raise ValueError(
            f"{len(prior.features)} inputs: beyond the torch-free record (1-8 inputs); "
            "calibrate it with torch: pip install 'fedcal[neural]'"
        )
    leaves = unit_leaves(done.units)
    flat = {f"params/{k}": v for k, v in leaves.items()}
    meta = {
        "method": prior.method,
        "seed": 0,
        "client_ids": list(done.ids),
        "num_features": len(prior.features),
        "task_meta": {k: v for k, v in fleet.meta.items() if k in ("task", "num_classes")},
        "model": record["model"],
        "model_repr": record["model_repr"][n],
        "whitening": None,
        "head_layers": record["head_layers"][n],
        "method_params": method_params(prior),
        "scaler": prior.scaler.to_dict(),
    }
    structure = {"params": {k: f"params/{k}" for k in leaves}}
    meta_text = json.dumps({"format": FORMAT, "structure": structure, "meta": meta})
    return save(flat, metadata={META_KEY: meta_text, "sha256": digest(flat, meta_text)})


def unit_leaves(units: posterior.Units) -> dict[str, np.ndarray]:
    """The units' model tree ``params`` in the torch path's order (one array per leaf, units
    first, float64): coef, cov, noise_var[, disc_var, declined (1.0/0.0)], box[, the ``gp_*``
    leaves of the deployment discrepancy model]; what model.safetensors holds and
    :class:`fedcal.report.served.StationFleet` serves."""
    u = units
    leaves = {"coef": u.coef, "cov": u.cov, "noise_var": u.noise_var}
    if u.disc_var is not None:
        leaves.update(disc_var=u.disc_var, declined=u.declined.astype(np.float64))
    leaves["box"] = u.box
    if u.gp is not None:  # the prior's deployment discrepancy model (fedprior_deployed's)
        leaves.update(u.gp)
    return {k: np.ascontiguousarray(v, dtype=np.float64) for k, v in leaves.items()}


def test_errors(prior: PriorModel, fleet: Fleet, units: posterior.Units) -> dict[str, np.ndarray]:
    """Per unit on its test rows (:func:`fedcal.engine.evaluation.errors`): rmse, mae,
    max_abs, coverage95 (inside the stated 95 % interval), pred_sd, beyond_support."""
    x, y, mask, _ = posterior.padded_rows(prior, fleet, "test")
    y_scale = float(np.asarray(prior.scaler.y_scale).ravel()[0])
    pred = posterior.predict(units, x)
    std = posterior.predictive_std(units, x)
    half = posterior.interval_halfwidth(units, x, std)
    n = np.maximum(mask.sum(1), 1.0)
    err = np.abs((pred - y) * y_scale) * mask
    stated = ~(np.isnan(std) & (mask > 0)).any(1)
    inside = (np.abs(pred - y) <= half).astype(float)
    beyond = posterior._guarded(units, x)[1].astype(float)
    return {
        "rmse": np.sqrt((err * err).sum(1) / n),
        "mae": err.sum(1) / n,
        "max_abs": err.max(1),
        "coverage95": np.where(stated, (inside * mask).sum(1) / n, np.nan),
        "pred_sd": np.where(stated, (np.nan_to_num(std) * y_scale * mask).sum(1) / n, np.nan),
        "beyond_support": (beyond * mask).sum(1) / n,
    }


def declined_note(
    prior: PriorModel,
    declined: np.ndarray | None,
    reasons: Sequence[str] = (),
    probe_rows: int | None = None,
) -> str:
    """One line: why some units calibrated from this prior get no interval ("" if none).

    ``declined``: per unit, whether its interval is declined; ``reasons``: per unit, the
    deployment discrepancy model's reason (the torch path, issue 33); ``probe_rows``: the
    method's probe size (default: the prior's recorded one)."""
    iv = prior.interval
    if declined is None or not np.asarray(declined).any():
        return ""
    if any(reasons):  # the discrepancy model's: the designs it does not span
        return "; ".join(dict.fromkeys(r for r in reasons if r))
    if iv is None:
        return ""
    if iv.reason:
        return iv.reason
    probe = int(iv.probe_rows)  # 0: the fleet had no unit of at most probe_rows points
    if probe_rows is None:
        probe_rows = prior.provenance.method_params.get("probe_rows", posterior.PROBE_ROWS)
    return DECLINE_SMALL.format(n=probe) if probe else NO_PROBE.format(n=probe_rows)


def coefficient_table(
    prior: PriorModel,
    ids: Sequence[str],
    coef: np.ndarray,
    noise_var: np.ndarray,
    points: np.ndarray,
) -> pd.DataFrame:
    """coefficients.csv: per unit its points, noise σ and coefficients (scaled, (units, p))
    in the target's unit: y = y_offset + y_scale·Σ_k c_k φ_k, so c ← y_scale·c and the
    term '1' (φ_0 = 1) carries the offset."""
    y_scale = float(np.asarray(prior.scaler.y_scale).ravel()[0])
    coef = coef * y_scale
    coef[:, 0] += float(np.asarray(prior.scaler.y_offset).ravel()[0])
    table = pd.DataFrame(coef, columns=prior.basis.names())
    table.insert(0, "sensor_id", list(ids))
    table.insert(1, "points", points)
    table.insert(2, "noise_sd", np.sqrt(noise_var) * y_scale)
    return table


def unit_tables(prior: PriorModel, fleet: Fleet, done: Station) -> tuple[pd.DataFrame, ...]:
    """(units.csv, calibration_points.csv) (:func:`residual_tables` of the NumPy posterior)."""
    x, y, mask, _ = posterior.padded_rows(prior, fleet)
    s = prior.scaler
    n, rows = y.shape
    pred = s.y_inverse(posterior.predict(done.units, x).reshape(-1, 1)).reshape(n, rows)
    sd = posterior.predictive_std(done.units, x) * abs(float(np.asarray(s.y_scale).ravel()[0]))
    ref = s.y_inverse(y.reshape(-1, 1)).reshape(n, rows)
    raw_x = (x.reshape(-1, x.shape[-1]) * s.x_scale + s.x_offset).reshape(x.shape)
    return residual_tables(prior, done.ids, raw_x, ref, pred, sd, mask > 0, done.checks)


CHECKS = ("status", "d2", "dof", "d2_threshold", "p_value", "unlike_fleet")


def residual_tables(
    prior: PriorModel,
    ids: Sequence[str],
    raw_x: np.ndarray,
    ref: np.ndarray,
    pred: np.ndarray,
    sd: np.ndarray,
    real: np.ndarray,
    checks: dict[str, Any],
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(units.csv, calibration_points.csv) from each unit's calibration rows, both paths'.

    ``raw_x`` (units, rows, inputs), ``ref``/``pred``/``sd`` (units, rows) the reference,
    the calibrated value and its σ in the target's unit, ``real`` which rows are points
    (padding excluded); ``checks``: per unit :data:`CHECKS` and ``sigma_mean``/``sigma_max``
    (:func:`fedcal.prior.qa.unit_checks`). units.csv adds resid_rms and resid_max_abs over a
    unit's points (NaN without any); calibration_points.csv one row per point, unit by unit.
    """
    count = real.sum(-1)
    res = np.where(real, pred - ref, 0.0)
    has = count > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        rms = np.where(has, np.sqrt((res**2).sum(-1) / np.maximum(count, 1)), np.nan)
    worst = np.where(has, np.where(real, np.abs(pred - ref), -np.inf).max(-1), np.nan)
    c = checks
    units = pd.DataFrame(
        {
            "sensor_id": list(ids),
            "points": count.astype(int),
            "status": np.asarray(c["status"]).astype(object),
            "d2": c["d2"],
            "dof": np.asarray(c["dof"]).astype(int),
            "d2_threshold": c["d2_threshold"],
            "qa_level": QA_LEVEL,
            "p_value": c["p_value"],
            "unlike_fleet": c["unlike_fleet"],
            "sigma_mean": c["sigma_mean"],  # in the target's unit (qa.sigma_over_range)
            "sigma_max": c["sigma_max"],
            "resid_rms": rms,
            "resid_max_abs": worst,
        }
    )
    unit, row = np.nonzero(real)
    if not len(unit):
        return units, pd.DataFrame([])
    points = {"sensor_id": np.asarray(ids, dtype=object)[unit]}
    points.update({col: raw_x[unit, row, j] for j, col in enumerate(prior.features)})
    points[prior.target] = ref[unit, row]
    points["calibrated"] = pred[unit, row]
    points["residual"] = pred[unit, row] - ref[unit, row]
    points["sigma"] = sd[unit, row]
    return units, pd.DataFrame(points)


def summary_row(prior: PriorModel, fleet: Fleet, per_sensor: pd.DataFrame, note: str) -> dict:
    """summary.csv's one row (:func:`fedcal.calibration.write`)."""
    row: dict[str, Any] = {"method": prior.method, "seed": 0, "train_points": 0}
    for col in per_sensor.columns:
        if col.startswith("test_"):
            name = col.removeprefix("test_")
            row[f"{name}_mean"] = fleet_stat(per_sensor[col], "mean", name)
            row[f"{name}_worst"] = fleet_stat(per_sensor[col], "worst", name)
    if note:
        row["coverage_note"] = note
    if "rmse_mean" in row:
        values = fleet.frame[fleet.target].to_numpy(float)
        fs = float(values.max() - values.min())  # = fedcal.experiment.full_scale
        row["rmse_mean_pct_fs"] = 100.0 * row["rmse_mean"] / fs
        row["max_abs_worst_pct_fs"] = 100.0 * row["max_abs_worst"] / fs
    row.update(wall_s=0.0, bytes_up_per_round=0.0, bytes_down_per_round=0.0)
    return row


def write(out: Path, prior: PriorModel, fleet: Fleet, done: Station) -> pd.DataFrame:
    """The calibrate output folder (module docstring); returns per_sensor.csv's table."""
    out = Path(out)
    record = template()
    run_dir = runnames.run_path(out, prior.method)
    run_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(config_record(prior, record), indent=2, sort_keys=True, default=list)
    write_text(out / runnames.CONFIG, text)
    prior.save(run_dir / runnames.PRIOR)
    write_bytes(run_dir / runnames.MODEL, model_bytes(prior, fleet, done, record))
    counts = np.array([len(xi) for xi, _ in fleet.arrays("train")], dtype=np.int64)
    u = done.units
    table = coefficient_table(prior, done.ids, u.coef, u.noise_var, counts)
    tests = np.array([len(xi) for xi, _ in fleet.arrays("test")])
    errors = test_errors(prior, fleet, u) if tests.sum() > 0 else {}
    per_sensor = per_sensor_table(table, errors, tests > 0)
    return write_tables(
        out, prior, fleet, (table, per_sensor, *unit_tables(prior, fleet, done)),
        declined_note(prior, u.declined, u.reasons), done.refused,
    )  # fmt: skip


def per_sensor_table(
    coefficients: pd.DataFrame, errors: dict[str, np.ndarray], has_test: np.ndarray
) -> pd.DataFrame:
    """per_sensor.csv: points and noise σ, and each test error where a unit has test rows."""
    per_sensor = coefficients[["sensor_id", "points", "noise_sd"]].copy()
    for k, v in errors.items():
        per_sensor[f"test_{k}"] = np.where(has_test, v, np.nan)
    return per_sensor


def write_tables(
    out: Path,
    prior: PriorModel,
    fleet: Fleet,
    tables: Sequence[pd.DataFrame],
    note: str,
    refused: Sequence[Refusal] = (),
) -> pd.DataFrame:
    """The calibrate folder's tables, both paths': ``tables`` = (coefficients, per_sensor,
    units, calibration_points) of the calibrated units (``fleet``), the units' valid ranges
    and summary.csv (its coverage note, the count of ``refused`` units and why); the units
    the range guard refused are listed after them in per_sensor.csv and units.csv
    (:func:`with_refused`). Returns per_sensor.csv's table."""
    written = with_refused(tables, refused)
    for name, table in zip(TABLES, written, strict=True):
        write_table(out / name, table)
    run_dir = runnames.run_path(out, prior.method)
    write_text(run_dir / runnames.VALID_RANGE, json.dumps(valid_ranges(fleet), indent=1))
    row = summary_row(prior, fleet, tables[1], note)  # over the calibrated units
    if refused:
        row.update(
            refused=len(refused), refused_note=refused_line(refused, len(tables[1]) + len(refused))
        )
    write_table(out / runnames.SUMMARY, pd.DataFrame([row]))
    return written[1]


def with_refused(
    tables: Sequence[pd.DataFrame], refused: Sequence[Refusal]
) -> tuple[pd.DataFrame, ...]:
    """(coefficients, per_sensor, units, calibration_points) with a row per refused unit
    after the calibrated ones in per_sensor (its points; no model, so no number) and units
    (status ``refused`` and ``status_reason``: the range guard's wording, ``dof`` 0);
    units.csv's ``status_reason`` is "" for a calibrated unit. The calibrated units' rows
    are the tables of the file without the refused units, value for value."""
    coefficients, per_sensor, units, points = tables
    units = units.copy()
    units.insert(units.columns.get_loc("status") + 1, "status_reason", "")
    if not refused:
        return coefficients, per_sensor, units, points
    ids = [r.unit for r in refused]
    counts = [r.points for r in refused]
    more = pd.DataFrame({"sensor_id": ids, "points": counts})
    per_sensor = pd.concat([per_sensor, more], ignore_index=True)
    more = more.assign(
        status=STATUS_REFUSED, status_reason=[r.reason for r in refused], dof=0, qa_level=QA_LEVEL,
        unlike_fleet=False,
    )  # fmt: skip
    units = pd.concat([units, more], ignore_index=True)[units.columns]
    return coefficients, per_sensor, units, points


TABLES = ("coefficients.csv", runnames.PER_SENSOR, runnames.UNITS, "calibration_points.csv")
