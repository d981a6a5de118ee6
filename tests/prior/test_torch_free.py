"""Issue 37.1: what a calibration station runs, with torch not importable.

Each check runs in a child process whose ``sys.meta_path`` refuses ``torch`` (any import of
it, direct or through a fedcal module, raises ImportError). Covered: the command line's
``--help``/``--version`` (and that they load no torch, pandas or scipy), and the station's
numbers — a stored prior loaded and validated, new units read from a file and calibrated
(:func:`fedcal.prior.station.calibrate_fleet`: posterior, range guard, fleet
distance, status), their predictions and predictive σ — equal
to the same calls in this process, where torch is importable. CI also runs this file in a
clean environment built from the wheel (.ci/run). The commands ``calibrate``, ``predict``,
``plan``, ``export``, ``certificate``, ``report`` still import torch (docs/not-done.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from fedcal import calibration
from fedcal.cli import app
from fedcal.data.loader import load_fleet
from fedcal.data.simulator import FleetSpec, simulate_fleet
from fedcal.prior import posterior, station
from fedcal.prior.model import PriorModel

runner = CliRunner(env={"COLUMNS": "200"})
COLS = ["sensor_id", "frequency_hz", "temperature_c", "pressure_hpa", "split"]

BLOCK = """
import sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)  # as if absent
        return None

sys.meta_path.insert(0, NoTorch())
"""

STATION = """
import json, sys
import numpy as np
from fedcal.data.loader import load_fleet
from fedcal.prior import posterior, station
from fedcal.prior.model import PriorModel

prior = PriorModel.load(sys.argv[1])
fleet = load_fleet(sys.argv[2], prior.features, prior.target, test_fraction=0.0,
                   min_train_points=1, min_test_points=0)
done = station.calibrate_fleet(prior, fleet, sys.argv[2])
units = done.units
x, _, _, _ = posterior.padded_rows(prior, fleet, "test")
one = done.predict(done.ids[0], fleet.arrays("test")[0][0])
np.savez(sys.argv[3], coef=units.coef, cov=units.cov, noise=units.noise_var,
         one_mean=one[0], one_std=one[1],
         d2=done.checks["d2"], status=done.status.astype(str),
         pred=posterior.predict(units, x), std=posterior.predictive_std(units, x))
print(json.dumps(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))))
"""


def _child(code: str, *args: str, block: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-c", (BLOCK if block else "import sys\n") + code, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_the_blocker_blocks():
    res = _child("import torch")
    assert res.returncode != 0 and "No module named 'torch'" in res.stderr


@pytest.mark.parametrize("args", [["--help"], ["calibrate", "--help"], ["--version"]])
def test_help_and_version_need_no_torch_and_load_no_heavy_module(args):
    code = (
        "from fedcal.cli import app\n"
        "try:\n    app(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
        "heavy = [m for m in ('torch', 'pandas', 'scipy') if m in sys.modules]\n"
        "print('HEAVY', heavy, 'EXIT', code)\n"
    )
    res = _child(code, *args)
    assert res.returncode == 0, res.stderr
    assert "HEAVY [] EXIT 0" in res.stdout, res.stdout[-500:]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A fedprior run on 12 reference units + 4 with a 3x2 design; 3 new 3x2 units with
    held-out test rows."""
    root = tmp_path_factory.mktemp("torch_free")
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
    new_file = root / "new_units.csv"
    new.frame.assign(sensor_id="NEW-" + new.frame["sensor_id"])[COLS].to_csv(new_file, index=False)
    return calibration.find_prior(out), new_file, root


