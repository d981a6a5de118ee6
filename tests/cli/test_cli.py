"""The command line as a user and a script call it."""

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from fedcal.cli import app
from fedcal.data.loader import save_fleet
from fedcal.report.tables import fmt_num

runner = CliRunner(env={"COLUMNS": "200"})
# 2-3 rounds are unconverged by design: these tests are about files and tables, so the
# convergence status is off (unconverged_tol = 1; tested in tests/test_status.py).
SMALL = "[run]\nunconverged_tol = 1\n" + (
    "[model]\nhidden = [8, 8]\n[train]\nlocal_epochs = 1\n[engine]\nrounds = 2\n"
)


@pytest.fixture
def files(tmp_path, make_fleet):
    data = tmp_path / "fleet.csv"
    save_fleet(make_fleet(num_clients=3), data)
    cfg = tmp_path / "small.toml"
    cfg.write_text(SMALL)
    return data, cfg


def test_run_writes_summary_with_the_stable_columns(tmp_path, files):
    data, cfg = files
    out = tmp_path / "out"
    args = [
        "run",
        "--data",
        str(data),
        "--methods",
        "fedgmi,local",
        "--seeds",
        "2",
        "--config",
        str(cfg),
    ]
    result = runner.invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "RMSE" in result.output and "in hPa" in result.output and "fedgmi" in result.output
    summary = pd.read_csv(out / "summary.csv")
    for col in ["method", "seed", "rmse_mean", "rmse_worst", "mae_mean", "max_abs_worst", "wall_s"]:
        assert col in summary.columns
    assert sorted(zip(summary["method"], summary["seed"], strict=True)) == [
        ("fedgmi", 0),
        ("fedgmi", 1),
        ("local", 0),
        ("local", 1),
    ]


