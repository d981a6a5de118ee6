"""A run's calibrated models as one value: :class:`CalibratedFleet`, what ``predict``, the
exports, the certificate and the API read (:func:`fedcal.report.export.load_models`).

Its predictions, intervals and σ checks are written once here; the evaluation of one
sensor's model is a hook (:meth:`CalibratedFleet.evaluate`, :meth:`~CalibratedFleet.halfwidth`,
:meth:`~CalibratedFleet.sigma_at_centre`): the method's torch algorithm, or the NumPy
posterior of a fedprior model (:class:`fedcal.report.served.StationFleet`). Torch-free at
import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from fedcal.data.scaling import Scaler

if TYPE_CHECKING:  # torch is imported where a torch model is evaluated (issue 37.1)
    from fedcal.core.algorithm import Algorithm
    from fedcal.core.tree import Tree


@dataclass(frozen=True)
class CalibratedFleet:
    """The personalized models of one run, ready to calibrate raw readings."""

    algorithm: Algorithm
    params: dict[str, Tree]  # sensor id → parameters (server-tree shapes)
    scaler: Scaler
    features: tuple[str, ...]
    target: str
    model: dict
    sensor_column: str = "sensor_id"  # the run's column of sensor ids ([data] client_column)
    # sensors the run recorded as refused (no model: NaN parameters), with the run's reason;
    # they are left out of ``params``, so exports carry every other sensor (load_models)
    excluded: dict[str, str] = field(default_factory=dict)

    def no_model(self, sensor: str) -> str:
        """The one-line reason why ``sensor`` has no model in this run."""
        return f"sensor {sensor} has no model in this run: {self.excluded[sensor]}"

    def predict(self, sensor: str, x_raw: np.ndarray) -> np.ndarray:
        """Calibrated target values for raw readings ``x_raw`` (rows, features) of ``sensor``."""
        return self.predict_with_std(sensor, x_raw)[0]

    def check_sensor(self, sensor: str) -> None:
        """A KeyError naming why ``sensor`` has no model here: refused by the run, or unknown."""
        if sensor in self.excluded:
            raise KeyError(self.no_model(sensor))
        if sensor not in self.params:
            raise KeyError(
                f"sensor {sensor!r} is not in this run; known: {', '.join(sorted(self.params))}"
            )

    def predict_with_std(
        self, sensor: str, x_raw: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """(calibrated values, predictive σ or None) in the target's unit, rows × 1 each.

        σ is the method's own (:meth:`evaluate`, e.g. fedprior's posterior and noise); None
        for a method without one.
        """
        self.check_sensor(sensor)
        y, sd = self.evaluate(sensor, self.scaler.x(np.asarray(x_raw, float)))
        scale = np.asarray(self.scaler.y_scale, float)
        return self.scaler.y_inverse(y), None if sd is None else sd * np.abs(scale)

    def evaluate(self, sensor: str, z: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """One sensor's model at scaled inputs ``z`` (rows, F): (ŷ, σ or None), scaled, rows × 1
        each (``algorithm.predict`` and ``predictive_std``, torch; NumPy in
        :class:`fedcal.report.served.StationFleet`)."""
        import torch

        from fedcal.core.tree import stack

        params = stack([self.params[sensor]])
        dtype = next(iter(params.values())).dtype
        x = torch.as_tensor(z, dtype=dtype).unsqueeze(0)
        with torch.no_grad():
            y = self.algorithm.predict(params, x)[0].double().numpy()
            std = self.algorithm.predictive_std(params, x)
        return y, None if std is None else std[0].double().numpy()

    def interval_rows(self, frame, sensor_column: str | None = None) -> np.ndarray | None:
        """Per row of ``frame`` the half-width of the stated central 95 % interval (target
        units), or None for a method without a σ; NaN where no σ is stated.

        The interval the run scores (its ``coverage95``: :func:`fedcal.engine.evaluation.errors`
        through ``algorithm.interval_halfwidth``), so the one a user is given. ±1.96 σ for a
        Gaussian predictive; with fedprior's direction term (fedprior_branch) the sweep
        mixture's, ½N(ψᵀm_h, s²) + ½N(−ψᵀm_h, s²): in the field the sweep b = ±1 is unknown,
        so that mixture is the model's own distribution of the branch-average prediction's
        error, and the model-error τ² a calibrated interval adds is learned for this
        interval (:mod:`fedcal.algorithms.fedprior_interval`). ±1.96 σ of the same variance
        treats ±ψᵀm_h as Gaussian: wider than the model's 95 % interval, a second interval
        that disagrees with the scored one. So this one is stated, not 1.96 σ.
        """
        column = sensor_column or self.sensor_column
        half = np.full(len(frame), np.nan)
        x_all = frame[list(self.features)].to_numpy(float)
        scale = float(np.abs(np.asarray(self.scaler.y_scale, float)).ravel()[0])
        for sensor, rows in frame.groupby(column, sort=False).indices.items():
            if str(sensor) in self.excluded:
                continue  # no model: no interval
            if str(sensor) not in self.params:
                raise KeyError(f"sensor {sensor!r} is not in this run")
            width = self.halfwidth(str(sensor), self.scaler.x(x_all[rows]))
            if width is None:
                return None
            half[rows] = width * scale
        return half

    def halfwidth(self, sensor: str, z: np.ndarray) -> np.ndarray | None:
        """The stated 95 % half-width (scaled) at ``z`` (rows, F): (rows,), None without σ."""
        import torch

        from fedcal.core.tree import stack

        params = stack([self.params[sensor]])
        dtype = next(iter(params.values())).dtype
        x = torch.as_tensor(z, dtype=dtype).unsqueeze(0)
        with torch.no_grad():
            std = self.algorithm.predictive_std(params, x)
            if std is None:
                return None
            width = self.algorithm.interval_halfwidth(params, x, std)
        return width[0, :, 0].double().numpy()

    def without_sigma(self) -> list[str]:
        """Sensors whose model states no predictive σ although the method has one (e.g.
        fedprior's declined interval: σ NaN, at the scaled inputs' centre 0): every export
        leaves σ out for them and says so."""
        sensors = sorted(self.params)
        std = self.sigma_at_centre(sensors) if sensors else None
        if std is None:
            return []
        finite = np.isfinite(std.reshape(len(sensors), -1)).all(-1)
        return [s for s, ok in zip(sensors, finite.tolist(), strict=True) if not ok]

    def sigma_at_centre(self, sensors: list[str]) -> np.ndarray | None:
        """The sensors' σ (scaled) at the scaled inputs' centre: (sensors, 1), None without σ."""
        if getattr(self.algorithm, "predictive_std", None) is None:
            return None
        import torch

        from fedcal.core.tree import stack

        params = stack([self.params[s] for s in sensors])
        dtype = next(iter(params.values())).dtype
        at = torch.zeros(len(sensors), 1, len(self.features), dtype=dtype)
        with torch.no_grad():
            std = self.algorithm.predictive_std(params, at)
        return None if std is None else std.reshape(len(sensors), -1).double().numpy()

    def predict_rows(self, frame, sensor_column: str | None = None):
        """(mean, σ or None): one value per row of ``frame`` (its sensor column, features).

        The one prediction path of ``fedcal predict`` and ``fedcal.api.CalibratedUnits.predict``.
        Rows of a sensor the run refused (``excluded``) are NaN: it has no model (callers
        say so, :func:`uncalibrated_notes`); a sensor not in the run is a KeyError.
        """
        column = sensor_column or self.sensor_column
        mean = np.full(len(frame), np.nan)
        sd: np.ndarray | None = np.full(len(frame), np.nan)
        x_all = frame[list(self.features)].to_numpy(float)
        predicted = False
        for sensor, rows in frame.groupby(column, sort=False).indices.items():
            if str(sensor) in self.excluded:
                continue  # no model: NaN mean and σ
            m, s = self.predict_with_std(str(sensor), x_all[rows])
            predicted = True
            mean[rows] = m[:, 0]
            if s is None:
                sd = None
            elif sd is not None:
                sd[rows] = s[:, 0]
        only_refused = not predicted and self.params and len(frame)
        if only_refused and self.predict_with_std(next(iter(self.params)), x_all[:1])[1] is None:
            sd = None  # no row was predicted: ask one sensor's model whether it has a σ
        return mean, sd
