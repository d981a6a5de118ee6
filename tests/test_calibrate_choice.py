"""Review B of issue 34: a prior learned with ``choose = "auto"`` records "auto", and
``calibrate`` turns the time-respecting choice on only for data with their own time column
(a file without one is not read as if its row order were time)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from fedcal import calibration
from fedcal.api import FleetPrior
from fedcal.data.fleet import Fleet


def _frame(units: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(units):
        t, x = np.arange(30.0), rng.uniform(-1, 1, 30)
        y = rng.normal(0, 0.3) + rng.normal(1, 0.2) * x + 0.05 * rng.standard_normal(30)
        split = np.where(t < 24, "train", "test")
        rows += [
            dict(sensor_id=f"S{i:02d}", time=a, x=b, y=c, split=d)
            for a, b, c, d in zip(t, x, y, split, strict=True)
        ]
    return pd.DataFrame(rows)


def test_auto_is_recorded_and_resolved_by_the_calibrate_data(tmp_path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(
        '[data]\ntime_column = "time"\n[methods.fedprior]\nbasis = "total"\ndegree = 1\n'
    )
    prior = FleetPrior(features=("x",), target="y", config=config, rounds=3).fit(_frame(8, 0))
    model = prior.model_
    assert model.provenance.method_params["choose"] == "auto"  # not this run's "time"
    new = _frame(3, 1)
    timed = Fleet(new, ("x",), "y", "sensor_id", {"time_column": "time"})
    untimed = Fleet(new.drop(columns="time"), ("x",), "y", "sensor_id", {})
    on = calibration.calibrate(model, timed)
    off = calibration.calibrate(model, untimed)
    assert on.algorithm.choose == "time" and "fallback" in on.personal
    assert off.algorithm.choose == "off" and "fallback" not in off.personal
    assert calibration.prior_algorithm(model).choose == "off"  # no data: no choice
