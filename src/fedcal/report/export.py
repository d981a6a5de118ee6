"""Use and ship the calibrated models of a run: predictions for new readings, firmware export.

A run directory keeps, per (method, seed), ``model.safetensors``: every sensor's
personalized parameters, the input/target scaling and the model settings.
:func:`load_models` turns it back into a callable calibration; :func:`to_c_header`
writes a dependency-free C header for MLP models (float32, one weight set per
sensor and a small ``fedcal_calibrate`` routine) and, for models linear in a
basis (fedprior, polynomial, fedpoly, leastsq), the basis and each unit's
coefficients and predictive-covariance factor (:mod:`fedcal.report.linear_export`);
:func:`to_json` writes the same numbers for any other toolchain.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fedcal.core import runnames
from fedcal.core.errors import ConfigError, did_you_mean
from fedcal.core.paths import read_json
from fedcal.data.scaling import Scaler
from fedcal.report.fleet import CalibratedFleet  # re-exported: its readers import it here


def choose_method(run_dir: str | Path, method: str | None) -> str:
    """``method``, or the run's only method; several and none named: a one-line error.

    The run's methods are those of its ``config.json`` (``[run] methods``).
    """
    if method:
        return method
    path = Path(run_dir) / runnames.CONFIG
    try:  # read under the run folder's guards (regular file, size limit)
        methods = list(read_json(path)["run"]["methods"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a readable fedcal run configuration ({e})") from None
    if len(methods) == 1:
        return methods[0]
    raise ValueError(
        f"{run_dir} has {len(methods)} methods; choose one with --method: {', '.join(methods)}"
    )


RANGE_MARGIN = 0.05  # inputs up to 5 % of a sensor's calibrated span beyond it are in range


class OutOfRangeError(ValueError):
    """A reading beyond its sensor's calibrated range (``fedcal predict --strict``)."""


class NoModelError(ValueError):
    """A reading of a sensor the run refused, so without a model (``fedcal predict --strict``)."""


def uncalibrated_notes(
    fleet: CalibratedFleet, frame, sensor_column: str | None = None
) -> list[str]:
    """One line per sensor of ``frame`` that the run refused (``fleet.excluded``): its
    rows were not calibrated (NaN), and why."""
    column = sensor_column or fleet.sensor_column
    ids = frame[column].astype(str)
    return [
        f"{int((ids == sensor).sum())} row(s) of sensor {sensor} not calibrated (left empty): "
        f"no model, {reason}"
        for sensor, reason in fleet.excluded.items()
        if (ids == sensor).any()
    ]


def range_bounds(span: dict, features: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper) per input, float64: the calibrated span widened by ``RANGE_MARGIN``
    × its width on each side, lo − m·w and hi + m·w (w = hi − lo). The one formula of
    :func:`in_range` and of the ONNX export's ``in_range`` output."""
    bounds = []
    for column in features:
        lo, hi = (float(v) for v in span[column])
        margin = RANGE_MARGIN * (hi - lo)
        bounds.append((lo - margin, hi + margin))
    lower, upper = np.array(bounds, dtype=np.float64).reshape(-1, 2).T
    return lower, upper


def in_range(x_raw: np.ndarray, span: dict, features: tuple[str, ...]) -> np.ndarray:
    """(rows,) bool: every input within the sensor's calibrated span widened by
    ``RANGE_MARGIN`` × its width on each side, lo − m·w ≤ x ≤ hi + m·w (w = hi − lo)."""
    x = np.asarray(x_raw, float)
    lower, upper = range_bounds(span, features)
    return ((x >= lower) & (x <= upper)).all(axis=1)


