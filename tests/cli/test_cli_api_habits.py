"""API and CLI habits (issue 37.5) and the CLI's light start (37.1).

CalibratedUnits.load gives back the saved units; predict's in_range is the command line's;
a wrong input type is one line; --version, run's defaults, choices and "did you mean".
"""

from __future__ import annotations

import subprocess
import sys
import typing

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from fedcal import CalibratedUnits, FleetPrior, __version__, cli
from fedcal.cli import app
from fedcal.data.simulator import FleetSpec, simulate_fleet

runner = CliRunner(env={"COLUMNS": "200"})
COLS = ["sensor_id", "frequency_hz", "temperature_c", "pressure_hpa", "split"]


@pytest.fixture(scope="module")
def units(tmp_path_factory):
    """6 calibrated + 2 units of a 3x2 design in the prior; 2 new 3x2 units, saved."""
    root = tmp_path_factory.mktemp("habits")
    spec = FleetSpec(num_reference=6, num_new=4, train_design="3x2", test_design="random")
    frame = simulate_fleet(spec, seed=3).frame[COLS]
    new = frame[frame.sensor_id > "S007"]
    calibrated = FleetPrior(rounds=10).fit(frame[frame.sensor_id <= "S007"]).calibrate(new)
    calibrated.save(root / "cal")
    readings = new[new.split == "test"].reset_index(drop=True)
    beyond = readings.iloc[:2].assign(temperature_c=[-60.0, 85.0])  # beyond the span + 5 %
    readings = pd.concat([readings, beyond], ignore_index=True)
    readings[COLS[:3]].to_csv(root / "readings.csv", index=False)
    return root, calibrated, readings


def test_load_gives_back_the_saved_units(units):
    root, calibrated, readings = units
    loaded = CalibratedUnits.load(root / "cal")
    mean, std = calibrated.predict(readings, return_std=True)
    mean2, std2 = loaded.predict(readings, return_std=True)
    assert np.array_equal(mean, mean2) and np.array_equal(std, std2)  # bit for bit
    assert loaded.coefficients.equals(calibrated.coefficients)
    assert loaded.valid_range == calibrated.valid_range
    assert loaded.sensor_ids == calibrated.sensor_ids
    with pytest.raises(FileNotFoundError, match="not a `fedcal calibrate` output"):
        CalibratedUnits.load(root)


def test_in_range_is_the_command_line_s(units, tmp_path):
    root, calibrated, readings = units
    mean, _, inside = calibrated.predict(readings, return_std=True, return_range=True)
    only_mean, inside2 = calibrated.predict(readings, return_range=True)
    assert np.array_equal(only_mean, mean) and np.array_equal(inside, inside2)
    assert inside.dtype == bool and not inside[-2:].any() and inside[:-2].all()
    out = tmp_path / "pred.csv"
    args = ["predict", str(root / "cal"), "--data", str(root / "readings.csv"), "--out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert np.array_equal(pd.read_csv(out)["in_range"].to_numpy(), inside)
    assert isinstance(calibrated.predict(readings), np.ndarray)  # no flag: the mean alone
    everything = calibrated.predict(
        readings, return_std=True, return_interval=True, return_range=True
    )
    _, half = calibrated.predict(readings, return_interval=True)
    assert np.array_equal(everything[2], half) and np.array_equal(everything[3], inside)


@pytest.mark.parametrize("bad", [np.zeros((3, 3)), [1.0, 2.0], 3.0])
def test_a_wrong_input_type_is_one_line_naming_what_is_expected(units, bad):
    _, calibrated, _ = units
    with pytest.raises(TypeError) as err:
        calibrated.predict(bad)
    text = str(err.value)
    assert "\n" not in text and text.startswith("CalibratedUnits.predict(X): expected a pandas")
    assert type(bad).__name__ in text
    if isinstance(bad, np.ndarray):
        assert "pd.DataFrame(X, columns=" in text
    with pytest.raises(TypeError, match=r"^FleetPrior.calibrate\(X\): expected a pandas"):
        FleetPrior().calibrate(bad)
    with pytest.raises(TypeError, match=r"^FleetPrior.fit\(X\): expected a pandas"):
        FleetPrior().fit(bad)
    for load in (FleetPrior.load, CalibratedUnits.load):  # a folder, not data
        with pytest.raises(TypeError, match=r"\.load\(run_dir\): expected a folder or file"):
            load(pd.DataFrame({"a": [1]}))


def test_importing_the_cli_imports_no_heavy_module():
    code = (
        "import sys, fedcal.cli; "
        "print(sorted(m for m in ('torch', 'pandas', 'scipy', 'flwr', 'matplotlib', 'numpy') "
        "if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_version_and_run_s_defaults_in_help():
    from fedcal.config import load_config

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"fedcal {__version__}"
    shipped = load_config(None)
    text = " ".join(runner.invoke(app, ["run", "--help"]).output.split())
    for option, value in (
        ("--seeds", shipped.seeds),
        ("--rounds", shipped.engine.rounds),
        ("--aggregation", shipped.aggregation.rule),
        ("--split-by", shipped.data.split_by),
        ("--target", shipped.data.target),
    ):
        assert f"(default: {value}, or --config's)" in text, option
    assert f"(default: {','.join(shipped.methods)}, or --config's)" in text


def test_fixed_choices_are_the_schema_s():
    from fedcal.config import DataConfig
    from fedcal.core.aggregation import Rule
    from fedcal.data.simulator import FleetSpec

    def literal(cls, name):
        return typing.get_args(typing.get_type_hints(cls)[name])

    assert typing.get_args(Rule) == cli.AGGREGATION_RULES
    assert literal(DataConfig, "split_by") == cli.SPLIT_BY
    for name, choices in cli.SIMULATOR_CHOICES.items():
        assert literal(FleetSpec, name) == choices, name
    result = runner.invoke(app, ["run", "--aggregation", "avg"])
    assert result.exit_code == 2 and "'avg' is not one of 'mean', 'median'" in result.output


def test_did_you_mean_for_a_method_and_for_a_command(units, tmp_path):
    result = runner.invoke(app, ["run", "--methods", "fedprio", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert "unknown method(s) fedprio (did you mean fedprior" in " ".join(result.output.split())
    root = units[0]
    args = ["export", str(root / "cal"), "--method", "fedprio", "--format", "json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "(did you mean fedprior?)" in result.output
    result = runner.invoke(app, ["calibrat"])
    assert result.exit_code == 2 and result.output.count("Did you mean 'calibrate'?") == 1
