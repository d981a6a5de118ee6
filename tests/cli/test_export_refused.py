"""A sensor the method refused (a polynomial on one temperature level: no surface) has no
model; ``fedcal export`` writes every other sensor's, ``fedcal predict`` calibrates every
other sensor's rows and leaves its rows empty with a one-line reason (``--strict``: refused,
naming the row and the sensor). A NaN model the run did not record as refused stays an
error (a diverged or tampered file)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from fedcal.cli import app
from fedcal.data.fleet import Fleet
from fedcal.data.loader import save_fleet
from fedcal.report.export import load_models

runner = CliRunner()
REASON = "refused (the method declined to calibrate this sensor)"


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """(run directory, data file): 3 toy sensors, S02's calibration points all at 20 °C."""
    from tests.conftest import toy_fleet

    root = tmp_path_factory.mktemp("refused")
    frame = toy_fleet(num_clients=3, train=12).frame
    frame.loc[(frame.sensor_id == "S02") & (frame.split == "train"), "temperature_c"] = 20.0
    data = root / "fleet.csv"
    save_fleet(Fleet(frame), data)
    run = root / "run"
    args = ["run", "--data", str(data), "--methods", "polynomial", "--seeds", "1"]
    result = runner.invoke(app, [*args, "--out", str(run), "--quiet"])
    assert result.exit_code == 0, result.output
    status = pd.read_csv(run / "runs" / "polynomial_tp0_seed0" / "per_sensor.csv")
    assert status.set_index("client")["status"].to_dict() == {
        "S00": "ok",
        "S01": "ok",
        "S02": "refused",
    }
    return run, data


def test_export_writes_every_other_sensor_and_names_the_refused_one(planted, tmp_path):
    run, _ = planted
    for fmt, out in (("c", tmp_path / "cal.h"), ("json", tmp_path / "cal.json")):
        result = runner.invoke(app, ["export", str(run), "--format", fmt, "--out", str(out)])
        assert result.exit_code == 0, result.output
        assert "wrote 2 sensors' models" in result.output
        assert f"not exported: sensor S02 has no model in this run: {REASON}" in " ".join(
            result.output.split()
        )
    header = (tmp_path / "cal.h").read_text()
    assert 'fedcal_sensor_ids[FEDCAL_NUM_SENSORS] = {"S00", "S01"}' in header
    doc = json.loads((tmp_path / "cal.json").read_text())
    assert sorted(doc["sensors"]) == ["S00", "S01"] and doc["excluded"] == {"S02": REASON}
    # (ONNX writes one file per sensor of the same loaded models: not S02; not run here,
    # the exporter's import alone takes seconds)


def test_predict_calibrates_the_others_and_leaves_the_refused_rows_empty(planted, tmp_path):
    run, data = planted
    out = tmp_path / "cal.csv"
    result = runner.invoke(app, ["predict", str(run), "--data", str(data), "--out", str(out)])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert f"18 row(s) of sensor S02 not calibrated (left empty): no model, {REASON}" in said
    cal = pd.read_csv(out)
    # the out-of-range warning counts calibrated rows only (S02's are empty, said apart)
    beyond = int((~cal["in_range"] & (cal["sensor_id"] != "S02")).sum())
    assert beyond > 0 and f"warning {beyond} row(s) beyond the calibrated range" in said
    fleet = load_models(run, "polynomial")
    assert fleet.excluded == {"S02": REASON} and sorted(fleet.params) == ["S00", "S01"]
    for sensor, rows in cal.groupby("sensor_id"):
        got = rows["pressure_hpa_calibrated"].to_numpy()
        if sensor == "S02":
            assert np.isnan(got).all()
            continue
        x = rows[["frequency_hz", "temperature_c"]].to_numpy(float)
        assert np.isfinite(got).all()
        assert np.allclose(got, fleet.predict(sensor, x)[:, 0], rtol=0, atol=1e-9)
    assert "pressure_hpa_std" not in cal.columns  # the polynomial has no σ
    # a file of the refused sensor's rows only: every value empty, still no σ column
    only = tmp_path / "s02.csv"
    pd.read_csv(data).query("sensor_id == 'S02'").to_csv(only, index=False)
    result = runner.invoke(app, ["predict", str(run), "--data", str(only), "--out", str(out)])
    assert result.exit_code == 0, result.output
    cal = pd.read_csv(out)
    assert len(cal) == 18 and cal["pressure_hpa_calibrated"].isna().all()
    assert "pressure_hpa_std" not in cal.columns


def test_strict_refuses_a_row_of_the_refused_sensor_in_one_line(planted, tmp_path):
    run, data = planted
    out = tmp_path / "cal.csv"
    frame = pd.read_csv(data)
    first = int(np.argmax(frame["sensor_id"] == "S02")) + 1  # 1-based data row
    args = ["predict", str(run), "--data", str(data), "--out", str(out), "--strict"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert lines == [
        f"error: data row {first}: sensor S02 has no model in this run: {REASON} (--strict)"
    ]
    assert not out.exists()
    # the other sensors' rows alone pass --strict as before (if in range)
    ok_rows = tmp_path / "ok.csv"
    frame[(frame["sensor_id"] != "S02") & (frame["split"] == "train")].to_csv(ok_rows, index=False)
    args = ["predict", str(run), "--data", str(ok_rows), "--out", str(out), "--strict"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output


def test_a_nan_model_the_run_did_not_refuse_is_still_an_error(planted, tmp_path):
    """Only the run's own record excuses a NaN model: marked ok, S02's NaN refuses the run."""
    import shutil

    run, _ = planted
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    table = copy / "runs" / "polynomial_tp0_seed0" / "per_sensor.csv"
    status = pd.read_csv(table)
    status.loc[status["client"] == "S02", ["status", "status_reason"]] = ["ok", ""]
    status.to_csv(table, index=False)
    result = runner.invoke(app, ["export", str(copy), "--out", str(tmp_path / "cal.h")])
    assert result.exit_code == 2
    assert "sensor 'S02'/coef holds NaN or infinite values" in " ".join(result.output.split())
