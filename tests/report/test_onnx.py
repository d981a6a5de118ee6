"""ONNX export equals fedcal's predictions (onnxruntime); every export carries the valid range."""

import json
import shutil
import subprocess
from dataclasses import replace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from typer.testing import CliRunner

from fedcal.algorithms.polynomial import PolynomialCalibration
from fedcal.cli import app
from fedcal.data.loader import load_fleet
from fedcal.experiment import valid_ranges
from fedcal.report.export import in_range, load_models
from fedcal.report.onnx_export import to_onnx
from fedcal.report.rundir import predictive_std

runner = CliRunner(env={"COLUMNS": "200"})


def probe_inputs(ranges: dict) -> np.ndarray:
    """Raw inputs inside the sensor's range and 10 % beyond it (extrapolation must match too)."""
    lo = np.array([ranges["frequency_hz"][0], ranges["temperature_c"][0]])
    hi = np.array([ranges["frequency_hz"][1], ranges["temperature_c"][1]])
    u = np.random.default_rng(0).uniform(-0.1, 1.1, (50, 2))
    return lo + u * (hi - lo)


def as_float64(fleet):
    """The same models evaluated by fedcal in float64 (the float32 weights convert exactly)."""
    params = {s: {k: v.double() for k, v in p.items()} for s, p in fleet.params.items()}
    return replace(fleet, params=params)


