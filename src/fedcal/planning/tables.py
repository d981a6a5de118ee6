"""The planner's tables: named designs side by side (:func:`compare`) and a design's σ over
the operating range (:func:`sigma_map`)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from fedcal.planning.chamber import Design
from fedcal.planning.forecast import GRID, Planner, evaluate, expected_variance, meets


def compare(plan: Planner, designs: dict[str, Design], spec: float | None = None) -> pd.DataFrame:
    """One row per named design: plateaus, points, chamber minutes, expected RMS σ, worst σ
    over the range, mean and quantile unit RMSE (target units), and whether it meets
    ``spec``."""
    rows = []
    for name, d in designs.items():
        e = evaluate(plan, d)
        row = {
            "design": name,
            "plateaus": e.plateaus,
            "points": e.points,
            "minutes": e.minutes,
            "rms_sd": e.rms,
            "worst_sd": e.worst,
            "mean_rmse": e.mean_rmse,
            f"q{round(100 * plan.quantile)}_rmse": e.quantile_rmse,
        }
        if spec is not None:
            row["meets_spec"] = meets(e, spec)
        if plan.prior.interval is not None:  # whether a unit of this design gets a stated interval
            row["interval"] = "declined" if e.declined else "stated"
        rows.append(row)
    return pd.DataFrame(rows)


def sigma_map(plan: Planner, design: Design) -> pd.DataFrame:
    """The design's expected predictive σ (target units) on the range's regular grid:
    columns ``pressure_hpa``, ``temperature_c``, ``sigma`` (for a figure of the plane)."""
    var = expected_variance(plan, [design], at=plan.grid)[0]
    scaler, k = plan.prior.scaler, plan.temperature
    temps = plan.grid[:, k] * scaler.x_scale[k] + scaler.x_offset[k]
    p_lo, p_hi = plan.chamber.pressures[0], plan.chamber.pressures[-1]
    pressures = np.repeat(np.linspace(p_lo, p_hi, GRID[0]), GRID[1])
    return pd.DataFrame(
        {"pressure_hpa": pressures, "temperature_c": temps, "sigma": np.sqrt(var) * plan.y_scale}
    )
