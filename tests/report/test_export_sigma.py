"""Exports claim a σ only where the model states one (issue 33, part 3).

New units calibrated against a prior whose fleet learned the model error of 6-point
units (12 fully calibrated + 4 units of the 3x2 design): two new units at 6 points get
a stated σ, one at 4 points is declined (fewer points than the fleet's smallest design:
σ NaN). Before, the C header said "with σ" for all three and carried NaN; the JSON gave
the declined unit a factor and a NaN var_add; its ONNX file had a σ output of NaN.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess

import numpy as np
import pytest
from typer.testing import CliRunner

from fedcal.cli import app
from fedcal.data.simulator import FleetSpec, simulate_fleet
from fedcal.report.export import load_models

runner = CliRunner(env={"COLUMNS": "200"})


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    root = tmp_path_factory.mktemp("sigma_export")
    fleet_file = root / "fleet.csv"
    spec = FleetSpec(num_reference=12, num_new=4, train_design="3x2")
    simulate_fleet(spec, seed=3).frame.to_csv(fleet_file, index=False)
    cfg = root / "prior.toml"
    cfg.write_text("[engine]\nrounds = 30\neval_every = 30\n")
    run = root / "run"
    args = ["run", "--data", str(fleet_file), "--methods", "fedprior", "--seeds", "1"]
    result = runner.invoke(app, [*args, "--config", str(cfg), "--out", str(run)])
    assert result.exit_code == 0, result.output
    new = simulate_fleet(FleetSpec(num_sensors=3, train_design="3x2"), 9).frame
    new = new[new["split"] == "train"].assign(sensor_id="NEW-" + new["sensor_id"])
    short = new.index[new["sensor_id"] == "NEW-S002"][:2]
    new = new.drop(short)  # NEW-S002: 4 points, below the fleet's smallest design (6)
    new_file = root / "new.csv"
    new.to_csv(new_file, index=False)
    out = root / "new"
    result = runner.invoke(
        app, ["calibrate", "--prior", str(run), "--data", str(new_file), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    return root, out


def test_the_declined_unit_is_known_to_have_no_sigma(calibrated):
    _, out = calibrated
    fleet = load_models(out, "fedprior")
    assert fleet.without_sigma() == ["NEW-S002"]
    x = np.array([[34000.0, 10.0]])
    assert np.isnan(fleet.predict_with_std("NEW-S002", x)[1]).all()
    assert np.isfinite(fleet.predict_with_std("NEW-S000", x)[1]).all()


def test_c_header_flags_sigma_per_unit_and_carries_no_nan(calibrated, tmp_path):
    _, out = calibrated
    header = tmp_path / "cal.h"
    result = runner.invoke(app, ["export", str(out), "--method", "fedprior", "--out", str(header)])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())  # the console wraps at its width (80 under xdist)
    assert "with σ for 2 of 3 units" in said
    assert "no σ stated for 1 of 3 sensor(s) (NEW-S002" in said
    text = header.read_text()
    assert "static const unsigned char fedcal_has_std[FEDCAL_NUM_SENSORS] = {1, 1, 0};" in text
    assert "No σ stated for 1 of 3 units: NEW-S002." in text
    assert "NAN" not in text.split("fedcal_var_add")[1].split(";")[0]  # no NaN constants
    assert "if (!fedcal_has_std[sensor]) return NAN;" in text


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler on this machine")
def test_c_sigma_is_the_model_s_for_stated_units_and_nan_for_the_declined(calibrated, tmp_path):
    _, out = calibrated
    header = tmp_path / "cal.h"
    runner.invoke(app, ["export", str(out), "--method", "fedprior", "--out", str(header)])
    main = tmp_path / "main.c"
    main.write_text(
        '#include <stdio.h>\n#include "cal.h"\n'
        "int main(void) {\n"
        "  float x[2] = {34000.0f, 10.0f};\n"
        "  for (int s = 0; s < FEDCAL_NUM_SENSORS; ++s)\n"
        '    printf("%d %.9g\\n", fedcal_has_std[s], fedcal_calibrate_std(s, x));\n'
        "  return 0;\n}\n"
    )
    exe = tmp_path / "cal"
    cc = ["gcc", "-std=c99", "-O2", "-Wall", "-Werror", str(main), "-o", str(exe), "-lm"]
    subprocess.run(cc, check=True)
    lines = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()
    flags, sigma = [int(v) for v in lines[0::2]], [float(v) for v in lines[1::2]]
    fleet = load_models(out, "fedprior")
    want = [float(fleet.predict_with_std(s, np.array([[34000.0, 10.0]]))[1][0, 0]) for s in
            sorted(fleet.params)]  # fmt: skip
    assert flags == [1, 1, 0] and math.isnan(sigma[2])
    np.testing.assert_allclose(sigma[:2], want[:2], rtol=1e-3)  # float σ arithmetic


def test_json_gives_the_declined_unit_has_sigma_false_and_no_factor(calibrated, tmp_path):
    _, out = calibrated
    path = tmp_path / "cal.json"
    args = ["export", str(out), "--method", "fedprior", "--format", "json", "--out", str(path)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    units = json.loads(path.read_text())["model"]["units"]
    assert [units[s]["has_sigma"] for s in sorted(units)] == [True, True, False]
    assert "cov_factor" not in units["NEW-S002"] and "var_add" not in units["NEW-S002"]
    assert all(math.isfinite(units[s]["var_add"]) for s in ("NEW-S000", "NEW-S001"))


def test_onnx_has_no_sigma_output_for_the_declined_unit(calibrated, tmp_path):
    onnx = pytest.importorskip("onnx")
    _, out = calibrated
    args = ["export", str(out), "--method", "fedprior", "--format", "onnx", "--out", str(tmp_path)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    for sid, stated in (("NEW-S000", True), ("NEW-S002", False)):
        model = onnx.load(str(tmp_path / f"{sid}.onnx"))
        outputs = [o.name for o in model.graph.output]
        meta = {p.key: p.value for p in model.metadata_props}
        assert ("pressure_hpa_std" in outputs) == stated
        assert meta["has_sigma"] == ("true" if stated else "false")
        assert ("sigma_note" in meta) == (not stated)
