"""The simulated calibration protocol (:mod:`fedcal.data.simulator`): each sensor's
measurement plan — a PxT chamber grid, explicit chamber points, or the seed's campaign —
and its train/test roles.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from fedcal.data.fleetspec import (
    _S_CHAMBER,
    _S_DESIGN_CHAMBER,
    _S_POINTS_CHAMBER,
    _S_RANDOM_TEST,
    POINTS,
    FleetSpec,
    parse_design,
)
from fedcal.data.sensor_models import _check_seed, _rng


def measurement_plan(
    spec: FleetSpec = FleetSpec(), seed: int = 0, design: str | None = None
) -> pd.DataFrame:
    """The chamber schedule of every unit of one design, in measurement order.

    ``design`` defaults to ``spec.train_design``. Columns: ``pressure_hpa``
    (true, reference gauge), ``temperature_true_c`` (chamber, setpoint +
    plateau offset), ``plateau`` (index into the design's plateaus, −1 for
    random test points), ``sweep``, ``direction``, ``split``. Test rows are the
    campaign's whatever the design.
    """
    _check_seed(seed)
    design = spec.train_design if design is None else design
    campaign = _campaign_plan(spec, seed)
    if design == POINTS:
        train = _points_plan(spec, seed)
    elif (grid := parse_design(design)) is None:
        return campaign
    else:
        train = _grid_plan(spec, seed, *grid)
    test = campaign[campaign["split"] == "test"]
    return pd.concat([train, test], ignore_index=True)


def design_levels(spec: FleetSpec, num_levels: int, num_plateaus: int) -> tuple[np.ndarray, ...]:
    """(pressure levels, temperature setpoints) of a PxT design: evenly spread, ends included."""
    levels = np.asarray(spec.pressure_levels_hpa, dtype=float)
    plateaus = np.asarray(spec.temperature_plateaus_c, dtype=float)
    p = np.linspace(levels.min(), levels.max(), num_levels)
    if num_plateaus == 1:
        t = np.array([(plateaus.min() + plateaus.max()) / 2.0])
    else:
        t = np.linspace(plateaus.min(), plateaus.max(), num_plateaus)
    return p, t


def _grid_plan(spec: FleetSpec, seed: int, num_levels: int, num_plateaus: int) -> pd.DataFrame:
    """Training rows of a PxT design: one ascending sweep per plateau, cold to hot."""
    p, t = design_levels(spec, num_levels, num_plateaus)
    offsets = spec.plateau_offset_c * _rng(
        seed, _S_DESIGN_CHAMBER, num_levels, num_plateaus
    ).standard_normal(num_plateaus)
    n = num_levels * num_plateaus
    return pd.DataFrame(
        {
            "pressure_hpa": np.tile(p, num_plateaus),
            "temperature_true_c": np.repeat(t + offsets, num_levels),
            "plateau": np.repeat(np.arange(num_plateaus, dtype=np.int64), num_levels),
            "sweep": np.zeros(n, dtype=np.int64),
            "direction": np.full(n, "up", dtype=object),
            "split": np.full(n, "train", dtype=object),
        }
    )


def _points_plan(spec: FleetSpec, seed: int) -> pd.DataFrame:
    """Training rows of the explicit design ``design_points``, in the given order.

    Plateaus are the distinct set points in order of first appearance; each one's true
    temperature is its set point plus N(0, ``plateau_offset_c``²) from its own stream
    (seed, plateau index), shared by every unit of the design (one chamber run).
    """
    pressure = np.array([p for p, _, _ in spec.design_points], dtype=float)
    setpoint = np.array([t for _, t, _ in spec.design_points], dtype=float)
    plateaus, index = np.unique(setpoint, return_inverse=True)
    first = [int(np.flatnonzero(index == k)[0]) for k in range(len(plateaus))]
    order = np.argsort(first)  # plateau numbers in order of first appearance
    rank = np.empty(len(plateaus), dtype=np.int64)
    rank[order] = np.arange(len(plateaus))
    offsets = spec.plateau_offset_c * _rng(seed, _S_POINTS_CHAMBER).standard_normal(len(plateaus))
    plateau = rank[index]
    n = len(pressure)
    return pd.DataFrame(
        {
            "pressure_hpa": pressure,
            "temperature_true_c": setpoint + offsets[plateau],
            "plateau": plateau.astype(np.int64),
            "sweep": np.zeros(n, dtype=np.int64),
            "direction": np.array([d for _, _, d in spec.design_points], dtype=object),
            "split": np.full(n, "train", dtype=object),
        }
    )


def _campaign_plan(spec: FleetSpec, seed: int) -> pd.DataFrame:
    levels = np.asarray(spec.pressure_levels_hpa, dtype=float)
    plateaus = np.asarray(spec.temperature_plateaus_c, dtype=float)
    n_sweeps = spec.train_sweeps + 1  # the test cycle is sweep index train_sweeps
    offsets = spec.plateau_offset_c * _rng(seed, _S_CHAMBER).standard_normal(
        (len(plateaus), n_sweeps)
    )
    cycle = spec.test_design == "cycle"
    n_up = (spec.test_points_per_plateau + 1) // 2
    n_down = spec.test_points_per_plateau // 2
    up_idx = np.round(np.linspace(0, len(levels) - 1, n_up)).astype(int)
    down_idx = np.round(np.linspace(0, len(levels) - 1, n_down)).astype(int)[::-1]

    cols: dict[str, list] = {k: [] for k in ("p", "t", "plateau", "sweep", "dir", "split")}

    def add(p, t, plateau, sweep, direction, split):
        n = len(p)
        cols["p"].append(np.asarray(p, float))
        cols["t"].append(np.broadcast_to(np.asarray(t, float), (n,)))
        cols["plateau"].append(np.full(n, plateau, dtype=np.int64))
        cols["sweep"].append(np.full(n, sweep, dtype=np.int64))
        cols["dir"].append(np.full(n, direction, dtype=object))
        cols["split"].append(np.full(n, split, dtype=object))

    for j, t_set in enumerate(plateaus):
        for s in range(spec.train_sweeps):
            up = s % 2 == 0
            add(levels if up else levels[::-1], t_set + offsets[j, s], j, s, _dir(up), "train")
        if cycle:
            t_test = t_set + offsets[j, spec.train_sweeps]
            add(levels[up_idx], t_test, j, spec.train_sweeps, "up", "test")
            add(levels[down_idx], t_test, j, spec.train_sweeps, "down", "test")
    if not cycle:
        n = spec.test_points_per_plateau * len(plateaus)
        r = _rng(seed, _S_RANDOM_TEST)
        p = r.uniform(levels.min(), levels.max(), n)
        t = r.uniform(plateaus.min(), plateaus.max(), n)
        ups = r.uniform(size=n) < 0.5
        for k in range(n):
            add(p[k : k + 1], t[k], -1, spec.train_sweeps, _dir(bool(ups[k])), "test")
    cat = {k: np.concatenate(v) if v else np.zeros(0) for k, v in cols.items()}
    return pd.DataFrame(
        {
            "pressure_hpa": cat["p"].astype(float),
            "temperature_true_c": cat["t"].astype(float),
            "plateau": cat["plateau"].astype(np.int64),
            "sweep": cat["sweep"].astype(np.int64),
            "direction": cat["dir"].astype(object),
            "split": cat["split"].astype(object),
        }
    )


def _dir(up: bool) -> str:
    return "up" if up else "down"
