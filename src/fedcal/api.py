"""The Python API: learn a fleet prior from reference units, calibrate new units, ship them.

scikit-learn's conventions (the estimator is a :class:`sklearn.base.BaseEstimator`: its
settings are constructor arguments, ``fit`` returns it, what it learned ends in ``_``).
The command line runs through the same code: ``fedcal calibrate`` is
:meth:`FleetPrior.load` → :meth:`FleetPrior.calibrate` → :meth:`CalibratedUnits.save`,
``fedcal predict`` is :meth:`fedcal.report.fleet.CalibratedFleet.predict_rows`, which
:meth:`CalibratedUnits.predict` calls too.

>>> from fedcal import FleetPrior
>>> from fedcal.data.simulator import FleetSpec, simulate_fleet
>>> spec = FleetSpec(num_reference=6, num_new=4, train_design="3x2", test_design="random")
>>> frame = simulate_fleet(spec, seed=0).frame       # S000-S005 full campaign, S006-S009 3x2
>>> fleet = frame[frame.sensor_id <= "S007"]  # 6 calibrated + 2 units of the 3x2 design
>>> new = frame[frame.sensor_id > "S007"]     # new units, 6 chamber points each
>>> prior = FleetPrior(rounds=10).fit(fleet)        # federated fedprior over 8 units
>>> units = prior.calibrate(new[new.split == "train"])
>>> test = new[new.split == "test"]
>>> mean, std = units.predict(test, return_std=True)  # hPa, one per row
>>> bool(abs(mean - test.pressure_hpa).max() < 1.0) and bool((std > 0).all())
True
>>> list(units.coefficients.columns[:4])
['sensor_id', 'points', 'noise_sd', '1']

The fleet includes units of the new units' chamber design: from them the federation learns
that design's model error, which every interval of a new unit includes. A prior learned on
fully calibrated units alone calibrates new units just as well, but states no interval for
them (σ NaN, with a one-line reason): fedprior's "Intervals" (docs/uncertainty.md).

The coefficients (:attr:`CalibratedUnits.coefficients`) are in the target's unit (hPa for
``pressure_hpa``) on dimensionless basis functions: y = Σ_k c_k φ_k(z) with
z_j = (x_j − offset_j) / scale_j (:attr:`CalibratedUnits.input_scaling`, the prior's
scaler) and φ_k = Π_j P̃_{a_kj}(z_j), P̃_a = √(2a+1)·P_a the normalized Legendre
polynomial of order a; a column named ``P2(frequency_hz)·P1(temperature_c)`` is
φ = P̃_2(z_f)·P̃_1(z_T), and ``1`` (φ = 1) carries the offset.
"""

from __future__ import annotations

import dataclasses
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
from sklearn.base import BaseEstimator

from fedcal.core import runnames
from fedcal.core.paths import read_regular, safe_name
from fedcal.data.fleet import BAROMETRIC_FEATURES, BAROMETRIC_TARGET, CLIENT_COLUMN

if TYPE_CHECKING:
    from fedcal.prior.model import PriorModel

__all__ = ["CalibratedUnits", "FleetPrior", "NotFittedError", "RefusedUnitsWarning"]

Data = pd.DataFrame | str | Path


class NotFittedError(ValueError):
    """A :class:`FleetPrior` used before ``fit`` or ``load``."""


class RefusedUnitsWarning(UserWarning):
    """Units of a calibrate file outside the prior's range: refused, the others calibrated."""


def _check_path(value: Any, where: str) -> None:
    """One line for a folder or file argument that is not a path (e.g. a DataFrame)."""
    if not isinstance(value, (str, Path)):
        kind = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
        raise TypeError(f"{where}: expected a folder or file path (str or Path), got {kind}")


def _check_data(X: Any, where: str) -> None:
    """One line for an input that is neither a DataFrame nor a file path (e.g. a NumPy array)."""
    if isinstance(X, (pd.DataFrame, str, Path)):
        return
    kind = f"{type(X).__module__}.{type(X).__qualname__}".removeprefix("builtins.")
    hint = (
        ": an array has no column names; wrap it, e.g. pd.DataFrame(X, columns=[...])"
        if isinstance(X, np.ndarray) or hasattr(X, "__array__")
        else ""
    )
    raise TypeError(f"{where}: expected a pandas DataFrame or a CSV/Parquet path, got {kind}{hint}")


