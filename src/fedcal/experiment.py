"""Experiments: methods × seeds (× calibration-point budgets) on one fleet, in a run directory.

Layout of a run directory::

    config.json            the configuration (fedcal.config layout), the values each method
                           ran with ("resolved") and the data's digest (refuses to mix
                           with another configuration or with changed data)
    fleet.json             where the data came from (file or simulator settings)
    summary.csv            one row per (method, train_points, seed), rewritten after each run
                           (and per design / fleet seed when those are swept)
    runs/<method>_tp<N>_seed<S>/    (sweeps: <method>_<design>_fs<F>_tp<N>_seed<S>)
        metrics.csv        per round and sensor: test/train errors, train loss
        per_sensor.csv     final errors of each sensor's personalized model (and its role)
        model.safetensors  personalized weights of every sensor (tensors) + JSON: scaler,
                           model settings (no pickle: the model is rebuilt from config.json)
        valid_range.json   per sensor, the span of its calibration points (exports carry it)
        prior.json         fedprior: the fleet prior, for `fedcal calibrate`
        done.json          the summary row; written last, so a run without it is redone
        checkpoint.safetensors  while running (removed when done): resume point

Every file is written atomically (:mod:`fedcal.core.atomic`: temporary file,
fsync, rename, fsync of the directory): an interrupted
or failed run never leaves a half-written file, and results already written
stay intact. Running the same command again resumes: finished runs are read
back, an interrupted run continues from its checkpoint with the same numbers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from fedcal.build import (  # noqa: F401  (re-exported: callers import the builders from here too)
    FleetOutline,
    build_algorithm,
    build_policy,
    build_task,
    check_fit,
    check_methods,
    client_inputs,
    engine_settings,
    load_data,
    method_settings,
    run_record,
    task_kind,
    valid_ranges,
    with_raw_column,
)
from fedcal.config import ConfigError, RunConfig
from fedcal.core import runnames
from fedcal.core.aggregation import AggregationError, check_policy, is_downweighting
from fedcal.core.algorithm import Algorithm, fleet_medians
from fedcal.core.atomic import write_text, write_with
from fedcal.core.coverage import SEVERITY, coverage_check
from fedcal.core.paths import read_json
from fedcal.core.task import Task
from fedcal.core.tensorfile import TensorFileError, load_trees, save_trees
from fedcal.core.tree import flatten, gather, unstack
from fedcal.data.fleet import SPLIT_COLUMN, Fleet
from fedcal.engine.chunks import spans
from fedcal.engine.evaluation import errors
from fedcal.engine.simulation import (
    CheckpointError,
    EngineConfig,
    FleetTensors,
    RunResult,
    prepare,
    simulate,
)
from fedcal.prior.model import PriorModel, created_by
from fedcal.status import COUNT_COLUMNS, NOT_OK, own_fit_rmse, sensor_statuses
from fedcal.status import counts as status_counts

# Metrics whose worst sensor is the minimum: accuracy, and the coverage of nominal 95 %
# intervals (worst = farthest below nominal). Every other metric is an error (worst = max).
HIGHER_IS_BETTER = {"accuracy", "coverage95"}

SUMMARY_COLUMNS = [
    "method",
    "design",
    "fleet_seed",
    "seed",
    "train_points",
    "rmse_mean",
    "rmse_worst",
    "mae_mean",
    "max_abs_worst",
    "rmse_mean_pct_fs",
    "max_abs_worst_pct_fs",
    "wall_s",
    "bytes_up_per_round",
    "bytes_down_per_round",
    "sensors",
    "excluded",
    *COUNT_COLUMNS.values(),  # one count per status other than ok (fedcal.status)
    "rejected",
    "failed",
]


def one_line(err: BaseException, limit: int = 300) -> str:
    """An exception as one short line (no tensor dumps, no traceback)."""
    text = str(err).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > limit:
        first = first[:limit] + "…"
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


MODEL_FILE = runnames.MODEL  # (names kept: calibration and the exports import them)
CHECKPOINT_FILE = runnames.CHECKPOINT


class RunDirectoryError(ConfigError):
    """A run directory that cannot be resumed (its data changed, or a file in it is corrupt).

    A :class:`ConfigError` so that every caller reports it the same way: one line.
    """


def _write_text(path: Path, text: str) -> None:
    write_text(path, text)


def _write_csv(path: Path, frame: pd.DataFrame) -> None:
    """``frame`` as CSV, atomically, written 10,000 rows at a time into the temporary file
    (pandas' ``chunksize``): a 100,000-sensor table is never held as one string too."""

    def write(tmp: Path) -> None:
        # exclusive, as every writer (core.atomic); UTF-8 whatever the locale
        with open(tmp, "x", newline="", encoding="utf-8") as fh:
            frame.to_csv(fh, index=False, chunksize=10_000)

    write_with(path, write)


def full_scale(fleet: Fleet | FleetOutline) -> float:
    """The calibrated span of the target (max − min over the fleet's reference values)."""
    if isinstance(fleet, FleetOutline):  # gathered row group by row group
        return fleet.full_scale
    values = fleet.frame[fleet.target].to_numpy(float)
    return float(values.max() - values.min())


def fleet_stat(values: pd.Series, how: str, name: str) -> float:
    """Mean or worst of one metric over sensors; NaN if any sensor's value is not finite.

    A diverged sensor (NaN or ±inf) must show in the summary, not vanish from
    a mean (pandas skips NaN by default) or turn it into an infinite number.
    """
    v = values.to_numpy(dtype=float)
    if len(v) == 0 or not np.isfinite(v).all():
        return float("nan")
    if how == "mean":
        return float(v.mean())
    return float(v.min() if name in HIGHER_IS_BETTER else v.max())


def summary_row(
    method: str,
    seed: int,
    train_points: int,
    result: RunResult,
    fs: float,
    task: Task,
    roles: dict[str, str] | None = None,
    statuses: list[str] | None = None,
) -> dict[str, Any]:
    """One summary row: each test metric's mean and worst over the ``ok`` sensors.

    ``statuses`` (one per final row, :mod:`fedcal.status`; default: the engine's
    ok/diverged) decide which sensors count: the others are excluded from every mean
    and worst value and counted per status (``excluded``, ``weak``, …). With ``roles``
    (sensor id → role, e.g. a mixed fleet's "reference"/"new") the row also gets
    ``<metric>_mean_<role>`` and ``<metric>_worst_<role>`` over that role's ok sensors,
    ``sensors_<role>`` and ``excluded_<role>``. A non-finite value of an ok sensor (e.g. a
    coverage the method declines to state) makes that metric's mean and worst NaN
    (:func:`fleet_stat`); no ok sensor at all: every error is NaN.
    """
    final = pd.DataFrame(result.final)
    status = pd.Series(
        statuses if statuses is not None else final.get("status", pd.Series(["ok"] * len(final))),
        index=final.index,
    ).astype(str)
    ok = status == "ok"
    row: dict[str, Any] = {"method": method, "seed": seed, "train_points": train_points}
    groups: dict[str, pd.Series] = {}
    if roles is not None:
        role_of = final["client"].astype(str).map(roles)
        groups = {r: role_of == r for r in sorted(set(role_of))}
    for col in final.columns:
        if col.startswith("test_"):
            name = col.removeprefix("test_")
            for how in ("mean", "worst"):
                row[f"{name}_{how}"] = fleet_stat(final.loc[ok, col], how, name)
            for role, rows in groups.items():
                for how in ("mean", "worst"):
                    row[f"{name}_{how}_{role}"] = fleet_stat(final.loc[rows & ok, col], how, name)
    row.update(all_sensor_means(final, task.primary_metric, groups))
    if task.kind == "regression":
        row["rmse_mean_pct_fs"] = 100.0 * row["rmse_mean"] / fs
        row["max_abs_worst_pct_fs"] = 100.0 * row["max_abs_worst"] / fs
    row["wall_s"] = result.wall_s
    row["bytes_up_per_round"] = result.bytes_up_per_round
    row["bytes_down_per_round"] = result.bytes_down_per_round
    row.update(status_counts(status))
    for role, rows in groups.items():
        row[f"sensors_{role}"] = int(rows.sum())
        row[f"excluded_{role}"] = int((rows & ~ok).sum())
    row["rejected"] = int(final["rejected_rounds"].sum()) if "rejected_rounds" in final else 0
    row["failed"] = 0
    return row


def all_sensor_means(
    final: pd.DataFrame, metric: str, groups: dict[str, pd.Series] | None = None
) -> dict[str, Any]:
    """The primary metric's mean over every sensor with a finite test error, whatever its
    status (issue 34.4: weak, unconverged and rejected ones counted), ``<metric>_mean_all``,
    and ``unscored`` the sensors without one (diverged, refused: never silently dropped);
    per role with ``groups`` (``<metric>_mean_all_<role>``, ``unscored_<role>``)."""
    column = f"test_{metric}"
    if column not in final.columns:
        return {}
    values = final[column].to_numpy(float)
    finite = np.isfinite(values)
    out: dict[str, Any] = {}
    for role, rows in {"": np.ones(len(final), bool), **(groups or {})}.items():
        use = np.asarray(rows, bool)
        tail = f"_{role}" if role else ""
        scored = values[use & finite]
        out[f"{metric}_mean_all{tail}"] = float(scored.mean()) if len(scored) else math.nan
        out[f"unscored{tail}"] = int((use & ~finite).sum())
    return out


def common_sensor_means(summary: pd.DataFrame, runs: dict[int, tuple[Path, str]]) -> pd.DataFrame:
    """``summary`` with each run's primary-metric mean over the sensors that every method of
    its group (same fleet, design, point budget and seed) has ``ok`` (issue 34.4):
    ``<metric>_mean_common`` and ``common_sensors`` (per role too, ``…_<role>``). ``runs``:
    per summary row, its per_sensor.csv and primary metric; a failed method has none and
    does not narrow the set (its row says ``failed``)."""
    finals = {}
    for i, (path, metric) in runs.items():
        if path.is_file():
            final = pd.read_csv(path)
            if f"test_{metric}" in final.columns and "status" in final.columns:
                finals[i] = (final, metric)
    out = summary.copy()
    keys = [c for c in ("design", "fleet_seed", "train_points", "seed") if c in out.columns]
    for _, part in out.groupby(keys, sort=False, dropna=False):
        present = [i for i in part.index if i in finals]
        if len(present) < 2:
            continue
        common = set.intersection(
            *(
                set(f.loc[f["status"] == "ok", "client"].astype(str))
                for f, _ in (finals[i] for i in present)
            )
        )
        for i in present:
            final, metric = finals[i]
            chosen = final[final["client"].astype(str).isin(common)]
            roles = {"": chosen}
            if "role" in final.columns:
                roles.update({str(r): g for r, g in chosen.groupby("role", sort=True)})
            for role, rows in roles.items():
                tail = f"_{role}" if role else ""
                values = rows[f"test_{metric}"].to_numpy(float)
                mean = float(values.mean()) if len(values) else math.nan
                out.loc[i, f"{metric}_mean_common{tail}"] = mean
                out.loc[i, f"common_sensors{tail}"] = len(values)
    return out


def save_models(
    path: Path,
    result: RunResult,
    tensors: FleetTensors,
    config: RunConfig,
    algorithm: Algorithm,
    method: str,
    seed: int,
    task_meta: dict | None = None,
) -> None:
    """Every sensor's personalized parameters (tensors) and how to rebuild the model (JSON).

    Nothing is pickled: the model is rebuilt from the run's configuration by
    :func:`rebuild_task`; what the configuration alone cannot give (a whitened
    basis's fleet moments) is stored as numbers.
    """
    model = algorithm.task.model
    whitening = None
    if getattr(model, "poly_center", None) is not None:
        whitening = {"poly_center": model.poly_center, "poly_transform": model.poly_transform}
    meta = {
        "method": method,
        "seed": seed,
        "client_ids": list(tensors.client_ids),
        "num_features": int(tensors.train.x.shape[-1]),
        "task_meta": {k: v for k, v in (task_meta or {}).items() if k in ("task", "num_classes")},
        "model": asdict(config.model),
        "model_repr": repr(model),
        "whitening": whitening,
        "head_layers": algorithm.task.head_layers,
        "method_params": config.method_params.get(method, {}),
        "scaler": tensors.scaler.to_dict(),
    }
    save_trees(path, {"params": result.personal}, meta)


def rebuild_task(config: RunConfig, meta: dict, path: Path) -> Task:
    """The task a model file was trained with, rebuilt from its run's config and its metadata."""
    cfg = replace(config, model=replace(config.model, whiten=False))
    task = build_task(cfg, int(meta["num_features"]), meta.get("task_meta") or {})
    if meta.get("whitening"):
        w = meta["whitening"]
        model = replace(
            task.model,
            poly_center=tuple(w["poly_center"]),
            poly_transform=tuple(tuple(r) for r in w["poly_transform"]),
        )
        task = type(task)(model, head_layers=task.head_layers)
    if repr(task.model) != meta.get("model_repr"):
        raise TensorFileError(path, "its model does not match the run's config.json")
    return task


def load_model_file(path: Path, config: RunConfig) -> tuple[Task, dict[str, dict], dict]:
    """``(task, {sensor id: parameters}, metadata)`` of a file written by :func:`save_models`."""
    trees, meta, _ = load_trees(path)
    try:
        task = rebuild_task(config, meta, path)
        per_client = unstack(trees["params"])
        params = dict(zip(meta["client_ids"], per_client, strict=True))
    except (KeyError, TypeError, ValueError, ConfigError) as e:
        if isinstance(e, TensorFileError):
            raise
        raise TensorFileError(path, f"does not fit its run ({type(e).__name__}: {e})") from None
    expected = {
        k: tuple(v.shape)
        for k, v in flatten(task.model.init(torch.Generator(), torch.float64)).items()
    }
    shapes = {s: {k: tuple(v.shape) for k, v in flatten(p).items()} for s, p in params.items()}
    # Methods with a parameterization of their own (polynomial, fedprior: coefficients and
    # covariances) do not use the task's model: their sensors must at least agree.
    own = not any(set(expected) & set(got) for got in shapes.values())
    for sensor, got in shapes.items():
        if own:
            ok = got == next(iter(shapes.values()))
        else:
            ok = set(expected) <= set(got) and all(got[k] == expected[k] for k in expected)
        if not ok:
            raise TensorFileError(path, f"parameters of sensor {sensor!r} do not fit the model")
    return task, params, meta


def export_state(
    algorithm: Algorithm,
    server: dict,
    fleet: Fleet | FleetOutline,
    tensors: FleetTensors,
    method: str,
    choose: str = "",
) -> PriorModel | None:
    """The algorithm's reusable server state (fedprior's fleet prior) as the fitted value.

    ``choose``: the time-respecting choice the configuration asked for; "auto" is recorded
    as "auto" (calibrate resolves it by its own data's time column), not as this run's.

    Adds what is needed to apply it to new units: the method and its parameters,
    feature and target names, the scaler, and the range of each input the fleet
    was calibrated over (inputs outside it are extrapolation); and its provenance
    (fleet size, units per number of calibration points, fedcal's version). The
    value is validated as a loaded file is (:class:`fedcal.prior.model.PriorModel`):
    a prior that could not be read back is a RunFileError here, not a file.
    """
    state = algorithm.export_state(server)
    if state is None:
        return None
    names = list(fleet.features)
    if isinstance(fleet, FleetOutline):
        input_range = fleet.input_range
    else:
        train = fleet.frame[fleet.frame[SPLIT_COLUMN] == "train"]
        input_range = {c: [float(train[c].min()), float(train[c].max())] for c in names}

    def named(terms: list[str]) -> list[str]:  # 'P2(x0)·P1(x1)' → 'P2(frequency_hz)·…'
        return [re.sub(r"x(\d+)", lambda m: names[int(m.group(1))], t) for t in terms]

    for key in ("term_names", "branch_term_names"):
        if key in state:
            state[key] = named(state[key])
    if state.get("identification"):
        state["identification"]["weak_terms"] = named(state["identification"]["weak_terms"])
    doc = {
        **state,
        "method": method,
        "method_params": {
            f.name: getattr(algorithm, f.name)
            for f in dataclasses.fields(algorithm)
            if f.name != "task"
        },
        "features": names,
        "target": fleet.target,
        "sensor_column": fleet.client_column,  # calibrate/predict read new units' ids from it
        "scaler": tensors.scaler.to_dict(),
        "input_range": input_range,
        "num_units": fleet.num_clients,
        "design_counts": _design_counts(tensors, fleet.num_clients),
        "created_by": created_by(),
    }
    if "choose" in doc["method_params"] and choose == "auto":  # calibrate resolves it by its data
        doc["method_params"]["choose"] = "auto"
    return PriorModel.from_dict(doc, f"{method}: the trained prior")


def _asked_choose(config: RunConfig, method: str) -> str:
    """The ``choose`` the configuration gives ``method`` (or its base's table), "auto" if none."""
    params = config.method_params.get(method, {})
    base = config.method_params.get(str(params.get("base", "")), {})
    return str(params.get("choose", base.get("choose", "auto")))


def _design_counts(tensors: FleetTensors, units: int) -> dict[str, int] | None:
    """{calibration points: units with that many}, ascending (None: counts not at hand)."""
    count = tensors.train.count.cpu().numpy()
    if len(count) != units:
        return None
    points, many = np.unique(count.astype(int), return_counts=True)
    return {str(int(p)): int(m) for p, m in zip(points, many, strict=True)}


REJECTION_COLUMNS = ["round", "client_index", "client", "reason", "ratio", "threshold"]


def _status_server(
    algorithm: Algorithm, result: RunResult, tensors: FleetTensors, chunk_size: int
) -> Any:
    """The server ``client_status`` reads: with the fleet's medians of the algorithm's
    :attr:`~fedcal.core.algorithm.Algorithm.status_values` over every unit (taken chunk by
    chunk), so that ``chunk_size`` changes no status."""
    if algorithm.status_values is None:
        return result.server
    n, found = tensors.num_clients, {}
    for rows in spans(n, chunk_size):
        with torch.no_grad():
            got = algorithm.status_values(
                _clients(result.personal, rows, n),
                _clients(tensors.test.x, rows, n).to(torch.float64),
                _clients(tensors.test.mask, rows, n),
            )
        for key, v in got.items():
            found.setdefault(key, []).append(v)
    if not found:
        return result.server
    medians = fleet_medians({k: torch.cat(v) for k, v in found.items()})
    return {**result.server, "status_medians": medians}


def judge_sensors(
    algorithm: Algorithm,
    result: RunResult,
    tensors: FleetTensors,
    history: pd.DataFrame,
    metric: str,
    tolerance: float | None = None,
    chunk_size: int = 0,
) -> tuple[list[str], list[str], pd.DataFrame]:
    """Each final row's (status, reason) (:func:`fedcal.status.sensor_statuses`) and the
    run's rejections as a table (round, client, reason, measured ratio, threshold).

    The algorithm's own flags (``client_status``: weak, refused) are taken at each
    sensor's test inputs, where its errors are measured. Every client's flags and fits
    are its own, so they are computed ``chunk_size`` clients at a time (0 = all at once):
    at once, the rows' designs and predictive variances of a 10,000-unit fleet were the
    run's peak memory (issue 25.1).
    """
    parts: list[dict[str, np.ndarray]] = []
    server = _status_server(algorithm, result, tensors, chunk_size)
    for rows in spans(tensors.num_clients, chunk_size):
        with torch.no_grad():
            got = algorithm.client_status(
                server,
                _clients(result.personal, rows, tensors.num_clients),
                _clients(tensors.test.x, rows, tensors.num_clients).to(torch.float64),
                _clients(tensors.test.mask, rows, tensors.num_clients),
            )
        parts.append({k: v.cpu().numpy() for k, v in got.items()})
    flags = {}  # a flag one chunk did not return is False for its clients (client_status)
    for key in sorted({k for part in parts for k in part}):
        flags[key] = np.concatenate(
            [
                part[key] if key in part else np.zeros(len(rows), dtype=bool)
                for part, rows in zip(parts, spans(tensors.num_clients, chunk_size), strict=True)
            ]
        )
    rejections = pd.DataFrame(result.extra.get("rejections", []))
    if rejections.empty:
        rejections = pd.DataFrame(columns=REJECTION_COLUMNS)
    else:
        ids = list(tensors.client_ids)
        rejections.insert(2, "client", [ids[int(i)] for i in rejections["client_index"]])
    statuses, reasons = sensor_statuses(
        pd.DataFrame(result.final),
        history,
        result.extra.get("rejections", []),
        flags,
        result.rounds_done,
        metric,
        tolerance,
        _own_fit(algorithm, result, tensors, metric, chunk_size),
    )
    return statuses, reasons, rejections


def _clients(tree, rows: torch.Tensor, n: int):
    """Clients ``rows`` of a tree or tensor with a leading clients axis (itself when all)."""
    if len(rows) == n:
        return tree
    if isinstance(tree, torch.Tensor):
        return tree.index_select(0, rows)
    return gather(tree, rows)


def _own_fit(
    algorithm: Algorithm,
    result: RunResult,
    tensors: FleetTensors,
    metric: str,
    chunk_size: int = 0,
) -> dict[int, tuple[float, float]] | None:
    """Per client (final train RMSE, its own least-squares fit's), target units, for the
    status's factor rule (:func:`fedcal.status.own_fit_rmse`); None for a one-round
    method or a metric other than RMSE. ``chunk_size`` clients at a time (0 = all)."""
    if metric != "rmse" or result.rounds_done <= 1:
        return None
    n = tensors.num_clients
    scale = float(np.asarray(tensors.scaler.y_scale, dtype=float).ravel()[0])
    got, own = [], []
    for rows in spans(n, chunk_size):
        train = tensors.train if len(rows) == n else tensors.train.select(rows)
        with torch.no_grad():
            personal = _clients(result.personal, rows, n)
            got.append(errors(algorithm, personal, train, tensors.scaler)["rmse"].double())
        own.append(own_fit_rmse(train.x, train.y[..., :1], train.mask) * scale)
    fit, mine = torch.cat(got), torch.cat(own)
    return {i: (float(fit[i]), float(mine[i])) for i in range(n)}


def status_notes(final: pd.DataFrame, rejections: pd.DataFrame, limit: int = 10) -> list[str]:
    """What the run output says about a finished run's sensors: one line per status that is
    not ok (how many, which), and one per rejected client (rounds, reason, ratio vs
    threshold), at most ``limit`` clients named (the rest are in rejections.csv)."""
    notes = []
    status = final["status"].astype(str)
    for name in NOT_OK:
        which = final.loc[status == name, "client"].astype(str).tolist()
        if which:
            shown = ", ".join(which[:limit]) + (
                f" and {len(which) - limit} more" * (len(which) > limit)
            )
            notes.append(
                f"{len(which)} of {len(final)} sensor(s) {name}, excluded from the means: {shown}"
                " (status_reason in per_sensor.csv)"
            )
    if rejections.empty:
        return notes
    lowered = rejections["reason"].map(is_downweighting)
    for part, verb in ((rejections[~lowered], "rejected"), (rejections[lowered], "down-weighted")):
        groups = list(part.groupby("client", sort=False))
        for client, rows in groups[:limit]:
            last = rows.iloc[-1]
            rounds = rows["round"].astype(int)
            size = (
                f": size {float(last['ratio']):.3g} > threshold {float(last['threshold']):g}"
                if last["reason"] == "size"
                else f": {last['reason']}"
            )
            span = f"{rounds.min()}–{rounds.max()}" if rounds.max() > rounds.min() else rounds.min()
            notes.append(
                f"server {verb} {client}'s reply in {len(rows)} round(s) ({span}){size}"
                + (" (still aggregated)" if verb == "down-weighted" else "")
            )
        if len(groups) > limit:
            notes.append(f"… and {len(groups) - limit} more client(s) {verb} (rejections.csv)")
    return notes


def coverage_checks(
    final: pd.DataFrame, roles: dict[str, str] | None, test_points: np.ndarray
) -> tuple[dict[str, str], list[str]]:
    """The run's stated 95 % intervals judged on its own test rows (:mod:`fedcal.core.coverage`):
    summary fields and one note line per group that is off or too small to judge.

    Over the ``ok`` sensors with test rows (``test_points``, their counts aligned with
    ``final``) whose coverage is stated (``coverage95_mean`` is over the same ok units, but is
    NaN when any of them states none, where this judges the ones that do), per role with
    ``roles`` (``coverage_check_<role>``), else over all; ``coverage_check`` is the most
    severe verdict (``core.coverage.SEVERITY``; "" not judged), ``coverage_check_note`` the
    lines. The notes returned (for the console) leave out a band miss within chance over the
    units ("low", "high"): that one is in the file and the table's mark (issue 37.2).
    Nothing for a method that states no interval. The sensors' statuses are unchanged: one
    unit's coverage on its few test points is too noisy to judge (docs/statuses.md).
    """
    if "test_coverage95" not in final.columns:
        return {}, []
    points = np.asarray(test_points, dtype=float)
    usable = (final["status"].astype(str) == "ok").to_numpy() & (points > 0)
    coverage = final["test_coverage95"].to_numpy(float)
    groups = {"": usable}
    if roles is not None:
        role_of = final["client"].astype(str).map(roles).astype(str).to_numpy()
        groups = {r: usable & (role_of == r) for r in sorted(set(role_of))}
    fields: dict[str, str] = {}
    notes, verdicts, loud = [], [], []
    for role, rows in groups.items():
        check = coverage_check(coverage[rows], points[rows])
        if role:
            fields[f"coverage_check_{role}"] = check.verdict
        verdicts.append(check.verdict)
        note = check.message(f"{role} units" if role else "units")
        if note:
            notes.append(note)
            if check.verdict not in ("low", "high"):  # a band miss within chance: file only
                loud.append(note)
    fields["coverage_check"] = next((v for v in SEVERITY if v in verdicts), "")
    if notes:
        fields["coverage_check_note"] = "; ".join(notes)
    return fields, loud


def identification_note(state: dict[str, Any]) -> str:
    """A one-line warning when the fleet's data leave directions of a prior unlearned."""
    ident = state.get("identification") or {}
    weak = ident.get("weak_directions", 0)
    if not weak:
        return ""
    return (
        f"the fleet's calibration points do not identify {weak} direction(s) of the "
        f"prior (terms {', '.join(ident['weak_terms'])}): predictions that depend on them "
        "carry the vague starting prior's σ, not a learned one. Calibrate some units over "
        "the whole range, or use lower orders."
    )


def selection_note(state: dict[str, Any], final: pd.DataFrame) -> str:
    """One line on fedprior's time-respecting choice: the candidates ranked by the fleet's
    forward-validation score (lower is better) and the units that ship a simple fit."""
    forward = (state.get("selection") or {}).get("forward")
    if not forward:
        return ""
    ranked = ", ".join(f"{r['candidate']} {r['score']:g}" for r in forward["ranked"])
    text = f"chosen by each unit's forward validation (lower is better): {ranked}"
    if "fallback" in final:
        ships = final["fallback"].astype(str)
        counts = ships[ships != "prior"].value_counts()
        if len(counts):
            text += "; no-harm fall-back: " + ", ".join(f"{v} {k}" for k, v in counts.items())
    return text


def jitter_note(jitter: pd.Series, worst: float) -> str:
    """One line when a near-singular Gram needed jitter or an eigenvalue floor (core.bayes)."""
    what = "an eigenvalue floor" if worst >= 1.0 else f"a relative jitter up to {worst:.0e}"
    return (
        f"near-singular Gram matrices (collinear features?) needed {what} in "
        f"{int((jitter > 0).sum())} unit-round(s) (metrics.csv column 'jitter')"
    )


def refuse_unprivate_scaling(config: RunConfig, fleet: Fleet) -> None:
    """Client-level DP noises the algorithm's sums only: a column scaled by federated
    statistics (the fleet's mean and std, un-noised, sent to every site) would be released
    outside the accountant's ε, so DP is refused unless every column has a physical range."""
    from fedcal.data.scaling import PHYSICAL_RANGES, needs_moments

    mode, regression = config.data.scaling, fleet.meta.get("task") != "classification"
    if not needs_moments(fleet.features, fleet.target, mode, regression):
        return
    columns = [*fleet.features, *([fleet.target] if regression else [])]
    named = [c for c in columns if mode == "federated" or c not in PHYSICAL_RANGES]
    raise ConfigError(
        f"[data] scaling = {mode!r}: client-level DP ([privacy] epsilon > 0) needs every column "
        f"on a physical range; {', '.join(named)} would be scaled by the fleet's un-noised "
        "mean and std (released outside ε)"
    )


def run_experiment(
    config: RunConfig,
    fleet: Fleet | FleetOutline,
    out: Path,
    methods: Sequence[str],
    train_points: Sequence[int] = (0,),
    on_progress: Callable[[str, int, dict], None] | None = None,
    on_skip: Callable[[str, str], None] | None = None,
    on_fail: Callable[[str, str], None] | None = None,
    on_note: Callable[[str, str], None] | None = None,
    on_status: Callable[[str, str], None] | None = None,
) -> pd.DataFrame:
    """Run every (fleet variant, train_points, method, seed); return (and write) the summary.

    Fleet variants come from the design and fleet-seed sweeps of ``config``
    (see :func:`fleet_variants`); without them ``fleet`` is the only one. With
    ``methods=["all"]`` a method that cannot run on this model (e.g. one
    that needs a shared body when the model is all head) is skipped and
    reported through ``on_skip(method, reason)``; a method named explicitly
    that cannot run is an error (raised before anything trains). A method that
    raises while training is reported through ``on_fail(label, one-line reason)``,
    gets a summary row with ``failed = 1`` and no numbers, and the others go on.
    Summary rows count each run's ``diverged`` sensors (non-finite personalized
    model) and ``rejected`` replies; fleet means are NaN when a sensor diverged.
    What a user must know about a finished run (e.g. a fleet prior that the data do
    not identify) goes to ``on_note(method, message)``; which sensors are not ``ok``
    and every client the server rejected (round, reason, ratio vs threshold) to
    ``on_status(run label, message)`` (:func:`status_notes`). Each sensor's status
    (:mod:`fedcal.status`) is in per_sensor.csv with its reason, every rejection in
    the run's rejections.csv; summary means are over ok sensors, with the others
    counted (``excluded``, ``weak``, ``unconverged``, ``rejected_sensors``,
    ``diverged``, ``refused``).

    ``fleet`` may be a :class:`FleetOutline` (a Parquet file read by row groups,
    :func:`fedcal.build.load_outline`): its tensors are used as built, and it has no
    calibration-point budgets (``train_points`` other than 0 need the frame).
    """
    outline = isinstance(fleet, FleetOutline)
    if outline and any(train_points):
        raise ConfigError("train_points need the fleet's frame: load the file whole")
    expand_all = list(methods) == ["all"]
    methods = check_methods(methods, config, task_kind(fleet))
    check_fit(config, fleet)
    variants = fleet_variants(config, fleet)
    # bad input stops here, before anything is written; δ = 1/N² for N units unless set
    policy, privacy = build_policy(config, fleet.num_clients)
    if policy.dp:
        refuse_unprivate_scaling(config, fleet)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    resolved = run_record(config, methods, train_points)
    config_path = out / runnames.CONFIG
    text = json.dumps(resolved, indent=2, sort_keys=True, default=list)
    # The data's content, not just its path: a file replaced at the same path is another run.
    digest = _data_digest(variants)
    if config_path.exists():
        _check_same_run(config_path, json.loads(text), digest, out)
    _write_text(
        config_path,
        json.dumps({**resolved, "data_sha256": digest}, indent=2, sort_keys=True, default=list),
    )
    _write_text(
        out / runnames.FLEET,
        json.dumps(_provenance(variants), indent=2, sort_keys=True, default=str),
    )
    if privacy:
        _write_text(out / runnames.PRIVACY, json.dumps(privacy, indent=2))
    # Every method is built (and its aggregation policy checked) for every fleet variant and
    # budget before anything trains: a method that cannot run is known before the first round.
    plans = []
    refused: dict[str, str] = {}
    for labels, variant, tp in [(lab, f, tp) for lab, f in variants for tp in train_points]:
        if isinstance(variant, FleetOutline):
            subset, tensors = variant, variant.tensors
        else:
            subset = variant.with_train_points(tp or None, seed=config.data.split_seed)
            tensors = prepare(subset, config.data.scaling, config.engine.dtype)
        task = build_task(config, tensors.train.x.shape[-1], subset.meta, client_inputs(tensors))
        built = []
        for method in methods:
            try:
                algorithm = with_raw_column(build_algorithm(method, config, task), config, tensors)
                check_policy(algorithm, policy)
            except (ConfigError, AggregationError) as err:
                refused.setdefault(method, str(err))
                continue
            built.append((method, algorithm))
        plans.append((labels, variant, tp, subset, tensors, task, built))
    if refused and not expand_all:
        raise ConfigError("; ".join(refused.values()))
    for method, reason in refused.items():
        if on_skip is not None:
            on_skip(method, reason)
    rows: list[dict[str, Any]] = []
    runs: dict[int, tuple[Path, str]] = {}  # summary row → (per_sensor.csv, primary metric)
    for labels, variant, tp, subset, tensors, task, built in plans:
        fs, roles = full_scale(variant), variant.roles
        for method, algorithm in built:
            for seed in range(config.seeds):
                run_dir = _in_place(out, out / runnames.RUNS / _run_name(method, labels, tp, seed))
                done = run_dir / runnames.DONE
                if done.exists():
                    runs[len(rows)] = (run_dir / runnames.PER_SENSOR, task.primary_metric)
                    rows.append(_read_done(done, out))
                    continue
                run_dir.mkdir(parents=True, exist_ok=True)
                engine = EngineConfig(**engine_settings(config), seed=seed, aggregation=policy)
                label = f"{method}{_where(labels)} tp={tp or 'all'} seed={seed}"
                try:
                    result = simulate(
                        algorithm,
                        tensors,
                        engine,
                        on_round=(lambda t, s, label=label: on_progress(label, t, s))
                        if on_progress
                        else None,
                        checkpoint=run_dir / CHECKPOINT_FILE,
                        checkpoint_every=config.engine.checkpoint_every,
                    )
                except CheckpointError as err:
                    raise RunDirectoryError(
                        f"checkpoint {err.path}: {err.problem}: remove {out} (or only that "
                        "checkpoint, to redo that run) or choose another --out"
                    ) from None
                except (KeyboardInterrupt, MemoryError):
                    raise
                except Exception as err:  # one method's failure must not end the others
                    reason = one_line(err)
                    _write_text(run_dir / "failed.txt", reason + "\n")
                    if on_fail is not None:
                        on_fail(label, reason)
                    failed = {"method": method, "seed": seed, "train_points": tp, "failed": 1}
                    rows.append({**labels, **failed})
                    _write_csv(out / runnames.SUMMARY, _ordered(pd.DataFrame(rows)))
                    break  # the other seeds of this method would fail alike
                (run_dir / "failed.txt").unlink(missing_ok=True)
                history = pd.DataFrame(result.history)
                history.insert(0, "method", method)
                history.insert(1, "seed", seed)
                _write_csv(run_dir / runnames.METRICS, history)
                _write_csv(run_dir / "aggregation.csv", pd.DataFrame(result.extra["aggregation"]))
                statuses, reasons, rejections = judge_sensors(
                    algorithm,
                    result,
                    tensors,
                    history,
                    task.primary_metric,
                    config.unconverged_tol,
                    config.engine.chunk_size,
                )
                _write_csv(run_dir / runnames.REJECTIONS, rejections)
                final = pd.DataFrame(result.final)
                final["status"], final["status_reason"] = statuses, reasons
                final.insert(0, "method", method)
                final.insert(1, "seed", seed)
                if algorithm.unit_columns is not None:  # e.g. recalibrate_at
                    with torch.no_grad():
                        extra = algorithm.unit_columns(result.personal, tensors.train)
                    extra = algorithm.labelled_units(extra)  # e.g. fallback codes as names
                    for name, values in extra.items():
                        final[name] = np.asarray(values)[final["client_index"].to_numpy(int)]
                if roles is not None:  # mixed fleets: each sensor's role beside its id
                    role_column = final["client"].astype(str).map(roles)
                    final.insert(final.columns.get_loc("client") + 1, "role", role_column)
                _write_csv(run_dir / runnames.PER_SENSOR, final)
                save_models(
                    run_dir / MODEL_FILE,
                    result,
                    tensors,
                    config,
                    algorithm,
                    method,
                    seed,
                    subset.meta,
                )
                if task.kind == "regression":
                    ranges = subset.valid_ranges if outline else valid_ranges(subset)
                    ranges = json.dumps(ranges, indent=1)
                    _write_text(run_dir / runnames.VALID_RANGE, ranges)
                row = {
                    **labels,
                    **summary_row(method, seed, tp, result, fs, task, roles, statuses),
                }
                if on_status is not None:
                    for note in status_notes(final, rejections):
                        on_status(label, note)
                has_test = tensors.test.count.cpu().numpy()[final["client_index"].to_numpy(int)]
                checked, check_notes = coverage_checks(final, roles, has_test)
                row.update(checked)  # the stated intervals judged on the test rows
                where = (
                    _where(labels) + f" tp={tp}" * bool(tp) + f" seed={seed}" * (config.seeds > 1)
                )
                for note in check_notes if on_note is not None else ():
                    on_note(method, f"{where.strip()}: {note}" if where.strip() else note)
                if privacy:
                    row["epsilon"] = privacy["epsilon"]
                    row["noise_multiplier"] = privacy["noise_multiplier"]
                fitted = export_state(
                    algorithm, result.server, subset, tensors, method, _asked_choose(config, method)
                )
                deploy = getattr(algorithm, "deploy_state", None)  # fedprior: issue 33
                if fitted is not None and deploy is not None:
                    model = deploy(result.server, tensors.train)
                    if model is not None:
                        fitted = dataclasses.replace(fitted, discrepancy=model)
                if fitted is not None:
                    fitted.save(run_dir / runnames.PRIOR)
                    exported = fitted.to_dict()
                    note = identification_note(exported)
                    if "identification" in exported:
                        row["weak_directions"] = exported["identification"]["weak_directions"]
                    if note and on_note is not None:
                        on_note(method, note)
                    drift = exported.get("drift")
                    if isinstance(drift, dict) and drift.get("note") and on_note is not None:
                        on_note(method, drift["note"])  # e.g. no time column: fedprior's model
                    chosen = selection_note(exported, final)
                    if chosen:  # the time-respecting choice (algorithms/fedprior_choice.py)
                        row["selection_note"] = chosen
                        if on_note is not None:
                            on_note(method, chosen)
                    reason = (exported.get("interval") or {}).get("reason", "")
                    if reason:  # no interval stated: coverage is empty (NaN), and why
                        row["coverage_note"] = reason
                        if on_note is not None:
                            on_note(method, reason)
                own_note = getattr(algorithm, "note", "")  # e.g. a basis reduced to fit its limit
                if own_note and on_note is not None:
                    on_note(method, own_note)
                if on_note is not None and "jitter" in history and (history["jitter"] > 0).any():
                    worst = float(history["jitter"].max())
                    on_note(method, jitter_note(history["jitter"], worst))
                note = unjudged_note(result.extra["aggregation"])
                if note:  # the robust M-step judged nobody: marked in the row, and said
                    row["unjudged_rounds"] = int(note.split(" ", 1)[0])
                    if on_note is not None:
                        on_note(method, note.split(" ", 1)[1])
                _write_text(done, json.dumps(row, indent=2))
                (run_dir / CHECKPOINT_FILE).unlink(missing_ok=True)
                runs[len(rows)] = (run_dir / runnames.PER_SENSOR, task.primary_metric)
                rows.append(row)
                _write_csv(out / runnames.SUMMARY, _ordered(pd.DataFrame(rows)))
    summary = common_sensor_means(pd.DataFrame(rows), runs)  # like with like (issue 34.4)
    summary = _ordered(summary)
    _write_csv(out / runnames.SUMMARY, summary)
    return summary


def unjudged_note(rounds_log: list[dict]) -> str:
    """``"<k> <note>"`` when the robust M-step judged nobody in k rounds, else ""."""
    marked = [r for r in rounds_log if r.get("unjudged")]
    if not marked:
        return ""
    few = min(int(r["cohort"]) for r in marked)
    return (
        f'{len(marked)} robust = "full" judged nobody in {len(marked)} of {len(rounds_log)} '
        f"round(s): {few} unit(s) are too few to judge each against the others (more than "
        "the basis's terms + 2 needed); a hostile unit would not have been down-weighted"
    )


def _data_digest(variants: list[tuple[dict[str, Any], Fleet]]) -> str:
    """One digest of every fleet variant's content (a single fleet: its own digest)."""
    digests = [f.content_digest() for _, f in variants]
    if len(digests) == 1:
        return digests[0]
    return hashlib.sha256("\n".join(digests).encode()).hexdigest()


def _numbers_config(resolved: dict) -> dict:
    """The configuration without what cannot change the numbers ([engine] chunk_size and
    device, and [data] path: the data's content is compared by its digest), so a run may
    resume in other chunks, on another device, or with the same data by another path."""
    engine = {
        k: v for k, v in resolved.get("engine", {}).items() if k not in ("chunk_size", "device")
    }
    data = resolved.get("data", {})
    data = {k: v for k, v in data.items() if k != "path"} if isinstance(data, dict) else data
    return {**resolved, "engine": engine, "data": data}


def _check_same_run(config_path: Path, resolved: dict, digest: str, out: Path) -> None:
    """Refuse a run directory holding another configuration or made from other data."""
    try:
        saved = read_json(config_path, allow_nan=True)  # guarded: no FIFO, size limit
        saved_digest = saved.pop("data_sha256", None)
    except (OSError, ValueError, AttributeError) as e:
        raise RunDirectoryError(
            f"{config_path} is unreadable or corrupt ({type(e).__name__}); "
            f"remove {out} or choose another --out"
        ) from None
    if _numbers_config(saved) != _numbers_config(resolved):
        raise ConfigError(
            f"{out} holds a run with another configuration; choose another --out "
            "or remove it (nothing was changed)"
        )
    if saved_digest != digest:
        raise RunDirectoryError(
            f"data changed since this run started (its content differs from what {out} was "
            f"run on): remove {out} or choose another --out"
        )


def _in_place(out: Path, run_dir: Path) -> Path:
    """``run_dir`` if it is ``out``'s own folder: not reached through a symbolic link
    (``runs/`` or ``runs/<name>`` planted as one would be followed on resume, reading a
    done.json and writing models outside ``--out``: issue 36.5), else a RunDirectoryError."""
    for path in (run_dir.parent, run_dir):
        if path.is_symlink():
            raise RunDirectoryError(
                f"{path} is a symbolic link: a run folder is written in place, never through "
                f"a link; remove it (or choose another --out)"
            )
    if run_dir.exists() and run_dir.resolve().parent.parent != out.resolve():
        raise RunDirectoryError(f"{run_dir} lies outside {out}: remove it")
    return run_dir


def _read_done(done: Path, out: Path) -> dict[str, Any]:
    try:
        row = read_json(done, allow_nan=True)
        if not isinstance(row, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise RunDirectoryError(
            f"{done} is corrupt ({type(e).__name__}); remove {done.parent} to redo that run, "
            f"or remove {out} or choose another --out"
        ) from None
    return row


def _ordered(frame: pd.DataFrame) -> pd.DataFrame:
    first = [c for c in SUMMARY_COLUMNS if c in frame.columns]
    rest = [c for c in frame.columns if c not in first]
    return frame[first + rest]


def fleet_variants(config: RunConfig, fleet: Fleet) -> list[tuple[dict[str, Any], Fleet]]:
    """The fleets of a run: ``fleet`` alone, or one per (fleet seed, design) of the sweeps.

    ``[run] fleet_seeds`` / ``designs`` (or ``--fleet-seeds`` / ``--designs``)
    regenerate the fleet with ``[fleet] seed`` / ``train_design`` set to each
    value; each variant is labelled by the swept fields only (they become
    summary columns ``fleet_seed`` / ``design``).
    """
    if not config.designs and not config.fleet_seeds:
        return [({}, fleet)]
    path = config.data.path
    if config.designs and path:
        raise ConfigError(
            f"[run] designs sweep the simulator's chamber designs; [data] path is {path!r}"
        )
    if config.fleet_seeds and path and not path.startswith("builtin:"):
        raise ConfigError(
            f"[run] fleet_seeds regenerate a built-in fleet; [data] path is the file {path!r}"
        )
    out = []
    for fleet_seed in config.fleet_seeds or (config.fleet.seed,):
        for design in config.designs or (config.fleet.train_design,):
            f = dataclasses.replace(config.fleet, seed=fleet_seed, train_design=design)
            labels: dict[str, Any] = {}
            if config.designs:
                labels["design"] = design
            if config.fleet_seeds:
                labels["fleet_seed"] = fleet_seed
            out.append((labels, load_data(dataclasses.replace(config, fleet=f))))
    return out


def _run_name(method: str, labels: dict[str, Any], tp: int, seed: int) -> str:
    return runnames.run_name(method, tp, seed, labels.get("design"), labels.get("fleet_seed"))


def _where(labels: dict[str, Any]) -> str:
    return "".join(f" {k}={v}" for k, v in labels.items())


def _provenance(variants: list[tuple[dict[str, Any], Fleet]]) -> Any:
    """fleet.json: the fleet's meta, or per swept variant its labels and meta."""
    if len(variants) == 1 and not variants[0][0]:
        return variants[0][1].meta
    return [{**labels, "meta": fleet.meta} for labels, fleet in variants]
