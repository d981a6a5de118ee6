"""The smaller holes of issue 21: each refused in one line (or, for the last, accepted)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from fedcal.build import build_algorithm, build_task
from fedcal.cli import app
from fedcal.config import ConfigError, default_config, override
from fedcal.core.paths import PathError, check_dir_output, mapped_name, run_folders_of, safe_name
from fedcal.data.loader import FleetDataError, load_fleet, save_fleet
from fedcal.engine.flower.validation import implausible_metrics

runner = CliRunner(env={"COLUMNS": "1000"})
COLS = ["sensor_id", "frequency_hz", "temperature_c", "pressure_hpa"]


@pytest.fixture()
def frame(make_fleet) -> pd.DataFrame:
    return make_fleet(num_clients=3).frame[COLS].reset_index(drop=True)


def test_a_parquet_file_with_a_repeated_column_name_is_refused(frame, tmp_path):
    path = tmp_path / "dup.parquet"
    arrays = [pa.array(frame[c]) for c in COLS] + [pa.array(frame["pressure_hpa"])]
    pq.write_table(pa.Table.from_arrays(arrays, names=[*COLS, "pressure_hpa"]), path)
    with pytest.raises(FleetDataError, match=r"duplicate column names.*'pressure_hpa'"):
        load_fleet(path)


def test_a_float16_column_is_refused(frame, tmp_path):
    path = tmp_path / "f16.parquet"
    frame.astype({"frequency_hz": np.float16}).to_parquet(path)
    # float16 stores 33 kHz in steps of 32 Hz: two readings 13 Hz apart become one
    assert np.float16(33_017.0) == np.float16(33_030.0)
    with pytest.raises(FleetDataError, match=r"frequency_hz.*float16"):
        load_fleet(path)


@pytest.mark.parametrize("digits", ["２０", "٢٠", "२०"])  # full-width, Arabic-Indic, Devanagari
def test_non_ascii_digits_are_refused(frame, tmp_path, digits):
    assert float(digits) == 20.0  # what float() would have read
    text = frame.astype({"temperature_c": str})
    text.loc[2, "temperature_c"] = digits
    path = tmp_path / "u.csv"
    text.to_csv(path, index=False)
    with pytest.raises(FleetDataError, match=f"temperature_c.*line 4 \\('{digits}'"):
        load_fleet(path)


def test_a_row_a_thousand_times_the_fleet_frequency_is_refused(frame, tmp_path):
    bad = frame.copy()
    bad.loc[5, "frequency_hz"] = bad.loc[5, "frequency_hz"] * 1000  # 33 kHz → 33 MHz
    path = tmp_path / "mhz.csv"
    bad.to_csv(path, index=False)
    with pytest.raises(FleetDataError, match=r"frequency_hz.*10× away.*line 7"):
        load_fleet(path)
    # an explicit bound for the column is the user's word: accepted
    fleet = load_fleet(path, physical_bounds={"frequency_hz": (0.0, None)})
    assert fleet.frame["frequency_hz"].max() == bad["frequency_hz"].max()


def test_local_epochs_zero_is_refused_where_it_trains_nothing():
    cfg = override(default_config(), {"train": {"local_epochs": 0}})
    task = build_task(cfg, 2)
    for method in ("fedavg", "local", "fedgmi"):
        with pytest.raises(ConfigError, match=f"{method}.*local_epochs: 0 would train nothing"):
            build_algorithm(method, cfg, task)
    # closed forms, and the frozen-body posterior variant, do not learn by epochs
    for method in ("fedprior", "polynomial", "leastsq", "fedgmi_posterior_frozen"):
        assert build_algorithm(method, cfg, task).uses_local_epochs is False


def test_local_epochs_zero_is_refused_by_the_cli_before_training(tmp_path, make_fleet):
    data = tmp_path / "f.csv"
    save_fleet(make_fleet(num_clients=2), data)
    cfg = tmp_path / "c.toml"
    cfg.write_text("[train]\nlocal_epochs = 0\n[engine]\nrounds = 1\n")
    out = tmp_path / "out"
    result = runner.invoke(
        app, ["run", "--data", str(data), "--methods", "fedavg", "--config", str(cfg),
              "--out", str(out)]
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "local_epochs: 0 would train nothing" in result.output
    assert not out.exists()


@pytest.mark.parametrize(
    ("metrics", "finite", "problem"),
    [
        ({"test_rmse": -1.0, "train_rmse": 0.1}, True, "negative"),
        ({"test_rmse": 0.1, "train_rmse": -0.1}, True, "negative"),
        ({"test_rmse": math.nan, "train_rmse": 0.1}, True, "not finite"),
        ({"test_rmse": math.inf, "train_rmse": 0.1}, True, "not finite"),
        ({"test_rmse": math.nan, "train_rmse": 0.1}, False, None),  # a diverged model: shown so
        ({"test_rmse": 0.1, "train_rmse": math.inf}, True, None),  # train error may overflow
        ({"test_rmse": 0.0, "test_coverage95": 1.0}, True, None),
        # a declined interval (fedprior "Intervals"): NaN coverage and σ, finite errors
        ({"test_rmse": 0.1, "test_coverage95": math.nan, "test_pred_sd": math.nan}, True, None),
    ],
)
def test_implausible_flower_metrics_are_rejected(metrics, finite, problem):
    why = implausible_metrics(metrics, finite)
    assert (why is None) if problem is None else (problem in why)


def test_the_same_data_by_another_path_resumes_the_run(tmp_path, make_fleet, monkeypatch):
    data = tmp_path / "f.csv"
    save_fleet(make_fleet(num_clients=2), data)
    cfg = tmp_path / "c.toml"
    cfg.write_text("[model]\nhidden = [4]\n[train]\nlocal_epochs = 1\n[engine]\nrounds = 1\n")
    out = tmp_path / "out"
    args = ["--methods", "local", "--config", str(cfg), "--out", str(out), "--quiet"]
    first = runner.invoke(app, ["run", "--data", str(data), *args])
    assert first.exit_code == 0, first.output
    summary = (out / "summary.csv").read_text()
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    again = runner.invoke(app, ["run", "--data", "../f.csv", *args])
    assert again.exit_code == 0, again.output
    assert (out / "summary.csv").read_text() == summary
    # other content under the same name is still refused
    frame = pd.read_csv(data)
    frame.loc[0, "pressure_hpa"] += 1.0
    frame.to_csv(data, index=False)
    changed = runner.invoke(app, ["run", "--data", str(data), *args])
    assert changed.exit_code == 2 and "data changed" in changed.output


@pytest.mark.parametrize(
    "name", ["", ".", "..", "../x", "a/b", "a\\b", "/abs", "a..b", "a\x00b", "a\nb", "a\u202eb"]
)
def test_safe_name_refuses_what_could_leave_a_folder(name):
    with pytest.raises(PathError, match=r"cannot name a file|expected a string"):
        safe_name(name, "sensor id")


@pytest.mark.parametrize("name", ["S001", "fedgmi_posterior", "NEW-S000", "капля", "sensor 7"])
def test_safe_name_keeps_ordinary_names(name):
    assert safe_name(name) == name


@pytest.mark.parametrize(
    ("site", "stem"),
    [("site-A", "site-A"), ("lab 3/bay.7", "lab_3_bay.7"), ("..", "__"), ("", "_"), (".", "_")],
)
def test_site_ids_map_to_safe_file_stems(site, stem):
    assert mapped_name(site) == stem
    assert safe_name(mapped_name(site)) == stem


def test_run_folders_of_a_prior(tmp_path):
    inside = tmp_path / "run" / "runs" / "fedprior_tp0_seed0" / "prior.json"
    assert run_folders_of(inside) == [inside.parent, tmp_path / "run"]
    assert run_folders_of(tmp_path / "priors" / "prior.json") == []  # on its own: the file


def test_a_calibrate_output_may_sit_next_to_a_standalone_prior_but_not_hold_it(tmp_path):
    prior = tmp_path / "priors" / "prior.json"
    prior.parent.mkdir()
    prior.write_text("{}")
    check_dir_output(tmp_path / "priors" / "new", "--out", run_folders_of(prior), [prior])
    with pytest.raises(PathError, match="holds the input"):
        check_dir_output(tmp_path / "priors", "--out", run_folders_of(prior), [prior])
    with pytest.raises(PathError, match="holds the input"):
        check_dir_output(tmp_path, "--out", run_folders_of(prior), [prior])
