"""What the chamber can do (:class:`Chamber`), a design in it (:class:`Design`, design.csv),
the standard PxT grids and the check that a design fits the chamber."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from fedcal.data.fleet import DIRECTION_SIGNS
from fedcal.prior.model import PriorModel

DESIGN_COLUMNS = ("pressure_hpa", "temperature_c", "direction")
DEFAULT_PRESSURES = tuple(float(p) for p in range(50, 1551, 100))  # the campaign's levels


@dataclass(frozen=True)
class Chamber:
    """What the chamber can do: feasible set points, pressure steps, sweeps, and its time."""

    temperatures: tuple[float, ...]  # feasible plateau set points (°C), ascending
    pressures: tuple[float, ...]  # feasible pressure steps (hPa), ascending
    directions: tuple[str, ...] = ("up", "down")
    plateau_minutes: float = 90.0
    point_minutes: float = 5.0

    def __post_init__(self) -> None:
        for name in ("temperatures", "pressures"):
            values = tuple(sorted(float(v) for v in getattr(self, name)))
            if not values:
                raise ValueError(f"chamber: no feasible {name}")
            object.__setattr__(self, name, values)
        bad = [d for d in self.directions if d not in DIRECTION_SIGNS]
        if bad or not self.directions:
            raise ValueError(f"chamber: directions must be 'up'/'down', got {bad}")

    def minutes(self, plateaus: int, points: int) -> float:
        return plateaus * self.plateau_minutes + points * self.point_minutes


@dataclass(frozen=True)
class Design:
    """K plateau set points and N points (plateau index, pressure, direction)."""

    temperatures: tuple[float, ...]
    points: tuple[tuple[int, float, str], ...]

    @property
    def plateaus(self) -> int:
        return len(self.temperatures)

    @property
    def size(self) -> int:
        return len(self.points)

    def frame(self) -> pd.DataFrame:
        """design.csv: plateaus cold to hot; per plateau the up sweep, then the down sweep."""
        rows = []
        for k in np.argsort(self.temperatures, kind="stable"):
            mine = [(p, d) for j, p, d in self.points if j == k]
            up = sorted(p for p, d in mine if d == "up")
            down = sorted((p for p, d in mine if d == "down"), reverse=True)
            t = self.temperatures[k]
            rows += [(p, t, "up") for p in up] + [(p, t, "down") for p in down]
        return pd.DataFrame(rows, columns=list(DESIGN_COLUMNS))

    @staticmethod
    def from_frame(frame: pd.DataFrame, source: str = "design") -> Design:
        missing = [c for c in DESIGN_COLUMNS if c not in frame.columns]
        if missing:
            raise ValueError(f"{source}: missing column(s) {', '.join(missing)}")
        temps: list[float] = []
        points = []
        for i, row in enumerate(frame.itertuples(index=False), start=2):
            t, p = float(row.temperature_c), float(row.pressure_hpa)
            d = str(row.direction).strip().lower()
            if d not in DIRECTION_SIGNS or not (np.isfinite(t) and np.isfinite(p)):
                raise ValueError(f"{source}: line {i}: bad point ({p}, {t}, {row.direction!r})")
            if t not in temps:
                temps.append(t)
            points.append((temps.index(t), p, d))
        return Design(tuple(temps), tuple(points))


def default_chamber(
    prior: PriorModel,
    t_min: float | None = None,
    t_max: float | None = None,
    t_step: float = 5.0,
    pressures: tuple[float, ...] | None = None,
    plateau_minutes: float = 90.0,
    point_minutes: float = 5.0,
    directions: tuple[str, ...] | None = None,
) -> Chamber:
    """Set points every ``t_step`` within the limits (default: the prior's calibrated
    temperature range, snapped inward to the step); pressure steps (default the
    campaign's 50…1550 hPa by 100); both sweeps if the prior has a direction term."""
    _, temp = input_indices(prior)
    lo, hi = prior.input_range[prior.features[temp]]
    if t_step <= 0:
        raise ValueError(f"--t-step must be > 0, got {t_step}")
    t_min = float(np.ceil(lo / t_step - 1e-9) * t_step) if t_min is None else float(t_min)
    t_max = float(np.floor(hi / t_step + 1e-9) * t_step) if t_max is None else float(t_max)
    if t_max < t_min:
        raise ValueError(f"temperature limits {t_min}…{t_max} °C are empty")
    temps = np.arange(t_min, t_max + 1e-9, t_step)
    if directions is None:
        directions = ("up", "down") if prior.basis.branch_terms else ("up",)
    return Chamber(
        tuple(float(t) for t in temps),
        tuple(pressures) if pressures else DEFAULT_PRESSURES,
        tuple(directions),
        plateau_minutes,
        point_minutes,
    )


def input_indices(prior: PriorModel) -> tuple[int, int]:
    """(response, temperature) input indices; the target is what the chamber sets (P)."""
    names = list(prior.features)
    temps = [i for i, n in enumerate(names) if "temp" in n.lower()]
    if len(names) != 2 or len(temps) != 1:
        raise ValueError(
            f"plan needs a prior over (response, temperature) inputs, got {names}: "
            "a chamber sets the target and a temperature"
        )
    return 1 - temps[0], temps[0]


def snap(values: np.ndarray, feasible: tuple[float, ...]) -> list[float]:
    grid = np.asarray(feasible)
    return [float(grid[np.argmin(np.abs(grid - v))]) for v in values]


def grid_design(
    chamber: Chamber, pressures: int, plateaus: int, sweeps: tuple[str, ...] = ("up",)
) -> Design:
    """The standard PxT grid: P pressures and T set points evenly spread, ends included
    (T = 1: the middle), snapped to the chamber's steps; one sweep per entry of ``sweeps``."""
    p_lo, p_hi = chamber.pressures[0], chamber.pressures[-1]
    t_lo, t_hi = chamber.temperatures[0], chamber.temperatures[-1]
    ps = snap(np.linspace(p_lo, p_hi, pressures), chamber.pressures)
    ts = np.array([(t_lo + t_hi) / 2]) if plateaus == 1 else np.linspace(t_lo, t_hi, plateaus)
    temps = tuple(dict.fromkeys(snap(ts, chamber.temperatures)))
    points = tuple((k, p, s) for k in range(len(temps)) for s in sweeps for p in ps)
    return Design(temps, points)


def standard_grids(chamber: Chamber) -> dict[str, Design]:
    """3×2, 2×3, 4×3 (one up sweep each) and the full campaign (every step and set point
    of the simulator's protocol: 16 pressures × 6 plateaus × up, down, up, down)."""
    out = {f"{p}x{t}": grid_design(chamber, p, t) for p, t in ((3, 2), (2, 3), (4, 3))}
    campaign = grid_design(chamber, len(chamber.pressures), 6, ("up", "down", "up", "down"))
    out["campaign"] = campaign
    return out


def check_design(ch: Chamber, d: Design, plateaus: int | None = None, points: int | None = None):
    """Refuse a design outside the chamber (set points, pressures, directions) or of the
    wrong size, naming the offending value."""
    if plateaus is not None and d.plateaus != plateaus:
        raise ValueError(f"design has {d.plateaus} plateaus, expected {plateaus}")
    if points is not None and d.size != points:
        raise ValueError(f"design has {d.size} points, expected {points}")
    for t in d.temperatures:
        if not ch.temperatures[0] - 1e-9 <= t <= ch.temperatures[-1] + 1e-9:
            raise ValueError(f"set point {t} °C outside the chamber's limits")
    for k, p, s in d.points:
        if not (0 <= k < d.plateaus) or p not in ch.pressures or s not in ch.directions:
            raise ValueError(f"point ({p} hPa, plateau {k}, {s}) is not a feasible chamber point")
    if set(range(d.plateaus)) - {k for k, _, _ in d.points}:
        raise ValueError("design has a plateau without points")
