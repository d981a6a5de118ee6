"""Read a run directory back: configuration, tables, the fleet and each method's test residuals.

Everything the HTML report shows comes from here, so what it shows is what the
run wrote (summary.csv, per_sensor.csv, metrics.csv) or what the run's saved
models compute on the run's own held-out points (model.pt via
:func:`fedcal.report.export.load_models`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from fedcal.core import runnames
from fedcal.core.csvfile import read_table  # torch-free; read_table is re-exported here
from fedcal.core.paths import PathError, read_json, safe_name
from fedcal.core.runfiles import RunFileError, check_valid_ranges
from fedcal.data.fleet import SPLIT_COLUMN, Fleet
from fedcal.report.export import CalibratedFleet, load_models
from fedcal.status import Status

if TYPE_CHECKING:  # the run's configuration and torch models: imported where used (issue 37.1)
    from fedcal.config import RunConfig


def _run_config(raw: dict) -> RunConfig:
    """The RunConfig of a run directory's config.json (:func:`fedcal.config.from_json`)."""
    from fedcal.config import from_json

    return from_json(raw, "config.json")


SUMMARY_COLUMNS = ("method", "seed", "train_points")


def check_summary(path: Path, frame: pd.DataFrame) -> pd.DataFrame:
    """summary.csv's keys usable: whole non-negative seeds and budgets, safe method names."""
    for col in ("seed", "train_points"):
        values = pd.to_numeric(frame[col], errors="coerce")
        if not (values.notna().all() and (values >= 0).all() and (values % 1 == 0).all()):
            raise RunFileError(f"{path}: {col}: expected whole numbers >= 0")
    for method in frame["method"]:
        try:
            safe_name(method, "method")
        except PathError as e:
            raise RunFileError(f"{path}: {e}") from None
    return frame


@dataclass(frozen=True)
class RunDir:
    """The files of one ``fedcal run/compare`` output directory."""

    path: Path
    raw_config: dict
    config: RunConfig
    summary: pd.DataFrame

    @staticmethod
    def open(path: str | Path) -> RunDir:
        path = Path(path)
        summary_path = path / runnames.SUMMARY
        if not summary_path.exists():
            raise FileNotFoundError(
                f"{summary_path} does not exist: not a fedcal run directory, or no run finished yet"
            )
        raw = read_json(path / runnames.CONFIG)
        if not isinstance(raw, dict):
            raise RunFileError(f"{path / 'config.json'}: expected a JSON object")
        summary = check_summary(summary_path, read_table(summary_path, SUMMARY_COLUMNS))
        return RunDir(path, raw, _run_config(raw), summary)

    @property
    def methods(self) -> list[str]:
        return list(pd.unique(self.summary["method"]))

    @property
    def budgets(self) -> list[int]:
        return sorted(int(t) for t in pd.unique(self.summary["train_points"]))

    def run_path(self, method: str, train_points: int, seed: int) -> Path:
        return runnames.run_path(self.path, safe_name(method, "method"), train_points, seed)

    def _concat(self, name: str, train_points: int) -> pd.DataFrame:
        frames = []
        for row in self.summary.query("train_points == @train_points").itertuples():
            f = self.run_path(row.method, train_points, int(row.seed)) / name
            if f.exists():
                frames.append(read_table(f))
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    def per_sensor(self, train_points: int, mask: bool = True) -> pd.DataFrame:
        """Every (method, seed, sensor)'s final errors at one point budget.

        A sensor whose ``status`` (where the file has one) is not ``ok`` gets NaN
        errors, so that no figure draws a diverged model's numbers; ``mask=False`` keeps
        them, for a figure that marks each sensor by its status
        (:func:`fedcal.report.figures.per_sensor_rmse`, which draws no diverged sensor).
        """
        frame = self._concat(runnames.PER_SENSOR, train_points)
        if mask and "status" in frame.columns:
            bad = frame["status"].fillna(Status.DIVERGED).astype(str) != "ok"
            errors = [c for c in frame.columns if c.startswith(("test_", "train_"))]
            frame[errors] = frame[errors].astype(float).mask(bad, np.nan)
        return frame

    def metrics(self, train_points: int) -> pd.DataFrame:
        """Every (method, seed, round, sensor)'s errors at one point budget."""
        return self._concat(runnames.METRICS, train_points)

    def fleet(self) -> Fleet:
        """The run's fleet, rebuilt from its configuration (the simulator, or the data file)."""
        from fedcal.build import load_data

        return load_data(self.config)


