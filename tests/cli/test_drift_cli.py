"""fedprior_drift from a user's file (issue 26): `fedcal run --time-column` and `calibrate`."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
from typer.testing import CliRunner

from fedcal import calibration
from fedcal.cli import app
from fedcal.data.field import TIME_COLUMN, FieldSpec, field_frame, seconds
from fedcal.data.loader import time_split

runner = CliRunner(env={"COLUMNS": "200"})


def test_run_and_calibrate_report_when_to_recalibrate(tmp_path):
    frame = field_frame(FieldSpec(num_sensors=5, days=120), seed=1)
    frame.to_csv(tmp_path / "net.csv", index=False)
    (tmp_path / "run.toml").write_text("[engine]\nrounds = 5\neval_every = 5\n")
    args = ["run", "--data", str(tmp_path / "net.csv"), "--features", "pm25_raw,rh"]
    args += ["--target", "pm25_ref", "--time-column", TIME_COLUMN, "--split-by", "time"]
    args += ["--methods", "fedprior_drift", "--seeds", "1", "--config", str(tmp_path / "run.toml")]
    result = runner.invoke(app, [*args, "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    prior = calibration.find_prior(tmp_path / "run", "fedprior_drift")
    drift = json.loads(prior.read_text())["drift"]
    assert drift["q"] > 0 and drift["time_scale"] > 0  # the generator plants gain drift
    per_sensor = pd.read_csv(prior.parent / "per_sensor.csv")
    # once q > 0 the uploads are whitened: the default upload check must still accept them
    assert not (per_sensor["status"] == "rejected").any()
    t = seconds(frame[TIME_COLUMN])
    split = time_split(frame["sensor_id"].to_numpy(), t, 0.25)
    train = frame.assign(t=t)[split == "train"]
    last = train.groupby("sensor_id")["t"].max()  # each unit's last calibration row
    at = per_sensor.set_index("client")["recalibrate_at"]
    assert np.all(at > last[at.index])
    # calibrate: two units' first 40 rows against that prior, with their times (more than
    # probe_rows: with fewer, and no such unit in the fleet, the interval is declined and
    # recalibrate_at is empty).
    new = frame[frame["sensor_id"].isin(["S00", "S01"])].groupby("sensor_id").head(40)
    new.to_csv(tmp_path / "new.csv", index=False)
    args = ["calibrate", "--prior", str(tmp_path / "run"), "--method", "fedprior_drift"]
    args += ["--data", str(tmp_path / "new.csv"), "--time-column", TIME_COLUMN]
    result = runner.invoke(app, [*args, "--out", str(tmp_path / "new")])
    assert result.exit_code == 0, result.output
    units = pd.read_csv(tmp_path / "new" / "units.csv").set_index("sensor_id")
    t_new = seconds(new[TIME_COLUMN])
    last_new = new.assign(t=t_new).groupby("sensor_id")["t"].max()
    assert np.all(units["recalibrate_at"] > last_new[units.index])