def run_onnx(path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("method", ["polynomial", "fedpoly", "fedgmi"])
def test_onnx_equals_fedcal_predictions(compare_run, tmp_path, method):
    data, run, _, _ = compare_run
    out = tmp_path / "onnx"
    args = ["export", str(run), "--method", method, "--train-points", "24", "--format", "onnx"]
    result = runner.invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    fleet = load_models(run, method, 0, 24)
    guarded = fleet.algorithm.beyond_support is not None
    assert guarded == (method == "polynomial")
    assert sorted(p.name for p in out.iterdir()) == [f"{s}.onnx" for s in sorted(fleet.params)]
    expected_ranges = valid_ranges(load_fleet(data).with_train_points(24))
    exact = as_float64(fleet)
    for sensor in fleet.params:
        model = onnx.load(out / f"{sensor}.onnx")
        meta = {p.key: p.value for p in model.metadata_props}
        assert meta["sensor"] == sensor and meta["method"] == method
        assert json.loads(meta["features"]) == ["frequency_hz", "temperature_c"]
        assert json.loads(meta["valid_range"]) == expected_ranges[sensor]
        x = probe_inputs(expected_ranges[sensor])
        got = run_onnx(out / f"{sensor}.onnx", x)
        assert got.shape == (50, 1) and got.dtype == np.float64
        # every export with a valid range flags in_range; only a guarded method beyond_support
        session = ort.InferenceSession(str(out / f"{sensor}.onnx"))
        names = ["pressure_hpa", "in_range"] + (["beyond_support"] if guarded else [])
        assert [o.name for o in session.get_outputs()] == names
        flags = session.run(None, {"x": x})[1:]
        inside = in_range(x, expected_ranges[sensor], fleet.features)
        assert flags[0].tolist() == inside.tolist() and 0 < inside.sum() < len(x)
        if guarded:
            z = torch.as_tensor(fleet.scaler.x(x)).unsqueeze(0)
            params = {k: v.unsqueeze(0) for k, v in fleet.params[sensor].items()}
            assert flags[1].tolist() == fleet.algorithm.beyond_support(params, z)[0].tolist()
        want = exact.predict(sensor, x)
        assert np.max(np.abs(got - want) / np.abs(want)) <= 1e-6
        # against fedcal's own (float32) path: float32 rounding of a 1600 hPa full scale
        assert np.max(np.abs(got - fleet.predict(sensor, x))) <= 1e-6 * 1600


def test_onnx_export_of_the_physics_basis_model(tmp_path, make_fleet):
    from fedcal.data.loader import save_fleet

    data = tmp_path / "fleet.csv"
    save_fleet(make_fleet(num_clients=2), data)
    cfg = tmp_path / "basis.toml"
    cfg.write_text('[model]\nfamily = "basis"\nwhiten = true\n[engine]\nrounds = 2\n')
    run = tmp_path / "run"
    args = ["run", "--data", str(data), "--methods", "local", "--seeds", "1"]
    result = runner.invoke(app, [*args, "--config", str(cfg), "--out", str(run), "--quiet"])
    assert result.exit_code == 0, result.output
    out = tmp_path / "onnx"
    args = ["export", str(run), "--method", "local", "--format", "onnx", "--out", str(out)]
    assert runner.invoke(app, args).exit_code == 0
    fleet = as_float64(load_models(run, "local"))
    ranges = json.loads((run / "runs" / "local_tp0_seed0" / "valid_range.json").read_text())
    for sensor in fleet.params:
        x = probe_inputs(ranges[sensor])
        want = fleet.predict(sensor, x)
        got = run_onnx(out / f"{sensor}.onnx", x)
        assert np.max(np.abs(got - want) / np.abs(want)) <= 1e-6


def test_onnx_needs_a_directory(compare_run):
    _, run, _, _ = compare_run
    result = runner.invoke(app, ["export", str(run), "--method", "fedgmi", "--format", "onnx"])
    assert result.exit_code == 2 and "--out" in result.output


def test_json_export_carries_the_valid_range(compare_run):
    data, run, _, _ = compare_run
    args = ["export", str(run), "--method", "fedgmi", "--train-points", "12", "--format", "json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["valid_range"] == valid_ranges(load_fleet(data).with_train_points(12))
    s00 = doc["valid_range"]["S00"]
    assert set(s00) == {"frequency_hz", "temperature_c", "pressure_hpa"}
    assert all(lo < hi for lo, hi in s00.values())


def test_valid_ranges_are_the_calibration_points_span(make_fleet):
    fleet = make_fleet(num_clients=2, train=5, test=3)
    ranges = valid_ranges(fleet)
    train = fleet.frame[fleet.frame["split"] == "train"]
    s01 = train[train["sensor_id"] == "S01"]
    assert ranges["S01"]["pressure_hpa"] == [s01["pressure_hpa"].min(), s01["pressure_hpa"].max()]
    assert ranges["S01"]["temperature_c"] == [
        s01["temperature_c"].min(),
        s01["temperature_c"].max(),
    ]


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler on this machine")
def test_c_header_range_check(compare_run, tmp_path):
    _, run, _, _ = compare_run
    header = tmp_path / "cal.h"
    args = ["export", str(run), "--method", "fedgmi", "--train-points", "24", "--out", str(header)]
    assert runner.invoke(app, args).exit_code == 0
    ranges = json.loads((run / "runs" / "fedgmi_tp24_seed0" / "valid_range.json").read_text())
    sensors = sorted(ranges)
    probes = []
    for s in sensors:
        (f0, f1), (t0, t1) = ranges[s]["frequency_hz"], ranges[s]["temperature_c"]
        fm, tm, wf, wt = (f0 + f1) / 2, (t0 + t1) / 2, f1 - f0, t1 - t0
        # predict's in_range: the span widened by 5 % of it on each side
        probes += [(fm, tm, 1), (f1 + 0.02 * wf, tm, 1), (f1 + 0.1 * wf, tm, 0)]
        probes += [(fm, t0 - 0.1 * wt, 0)]
    main = tmp_path / "main.c"
    rows = ", ".join(f"{{{f!r}f, {t!r}f}}" for f, t, _ in probes)
    main.write_text(
        '#include <stdio.h>\n#include "cal.h"\n'
        f"int main(void) {{\n  float x[{len(probes)}][2] = {{{rows}}};\n"
        "  for (int i = 0; i < %d; ++i)\n"
        % len(probes)
        + '    printf("%d\\n", fedcal_in_range(i / 4, x[i]));\n'
        "  return 0;\n}\n"
    )
    exe = tmp_path / "cal"
    cmd = ["gcc", "-std=c99", "-Wall", "-Werror", str(main), "-o", str(exe), "-lm"]
    subprocess.run(cmd, check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()
    assert [int(v) for v in out] == [p[2] for p in probes]


class WithStd(PolynomialCalibration):
    """The polynomial with a predictive σ that varies with the input (scaled units)."""

    def predictive_std(self, params, x):
        return 0.01 + 0.02 * x[..., :1].abs()  # (clients, rows, 1)


def test_onnx_exports_predictive_std_where_the_method_has_one(compare_run):
    _, run, _, _ = compare_run
    fleet = load_models(run, "polynomial", 0, 24)
    fleet = replace(fleet, algorithm=WithStd(**fleet.algorithm.__dict__))
    ranges = json.loads((run / "runs" / "polynomial_tp24_seed0" / "valid_range.json").read_text())
    x = probe_inputs(ranges["S01"])
    session = ort.InferenceSession(to_onnx(fleet, "S01", "polynomial"))
    names = ["pressure_hpa", "pressure_hpa_std", "beyond_support"]  # no valid range given
    assert [o.name for o in session.get_outputs()] == names
    y, std, _ = session.run(None, {"x": x})
    assert np.max(np.abs(y - fleet.predict("S01", x)) / np.abs(y)) <= 1e-6
    want = predictive_std(fleet, "S01", x)
    assert want is not None and np.ptp(want) > 0
    assert np.max(np.abs(std[:, 0] - want) / want) <= 1e-6


def test_valid_ranges_of_an_older_run_are_recomputed_from_its_fleet(compare_run, tmp_path):
    from fedcal.report.rundir import read_valid_ranges

    _, run, _, _ = compare_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    written = read_valid_ranges(copy, "fedgmi", 1, 12)
    (copy / "runs" / "fedgmi_tp12_seed1" / "valid_range.json").unlink()
    assert read_valid_ranges(copy, "fedgmi", 1, 12) == written
