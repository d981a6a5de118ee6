"""A user's field network through the CLI (issue 26): --data with any variant, time split."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
from typer.testing import CliRunner

from fedcal.cli import app
from fedcal.data.field import FieldSpec, field_frame

runner = CliRunner(env={"COLUMNS": "200"})


def test_fedprior_sensor_runs_on_a_users_file_with_a_time_split(tmp_path):
    data = tmp_path / "network.csv"
    field_frame(FieldSpec(num_sensors=4, days=120), seed=5).to_csv(data, index=False)
    cfg = tmp_path / "run.toml"
    cfg.write_text("[data]\ntest_fraction = 0.25\n[engine]\nrounds = 5\neval_every = 5\n")
    out = tmp_path / "run"
    args = ["run", "--data", str(data), "--features", "pm25_raw,rh", "--target", "pm25_ref"]
    args += ["--time-column", "time", "--split-by", "time", "--config", str(cfg)]
    args += ["--methods", "fedprior_sensor,fedprior", "--seeds", "1", "--out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = pd.read_csv(out / "summary.csv").set_index("method")
    assert np.isfinite(summary.loc["fedprior_sensor", "rmse_mean"])
    prior = json.loads((out / "runs" / "fedprior_sensor_tp0_seed0" / "prior.json").read_text())
    # Two generic features: a total-degree basis (≤ 2), never the barometer's (4, 3) tensor.
    assert prior["method_params"]["basis"] == "total"
    assert max(sum(t) for t in prior["terms"]) <= 2 and prior["method_params"]["noise"] == "sensor"
    fleet = json.loads((out / "fleet.json").read_text())  # the fleet's provenance
    assert fleet["split"] == "time" and fleet["time_column"] == "time"
    assert fleet["test_fraction"] == 0.25
