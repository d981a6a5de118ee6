"""A run's summary statistics over sensors (torch-free: ``fedcal calibrate`` without torch
writes summary.csv with them too)."""

from __future__ import annotations

import numpy as np
import pandas as pd

HIGHER_IS_BETTER = {"accuracy", "coverage95"}


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