def test_the_station_calibrates_and_predicts_without_torch(trained):
    prior_file, new_file, root = trained
    res = _child(STATION, str(prior_file), str(new_file), str(root / "child.npz"))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1]) == []  # no torch module loaded
    child = np.load(root / "child.npz")
    prior = PriorModel.load(prior_file)  # the same calls here, torch importable
    fleet = load_fleet(
        new_file, prior.features, prior.target, test_fraction=0.0, min_train_points=1,
        min_test_points=0,
    )  # fmt: skip
    done = station.calibrate_fleet(prior, fleet)
    units = done.units
    x = posterior.padded_rows(prior, fleet, "test")[0]
    here = {
        "coef": units.coef, "cov": units.cov, "noise": units.noise_var,
        "d2": done.checks["d2"], "status": done.status.astype(str),
        "one_mean": done.predict(done.ids[0], fleet.arrays("test")[0][0])[0],
        "one_std": done.predict(done.ids[0], fleet.arrays("test")[0][0])[1],
        "pred": posterior.predict(units, x), "std": posterior.predictive_std(units, x),
    }  # fmt: skip
    for key, value in here.items():  # the same code on the same inputs: the same bits
        np.testing.assert_array_equal(child[key], value, err_msg=key)
    assert np.isfinite(child["std"]).any() and child["coef"].shape[0] == 3


def test_the_station_s_values_are_fedcal_predict_s_after_fedcal_calibrate(trained):
    """The torch-free values of one unit's held-out readings against the commands (torch):
    ``fedcal calibrate`` then ``fedcal predict`` — its <target>_calibrated and _std columns,
    to 1e-10 relative (fleet noise: tests/prior/test_posterior.py's derivation)."""
    prior_file, new_file, root = trained
    res = _child(STATION, str(prior_file), str(new_file), str(root / "child2.npz"))
    assert res.returncode == 0, res.stderr
    child = np.load(root / "child2.npz")
    out = root / "calibrated"
    args = ["calibrate", "--prior", str(prior_file), "--data", str(new_file), "--out", str(out)]
    assert runner.invoke(app, args).exit_code == 0
    prior = PriorModel.load(prior_file)
    frame = pd.read_csv(new_file)
    first = frame[(frame["sensor_id"] == frame["sensor_id"].iloc[0]) & (frame["split"] == "test")]
    readings = root / "readings.csv"
    first[["sensor_id", *prior.features]].to_csv(readings, index=False)
    served = root / "served.csv"
    args = ["predict", str(out), "--data", str(readings), "--out", str(served)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    table = pd.read_csv(served)
    for ours, column in (("one_mean", "_calibrated"), ("one_std", "_std")):
        theirs = table[prior.target + column].to_numpy()
        scale = np.abs(theirs).max()
        assert np.abs(child[ours] - theirs).max() <= 1e-10 * scale, column


def test_report_of_a_calibrate_output_runs_without_torch(trained):
    """``fedcal report OUT`` of a calibrate output (its units table and QA findings): the
    same output with torch blocked as without."""
    prior_file, new_file, root = trained
    out = root / "for_report"
    args = ["calibrate", "--prior", str(prior_file), "--data", str(new_file), "--out", str(out)]
    assert runner.invoke(app, args).exit_code == 0
    code = "from fedcal.cli import app\napp(sys.argv[1:])\n"
    blocked = _child(code, "report", str(out))
    normal = _child(code, "report", str(out), block=False)
    assert blocked.returncode == 0, blocked.stderr
    assert normal.returncode == 0 and blocked.stdout == normal.stdout
    assert "NEW-S000" in blocked.stdout and "QA" in blocked.stdout


def test_a_command_that_still_needs_torch_says_so_in_one_line(trained):
    prior_file, new_file, root = trained
    code = "from fedcal.cli import app\napp(sys.argv[1:])\n"
    args = ["calibrate", "--prior", str(prior_file), "--data", str(new_file)]
    res = _child(code, *args, "--out", str(root / "no_torch"))
    assert res.returncode == 3, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs torch, which is not installed: pip install" in lines[0]


def test_a_variant_the_numpy_path_does_not_cover_is_refused_in_one_line(trained):
    prior_file, new_file, _ = trained
    doc = json.loads(Path(prior_file).read_text())
    prior = PriorModel.from_dict({**doc, "noise_gamma": [0.1, 0.0]})
    fleet = load_fleet(new_file, prior.features, prior.target, test_fraction=0.0)
    with pytest.raises(ValueError, match=r"^new\.csv: noise over the inputs .* torch path"):
        station.calibrate_fleet(prior, fleet, "new.csv")
