"""A fedprior run's served models without torch: what ``predict`` and ``certificate`` read
on a calibration station (issue 37.1).

:func:`load_station` reads a ``fedcal calibrate`` output (or a fedprior run folder) as
:func:`fedcal.report.export.load_models` does — the model file (its checksum, metadata,
finite and well-formed parameters: :func:`fedcal.core.arrayfile.load_arrays`,
:func:`fedcal.core.runfiles.check_model_params`), the run's column names, the units the run
refused — and evaluates each unit's posterior with :mod:`fedcal.prior.posterior` (NumPy):

    ŷ(x) = y_offset + y_scale · ψ(x)ᵀm,   σ(x) = |y_scale| · √(z(x)ᵀQz(x) + s [+ gap²])

(the guarded basis ψ, (Q, s) of :func:`fedcal.prior.posterior.variance_form`), and the 95 %
half-width 1.96 σ, or with a direction term the sweep mixture's
(:func:`fedcal.prior.posterior.interval_halfwidth`).
Equal to the torch path within rounding (tests/prior/test_torch_free.py). A model this path
does not cover (another method; drift, the deployment discrepancy model, …: parameters
beyond :data:`COVERED`, or :func:`fedcal.prior.posterior.unsupported`) raises
:class:`NeedsTorch`, which the command line turns into its one-line "needs torch" error.
:func:`torch_available` says which path ``predict`` and ``certificate`` take.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedcal.core import runnames
from fedcal.core.arrayfile import TensorFileError, load_arrays
from fedcal.core.paths import read_json, safe_name
from fedcal.core.runfiles import check_model_meta, check_model_params
from fedcal.data.scaling import Scaler
from fedcal.prior import posterior
from fedcal.prior.model import PriorModel
from fedcal.report.export import CalibratedFleet, _refused_sensors

COVERED = frozenset({"coef", "cov", "noise_var", "box", "disc_var", "declined"})


class NeedsTorch(ImportError):
    """A model the NumPy path does not evaluate: the torch path (``fedcal[neural]``) does."""

    def __init__(self, why: str) -> None:
        super().__init__(why, name="torch")


def torch_available() -> bool:
    """Whether ``import torch`` can succeed here (no import is made)."""
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


@dataclass(frozen=True)
class StationFleet(CalibratedFleet):
    """:class:`~fedcal.report.export.CalibratedFleet` evaluated in NumPy (module docstring):
    ``params`` per sensor are NumPy arrays, ``algorithm`` is None; ``terms`` and
    ``branch_terms`` the prior's basis."""

    terms: tuple[tuple[int, ...], ...] = ()
    branch_terms: tuple[tuple[int, ...], ...] = ()

    def units(self, sensors: list[str]) -> posterior.Units:
        """The sensors' posteriors as :class:`fedcal.prior.posterior.Units` (scaled)."""
        p = {k: np.stack([self.params[s][k] for s in sensors]) for k in self.params[sensors[0]]}
        declined = p.get("declined")
        return posterior.Units(
            p["coef"], p["cov"], p["noise_var"], p["box"], self.terms, self.branch_terms,
            p.get("disc_var"), None if declined is None else declined > 0,
        )  # fmt: skip

    def _scaled(self, x_raw: np.ndarray) -> np.ndarray:
        return self.scaler.x(np.asarray(x_raw, float))[None]

    def _check(self, sensor: str) -> None:
        if sensor in self.excluded:
            raise KeyError(self.no_model(sensor))
        if sensor not in self.params:
            raise KeyError(
                f"sensor {sensor!r} is not in this run; known: {', '.join(sorted(self.params))}"
            )

    def predict_with_std(
        self, sensor: str, x_raw: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """(calibrated values, predictive σ) in the target's unit, rows × 1 each."""
        self._check(sensor)
        units, x = self.units([sensor]), self._scaled(x_raw)
        y = posterior.predict(units, x)[0].reshape(-1, 1)
        scale = np.abs(np.asarray(self.scaler.y_scale, float))
        sd = posterior.predictive_std(units, x)[0].reshape(-1, 1) * scale
        return self.scaler.y_inverse(y), sd

    def interval_rows(self, frame, sensor_column: str | None = None) -> np.ndarray:
        """The stated 95 % half-width per row (module docstring); NaN where no σ is stated."""
        column = sensor_column or self.sensor_column
        half = np.full(len(frame), np.nan)
        x_all = frame[list(self.features)].to_numpy(float)
        scale = float(np.abs(np.asarray(self.scaler.y_scale, float)).ravel()[0])
        for sensor, rows in frame.groupby(column, sort=False).indices.items():
            if str(sensor) in self.excluded:
                continue
            if str(sensor) not in self.params:
                raise KeyError(f"sensor {sensor!r} is not in this run")
            units, x = self.units([str(sensor)]), self._scaled(x_all[rows])
            half[rows] = posterior.interval_halfwidth(units, x)[0] * scale
        return half

    def without_sigma(self) -> list[str]:
        """Sensors whose model states no σ (a declined interval): σ at the scaler's offset."""
        sensors = sorted(self.params)
        if not sensors:
            return []
        at = np.zeros((len(sensors), 1, len(self.features)))
        std = posterior.predictive_std(self.units(sensors), at)
        return [s for s, v in zip(sensors, std[:, 0], strict=True) if not np.isfinite(v)]


def _per_sensor(path: Path, trees: dict, meta: dict) -> dict[str, dict[str, np.ndarray]]:
    """{sensor: {leaf: array}} of the file's ``params`` tree (flat, covered leaves only)."""
    params = trees.get("params")
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise NeedsTorch(f"{path}: a model with nested parameters")
    extra = sorted(set(params) - COVERED)
    if extra or not {"coef", "cov", "noise_var", "box"} <= set(params):
        raise NeedsTorch(f"{path}: parameters {', '.join(extra) or 'missing'}")
    ids = [str(s) for s in meta["client_ids"]]
    if any(len(v) != len(ids) for v in params.values()):
        raise TensorFileError(path, "parameters do not match its sensor ids")
    return {s: {k: v[i] for k, v in params.items()} for i, s in enumerate(ids)}


def load_station(
    run_dir: str | Path,
    method: str,
    seed: int = 0,
    train_points: int = 0,
    drop_diverged: bool = False,
) -> StationFleet:
    """:func:`fedcal.report.export.load_models` for a fedprior model, without torch (module
    docstring): the same checks, the same ``excluded`` sensors; :class:`NeedsTorch` for a
    model it does not cover."""
    run_dir = Path(run_dir)
    folder = runnames.run_path(run_dir, safe_name(method, "method"), train_points, seed)
    path = folder / runnames.MODEL
    if not path.exists():
        raise FileNotFoundError(f"no model for method {method!r}, seed {seed} in {run_dir}")
    if not (folder / runnames.PRIOR).is_file():
        raise NeedsTorch(f"{folder}: a run without prior.json (not a fedprior method)")
    prior = PriorModel.load(folder / runnames.PRIOR)
    why = posterior.unsupported(prior)
    if why:
        raise NeedsTorch(f"{folder}: {why}")
    config_path = run_dir / runnames.CONFIG
    data = read_json(config_path).get("data")
    try:
        features = tuple(str(f) for f in data["features"])
        target, column = str(data["target"]), str(data["client_column"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"{config_path}: not a readable fedcal run configuration ({e})") from None
    trees, meta, _ = load_arrays(path)
    check_model_meta(path, meta, len(features))
    if meta.get("method", method) != method:
        raise TensorFileError(
            path, f"holds a model of method {meta.get('method')!r}, not {method!r}: moved or edited"
        )
    if features != prior.features or target != prior.target:
        raise ValueError(f"{path}: its run's columns do not match its prior.json")
    params = _per_sensor(path, trees, meta)
    width = len(prior.basis.terms) + len(prior.basis.branch_terms)
    if any(p["coef"].shape != (width,) for p in params.values()):
        raise NeedsTorch(f"{path}: coefficients not on prior.json's basis")
    refused, excluded = _refused_sensors(folder / runnames.PER_SENSOR), {}
    for sensor in list(params):
        if all(np.isfinite(v).all() for v in params[sensor].values()):
            check_model_params(path, sensor, params[sensor])
            continue
        if sensor in refused:
            excluded[sensor] = refused[sensor]
        elif not drop_diverged:
            raise TensorFileError(
                path,
                f"sensor {sensor!r} holds NaN or infinite values (a diverged or tampered model)",
            )
        del params[sensor]
    if excluded and not params and not drop_diverged:
        raise ValueError(f"{path}: no sensor has a model: the method refused all {len(excluded)}")
    return StationFleet(
        None, params, Scaler.from_dict(meta["scaler"]), features, target, meta["model"], column,
        excluded, prior.basis.terms, prior.basis.branch_terms,
    )  # fmt: skip


def load_served_models(
    run_dir: str | Path,
    method: str,
    seed: int = 0,
    train_points: int = 0,
    drop_diverged: bool = False,
) -> CalibratedFleet:
    """The torch path (:func:`fedcal.report.export.load_models`) where torch is installed,
    else :func:`load_station`."""
    if torch_available():
        from fedcal.report.export import load_models

        return load_models(run_dir, method, seed, train_points, drop_diverged)
    return load_station(run_dir, method, seed, train_points, drop_diverged)