def _read_dir(folder: Path, run: Path) -> dict[str, bytes]:
    """The run-folder files of one run: the top-level files and ``runs/<run>/*``."""
    # read under the run folder's guards (regular files only, size limit): core/paths.py
    files = {p.name: read_regular(p) for p in folder.iterdir() if p.is_file()}
    for p in sorted(run.iterdir()):
        if p.is_file():
            files[str(p.relative_to(folder))] = read_regular(p)
    return files


class FleetPrior(BaseEstimator):
    """The fleet prior N(μ, Σ) of a fedprior method, learned by federation or loaded.

    ``fit`` runs the method through fedcal's engine (the simulated federation, one
    client per unit of the DataFrame) exactly as ``fedcal run --methods fedprior
    --seeds 1`` would on the same data; the run directory it writes is kept in
    memory (:meth:`save` writes it out).

    Parameters: ``features``/``target``/``sensor_column`` name the DataFrame's columns
    (default: the barometric schema); ``method`` a fedprior method of the
    configuration (``fedprior``, ``fedprior_branch``, ...); ``config`` a TOML file or a
    shipped configuration name whose settings apply (default: the shipped default);
    ``rounds`` the federated rounds (default: the configuration's).

    Fitted (or loaded), ``model_`` is the prior itself, a
    :class:`fedcal.prior.model.PriorModel` (μ, Σ, noise, basis, scaler, range, ...).
    """

    def __init__(
        self,
        features: tuple[str, ...] | list[str] = BAROMETRIC_FEATURES,
        target: str = BAROMETRIC_TARGET,
        sensor_column: str = CLIENT_COLUMN,
        method: str = "fedprior",
        config: str | Path | None = None,
        rounds: int | None = None,
    ) -> None:
        self.features = features
        self.target = target
        self.sensor_column = sensor_column
        self.method = method
        self.config = config
        self.rounds = rounds

    # ---- learning ------------------------------------------------------------------
    def _run_config(self):
        from fedcal.config import load_config, override

        cfg = load_config(self.config)
        layout: dict[str, Any] = {
            "data": {
                "path": "DataFrame",  # provenance: fleet.json names the source too
                "features": list(self.features),
                "target": self.target,
                "client_column": self.sensor_column,
            },
            "run": {"methods": [self.method], "seeds": 1, "designs": [], "fleet_seeds": []},
        }
        if self.rounds is not None:
            layout["engine"] = {"rounds": int(self.rounds)}
        return override(cfg, layout, "FleetPrior")

    def fit(self, X: Data, y: None = None) -> FleetPrior:
        """Learn the prior from reference units: a DataFrame (or CSV/Parquet path).

        One row per calibration point: the sensor column, the features and the target.
        A ``split`` column marks held-out rows (``test``, scored in :attr:`summary_`);
        without one a seeded share is held out, as ``fedcal run`` does. ``y`` is unused
        (the target is a column of ``X``, scikit-learn's convention for grouped data).
        """
        _check_data(X, "FleetPrior.fit(X)")
        import torch

        from fedcal.build import load_configured, validate_methods
        from fedcal.calibration import find_prior, load_prior
        from fedcal.experiment import run_experiment

        torch.set_num_threads(1)
        cfg = self._run_config()
        fleet = load_configured(cfg, X)  # as `fedcal run --data` reads a file
        validate_methods(cfg, fleet)
        failures: list[str] = []
        with tempfile.TemporaryDirectory(prefix="fedcal-prior-") as tmp:
            out = Path(tmp)
            summary = run_experiment(
                cfg,
                fleet,
                out,
                cfg.methods,
                (cfg.data.train_points,),
                on_fail=lambda label, why: failures.append(f"{label}: {why}"),
            )
            if failures:
                raise RuntimeError(f"fitting the fleet prior failed: {failures[0]}")
            path = find_prior(out, self.method, 0, cfg.data.train_points)
            self.model_ = load_prior(path)
            self.files_ = _read_dir(out, path.parent)
        self.summary_ = summary
        return self

    @classmethod
    def load(
        cls, run_dir: str | Path, method: str = "fedprior", seed: int = 0, train_points: int = 0
    ) -> FleetPrior:
        """A stored prior: a run directory of ``fedcal run`` or :meth:`save`, or a prior.json
        (torch-free: :meth:`plan` of it needs no torch)."""
        from fedcal.prior.find import find_prior
        from fedcal.prior.model import PriorModel

        _check_path(run_dir, "FleetPrior.load(run_dir)")
        path = find_prior(run_dir, method, seed, train_points)
        model = PriorModel.load(path)
        prior = cls(
            features=model.features,
            target=model.target,
            sensor_column=model.sensor_column,
            method=model.method,
        )
        prior.model_ = model
        prior.source_ = path  # save() copies its run folder (read then, not held in memory)
        return prior

    def save(self, out: str | Path) -> Path:
        """Write the run folder (config.json, fleet.json, summary.csv, runs/<run>/...).

        The files ``fedcal run`` writes for this method, byte for byte; ``fedcal calibrate
        --prior DIR`` and :meth:`load` read it. A prior loaded from a bare prior.json
        saves that file alone.
        """
        from fedcal.core.atomic import write_bytes

        self._check_fitted()
        out = Path(out)
        files = getattr(self, "files_", None)
        if files is None:  # loaded: the stored run folder, or the bare prior.json
            path = self.source_
            folder = path.parent.parent.parent
            is_run = (folder / runnames.CONFIG).is_file()
            is_run = is_run and path.parent.parent.name == runnames.RUNS
            if is_run:
                files = _read_dir(folder, path.parent)
            else:
                files = {runnames.PRIOR: path.read_bytes()}
        for name, blob in files.items():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            write_bytes(out / name, blob)
        return out

    def _check_fitted(self) -> None:
        if not hasattr(self, "model_"):
            raise NotFittedError("this FleetPrior is not fitted: call fit(reference) or load()")

    # ---- calibrating new units -----------------------------------------------------
    def plan(self, plateaus: int, points: int, chamber: Any = None) -> Any:
        """A new unit's chamber design of ``plateaus`` set points and ``points`` points.

        The design minimizing the expected predictive variance over the operating range
        under this prior (:func:`fedcal.planning.plan_design`; ``chamber`` a
        :class:`fedcal.planning.Chamber`, default: the prior's temperature range and the
        standard pressure steps). Returns the :class:`fedcal.planning.Plan`:
        ``plan.design.frame()`` is design.csv (``pressure_hpa, temperature_c,
        direction``) and ``plan.expected`` / ``plan.start_expected`` its expected figures
        and the standard grid's. The same as ``fedcal plan --plateaus K --points N``.
        """
        from fedcal.planning import plan_design

        self._check_fitted()
        return plan_design(self.model_, plateaus, points, chamber=chamber)

    def calibrate(
        self,
        X: Data,
        sensor_column: str | None = None,
        time_column: str | None = None,
        strict: bool = False,
    ) -> CalibratedUnits:
        """Each new unit's posterior under the prior, from its few calibration points.

        ``X``: a DataFrame (or CSV/Parquet path) with the sensor column, the prior's
        features and target. Every row is a calibration point unless a ``split`` column
        marks rows ``test`` (then held out and scored). ``time_column``: each row's time
        (a fedprior_drift prior: the walk since each unit's last point widens σ, and
        units.csv gains ``recalibrate_at``). The closed form of
        :func:`fedcal.calibration.calibrate`; nothing of the reference fleet is needed.

        A prior the NumPy posterior covers (fedprior, _branch, _fixed, _sensor, a prior's
        deployment discrepancy model) is calibrated in NumPy, with no torch import
        (:mod:`fedcal.prior.station`); the other variants (drift, the time-respecting
        choice, noise over the inputs, Student-t rows) by FedPrior with torch, and without
        torch they raise an ImportError saying so in one line (:mod:`fedcal.calibrated`).

        A unit whose calibration rows lie outside the prior's calibrated range (±5 % of
        its span) is refused alone: no model, listed in :attr:`CalibratedUnits.refused`
        with the reason and named in a warning; the others are calibrated as if ``X``
        held only them. ``strict`` (or every unit outside): a ValueError for the file.
        """
        _check_data(X, "FleetPrior.calibrate(X)")
        from fedcal import calibrated
        from fedcal.data.loader import load_fleet

        self._check_fitted()
        model = self.model_
        fleet = load_fleet(
            X,
            features=model.features,
            target=model.target,
            client_column=sensor_column or model.sensor_column,
            test_fraction=0.0,
            min_train_points=1,
            min_test_points=0,
            time_column=time_column,
        )
        source = "DataFrame" if isinstance(X, pd.DataFrame) else str(X)
        result = calibrated.calibrate(model, fleet, source, strict)
        if result.refused:
            warnings.warn(calibrated.refused_line(result), RefusedUnitsWarning, stacklevel=2)
        return CalibratedUnits(model, calibrated.calibrated_fleet(fleet, result), result)


