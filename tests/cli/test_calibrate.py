"""`fedcal calibrate`: new units from a few points against a stored fleet prior."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from fedcal import calibration
from fedcal.cli import app
from fedcal.core.tree import expand
from fedcal.data.simulator import FleetSpec, simulate_fleet
from fedcal.report.tables import fmt_num

runner = CliRunner(env={"COLUMNS": "200"})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A fedprior run on 12 fully calibrated units + 4 units with a 3x2 design (the fleet
    learns the model error of that design: fedprior's "Intervals"), and 3 new 3x2 units."""
    root = tmp_path_factory.mktemp("calibrate")
    fleet_file = root / "fleet.csv"
    spec = FleetSpec(num_reference=12, num_new=4, train_design="3x2")
    simulate_fleet(spec, seed=3).frame.to_csv(fleet_file, index=False)
    cfg = root / "prior.toml"
    cfg.write_text("[engine]\nrounds = 30\neval_every = 30\n")
    out = root / "fleet_run"
    args = ["run", "--data", str(fleet_file), "--methods", "fedprior", "--seeds", "1"]
    result = runner.invoke(app, [*args, "--config", str(cfg), "--out", str(out)])
    assert result.exit_code == 0, result.output
    new = simulate_fleet(FleetSpec(num_sensors=3, train_design="3x2", test_design="random"), 9)
    frame = new.frame.assign(sensor_id="NEW-" + new.frame["sensor_id"])
    cols = ["sensor_id", "frequency_hz", "temperature_c", "pressure_hpa", "split"]
    new_file = root / "new_units.csv"
    frame[cols].to_csv(new_file, index=False)
    return root, out, new_file, frame[cols]