def calibrate_frame(
    fleet: CalibratedFleet,
    frame,
    valid_range: dict,
    strict: bool = False,
    sensor_column: str | None = None,
):
    """``frame``'s readings calibrated per sensor: ``<target>_calibrated``, ``<target>_std``
    and ``<target>_halfwidth95`` (when the method has a predictive σ: the stated 95 %
    interval is calibrated ± halfwidth95, :meth:`CalibratedFleet.interval_rows`) and
    ``in_range`` (:func:`in_range` of the
    sensor's calibrated span in ``valid_range``). With ``strict`` a reading out of range is
    refused (:class:`OutOfRangeError` naming its row, sensor, input and range) instead of
    flagged. Rows of a sensor the run refused (``fleet.excluded``) get no value (NaN; say so
    with :func:`uncalibrated_notes`); with ``strict`` they are refused instead
    (:class:`NoModelError` naming the first such row and the sensor's reason). Returns the
    frame with those columns (a copy)."""
    frame = frame.copy()
    sensor_column = sensor_column or fleet.sensor_column
    if strict and fleet.excluded:
        refused = frame[sensor_column].astype(str).isin(list(fleet.excluded)).to_numpy()
        if refused.any():
            k = int(np.argmax(refused))
            sensor = str(frame[sensor_column].iloc[k])
            raise NoModelError(
                f"data row {frame.index[k] + 1}: {fleet.no_model(sensor)} (--strict)"
            )
    mean, std = fleet.predict_rows(frame, sensor_column)  # the one prediction path
    frame[f"{fleet.target}_calibrated"] = mean
    if std is not None:
        frame[f"{fleet.target}_std"] = std
        # the stated 95 % interval: calibrated ± this (the one the run scores)
        frame[f"{fleet.target}_halfwidth95"] = fleet.interval_rows(frame, sensor_column)
    frame["in_range"] = False
    for sensor, rows in frame.groupby(sensor_column, sort=False):
        sensor = str(sensor)
        x = rows[list(fleet.features)].to_numpy(float)
        span = valid_range.get(sensor)
        if span is None and sensor in fleet.excluded:
            continue  # refused by calibrate's range guard: no model, no valid range
        if span is None:
            raise KeyError(f"sensor {sensor!r} has no calibrated range in this run")
        inside = in_range(x, span, fleet.features)
        frame.loc[rows.index, "in_range"] = inside
        if strict and not inside.all():
            k = int(np.argmin(inside))
            row = rows.index[k]
            beyond = [
                f"{c}={x[k, j]:g} (calibrated {span[c][0]:g}..{span[c][1]:g})"
                for j, c in enumerate(fleet.features)
                if not in_range(x[k : k + 1, j : j + 1], {c: span[c]}, (c,))[0]
            ]
            raise OutOfRangeError(
                f"data row {row + 1} (sensor {sensor}): {', '.join(beyond)} is beyond the "
                f"calibrated range by more than {100 * RANGE_MARGIN:g} % of its span (--strict)"
            )
    return frame


def load_models(
    run_dir: str | Path,
    method: str,
    seed: int = 0,
    train_points: int = 0,
    drop_diverged: bool = False,
    algorithm: bool = False,
) -> CalibratedFleet:
    """Read ``runs/<method>_tp<N>_seed<S>/model.safetensors`` of a run directory.

    A model the NumPy posterior covers (a ``fedcal calibrate`` output of a covered prior:
    :func:`fedcal.report.served.load_station`) is evaluated in NumPy whether or not torch is
    installed, unless ``algorithm`` asks for the method's torch algorithm (the ONNX export
    traces it); any other model is rebuilt with torch.

    Tensors and JSON only: the model is rebuilt from the run's ``config.json``
    (nothing is unpickled, so a planted file cannot run code). A damaged or
    foreign file is a ``ValueError`` naming it; so is a NaN or infinite parameter
    (naming the sensor and field), unless ``drop_diverged`` leaves such sensors out
    (the report, which shows a diverged sensor as diverged), or the run recorded that
    sensor as ``refused`` (status in its ``per_sensor.csv``: the method declined it, e.g.
    a polynomial on points that support no surface, whose coefficients are NaN by
    design): it is left out of ``params`` and listed in ``excluded`` with the run's reason,
    so export and predict serve every other sensor. Every sensor refused: a ValueError.
    """
    from fedcal.core.paths import safe_name
    from fedcal.report.served import NeedsTorch, load_station, torch_available

    run_dir = Path(run_dir)
    folder = runnames.run_path(run_dir, safe_name(method, "method"), train_points, seed)
    path = folder / runnames.MODEL
    if not path.exists():
        if (folder / "model.pt").exists():
            raise ValueError(
                f"{folder / 'model.pt'}: a pickled model of an older fedcal, which is no longer "
                "read (unpickling can run code); rerun the experiment into a new --out"
            )
        known = sorted(
            {p.name.rsplit("_tp", 1)[0] for p in run_dir.glob(f"{runnames.RUNS}/*_tp*_seed*")}
        )
        raise FileNotFoundError(
            f"no model for method {method!r}, seed {seed} in {run_dir} ({path} missing)"
            + did_you_mean([method], known)
        )
    if not torch_available():  # a calibration station: the NumPy path, or NeedsTorch
        return load_station(run_dir, folder, method, drop_diverged)
    if not algorithm:  # one evaluation of a covered model, with torch or without
        try:
            return load_station(run_dir, folder, method, drop_diverged)
        except NeedsTorch:
            pass
    return _load_torch(run_dir, folder, method, drop_diverged)


