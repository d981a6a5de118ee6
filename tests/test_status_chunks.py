"""Review B of issue 34: fedprior_choice's implausible rule compares each unit with the
fleet's median over every unit, whatever ``chunk_size`` the statuses are judged in."""

from __future__ import annotations

import numpy as np
import pandas as pd

from fedcal.apps.flower_server import build
from fedcal.build import build_policy
from fedcal.config import EngineSection, RunConfig
from fedcal.data.fleet import Fleet
from fedcal.engine.simulation import EngineConfig, prepare, simulate
from fedcal.experiment import judge_sensors

NOISY = 5


def _fleet() -> Fleet:
    """12 units on y = x, noise 0.05 except unit 5's (2.0: implausible); unit 7 at ten
    times the scale (its spread divides its errors: plausible)."""
    rng = np.random.default_rng(3)
    rows = []
    for i in range(12):
        x, t = rng.uniform(-1, 1, 60), np.arange(60.0)
        noise, scale = (2.0 if i == NOISY else 0.05), (10.0 if i == 7 else 1.0)
        y = scale * (x + noise * rng.standard_normal(60))
        split = np.where(t < 48, "train", "test")
        rows += [
            dict(sensor_id=f"S{i:02d}", time=a, x=b, y=c, split=d)
            for a, b, c, d in zip(t, x, y, split, strict=True)
        ]
    return Fleet(pd.DataFrame(rows), ("x",), "y", "sensor_id", {"time_column": "time"})


def test_chunk_size_changes_no_status() -> None:
    cfg = RunConfig(
        engine=EngineSection(rounds=8, dtype="float64"),
        method_params={
            "fedprior": {"basis": "total", "degree": 1, "noise": "sensor", "choose": "time"}
        },
    )
    alg = build(cfg, "fedprior", 1)
    assert alg.choose == "time"
    tensors = prepare(_fleet(), dtype="float64")
    eng = EngineConfig(rounds=8, seed=0, dtype="float64", aggregation=build_policy(cfg)[0])
    result = simulate(alg, tensors, eng)
    history = pd.DataFrame(result.history)
    whole = judge_sensors(alg, result, tensors, history, "rmse")
    assert whole[0][NOISY] == "weak" and whole[0].count("weak") == 1, whole[0]
    for size in (4, 2):  # chunks of 2: {4, 5} alone had their own median (review B)
        got = judge_sensors(alg, result, tensors, history, "rmse", None, size)
        assert got[0] == whole[0] and got[1] == whole[1]
