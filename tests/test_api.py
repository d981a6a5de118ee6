"""The Python API (fedcal.api): the same numbers as the command line, on the same data."""

from __future__ import annotations

import doctest

import numpy as np
import pandas as pd
import pytest
from numpy.polynomial import legendre
from typer.testing import CliRunner

from fedcal import FleetPrior, api
from fedcal.cli import app
from fedcal.data.simulator import FleetSpec, simulate_fleet

runner = CliRunner(env={"COLUMNS": "200"})
COLS = ["sensor_id", "frequency_hz", "temperature_c", "pressure_hpa", "split"]
CONFIG = "[engine]\nrounds = 15\neval_every = 15\n"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A mixed fleet: 8 fully calibrated units + 3 of a 3x2 design in the prior, 3 new 3x2 units."""
    root = tmp_path_factory.mktemp("api")
    spec = FleetSpec(num_reference=8, num_new=6, train_design="3x2", test_design="random")
    frame = simulate_fleet(spec, seed=4).frame
    # the prior's fleet: 8 calibrated units + 3 units of the new units' 3x2 design (the
    # fleet learns that design's model error, so new units get an interval)
    reference = frame[frame.sensor_id <= "S010"][COLS].reset_index(drop=True)
    new = frame[frame.sensor_id > "S010"]
    new_train = new[new.split == "train"][COLS].reset_index(drop=True)
    readings = new[new.split == "test"][COLS[:3]].reset_index(drop=True)
    truth = new[new.split == "test"]["pressure_hpa"].to_numpy()
    (root / "config.toml").write_text(CONFIG)
    reference.to_csv(root / "reference.csv", index=False)
    new_train.to_csv(root / "new.csv", index=False)
    readings.to_csv(root / "readings.csv", index=False)
    return root, reference, new_train, readings, truth


@pytest.fixture(scope="module")
def cli_run(fleet):
    root = fleet[0]
    run, cal = root / "cli_run", root / "cli_cal"
    args = ["run", "--data", str(root / "reference.csv"), "--methods", "fedprior", "--seeds", "1"]
    result = runner.invoke(app, [*args, "--config", str(root / "config.toml"), "--out", str(run)])
    assert result.exit_code == 0, result.output
    args = ["calibrate", "--prior", str(run), "--data", str(root / "new.csv"), "--out", str(cal)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    pred = root / "cli_pred.csv"
    result = runner.invoke(  # no --method: the calibrate output has one
        app, ["predict", str(cal), "--data", str(root / "readings.csv"), "--out", str(pred)]
    )
    assert result.exit_code == 0, result.output
    return run, cal, pd.read_csv(pred)


@pytest.fixture(scope="module")
def fitted(fleet):
    root, reference, new_train, _, _ = fleet
    prior = FleetPrior(config=root / "config.toml").fit(reference)
    return prior, prior.calibrate(new_train)


def test_fit_calibrate_predict_equals_the_command_line(fleet, cli_run, fitted):
    _, _, _, readings, truth = fleet
    run, cal, cli_pred = cli_run
    prior, units = fitted
    mean, std = units.predict(readings, return_std=True)
    assert np.array_equal(mean, cli_pred["pressure_hpa_calibrated"].to_numpy())
    assert np.isfinite(std).all()  # an interval is stated for every new unit
    assert np.array_equal(std, cli_pred["pressure_hpa_std"].to_numpy())
    assert np.array_equal(units.predict(readings), mean)  # return_std=False: the mean alone
    # the prior itself, and the coefficients table, are the CLI's
    cli_prior = FleetPrior.load(run)
    assert cli_prior.model_ == prior.model_
    pd.testing.assert_frame_equal(units.coefficients, pd.read_csv(cal / "coefficients.csv"))
    # 6 points per new unit: the prior's calibration is sub-hPa off the grid
    assert float(np.sqrt(np.mean((mean - truth) ** 2))) < 0.5
    assert (std > 0).all()


def test_save_writes_the_run_folder_the_cli_writes_and_load_reads_it(
    fleet, cli_run, fitted, tmp_path
):
    run, _, _ = cli_run
    prior, _ = fitted
    saved = prior.save(tmp_path / "saved")
    files = sorted(p.relative_to(saved).as_posix() for p in saved.rglob("*") if p.is_file())
    cli_files = sorted(p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file())
    assert files == cli_files
    # same data, same configuration: the numbers (not the wall times) are identical
    for name in ("runs/fedprior_tp0_seed0/prior.json", "runs/fedprior_tp0_seed0/per_sensor.csv"):
        assert (saved / name).read_bytes() == (run / name).read_bytes()
    # the saved folder is a run directory the CLI calibrates against
    out = tmp_path / "cal"
    args = [
        "calibrate",
        "--prior",
        str(saved),
        "--data",
        str(fleet[0] / "new.csv"),
        "--out",
        str(out),
    ]
    assert runner.invoke(app, args).exit_code == 0
    assert FleetPrior.load(saved).model_ == prior.model_
    # a loaded prior saves the run folder it was loaded from, byte for byte
    copy = FleetPrior.load(run).save(tmp_path / "copy")
    for name in cli_files:
        assert (copy / name).read_bytes() == (run / name).read_bytes()


def test_coefficients_reproduce_the_predictions(fleet, fitted):
    """y = Σ c_k Π_j √(2a+1) P_a(z_j), z = (x − offset)/scale, evaluated by numpy alone."""
    _, _, _, readings, _ = fleet
    _, units = fitted
    coef = units.coefficients.set_index("sensor_id")
    scaling = units.input_scaling
    features = list(scaling.index)
    z = (readings[features].to_numpy(float) - scaling["offset"].to_numpy()) / scaling[
        "scale"
    ].to_numpy()
    terms = units.prior.basis.terms
    assert list(coef.columns[2:]) == list(units.prior.basis.term_names)

    def p(order: int, values: np.ndarray) -> np.ndarray:
        return np.sqrt(2 * order + 1) * legendre.legval(values, [0] * order + [1])

    phi = np.stack([np.prod([p(a, z[:, j]) for j, a in enumerate(t)], axis=0) for t in terms], 1)
    c = coef.loc[readings["sensor_id"], coef.columns[2:]].to_numpy(float)
    expected = (phi * c).sum(1)
    np.testing.assert_allclose(units.predict(readings), expected, rtol=0, atol=1e-9)


def test_custom_sensor_column_end_to_end(fleet, tmp_path):
    """Own column names from fit to predict, by the API and by the CLI (no 'sensor_id')."""
    root, reference, new_train, readings, _ = fleet
    rename = {"sensor_id": "unit", "frequency_hz": "f_hz", "temperature_c": "t_c"}
    kw = dict(features=("f_hz", "t_c"), sensor_column="unit", config=root / "config.toml")
    prior = FleetPrior(**kw).fit(reference.rename(columns=rename))
    units = prior.calibrate(new_train.rename(columns=rename))
    mean = units.predict(readings.rename(columns=rename))
    assert units.coefficients["sensor_id"].tolist() == sorted(set(new_train["sensor_id"]))

    ref_file = tmp_path / "reference.csv"
    reference.rename(columns=rename).to_csv(ref_file, index=False)
    args = ["run", "--data", str(ref_file), "--features", "f_hz,t_c", "--sensor-column", "unit"]
    args += ["--methods", "fedprior", "--seeds", "1", "--config", str(root / "config.toml")]
    result = runner.invoke(app, [*args, "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert FleetPrior.load(tmp_path / "run").model_ == prior.model_  # the CLI's own prior
    new_file, read_file = tmp_path / "new.csv", tmp_path / "readings.csv"
    new_train.rename(columns=rename).to_csv(new_file, index=False)
    readings.rename(columns=rename).to_csv(read_file, index=False)
    cal, pred = tmp_path / "cal", tmp_path / "pred.csv"
    args = [
        "calibrate",
        "--prior",
        str(tmp_path / "run"),
        "--data",
        str(new_file),
        "--out",
        str(cal),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["predict", str(cal), "--data", str(read_file), "--out", str(pred)])
    assert result.exit_code == 0, result.output
    written = pd.read_csv(pred)
    assert "unit" in written.columns and "sensor_id" not in written.columns
    assert np.array_equal(written["pressure_hpa_calibrated"].to_numpy(), mean)


def test_exports_are_the_cli_s(fleet, cli_run, fitted, tmp_path):
    """to_c_header / to_onnx call the exporters `fedcal export` calls: same bytes (or error)."""
    _, cal, _ = cli_run
    _, units = fitted
    header = tmp_path / "api.h"
    try:
        units.to_c_header(header)
        api_outcome = header.read_text()
    except ValueError as err:
        api_outcome = f"error: {err}"
    cli_header = tmp_path / "cli.h"
    result = runner.invoke(app, ["export", str(cal), "--format", "c", "--out", str(cli_header)])
    cli_outcome = cli_header.read_text() if result.exit_code == 0 else None
    if cli_outcome is None:
        assert api_outcome.startswith("error: ") and api_outcome[7:] in " ".join(
            result.output.split()
        )
    else:
        assert api_outcome == cli_outcome
    written = units.to_onnx(tmp_path / "onnx")
    result = runner.invoke(
        app, ["export", str(cal), "--format", "onnx", "--out", str(tmp_path / "o2")]
    )
    assert result.exit_code == 0, result.output
    assert [p.name for p in written] == sorted(p.name for p in (tmp_path / "o2").iterdir())
    for p in written:
        assert p.read_bytes() == (tmp_path / "o2" / p.name).read_bytes()


def test_unfitted_prior_is_refused():
    with pytest.raises(api.NotFittedError, match="not fitted"):
        FleetPrior().calibrate(pd.DataFrame())


def test_docstring_examples_run():
    result = doctest.testmod(api, raise_on_error=False, verbose=False)
    assert result.attempted >= 5 and result.failed == 0


def test_export_and_predict_take_the_only_method_or_refuse_listing_them(fleet, cli_run, tmp_path):
    root = fleet[0]
    _, cal, _ = cli_run
    json_out = tmp_path / "only.json"
    result = runner.invoke(app, ["export", str(cal), "--format", "json", "--out", str(json_out)])
    assert result.exit_code == 0, result.output  # the calibrate output's only method: fedprior
    two = tmp_path / "two"
    args = ["run", "--data", str(root / "reference.csv"), "--methods", "polynomial,fedprior"]
    result = runner.invoke(app, [*args, "--seeds", "1", "--rounds", "3", "--out", str(two)])
    assert result.exit_code == 0, result.output
    for command in (
        ["export", str(two), "--format", "json"],
        ["predict", str(two), "--data", str(root / "readings.csv"), "--out", str(tmp_path / "p")],
    ):
        result = runner.invoke(app, command)
        assert result.exit_code == 2
        message = " ".join(result.output.split())
        assert "has 2 methods; choose one with --method: polynomial, fedprior" in message
    result = runner.invoke(app, ["export", str(two), "--method", "polynomial", "--format", "json"])
    assert result.exit_code == 0, result.output


def test_unit_guards_work_on_the_user_s_own_column_names(fleet):
    """t_c in kelvin, f_hz in kHz: refused with the unit guess, as for the standard names."""
    _, reference, _, _, _ = fleet
    rename = {"sensor_id": "unit", "frequency_hz": "f_hz", "temperature_c": "t_c"}
    own = reference.rename(columns=rename)
    prior = FleetPrior(features=("f_hz", "t_c"), sensor_column="unit")
    with pytest.raises(ValueError, match="kelvin"):
        prior.fit(own.assign(t_c=own["t_c"] + 273.15))
    with pytest.raises(ValueError, match="kHz"):
        prior.fit(own.assign(f_hz=own["f_hz"] / 1000.0))


def test_plan_equals_the_command_line(cli_run, fitted, tmp_path):
    """FleetPrior.plan is `fedcal plan --plateaus K --points N`: the same design.csv."""
    run = cli_run[0]
    prior, _ = fitted
    plan = prior.plan(2, 4)
    out = tmp_path / "design.csv"
    args = ["plan", "--prior", str(run), "--plateaus", "2", "--points", "4", "--out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    pd.testing.assert_frame_equal(plan.design.frame(), pd.read_csv(out), check_dtype=False)
    assert list(pd.read_csv(out).columns) == ["pressure_hpa", "temperature_c", "direction"]
    assert plan.design.plateaus == 2 and plan.design.size == 4
    assert plan.expected.rms <= plan.start_expected.rms  # never worse than the standard grid
