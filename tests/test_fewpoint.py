"""Few-point benchmark plumbing: design/fleet-seed sweeps, roles, per-role summaries, configs."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from fedcal.algorithms import REGISTRY
from fedcal.cli import app
from fedcal.config import ConfigError, default_config, load_config
from fedcal.core.task import Task
from fedcal.engine.simulation import RunResult
from fedcal.experiment import (
    build_algorithm,
    build_task,
    check_methods,
    fleet_variants,
    load_data,
    run_experiment,
    summary_row,
)
from fedcal.models.mlp import MLP
from fedcal.report.tables import aggregate

runner = CliRunner(env={"COLUMNS": "200"})


def mixed_config(**run):
    cfg = default_config()
    return replace(
        cfg,
        seeds=1,
        engine=replace(cfg.engine, rounds=1, checkpoint_every=1),
        fleet=replace(
            cfg.fleet, num_reference=2, num_new=3, train_design="4x3", test_design="random"
        ),
        **run,
    )


def fake_result(final: list[dict]) -> RunResult:
    return RunResult(final, final, {}, {}, {}, 0.0, 0.0, 0.0)


def test_summary_per_role_equals_a_hand_computation_from_per_sensor_csv(tmp_path):
    cfg = mixed_config()
    fleet = load_data(cfg)
    summary = run_experiment(cfg, fleet, tmp_path, ["polynomial"])
    per_sensor = pd.read_csv(tmp_path / "runs" / "polynomial_tp0_seed0" / "per_sensor.csv")
    assert per_sensor["role"].tolist() == ["reference"] * 2 + ["new"] * 3
    assert per_sensor["client"].tolist() == ["S000", "S001", "S002", "S003", "S004"]
    row = summary.iloc[0]
    for metric in ("rmse", "mae", "max_abs"):
        for role in ("reference", "new"):
            values = per_sensor.loc[per_sensor["role"] == role, f"test_{metric}"]
            assert row[f"{metric}_mean_{role}"] == pytest.approx(values.mean(), rel=1e-12)
            assert row[f"{metric}_worst_{role}"] == pytest.approx(values.max(), rel=1e-12)
        assert row[f"{metric}_mean"] == pytest.approx(per_sensor[f"test_{metric}"].mean())
    # 12 chamber points against 384: the new units are the ones that pay.
    assert row["rmse_mean_new"] > row["rmse_mean_reference"]  # fewer points, worse fit
    on_disk = json.loads((tmp_path / "runs" / "polynomial_tp0_seed0" / "done.json").read_text())
    assert on_disk["rmse_worst_new"] == row["rmse_worst_new"]


def test_a_non_finite_sensor_makes_mean_and_worst_nan():
    task = Task(MLP())
    rows = [
        {"client_index": 0, "client": "A", "test_rmse": 1.0, "test_mae": 0.5, "test_max_abs": 2.0},
        {"client_index": 1, "client": "B", "test_rmse": 3.0, "test_mae": 1.0, "test_max_abs": 4.0},
        {"client_index": 2, "client": "C", "test_rmse": 5.0, "test_mae": 2.0, "test_max_abs": 9.0},
    ]
    roles = {"A": "reference", "B": "new", "C": "new"}
    ok = summary_row("m", 0, 0, fake_result(rows), 100.0, task, roles)
    assert (ok["rmse_mean"], ok["rmse_worst"]) == (3.0, 5.0)
    assert (ok["rmse_mean_new"], ok["rmse_worst_new"], ok["rmse_mean_reference"]) == (4.0, 5.0, 1.0)
    assert ok["rmse_mean_pct_fs"] == pytest.approx(3.0)
    for bad in (float("nan"), float("inf")):
        broken = [dict(r) for r in rows]
        broken[2]["test_rmse"] = bad
        row = summary_row("m", 0, 0, fake_result(broken), 100.0, task, roles)
        for key in ("rmse_mean", "rmse_worst", "rmse_mean_new", "rmse_worst_new"):
            assert math.isnan(row[key]), (bad, key)
        assert math.isnan(row["rmse_mean_pct_fs"])
        assert row["rmse_mean_reference"] == 1.0 and row["mae_mean_new"] == 1.5
    # Without roles: no per-role columns.
    plain = summary_row("m", 0, 0, fake_result(rows), 100.0, task)
    assert not any(k.endswith(("_new", "_reference")) for k in plain)


def test_design_and_fleet_seed_sweeps_regenerate_the_fleet():
    cfg = mixed_config(designs=("3x2", "6x4"), fleet_seeds=(0, 1))
    variants = fleet_variants(cfg, load_data(cfg))
    labels = [v[0] for v in variants]
    assert labels == [
        {"design": "3x2", "fleet_seed": 0},
        {"design": "6x4", "fleet_seed": 0},
        {"design": "3x2", "fleet_seed": 1},
        {"design": "6x4", "fleet_seed": 1},
    ]
    for label, fleet in variants:
        train = fleet.frame[fleet.frame["split"] == "train"].groupby("sensor_id").size()
        points = {"3x2": 6, "6x4": 24}[label["design"]]
        assert train.tolist() == [384, 384, points, points, points]
        assert fleet.meta["seed"] == label["fleet_seed"]
        assert fleet.meta["spec"]["train_design"] == label["design"]

    def rows(fleet, sid, split):
        f = fleet.frame
        return f[(f["sensor_id"] == sid) & (f["split"] == split)].reset_index(drop=True)

    # Same fleet seed: the reference units and every unit's test rows do not change with design.
    a, b, c = variants[0][1], variants[1][1], variants[2][1]
    pd.testing.assert_frame_equal(rows(a, "S000", "train"), rows(b, "S000", "train"))
    pd.testing.assert_frame_equal(rows(a, "S004", "test"), rows(b, "S004", "test"))
    # Another fleet seed: other units.
    assert not np.allclose(
        rows(a, "S000", "train")["frequency_hz"], rows(c, "S000", "train")["frequency_hz"]
    )


def test_sweep_runs_are_labelled_and_aggregated_per_design(tmp_path):
    cfg = mixed_config(designs=("3x2", "4x3"), fleet_seeds=(0, 2))
    summary = run_experiment(cfg, load_data(cfg), tmp_path, ["polynomial", "fedpoly_p3"])
    assert list(summary.columns[:4]) == ["method", "design", "fleet_seed", "seed"]
    assert len(summary) == 2 * 2 * 2
    assert (tmp_path / "runs" / "fedpoly_p3_4x3_fs2_tp0_seed0" / "done.json").exists()
    fleet_json = json.loads((tmp_path / "fleet.json").read_text())
    assert [(v["design"], v["fleet_seed"]) for v in fleet_json] == [
        ("3x2", 0),
        ("4x3", 0),
        ("3x2", 2),
        ("4x3", 2),
    ]
    table = aggregate(summary)
    assert table[["design", "method"]].values.tolist() == [
        ["3x2", "polynomial"],
        ["3x2", "fedpoly_p3"],
        ["4x3", "polynomial"],
        ["4x3", "fedpoly_p3"],
    ]
    assert (table["seeds"] == 2).all()  # 1 training seed × 2 fleet seeds
    # Each run trained on its own variant: the new units' points follow the design.
    for design in ("3x2", "4x3"):
        runs = summary.query(f"design == '{design}' and method == 'polynomial'")
        assert runs["rmse_mean_new"].nunique() == 2  # two fleets, two results
    worse = summary.query("method == 'polynomial'").groupby("design")["rmse_mean_new"].mean()
    assert worse["3x2"] > 5 * worse["4x3"]  # 6 points cannot do what 12 do
    expected = summary.query("design == '4x3' and method == 'polynomial'")["rmse_mean_new"].mean()
    got = table.query("design == '4x3' and method == 'polynomial'")["rmse_mean_new"].item()
    assert got == pytest.approx(expected)
    # Resume: the same command reads every run back.
    again = run_experiment(cfg, load_data(cfg), tmp_path, ["polynomial", "fedpoly_p3"])
    pd.testing.assert_frame_equal(again, summary)


def test_sweeps_need_a_generated_fleet(tmp_path):
    cfg = mixed_config(designs=("3x2",))
    cfg = replace(cfg, data=replace(cfg.data, path="fleet.csv"))
    with pytest.raises(ConfigError, match="designs"):
        fleet_variants(cfg, None)
    cfg = replace(cfg, designs=(), fleet_seeds=(0, 1))
    with pytest.raises(ConfigError, match="fleet_seeds"):
        fleet_variants(cfg, None)


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('[fleet]\ntrain_design = "3y2"', "[fleet] train_design: '3y2' is not 'campaign' or PxT"),
        ('[fleet]\nreference_design = "0x2"', "[fleet] reference_design: '0x2'"),
        ("[fleet]\nnum_new = -1", "[fleet] num_new: must be >= 0, got -1"),
        ('[run]\ndesigns = ["3x2", "4x"]', "[run] designs: '4x' is not 'campaign' or PxT"),
        ('[run]\ndesigns = ["3x2", "3x2"]', "[run] designs: 3x2 named more than once"),
        ('[run]\ndesigns = "3x2"', "[run] designs: expected a list"),
        ("[run]\nfleet_seeds = [0, -1]", "[run] fleet_seeds[1]: must be >= 0, got -1"),
        ("[run]\nfleet_seeds = [1, 1]", "[run] fleet_seeds: 1 named more than once"),
    ],
)
def test_config_errors_name_the_field(tmp_path, toml, message):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert message in str(err.value) and str(path) in str(err.value)
    assert "\n" not in str(err.value)


def test_cli_refuses_bad_sweep_options(tmp_path):
    for args, message in (
        (["--designs", "3y2"], "--designs: '3y2' is not 'campaign' or PxT"),
        (["--fleet-seeds", "0,a"], "--fleet-seeds: expected integers"),
    ):
        result = runner.invoke(app, ["compare", "--out", str(tmp_path / "x"), *args])
        assert result.exit_code == 2, result.output
        assert message in result.output
        assert not (tmp_path / "x").exists()


def test_cli_compare_sweeps_designs_and_fleet_seeds(tmp_path):
    config = tmp_path / "mixed.toml"
    config.write_text(
        "[run]\nseeds = 1\n[fleet]\nnum_reference = 1\nnum_new = 2\ntest_design = 'random'\n"
    )
    out = tmp_path / "out"
    args = ["compare", "--config", str(config), "--methods", "polynomial", "--rounds", "1"]
    result = runner.invoke(
        app, [*args, "--designs", "3x2,4x3", "--fleet-seeds", "0,1", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    summary = pd.read_csv(out / "summary.csv")
    assert sorted(zip(summary["design"], summary["fleet_seed"], strict=True)) == [
        ("3x2", 0),
        ("3x2", 1),
        ("4x3", 0),
        ("4x3", 1),
    ]
    assert "design 3x2" in result.output and "design 4x3" in result.output


def test_shipped_fewpoint_and_generic_configs():
    few = load_config("fewpoint")
    assert few.designs == ("3x2", "4x3", "6x4") and few.fleet_seeds == (0, 1, 2)
    f = few.fleet
    assert (f.num_reference, f.num_new, f.reference_design, f.test_design) == (
        20,
        20,
        "campaign",
        "random",
    )
    assert {"polynomial", "fedpoly", "fedpoly_p3", "fedprior", "local"} <= set(few.methods)
    assert check_methods(list(few.methods), few) == list(few.methods)
    generic = load_config("generic")
    assert generic.data.path == "builtin:humidity" and generic.fleet_seeds == (0, 1, 2)
    assert generic.method_params["fedprior"]["basis"] == "total"
    fleet = load_data(generic)
    assert fleet.num_clients == 40 and fleet.target == "rh_percent"
    task = build_task(generic, 3, fleet.meta)
    prior = build_algorithm("fedprior", generic, task)  # degree 2: the class's, not repeated
    assert prior.basis == "total" and prior.degree == 2
    pooled = build_algorithm("pooled_ls", generic, task)
    assert pooled.pooled and pooled.degree == 2 and len(pooled.exponents) == 10
    assert "leastsq" in REGISTRY


def test_aggregate_does_not_skip_a_nan_run():
    summary = pd.DataFrame(
        {
            "method": ["a", "a", "b", "b"],
            "seed": [0, 1, 0, 1],
            "train_points": [0] * 4,
            "rmse_mean": [1.0, float("nan"), 2.0, 4.0],
        }
    )
    table = aggregate(summary).set_index("method")
    assert math.isnan(table.loc["a", "rmse_mean"]) and math.isnan(table.loc["a", "rmse_mean_std"])
    assert table.loc["b", "rmse_mean"] == 3.0 and table.loc["b", "rmse_mean_std"] == 1.0
