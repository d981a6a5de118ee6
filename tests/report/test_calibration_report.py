"""The report of a `fedcal calibrate` output: one calibration report per new unit.

A fedprior run on fully calibrated units, then three new units with a 3x2 design,
one of them planted unlike the fleet (a temperature-dependent gain error of up
to 10 hPa at full scale, which no unit of the fleet has): the planted unit is
flagged, the typical ones are not, and every number of the report is checked
against an independent computation.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest
import torch
from scipy.stats import f as f_dist
from typer.testing import CliRunner

from fedcal import calibration
from fedcal.cli import app
from fedcal.data.simulator import FleetSpec, simulate_fleet
from fedcal.report.export import load_models
from fedcal.report.html import build_report
from fedcal.report.rundir import predictive_std

runner = CliRunner(env={"COLUMNS": "200"})
PLANTED = "NEW-S002"


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    root = tmp_path_factory.mktemp("calreport")
    data = root / "fleet.csv"
    # + 4 units of the new units' 3x2 design: the fleet learns that design's model error,
    # so the new units get an interval (fedprior "Intervals"; without them it is declined)
    spec = FleetSpec(num_reference=10, num_new=4, train_design="3x2")
    simulate_fleet(spec, seed=2).frame.to_csv(data, index=False)
    cfg = root / "c.toml"
    cfg.write_text("[engine]\nrounds = 20\neval_every = 20\n")
    run = root / "run"
    args = ["run", "--data", str(data), "--methods", "fedprior", "--seeds", "1", "--quiet"]
    result = runner.invoke(app, [*args, "--config", str(cfg), "--out", str(run)])
    assert result.exit_code == 0, result.output
    new = simulate_fleet(FleetSpec(num_sensors=3, train_design="3x2", test_design="random"), 9)
    frame = new.frame.assign(sensor_id="NEW-" + new.frame["sensor_id"])
    planted = frame["sensor_id"] == PLANTED
    t = (frame.loc[planted, "temperature_c"] - 10.0) / 50.0
    frame.loc[planted, "pressure_hpa"] += 10.0 * t * frame.loc[planted, "pressure_hpa"] / 800.0
    new_file = root / "new.csv"
    frame[["sensor_id", "frequency_hz", "temperature_c", "pressure_hpa", "split"]].to_csv(
        new_file, index=False
    )
    out = root / "cal"
    args = ["calibrate", "--prior", str(run), "--data", str(new_file), "--out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return run, out, result.output


def test_the_planted_unit_is_flagged_and_the_typical_ones_are_not(calibrated):
    _, out, output = calibrated
    units = pd.read_csv(out / "units.csv").set_index("sensor_id")
    assert units.loc[PLANTED, "status"] == "unlike the fleet"
    assert bool(units.loc[PLANTED, "unlike_fleet"])
    typical = units.drop(PLANTED)
    assert (typical["status"] == "ok").all() and not typical["unlike_fleet"].any()
    # 6 points, full row rank: dof 6; Σ from the fleet's N = 14 units: Hotelling's
    # prediction threshold 6·13·15/(14·8)·F⁻¹(0.999; 6, 8), by hand with scipy's F
    assert (units["dof"] == 6).all()
    threshold = 6 * 13 * 15 / (14 * 8) * f_dist.ppf(0.999, 6, 8)
    assert np.allclose(units["d2_threshold"], threshold)
    assert units.loc[PLANTED, "d2"] > threshold > typical["d2"].max()
    p = f_dist.sf(units["d2"] / (6 * 13 * 15 / (14 * 8)), 6, 8)
    assert np.allclose(units["p_value"], p)
    assert f"QA finding: {PLANTED}: unlike the fleet" in output
    assert "QA finding: NEW-S000" not in output and "QA finding: NEW-S001" not in output


def test_fleet_distance_is_the_coefficient_mahalanobis_distance(calibrated):
    """d² = (m − μ)ᵀ(Σ − V)⁺(m − μ), by hand in coefficient space (pseudo-inverse)."""
    run, out, _ = calibrated
    doc = calibration.load_prior(calibration.find_prior(run))
    units = pd.read_csv(out / "units.csv").set_index("sensor_id")
    fleet = load_models(out, "fedprior", algorithm=True)  # FedPrior evaluates (torch)
    mu, sigma = np.array(doc.mean), np.array(doc.covariance)
    for sid in fleet.params:
        m = fleet.params[sid]["coef"].double().numpy()
        v = fleet.params[sid]["cov"].double().numpy()
        # in the prior's whitened coordinates (Σ = R Rᵀ), where Σ − V becomes
        # K = I − R⁻¹VR⁻ᵀ with eigenvalues in [0, 1): 1 − posterior/prior variance
        r = np.linalg.cholesky(sigma)
        k = np.eye(len(mu)) - np.linalg.solve(r, np.linalg.solve(r, v).T)
        vals, vecs = np.linalg.eigh(0.5 * (k + k.T))
        keep = vals > 1e-6
        assert keep.sum() == 6  # the six points determine six directions
        w = vecs[:, keep].T @ np.linalg.solve(r, m - mu)
        d2 = float(np.sum(w**2 / vals[keep]))
        assert d2 == pytest.approx(units.loc[sid, "d2"], rel=1e-4)


def test_sigma_and_residuals_are_what_the_exported_models_compute(calibrated):
    run, out, _ = calibrated
    doc = calibration.load_prior(calibration.find_prior(run))
    fleet = load_models(out, "fedprior", algorithm=True)  # FedPrior evaluates (torch)
    units = pd.read_csv(out / "units.csv").set_index("sensor_id")
    points = pd.read_csv(out / "calibration_points.csv")
    lo_f, hi_f = doc.input_range["frequency_hz"]
    lo_t, hi_t = doc.input_range["temperature_c"]
    side = round(calibration.GRID_POINTS**0.5)
    f, t = np.meshgrid(np.linspace(lo_f, hi_f, side), np.linspace(lo_t, hi_t, side))
    grid = np.stack([f.ravel(), t.ravel()], 1)
    for sid, rows in points.groupby("sensor_id"):
        assert len(rows) == 6
        x = rows[["frequency_hz", "temperature_c"]].to_numpy()
        want = fleet.predict(sid, x)[:, 0]
        assert np.allclose(rows["calibrated"], want, rtol=0, atol=1e-9)
        assert np.allclose(rows["residual"], want - rows["pressure_hpa"], rtol=0, atol=1e-9)
        assert np.allclose(rows["sigma"], predictive_std(fleet, sid, x), rtol=1e-9)
        res = rows["residual"].to_numpy()
        assert units.loc[sid, "resid_rms"] == pytest.approx(np.sqrt(np.mean(res**2)))
        sd = predictive_std(fleet, sid, grid)
        assert units.loc[sid, "sigma_mean"] == pytest.approx(sd.mean(), rel=1e-9)
        assert units.loc[sid, "sigma_max"] == pytest.approx(sd.max(), rel=1e-9)
    # the planted unit's calibration points fit worse than the typical units'
    assert units.loc[PLANTED, "resid_rms"] > units.drop(PLANTED)["resid_rms"].max()


def test_the_html_report_of_a_calibrate_run_has_every_section(calibrated, tmp_path):
    _, out, _ = calibrated
    report = build_report(out, tmp_path / "cal.html")
    assert report.figures == ["fleet-distance", "sigma", "residuals", "prior"]
    text = (tmp_path / "cal.html").read_text()
    for section in ("units", "fleet-distance", "coefficients", "sigma", "residuals", "config"):
        assert f'<section id="{section}">' in text
    assert len(re.findall(r'src="data:image/png;base64,', text)) == 4
    assert "is not in this run" not in text
    assert "calibration points per unit: 6" in text and "1 QA finding(s)" in text
    findings = re.search(r"<b>QA findings:</b>(.*?)</p>", text).group(1)
    assert PLANTED in findings and "NEW-S000" not in findings and "NEW-S001" not in findings
    # the coefficients table: the run's coefficients.csv, with the basis stated
    coef = pd.read_csv(out / "coefficients.csv")
    section = text[text.index('<section id="coefficients">') :]
    section = section[: section.index("</section>")]
    assert "x0 = (frequency_hz − 33000) / 5000" in section and "√(2n+1)" in section
    values = [float(v) for v in re.findall(r'data-column="1" data-value="([^"]+)"', section)]
    assert np.allclose(values, coef["1"].to_numpy(), rtol=1e-12)
    # the units table carries units.csv's numbers
    units = pd.read_csv(out / "units.csv")
    shown = [float(v) for v in re.findall(r'data-column="d2" data-value="([^"]+)"', text)]
    assert np.allclose(shown, units["d2"].to_numpy(), rtol=1e-12)
    assert json.loads((out / "config.json").read_text())  # the config section's source
    torch.set_num_threads(1)


def test_fedcal_report_of_a_calibrate_run_prints_its_units(calibrated):
    _, out, _ = calibrated
    result = runner.invoke(app, ["report", str(out)])
    assert result.exit_code == 0, result.output
    assert "calibration points per unit: 6" in result.output
    assert "calibration points per sensor: all" not in result.output
    assert f"QA finding: {PLANTED}: unlike the fleet" in result.output
    assert "QA finding: NEW-S000" not in result.output