def test_calibrate_writes_coefficients_and_a_run_directory_that_export_and_predict_read(trained):
    root, run, new_file, frame = trained
    out = root / "new"
    result = runner.invoke(
        app, ["calibrate", "--prior", str(run), "--data", str(new_file), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    coef = pd.read_csv(out / "coefficients.csv")
    assert list(coef["sensor_id"]) == ["NEW-S000", "NEW-S001", "NEW-S002"]
    assert list(coef["points"]) == [6, 6, 6]
    per_sensor = pd.read_csv(out / "per_sensor.csv")
    # the console states each unit's own σ over the range (units.csv), not the fleet noise
    units = pd.read_csv(out / "units.csv")
    assert "σ mean over range (hPa)" in result.output and "noise sd" not in result.output
    for _, unit in units.iterrows():
        line = next(x for x in result.output.splitlines() if unit["sensor_id"] in x)
        assert fmt_num(unit["sigma_mean"], keep_zeros=True) in line, line
    # 6 chamber points each, off-grid test points: far below a per-unit fit's ~3 hPa
    assert per_sensor["test_rmse"].max() < 0.5
    assert per_sensor["test_coverage95"].mean() >= 0.85

    # `fedcal predict` through the exported run directory gives the calibration's numbers
    test = frame[frame["split"] == "test"].drop(columns=["split", "pressure_hpa"])
    test_file = root / "readings.csv"
    test.to_csv(test_file, index=False)
    pred_file = root / "calibrated.csv"
    args = ["predict", str(out), "--method", "fedprior", "--data", str(test_file)]
    result = runner.invoke(app, [*args, "--out", str(pred_file)])
    assert result.exit_code == 0, result.output
    predicted = pd.read_csv(pred_file)["pressure_hpa_calibrated"].to_numpy()
    onnx_dir = root / "onnx"
    args = ["export", str(out), "--method", "fedprior", "--format", "onnx", "--out", str(onnx_dir)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in onnx_dir.iterdir()) == [f"NEW-S00{i}.onnx" for i in range(3)]
    truth = frame[frame["split"] == "test"]["pressure_hpa"].to_numpy()
    rmse = float(np.sqrt(np.mean((predicted - truth) ** 2)))
    assert rmse == pytest.approx(float(np.sqrt((per_sensor["test_rmse"] ** 2).mean())), rel=1e-6)


def test_calibration_is_the_federation_s_own_posterior(trained):
    """A unit calibrated alone equals its personalize() under the same prior, by hand."""
    _, run, new_file, _ = trained
    from fedcal.data.loader import load_fleet

    doc = calibration.load_prior(calibration.find_prior(run))
    fleet = load_fleet(new_file, features=doc.features, target=doc.target)
    result = calibration.calibrate(doc, fleet)
    alg, tensors = result.algorithm, result.tensors
    down = expand(alg.broadcast(result.server), tensors.num_clients)
    state = {
        "noise_var": torch.full((tensors.num_clients,), doc.noise.variance, dtype=torch.float64)
    }
    direct = alg.personalize(down, state, tensors.train)
    torch.testing.assert_close(result.personal["coef"], direct["coef"], rtol=1e-10, atol=1e-12)


def test_units_outside_the_fleet_range_or_without_a_column_are_refused(trained):
    root, run, _, frame = trained
    hot = frame.assign(frequency_hz=frame["frequency_hz"] * 1.2)
    hot_file = root / "hot.csv"
    hot.to_csv(hot_file, index=False)
    result = runner.invoke(
        app, ["calibrate", "--prior", str(run), "--data", str(hot_file), "--out", str(root / "x")]
    )
    assert result.exit_code != 0
    assert (
        "NEW-S000" in result.output
        and "outside the prior fleet's calibrated range" in result.output
    )
    no_t = frame.drop(columns=["temperature_c"])
    no_t_file = root / "no_t.csv"
    no_t.to_csv(no_t_file, index=False)
    result = runner.invoke(
        app, ["calibrate", "--prior", str(run), "--data", str(no_t_file), "--out", str(root / "y")]
    )
    assert result.exit_code != 0 and "temperature_c" in result.output
    assert not (root / "x").exists() and not (root / "y").exists()


def test_a_prior_file_that_is_not_one_is_refused(tmp_path):
    bogus = tmp_path / "prior.json"
    bogus.write_text(json.dumps({"kind": "other"}))
    with pytest.raises(ValueError, match="not a fedprior fleet prior"):
        calibration.load_prior(bogus)
    with pytest.raises(FileNotFoundError, match="no fleet prior"):
        calibration.find_prior(tmp_path)


def test_test_rows_beyond_the_fleet_range_are_flagged_not_refused(trained):
    """Issue 26: a unit's held-out rows may leave the prior's range (the future drifts);
    they are scored with the extrapolation guard and counted, the unit is calibrated."""
    root, run, _, frame = trained
    test = frame["split"] == "test"
    drifted = frame.copy()
    drifted.loc[test, "frequency_hz"] = drifted.loc[test, "frequency_hz"] * 1.2
    drifted_file = root / "drifted.csv"
    drifted.to_csv(drifted_file, index=False)
    out = root / "drifted"
    result = runner.invoke(
        app, ["calibrate", "--prior", str(run), "--data", str(drifted_file), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    per_sensor = pd.read_csv(out / "per_sensor.csv")
    assert (per_sensor["test_beyond_support"] == 1.0).all()  # every test row is beyond
    assert np.isfinite(per_sensor["test_rmse"]).all()


def test_calibrate_states_the_federation_s_sigma_for_the_same_unit(trained):
    """The fleet's own 3x2 units calibrated again from prior.json: the same predictive σ
    (the discrepancy term included) and coverage as in the federation's run."""
    root, run, _, _ = trained
    fleet = pd.read_csv(root / "fleet.csv")
    own = fleet[fleet["sensor_id"].isin(["S012", "S013", "S014", "S015"])]
    cols = ["sensor_id", "frequency_hz", "temperature_c", "pressure_hpa", "split"]
    own_file = root / "own_units.csv"
    own[cols].to_csv(own_file, index=False)
    out = root / "own"
    args = ["calibrate", "--prior", str(run), "--data", str(own_file), "--out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    again = pd.read_csv(out / "per_sensor.csv").set_index("sensor_id")
    fed = pd.read_csv(run / "runs" / "fedprior_tp0_seed0" / "per_sensor.csv")
    fed = fed.set_index("client").loc[again.index]
    doc = json.loads((run / "runs" / "fedprior_tp0_seed0" / "prior.json").read_text())
    assert doc["interval"]["discrepancy_var"] > 0 and doc["interval"]["probe_rows"] == 6
    # the run evaluates in float32 (the engine's dtype), calibrate in float64
    np.testing.assert_allclose(again["test_pred_sd"], fed["test_pred_sd"], rtol=1e-6)
    np.testing.assert_allclose(again["test_coverage95"], fed["test_coverage95"], atol=1 / 60)
