"""The names of a run directory's files and folders, in one place.

Every writer (the experiment, ``fedcal calibrate``, the Flower ServerApp) and every reader
(the report, the exports, ``predict``, the API) takes a run folder's file names and the
per-run folder's name from here, so that a rename is one line and a reader cannot look for
a file under another spelling than the writer's. Layout (:mod:`fedcal.experiment`)::

    <run>/config.json, fleet.json, summary.csv, privacy.json, units.csv (calibrate)
    <run>/runs/<method>[_<design>][_fs<F>]_tp<N>_seed<S>/
        metrics.csv, per_sensor.csv, rejections.csv, model.safetensors, valid_range.json,
        prior.json, done.json, checkpoint.safetensors
"""

from __future__ import annotations

from pathlib import Path

# the run folder's top level
CONFIG = "config.json"  # the configuration and the values each method ran with
FLEET = "fleet.json"  # where the data came from
SUMMARY = "summary.csv"  # one row per (method, train points, seed)
PRIVACY = "privacy.json"  # the DP accounting
UNITS = "units.csv"  # fedcal calibrate: one row per new unit
RESULT = "result.json"  # the Flower ServerApp's result
RUNS = "runs"  # the subfolder of per-run folders
# a per-run folder's files
METRICS = "metrics.csv"
PER_SENSOR = "per_sensor.csv"
REJECTIONS = "rejections.csv"
MODEL = "model.safetensors"
CHECKPOINT = "checkpoint.safetensors"
VALID_RANGE = "valid_range.json"
PRIOR = "prior.json"
DONE = "done.json"


def run_name(
    method: str,
    train_points: int = 0,
    seed: int = 0,
    design: str | None = None,
    fleet_seed: int | None = None,
) -> str:
    """The per-run folder's name: ``<method>[_<design>][_fs<F>]_tp<N>_seed<S>``.

    A design or fleet seed is named only when the run sweeps it. ``method`` becomes a file
    name: a name read from a file goes through :func:`fedcal.core.paths.safe_name` first
    (this module imports nothing, so that ``core.paths`` can import its names).
    """
    parts = [method]
    if design is not None:
        parts.append(str(design))
    if fleet_seed is not None:
        parts.append(f"fs{fleet_seed}")
    return "_".join([*parts, f"tp{train_points}", f"seed{seed}"])


def run_path(run_dir: str | Path, method: str, train_points: int = 0, seed: int = 0) -> Path:
    """``<run_dir>/runs/<run_name(method, train_points, seed)>``."""
    return Path(run_dir) / RUNS / run_name(method, train_points, seed)