@dataclasses.dataclass(frozen=True)
class CalibratedUnits:
    """New units calibrated against a fleet prior: predict, export, save.

    ``prior``: the fitted prior (:class:`fedcal.prior.model.PriorModel`); ``fleet``: the
    units' calibration points; ``result``: their posteriors, in the form that covers the
    prior (:mod:`fedcal.calibrated`): a :class:`fedcal.prior.station.Station` (NumPy) or a
    :class:`fedcal.calibration.Calibration` (FedPrior, torch).
    """

    prior: PriorModel
    fleet: Any  # fedcal.data.fleet.Fleet
    result: Any  # fedcal.prior.station.Station | fedcal.calibration.Calibration
    ranges: dict[str, Any] | None = None  # loaded units: their saved valid_range.json

    @property
    def sensor_ids(self) -> list[str]:
        from fedcal.calibrated import sensor_ids

        return sensor_ids(self.result)

    @property
    def models(self):
        """The units as a :class:`fedcal.report.fleet.CalibratedFleet` (what exports read).

        The same object ``fedcal predict``/``export`` rebuild from the saved run directory
        (NumPy-evaluated for a covered prior, :class:`fedcal.report.served.StationFleet`).
        """
        from fedcal.calibrated import served

        return served(self.prior, self.fleet, self.result)

    @property
    def params(self) -> dict[str, np.ndarray]:
        """The units' posteriors as arrays, units first, scaled (``coef``, ``cov``,
        ``noise_var``, ``box``[, ``disc_var``, ``declined``, the ``gp_*`` of a deployment
        discrepancy model]): the tree model.safetensors holds."""
        from fedcal.calibrated import unit_params

        return unit_params(self.result)

    @property
    def declined(self) -> np.ndarray | None:
        """Per unit whether its interval is declined (no σ stated); None without an interval."""
        from fedcal.calibrated import declined

        return declined(self.result)

    @property
    def reasons(self) -> tuple[str, ...]:
        """Per unit why the prior's deployment discrepancy model states no σ ("" if it does)."""
        from fedcal.calibrated import reasons

        return reasons(self.result)

    @property
    def refused(self) -> dict[str, str]:
        """The units refused by the range guard (no model): {unit: reason}."""
        return {r.unit: r.reason for r in self.result.refused}

    @property
    def declined_note(self) -> str:
        """One line: why some units get no interval ("" if every unit has one)."""
        from fedcal.calibrated import declined_note

        return declined_note(self.prior, self.result)

    def predict(
        self,
        X: Data,
        return_std: bool = False,
        return_interval: bool = False,
        return_range: bool = False,
    ) -> np.ndarray | tuple[np.ndarray, ...]:
        """Calibrated target for each row of ``X`` (sensor column + features), in its unit.

        With ``return_std``: also the predictive σ (posterior of the unit's coefficients
        and its noise level). With ``return_interval``: also the half-width of the stated
        95 % interval (±1.96 σ; with a direction term the sweep mixture's, the interval
        the run scores: :meth:`fedcal.report.fleet.CalibratedFleet.interval_rows`).
        With ``return_range``: also ``in_range`` per row (bool), as ``fedcal predict``'s
        column: every input within the unit's calibrated span widened by 5 % of it
        (:func:`fedcal.report.export.in_range`); False: extrapolated, not calibrated.
        Returns ``mean`` alone, or the tuple of ``mean`` and those asked for, in this
        order: ``(mean, std, halfwidth, in_range)``. Rows keep ``X``'s order; a sensor not
        calibrated here is a KeyError naming it.
        """
        from fedcal.data.loader import load_readings
        from fedcal.report.export import in_range

        _check_data(X, "CalibratedUnits.predict(X)")
        models = self.models
        frame = load_readings(X, models.features, models.sensor_column)
        mean, std = models.predict_rows(frame)
        out: tuple[np.ndarray, ...] = (mean, std) if return_std else (mean,)
        if return_interval:
            out += (models.interval_rows(frame),)
        if return_range:
            inside = np.zeros(len(frame), dtype=bool)
            ranges, x = self.valid_range, frame[list(models.features)].to_numpy(float)
            for sensor, rows in frame.groupby(models.sensor_column, sort=False).indices.items():
                if str(sensor) not in models.excluded:  # refused: no model, no range (False)
                    inside[rows] = in_range(x[rows], ranges[str(sensor)], models.features)
            out = (*out, inside)
        return out if len(out) > 1 else mean

    @classmethod
    def load(cls, run_dir: str | Path) -> CalibratedUnits:
        """A ``fedcal calibrate`` output folder (or :meth:`save`'s), loaded back.

        The units' models are the stored ones (``model.safetensors``: predictions equal
        the saved units' bit for bit, tested), with the prior (``prior.json``) and the
        calibration points (``calibration_points.csv``: coefficients, valid range).
        """
        from fedcal.calibrated import load_dir

        _check_path(run_dir, "CalibratedUnits.load(run_dir)")
        return cls(*load_dir(Path(run_dir)))

    @property
    def coefficients(self) -> pd.DataFrame:
        """One row per unit: ``sensor_id``, ``points``, ``noise_sd`` and the coefficients.

        In the target's unit on the normalized Legendre basis of the scaled inputs (module
        docstring; :attr:`input_scaling` gives the scaling); the same table as the
        ``coefficients.csv`` of ``fedcal calibrate``.
        """
        from fedcal.calibrated import coefficients

        return coefficients(self.prior, self.fleet, self.result)

    @property
    def input_scaling(self) -> pd.DataFrame:
        """Per feature, ``offset`` and ``scale``: the basis reads z = (x − offset) / scale."""
        from fedcal.calibrated import scaler

        s = scaler(self.result)
        return pd.DataFrame(
            {"offset": np.asarray(s.x_offset, float), "scale": np.asarray(s.x_scale, float)},
            index=pd.Index(list(self.prior.features), name="feature"),
        )

    @property
    def valid_range(self) -> dict[str, dict[str, list[float]]]:
        """Per unit, the span of its calibration points (inputs and target)."""
        from fedcal.data.ranges import valid_ranges

        return self.ranges if self.ranges is not None else valid_ranges(self.fleet)

    def to_c_header(self, path: str | Path) -> Path:
        """Write the C header of ``fedcal export --format c`` (``report.export.to_c_header``)."""
        from fedcal.core.atomic import write_text
        from fedcal.report.export import to_c_header

        header = to_c_header(self.models, valid_range=self.valid_range, method=self.prior.method)
        write_text(Path(path), header)
        return Path(path)

    def to_onnx(self, out: str | Path) -> list[Path]:
        """One ``<sensor>.onnx`` per unit in ``out`` (``fedcal export --format onnx``)."""
        from fedcal.calibrated import torch_served
        from fedcal.core.atomic import write_bytes
        from fedcal.report.onnx_export import to_onnx

        models, ranges = torch_served(self.prior, self.fleet, self.result), self.valid_range
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for sid in sorted(models.params):
            blob = to_onnx(models, sid, self.prior.method, ranges.get(sid))
            path = out / f"{safe_name(sid, 'sensor id')}.onnx"  # an id names a file: sanitized
            write_bytes(path, blob)
            written.append(path)
        return written

    def save(self, out: str | Path) -> pd.DataFrame:
        """The run directory of ``fedcal calibrate`` (coefficients.csv, per_sensor.csv, ...).

        Returns the per-unit table (points, noise σ, test errors when rows were held out).
        """
        from fedcal.calibrated import write

        return write(Path(out), self.prior, self.fleet, self.result)