def test_compare_sweeps_calibration_points(tmp_path, files):
    data, cfg = files
    out = tmp_path / "cmp"
    result = runner.invoke(
        app,
        [
            "compare",
            "--data",
            str(data),
            "--methods",
            "fedavg",
            "--seeds",
            "1",
            "--config",
            str(cfg),
            "--train-points",
            "6,12",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    summary = pd.read_csv(out / "summary.csv")
    assert summary["train_points"].tolist() == [6, 12]
    assert "kB/round" in result.output


def test_bad_data_names_file_line_field_and_writes_nothing(tmp_path, files):
    data, cfg = files
    frame = pd.read_csv(data, dtype=str)
    frame.loc[3, "temperature_c"] = "warm"
    bad = tmp_path / "bad.csv"
    frame.to_csv(bad, index=False)
    out = tmp_path / "never"
    result = runner.invoke(
        app, ["run", "--data", str(bad), "--config", str(cfg), "--out", str(out)]
    )
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "bad.csv" in text and "line 5" in text and "temperature_c" in text and "warm" in text
    assert not out.exists()


def test_unknown_method_and_bad_options(files):
    data, cfg = files
    result = runner.invoke(
        app, ["run", "--data", str(data), "--methods", "fedmagic", "--config", str(cfg)]
    )
    assert result.exit_code == 2 and "unknown method(s) fedmagic" in result.output
    result = runner.invoke(app, ["run", "--data", str(data), "--rounds", "0"])
    assert result.exit_code == 2 and "--rounds" in result.output


def test_custom_schema_from_the_command_line(tmp_path, files):
    data, cfg = files
    frame = pd.read_csv(data).rename(
        columns={"frequency_hz": "capacitance_pf", "pressure_hpa": "rh_percent"}
    )
    humid = tmp_path / "humidity.csv"
    frame.to_csv(humid, index=False)
    out = tmp_path / "h"
    result = runner.invoke(
        app,
        [
            "run",
            "--data",
            str(humid),
            "--features",
            "capacitance_pf,temperature_c",
            "--target",
            "rh_percent",
            "--methods",
            "local",
            "--seeds",
            "1",
            "--config",
            str(cfg),
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "held-out points in %" in " ".join(result.output.split())  # titles may wrap


def test_simulate_writes_a_loadable_fleet(tmp_path):
    out = tmp_path / "f.parquet"
    result = runner.invoke(app, ["simulate", "--out", str(out), "--sensors", "2"])
    assert result.exit_code == 0, result.output
    frame = pd.read_parquet(out)
    assert frame["sensor_id"].nunique() == 2 and len(frame) == 2 * 444


def test_digits_classification_through_the_same_command(tmp_path):
    out = tmp_path / "digits"
    result = runner.invoke(
        app,
        [
            "compare",
            "--config",
            "digits",
            "--methods",
            "fedavg,fedlsa_nocom",
            "--rounds",
            "1",
            "--seeds",
            "1",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    summary = pd.read_csv(out / "summary.csv").set_index("method")
    assert {"accuracy_mean", "error_rate_mean", "error_rate_worst"} <= set(summary.columns)
    # the ablation without L_COM runs FedAvg's client step exactly (issue 6)
    assert summary.loc["fedavg", "accuracy_mean"] == summary.loc["fedlsa_nocom", "accuracy_mean"]
    per_sensor = pd.read_csv(out / "runs" / "fedavg_tp0_seed0" / "per_sensor.csv")
    assert summary.loc["fedavg", "accuracy_worst"] == per_sensor["test_accuracy"].min()
    assert summary.loc["fedavg", "error_rate_worst"] == per_sensor["test_error_rate"].max()


def test_config_errors_keep_their_section_names(tmp_path, files):
    data, _ = files
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine]\nrounds = 'many'\n")
    result = runner.invoke(app, ["run", "--data", str(data), "--config", str(bad)])
    assert result.exit_code == 2
    assert "bad.toml [engine] rounds: expected an integer, got 'many'" in " ".join(
        result.output.split()
    )


def test_flower_nodes_writes_one_file_per_site(tmp_path, files):
    from fedcal.engine.flower.nodes import load_site_file

    data, _ = files
    out = tmp_path / "nodes"
    result = runner.invoke(app, ["flower-nodes", "--data", str(data), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["S00.npz", "S01.npz", "S02.npz"]
    assert "site-id='S02'" in result.output and "(1 sensors)" in result.output
    # a mapping file puts S00 and S02 on one site
    sites = tmp_path / "sites.csv"
    sites.write_text("sensor_id,site\nS00,lab-a\nS01,lab-b\nS02,lab-a\n")
    out = tmp_path / "sites"
    args = ["flower-nodes", "--data", str(data), "--out", str(out), "--sites", str(sites)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["lab-a.npz", "lab-b.npz"]
    site = load_site_file(out / "lab-a.npz")
    assert site.sensor_ids == ("S00", "S02") and site.client_indices == (0, 2)
    assert "lab-a (2 sensors)" in result.output
    sites.write_text("sensor_id,site\nS00,lab-a\n")
    result = runner.invoke(app, [*args[:4], str(tmp_path / "x"), "--sites", str(sites)])
    assert result.exit_code == 2 and "no site for sensor(s) S01, S02" in result.output


def test_flower_nodes_with_workers_prints_each_sites_worker_command(tmp_path, files):
    data, _ = files
    out, state = tmp_path / "nodes", tmp_path / "st"
    args = ["flower-nodes", "--data", str(data), "--out", str(out), "--state-dir", str(state)]
    result = runner.invoke(app, [*args, "--workers"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    for site in ("S00", "S01", "S02"):
        node = next(line for line in lines if line.strip().startswith(f"{site} ("))
        cfg = node.split("--node-config ", 1)[1]
        sock = state.resolve() / site / "worker.sock"
        assert f"worker-socket='{sock}'" in cfg
        # the worker is started with the very node config its SuperNode gets
        worker = lines[lines.index(node) + 1].strip()
        assert worker == f"worker: python -m fedcal.engine.flower.worker --node-config {cfg}"
    plain = runner.invoke(app, args).output.splitlines()
    assert not any(line.strip().startswith("worker:") or "worker-socket" in line for line in plain)
    # a socket path beyond the Unix limit is refused before anything starts
    deep = tmp_path / ("d" * 120)
    result = runner.invoke(app, [*args[:-1], str(deep), "--workers"])
    assert result.exit_code == 2 and "longer than 107 bytes" in " ".join(result.output.split())


def test_flower_nodes_state_dirs_stay_under_the_state_dir(tmp_path, files):
    """A site id like ``../../X`` or ``/abs/X`` names its state folder only through the
    file-name-safe mapping of its site file (issue 36.5): every printed state-dir lies
    directly under --state-dir (it used to be built from the raw id and point outside)."""
    data, _ = files
    sites = tmp_path / "sites.csv"
    sites.write_text("sensor_id,site\nS00,../../ESCAPED\nS01,/abs/ESCAPED\nS02,lab a\n")
    # a short state folder: under pytest-xdist tmp_path is long enough that a worker's
    # socket path would pass the 107-byte limit of a Unix socket (refused, rightly)
    short = Path(tempfile.mkdtemp(prefix="fc", dir="/tmp"))
    state = short / "flower-state"
    args = ["flower-nodes", "--data", str(data), "--out", str(tmp_path / "nodes")]
    args += ["--sites", str(sites), "--state-dir", str(state), "--workers"]
    try:
        result = runner.invoke(app, args)
    finally:
        shutil.rmtree(short, ignore_errors=True)
    assert result.exit_code == 0, result.output
    dirs = [line.split("state-dir='", 1)[1].split("'", 1)[0] for line in
            result.output.splitlines() if "state-dir='" in line]  # fmt: skip
    assert len(dirs) == 6  # 3 SuperNodes and 3 workers
    assert {Path(d).parent for d in dirs} == {state.resolve()}
    assert {Path(d).name for d in dirs} == {"______ESCAPED", "_abs_ESCAPED", "lab_a"}
    assert "site-id='../../ESCAPED'" in result.output  # the id itself is unchanged
    sockets = [line.split("worker-socket='", 1)[1].split("'", 1)[0] for line in
               result.output.splitlines() if "worker-socket='" in line]  # fmt: skip
    assert all(Path(s).parent.parent == state.resolve() for s in sockets)


def test_flower_nodes_carries_the_direction_column_into_the_site_files(tmp_path, files):
    from fedcal.engine.flower.nodes import load_site_file

    data, _ = files
    frame = pd.read_csv(data)
    frame["direction"] = np.where(np.arange(len(frame)) % 3 == 0, "Down", "up")
    with_dir = tmp_path / "dir.csv"
    frame.to_csv(with_dir, index=False)
    out = tmp_path / "nodes"
    result = runner.invoke(app, ["flower-nodes", "--data", str(with_dir), "--out", str(out)])
    assert result.exit_code == 0, result.output
    site = load_site_file(out / "S01.npz")
    for split, signs in (("train", site.train_branch), ("test", site.test_branch)):
        rows = frame[(frame["sensor_id"] == "S01") & (frame["split"] == split)]
        want = np.where(rows["direction"] == "up", 1.0, -1.0)
        assert signs is not None and signs[0].tolist() == want.tolist(), split


def test_report_reprints_a_run_as_markdown(tmp_path, files):
    data, cfg = files
    out = tmp_path / "r"
    args = ["run", "--data", str(data), "--methods", "local", "--seeds", "2", "--config", str(cfg)]
    assert runner.invoke(app, [*args, "--out", str(out)]).exit_code == 0
    result = runner.invoke(app, ["report", str(out), "--markdown"])
    assert result.exit_code == 0, result.output
    summary = pd.read_csv(out / "summary.csv")
    mean, std = summary["rmse_mean"].mean(), summary["rmse_mean"].std(ddof=0)
    assert result.output.startswith("| method | RMSE mean (hPa) |")
    assert f"| local | {fmt_num(mean)} ±{fmt_num(std, 2)} |" in result.output
    assert runner.invoke(app, ["report", str(tmp_path / "nothing")]).exit_code == 2


def test_the_target_unit_is_the_declared_one_then_the_column_name_s(tmp_path, files):
    """Issue 37.2: a ``--unit`` instead of guesses; a unit the column's name states in
    brackets is read; config.json records the declared one (the report reads it back)."""
    data, cfg = files
    frame = pd.read_csv(data).rename(columns={"pressure_hpa": "p_ref"})
    renamed = tmp_path / "ref.csv"
    frame.to_csv(renamed, index=False)
    base = ["run", "--data", str(renamed), "--target", "p_ref", "--methods", "local"]
    base += ["--seeds", "1", "--config", str(cfg)]
    said = runner.invoke(app, [*base, "--out", str(tmp_path / "a")])
    assert said.exit_code == 0, said.output
    assert "held-out points in" not in " ".join(said.output.split())  # no unit: none guessed
    declared = runner.invoke(app, [*base, "--unit", "kPa", "--out", str(tmp_path / "b")])
    assert declared.exit_code == 0, declared.output
    assert "held-out points in kPa" in " ".join(declared.output.split())
    recorded = json.loads((tmp_path / "b" / "config.json").read_text())
    assert recorded["data"]["target_unit"] == "kPa"
    again = runner.invoke(app, ["report", str(tmp_path / "b")])
    assert again.exit_code == 0 and "in kPa" in " ".join(again.output.split()), again.output


def test_a_unit_in_the_column_s_name_is_read_and_an_index_is_not():
    from fedcal.report.tables import target_unit

    assert target_unit("pressure [hPa]") == "hPa" and target_unit("o3 (ppb)") == "ppb"
    assert target_unit("pm25 (µg/m³)") == "µg/m³" and target_unit("x(1)") == ""
    assert target_unit("pressure_hpa", "kPa") == "kPa"  # declared beats the name
