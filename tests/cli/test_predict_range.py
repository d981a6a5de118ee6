"""`fedcal predict` carries the method's predictive σ and flags readings beyond the
calibrated range (refuses them with --strict)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from fedcal.cli import app
from fedcal.config import default_config
from fedcal.core.tree import stack
from fedcal.experiment import run_experiment
from fedcal.report.export import RANGE_MARGIN, in_range, load_models

runner = CliRunner()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from tests.conftest import toy_fleet

    root = tmp_path_factory.mktemp("predict_range")
    cfg = default_config()
    cfg = replace(cfg, seeds=1, engine=replace(cfg.engine, rounds=3), unconverged_tol=1.0)
    # 40 points a unit: no unit is a few-point probe design, so fedprior states its σ
    # (30 each would be a fleet of probes only, whose intervals it declines)
    fleet = toy_fleet(num_clients=3, train=40)
    run_experiment(cfg, fleet, root / "run", ["fedprior", "local"])
    readings = fleet.frame[fleet.frame["split"] == "test"].drop(columns=["pressure_hpa", "split"])
    far = pd.DataFrame([{"sensor_id": "S01", "frequency_hz": 39_000.0, "temperature_c": 20.0}])
    data = root / "readings.csv"
    pd.concat([readings, far], ignore_index=True).to_csv(data, index=False)
    return root / "run", data


def test_std_equals_the_methods_predictive_std_and_39_khz_is_out_of_range(run, tmp_path):
    run_dir, data = run
    out = tmp_path / "cal.csv"
    result = runner.invoke(
        app,
        ["predict", str(run_dir), "--data", str(data), "--out", str(out), "--method", "fedprior"],
    )
    assert result.exit_code == 0, result.output
    assert "1 row(s) beyond the calibrated range" in result.output
    cal = pd.read_csv(out)
    assert cal["in_range"].tolist() == [True] * (len(cal) - 1) + [False]  # the 39 kHz row
    fleet = load_models(run_dir, "fedprior")
    for sensor, rows in cal.groupby("sensor_id"):
        x = rows[["frequency_hz", "temperature_c"]].to_numpy(float)
        params = stack([fleet.params[sensor]])
        scaled = torch.as_tensor(fleet.scaler.x(x), dtype=next(iter(params.values())).dtype)
        sigma = fleet.algorithm.predictive_std(params, scaled.unsqueeze(0))[0, :, 0]
        expected = sigma.double().numpy() * fleet.scaler.y_scale[0]
        assert np.allclose(rows["pressure_hpa_std"].to_numpy(), expected, rtol=1e-12, atol=0)
        assert (rows["pressure_hpa_std"] > 0).all()


def test_strict_refuses_the_out_of_range_row_and_names_it(run, tmp_path):
    run_dir, data = run
    out = tmp_path / "cal.csv"
    args = ["predict", str(run_dir), "--data", str(data), "--out", str(out)]
    result = runner.invoke(app, [*args, "--method", "fedprior", "--strict"])
    assert result.exit_code == 2 and not out.exists()
    text = " ".join(result.output.split())
    rows = len(pd.read_csv(data))
    assert f"data row {rows} (sensor S01): frequency_hz=39000" in text and "--strict" in text


def test_a_method_without_a_sigma_has_no_std_column(run, tmp_path):
    run_dir, data = run
    out = tmp_path / "cal.csv"
    args = ["predict", str(run_dir), "--data", str(data), "--out", str(out), "--method", "local"]
    assert runner.invoke(app, args).exit_code == 0
    cal = pd.read_csv(out)
    assert "pressure_hpa_std" not in cal.columns and "in_range" in cal.columns


def test_the_range_margin_by_hand():
    span = {"a": [0.0, 10.0]}
    x = np.array([[-0.5], [10.5], [-0.51], [10.51], [5.0]])
    assert RANGE_MARGIN == 0.05
    assert in_range(x, span, ("a",)).tolist() == [True, True, False, False, True]
