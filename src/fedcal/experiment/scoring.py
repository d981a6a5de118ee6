"""A finished run scored: the summary row (each metric's mean and worst over the ok
sensors, per role), means over all and over the common sensors, the stated intervals
judged on the test rows.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fedcal.build import (
    FleetOutline,
)
from fedcal.core.coverage import SEVERITY, coverage_check
from fedcal.core.summarystats import HIGHER_IS_BETTER, fleet_stat  # noqa: F401 (re-exported)
from fedcal.core.task import Task
from fedcal.data.fleet import Fleet
from fedcal.engine.simulation import (
    RunResult,
)
from fedcal.status import counts as status_counts

# Metrics whose worst sensor is the minimum: accuracy, and the coverage of nominal 95 %
# intervals (worst = farthest below nominal). Every other metric is an error (worst = max).


def full_scale(fleet: Fleet | FleetOutline) -> float:
    """The calibrated span of the target (max − min over the fleet's reference values)."""
    if isinstance(fleet, FleetOutline):  # gathered row group by row group
        return fleet.full_scale
    values = fleet.frame[fleet.target].to_numpy(float)
    return float(values.max() - values.min())


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
