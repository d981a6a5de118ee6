"""`fedcal calibrate` with a prior that has a sweep-direction term (fedprior_branch)."""

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
from fedcal.data.loader import load_fleet
from fedcal.data.simulator import FleetSpec, simulate_fleet

runner = CliRunner(env={"COLUMNS": "200"})
COLS = ["sensor_id", "frequency_hz", "temperature_c", "pressure_hpa", "split", "direction"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """fedprior_branch on 12 units swept up and down; 3 new units, one ascending 3x2 sweep."""
    root = tmp_path_factory.mktemp("calibrate_branch")
    fleet_file = root / "fleet.csv"
    simulate_fleet(FleetSpec(num_sensors=12), seed=3).frame.to_csv(fleet_file, index=False)
    cfg = root / "prior.toml"
    cfg.write_text("[engine]\nrounds = 30\neval_every = 30\n")
    out = root / "fleet_run"
    args = ["run", "--data", str(fleet_file), "--methods", "fedprior_branch", "--seeds", "1"]
    result = runner.invoke(app, [*args, "--config", str(cfg), "--out", str(out)])
    assert result.exit_code == 0, result.output
    new = simulate_fleet(FleetSpec(num_sensors=3, train_design="3x2", test_design="random"), 9)
    frame = new.frame.assign(sensor_id="NEW-" + new.frame["sensor_id"])
    new_file = root / "new_units.csv"
    frame[COLS].to_csv(new_file, index=False)
    return root, out, new_file


def test_the_prior_carries_the_branch_terms_and_calibrate_writes_them(trained):
    root, run, new_file = trained
    doc = json.loads(calibration.find_prior(run, "fedprior_branch").read_text())
    assert doc["branch_terms"] == [[0, 0], [1, 0], [2, 0]]
    p, q = len(doc["terms"]), 3
    assert np.shape(doc["mu"]) == (p + q,) and np.shape(doc["sigma"]) == (p + q, p + q)
    out = root / "new"
    args = ["calibrate", "--prior", str(run), "--method", "fedprior_branch"]
    result = runner.invoke(app, [*args, "--data", str(new_file), "--out", str(out)])
    assert result.exit_code == 0, result.output
    coef = pd.read_csv(out / "coefficients.csv")
    assert list(coef.columns[-q:]) == ["b·1", "b·P1(frequency_hz)", "b·P2(frequency_hz)"]
    per_sensor = pd.read_csv(out / "per_sensor.csv")
    assert per_sensor["test_rmse"].max() < 0.5  # 6 points each; a per-unit fit is ~3 hPa


def test_calibration_is_the_federation_s_posterior_on_phi_and_b_psi(trained):
    """A unit calibrated alone equals personalize() on its signed rows, by hand."""
    _, run, new_file = trained
    doc = calibration.load_prior(calibration.find_prior(run, "fedprior_branch"))
    fleet = load_fleet(new_file, features=doc.features, target=doc.target)
    result = calibration.calibrate(doc, fleet)
    alg, tensors = result.algorithm, result.tensors
    assert tensors.train.branch is not None and torch.all(tensors.train.branch[:, :6] == 1)
    down = expand(alg.broadcast(result.server), tensors.num_clients)
    state = {
        "noise_var": torch.full((tensors.num_clients,), doc.noise.variance, dtype=torch.float64)
    }
    direct = alg.personalize(down, state, tensors.train)
    torch.testing.assert_close(result.personal["coef"], direct["coef"], rtol=1e-10, atol=1e-12)
    # The directions are used: the same points read as direction-less give another posterior.
    blind = fleet.frame.drop(columns=["direction"])
    other = calibration.calibrate(doc, type(fleet)(blind, fleet.features, fleet.target))
    assert not torch.allclose(other.personal["coef"], result.personal["coef"])
