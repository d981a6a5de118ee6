"""fedprior_branch: one interval — the run scores the one ``predict`` states (issue 33).

A mixed fleet swept both ways (12 reference units, 4 new units of the 4x3 design, 12
points each). The run scores each unit's ``test_coverage95`` with the sweep mixture's
interval; ``fedcal predict`` on the same units' test rows must state that interval
(``<target>_halfwidth95``), so the coverage a user computes from predict's output equals
the run's, unit by unit. Before, predict gave only σ, and ±1.96 σ is another interval.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from fedcal.cli import app
from fedcal.data.simulator import FleetSpec, simulate_fleet

runner = CliRunner(env={"COLUMNS": "200"})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("branch_interval")
    spec = FleetSpec(num_reference=12, num_new=4, train_design="4x3")
    frame = simulate_fleet(spec, seed=4).frame
    fleet_file = root / "fleet.csv"
    frame.to_csv(fleet_file, index=False)
    cfg = root / "prior.toml"
    cfg.write_text("[engine]\nrounds = 30\neval_every = 30\n")
    out = root / "run"
    args = ["run", "--data", str(fleet_file), "--methods", "fedprior_branch", "--seeds", "1"]
    result = runner.invoke(app, [*args, "--config", str(cfg), "--out", str(out)])
    assert result.exit_code == 0, result.output
    return root, out, frame


def test_predict_states_the_interval_the_run_scores(run):
    root, out, frame = run
    test = frame[frame["split"] == "test"]
    readings = root / "readings.csv"
    test.drop(columns=["pressure_hpa", "split"]).to_csv(readings, index=False)
    pred_file = root / "pred.csv"
    args = ["predict", str(out), "--method", "fedprior_branch", "--data", str(readings)]
    result = runner.invoke(app, [*args, "--out", str(pred_file)])
    assert result.exit_code == 0, result.output
    pred = pd.read_csv(pred_file)
    half = pred["pressure_hpa_halfwidth95"].to_numpy()
    err = np.abs(pred["pressure_hpa_calibrated"].to_numpy() - test["pressure_hpa"].to_numpy())
    inside = pd.Series(err <= half, index=pred["sensor_id"].to_numpy())
    stated = inside.groupby(level=0).mean()
    scored = pd.read_csv(out / "runs" / "fedprior_branch_tp0_seed0" / "per_sensor.csv")
    scored = scored.set_index("client")["test_coverage95"]
    rows = inside.groupby(level=0).size()
    assert set(stated.index) == set(scored.index) and len(stated) == 16
    # the same interval on the same rows: equal up to a row at the float32 edge per unit
    np.testing.assert_allclose(stated[scored.index], scored, rtol=0, atol=1.01 / rows.min())
    assert float((stated[scored.index] - scored).abs().mean()) < 0.25 / rows.min()
    # the mixture's interval is not ±1.96 σ of the same σ (narrower where ψᵀm_h matters)
    assert (half <= 1.959964 * pred["pressure_hpa_std"].to_numpy() + 1e-9).all()
    assert (half < 1.959964 * pred["pressure_hpa_std"].to_numpy() - 1e-6).any()