def temperature_column(fleet: Fleet) -> str | None:
    """The input that holds a temperature (``temperature_c``), if the fleet has one."""
    return next((f for f in fleet.features if "temp" in f.lower()), None)


def plateaus(
    t: np.ndarray, gap: float = 2.0, max_span: float = 5.0, max_groups: int = 8
) -> np.ndarray:
    """Temperature plateau index per point: runs of sorted values closer than ``gap``.

    Chamber data sits on a few set points (at most ``max_groups`` runs, none
    wider than ``max_span``); other data (off-grid, no plateaus) falls back to
    six quantile bins.
    """
    t = np.asarray(t, float)
    if len(t) == 0:
        return np.zeros(0, int)
    order = np.argsort(t)
    breaks = np.diff(t[order]) > gap
    group_sorted = np.concatenate([[0], np.cumsum(breaks)])
    spans = pd.Series(t[order]).groupby(group_sorted).agg(lambda v: v.max() - v.min())
    if group_sorted[-1] + 1 > max_groups or spans.max() > max_span:
        edges = np.quantile(t, np.linspace(0, 1, 7)[1:-1])
        return np.searchsorted(edges, t, side="right")
    groups = np.empty(len(t), int)
    groups[order] = group_sorted
    return groups


def predictive_std(fleet: CalibratedFleet, sensor: str, x_raw: np.ndarray) -> np.ndarray | None:
    """The method's predictive standard deviation (target units) at raw inputs, or None.

    Uses ``algorithm.predictive_std(params, x)`` (cohort tree, scaled inputs,
    scaled target units) where the method defines it and returns a tensor.
    """
    method = getattr(fleet.algorithm, "predictive_std", None)
    if method is None:
        return None
    import torch

    from fedcal.core.tree import stack

    params = stack([fleet.params[sensor]])
    dtype = next(iter(params.values())).dtype
    x = torch.as_tensor(fleet.scaler.x(np.asarray(x_raw, float)), dtype=dtype).unsqueeze(0)
    with torch.no_grad():
        std = method(params, x)
    if std is None:
        return None
    return std[0].double().numpy().reshape(len(x_raw), -1)[:, 0] * abs(fleet.scaler.y_scale[0])


def residuals(run: RunDir, fleet: Fleet, method: str, train_points: int, seed: int) -> pd.DataFrame:
    """Test rows of every sensor with ``predicted``, ``residual`` (predicted − reference), ``std``.

    ``std`` is NaN for methods without a predictive distribution.
    """
    models = load_models(run.path, method, seed, train_points, drop_diverged=True)
    test = fleet.frame[fleet.frame[SPLIT_COLUMN] == "test"]
    parts = []
    for sensor, rows in test.groupby(fleet.client_column, sort=False):
        x = rows[list(fleet.features)].to_numpy(float)
        part = rows[[fleet.client_column, *fleet.features, fleet.target]].copy()
        if str(sensor) not in models.params:  # diverged: nothing to draw
            part["predicted"], part["std"] = np.nan, np.nan
            parts.append(part)
            continue
        part["predicted"] = models.predict(str(sensor), x)[:, 0]
        std = predictive_std(models, str(sensor), x)
        part["std"] = np.nan if std is None else std
        parts.append(part)
    out = pd.concat(parts, ignore_index=True)
    out["residual"] = out["predicted"] - out[fleet.target]
    return out.rename(columns={fleet.client_column: "sensor"})


def read_valid_ranges(
    run_dir: str | Path, method: str, seed: int = 0, train_points: int = 0
) -> dict:
    """Each sensor's calibrated span ({sensor: {column: [min, max]}}) for one run.

    From the run's ``valid_range.json``; a run written before that file existed
    gets it recomputed from its fleet (the simulator, or the data file).
    """
    folder = runnames.run_path(run_dir, safe_name(method, "method"), train_points, seed)
    path = folder / runnames.VALID_RANGE
    if path.exists():
        return check_valid_ranges(path, read_json(path))
    from fedcal.experiment import valid_ranges

    run = RunDir.open(run_dir)
    fleet = run.fleet().with_train_points(train_points or None, seed=run.config.data.split_seed)
    return valid_ranges(fleet)