def _load_torch(run_dir: Path, folder: Path, method: str, drop_diverged: bool) -> CalibratedFleet:
    """:func:`load_models` with torch: the method's algorithm rebuilt from the run's config."""
    from fedcal.build import build_recorded
    from fedcal.config import from_json
    from fedcal.core.runfiles import check_model_meta, check_model_params
    from fedcal.core.tensorfile import TensorFileError, check_finite
    from fedcal.core.tree import flatten
    from fedcal.experiment import load_model_file
    from fedcal.report.sensors import check_method, served_sensors

    path = folder / runnames.MODEL
    config_path = run_dir / runnames.CONFIG
    record = read_json(config_path)  # guarded: a regular file, strict JSON (core/paths.py)
    try:
        cfg = from_json(record, str(config_path))
    except (OSError, ValueError, ConfigError) as e:
        raise ValueError(f"{config_path}: unreadable or not a fedcal run config ({e})") from None
    task, params, meta = load_model_file(path, cfg)
    check_model_meta(path, meta, len(cfg.data.features))
    check_method(path, meta, method)

    def problem(sensor: str) -> Exception | None:
        try:
            check_finite(path, {sensor: params[sensor]}, "sensor ")
        except TensorFileError as err:
            return err
        return None

    excluded = served_sensors(path, params, folder, drop_diverged, problem)
    resolved = record.get("resolved")
    methods = resolved.get("methods") if isinstance(resolved, dict) else None
    recorded = methods.get(method) if isinstance(methods, dict) else None
    if recorded is not None and not isinstance(recorded, dict):
        raise ValueError(f"{config_path}: resolved.methods.{method}: expected an object")
    algorithm = build_recorded(method, cfg, task, recorded)
    expected = getattr(algorithm, "personal_shapes", lambda: None)()
    for sensor, tree in params.items() if expected is not None else ():
        got = {k: tuple(v.shape) for k, v in flatten(tree).items()}
        if got != expected:
            raise TensorFileError(path, f"parameters of sensor {sensor!r} do not fit the model")
    for sensor, tree in params.items():  # dtypes, variances, covariances (core/runfiles.py)
        check_model_params(path, sensor, flatten(tree))
    return CalibratedFleet(
        algorithm,
        params,
        Scaler.from_dict(meta["scaler"]),
        cfg.data.features,
        cfg.data.target,
        meta["model"],
        cfg.data.client_column,
        excluded,
    )


def to_json(fleet: CalibratedFleet, valid_range: dict | None = None, method: str = "") -> str:
    """All numbers needed to evaluate every sensor's model, as JSON.

    ``valid_range`` ({sensor: {column: [min, max]}}, the span of each sensor's
    calibration points) is written as ``valid_range``; outside it the model
    extrapolates. Every leaf of the personalized parameter tree is written, so a
    method whose tree holds a posterior (coefficients, covariance) exports it too.
    A model linear in a basis gets ``model`` = its basis form (family
    ``linear_basis``: terms, normalisation, formula, each unit's coefficients and
    covariance factor; :func:`fedcal.report.linear_export.json_block`). Sensors the run
    refused have no model: they are listed in ``excluded`` with the run's reason.
    """
    from fedcal.report.linear_export import check_form, json_block, linear_form

    form = linear_form(fleet, method)
    model = fleet.model
    if form is not None:
        check_form(fleet, form, valid_range)
        model = json_block(fleet, form)
    return json.dumps(
        {
            "family": model.get("family"),
            "features": list(fleet.features),
            "target": fleet.target,
            "model": model,
            "scaler": fleet.scaler.to_dict(),
            "valid_range": valid_range or {},
            "excluded": dict(fleet.excluded),
            "sensors": {
                sid: {k: np.asarray(v, dtype=np.float64).tolist() for k, v in p.items()}
                for sid, p in fleet.params.items()
            },
        },
        indent=1,
    )


def to_c_header(
    fleet: CalibratedFleet,
    guard: str = "FEDCAL_CALIBRATION_H",
    valid_range: dict | None = None,
    method: str = "",
) -> str:
    """A C99 header evaluating each sensor's model: an MLP, or a model linear in a basis.

    With ``valid_range`` (see :func:`to_json`) it also carries each sensor's
    calibrated input and output span and ``fedcal_in_range``. A linear-in-basis
    model (:mod:`fedcal.report.linear_export`) also gets ``fedcal_calibrate_std``
    when the method has a predictive σ; its form is checked against the model's
    own predictions before it is written.
    """
    from fedcal.report.linear_c import c_header
    from fedcal.report.linear_export import check_form, linear_form
    from fedcal.report.mlp_c import mlp_header, range_lines

    form = linear_form(fleet, method)
    sensors = list(form.sensors) if form is not None else sorted(fleet.params)
    ranges = []
    if valid_range:
        missing = [s for s in sensors if s not in valid_range]
        if missing:
            raise ValueError(f"no valid range for sensor(s) {', '.join(missing)}")
        bounds = [range_bounds(valid_range[s], tuple(fleet.features)) for s in sensors]
        columns = [*fleet.features, fleet.target]
        ranges = range_lines(sensors, columns, valid_range, bounds, RANGE_MARGIN)
    if form is None:
        return excluded_line(mlp_header(fleet, guard, ranges), fleet, guard)
    check_form(fleet, form, valid_range)
    return excluded_line(c_header(fleet, form, guard, ranges), fleet, guard)


def excluded_line(header: str, fleet: CalibratedFleet, guard: str) -> str:
    """``header`` with one comment line, before its include guard, naming the sensors the
    run refused (not exported: no model) and why; unchanged if none."""
    if not fleet.excluded:
        return header
    named = "; ".join(f"{s}: {why}" for s, why in fleet.excluded.items())
    named = " ".join(named.replace("*/", "* /").split())  # one line, the comment unbroken
    line = f"/* Not exported (no model): {named}. */\n"
    return header.replace(f"#ifndef {guard}\n", line + f"#ifndef {guard}\n", 1)