# A served model's prediction inside its own calibrated input box may stray from the
# target's calibrated span by at most this many spans: an honest but poor fit (fedpoly on
# 7 points: 274 hPa off a 1,500 hPa span) is well inside, a ×1e3 or ×1e38 edited weight is
# far outside. The box's corners and centre are the points checked.
PLAUSIBLE_SPANS = 100.0


def _box_points(span: dict[str, list[float]], features: tuple[str, ...]) -> np.ndarray | None:
    """The corners and the centre of a sensor's calibrated input box (rows, features)."""
    if not all(f in span for f in features):
        return None
    lo = np.array([span[f][0] for f in features], float)
    hi = np.array([span[f][1] for f in features], float)
    corners = np.array(np.meshgrid(*[[a, b] for a, b in zip(lo, hi, strict=True)]))
    return np.vstack([corners.reshape(len(features), -1).T, (lo + hi) / 2])


def check_plausible(models: CalibratedFleet, ranges: dict, path: str | Path) -> None:
    """Refuse a model file whose predictions inside a sensor's calibrated input box are
    not finite, lie more than :data:`PLAUSIBLE_SPANS` target spans outside its calibrated
    target span, or come with a σ ≤ 0 or infinite (NaN is a unit whose interval the
    method declined; a negative variance is refused before, by ``check_model_params``)."""
    target = models.target
    spans = [r[target] for r in ranges.values() if isinstance(r, dict) and target in r]
    for sensor in sorted(models.params):
        span = ranges.get(sensor) or {}
        points = _box_points(span, models.features)
        lo, hi = span.get(target) or (
            (min(s[0] for s in spans), max(s[1] for s in spans)) if spans else (None, None)
        )
        if points is None or lo is None:
            continue  # no recorded range to hold it to (a run without valid_range.json)
        mean, sd = models.predict_with_std(sensor, points)
        width = max(hi - lo, abs(hi), abs(lo), 1e-12)
        mean = np.asarray(mean, float).reshape(-1)
        worst = mean[np.argmax(np.abs(mean - (lo + hi) / 2))]
        if not np.isfinite(mean).all() or not (
            lo - PLAUSIBLE_SPANS * width <= worst <= hi + PLAUSIBLE_SPANS * width
        ):
            raise RunFileError(
                f"{path}: sensor {sensor!r} predicts {worst:.3g} {target} inside its calibrated "
                f"inputs, over {PLAUSIBLE_SPANS:g}× its calibrated span [{lo:.6g}, {hi:.6g}] "
                "away: an edited or broken model"
            )
        sd = None if sd is None else np.asarray(sd, float)
        if sd is not None and ((sd <= 0) | np.isinf(sd)).any():  # NaN: a declined interval
            raise RunFileError(
                f"{path}: sensor {sensor!r}: its predictive σ is not > 0 and finite "
                "inside its calibrated inputs: an edited or broken model"
            )


def load_served(
    run_dir: str | Path, method: str, seed: int = 0, train_points: int = 0, algorithm: bool = False
) -> tuple[CalibratedFleet, dict]:
    """The models ``predict`` and ``export`` serve, and their valid ranges, both checked:
    :func:`load_models` (shapes, dtypes, finite, variances, covariances) and
    :func:`check_plausible` (magnitudes against the recorded ranges). A covered fedprior
    model is read and evaluated in NumPy (:func:`fedcal.report.served.load_station`), unless
    ``algorithm`` asks for the torch one (ONNX)."""

    models = load_models(run_dir, method, seed, train_points, algorithm=algorithm)
    ranges = read_valid_ranges(run_dir, method, seed, train_points)
    folder = runnames.run_path(run_dir, safe_name(method, "method"), train_points, seed)
    check_plausible(models, ranges, folder / runnames.MODEL)
    return models, ranges
