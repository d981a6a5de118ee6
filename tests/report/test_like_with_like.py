"""Tables that compare like with like (issue 34.4) and a console that says the result first
(issue 37.2): a mean over every sensor and over the sensors every method has ok, beside each
method's own ok mean, in summary.csv, the console and Markdown; digits that compare; no ±0
on one run."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from rich.console import Console

from fedcal.experiment import all_sensor_means, common_sensor_means
from fedcal.report.tables import (
    aggregate,
    cell,
    fmt_num,
    rich_tables,
    table_columns,
    to_markdown,
)

# method "prior": 4 sensors ok; "neural": S3 unconverged (error 9), S4 diverged (no error)
ERRORS = {
    "prior": ({"S1": 1.0, "S2": 2.0, "S3": 3.0, "S4": 4.0}, {}),
    "neural": (
        {"S1": 0.5, "S2": 1.5, "S3": 9.0, "S4": math.nan},
        {"S3": "unconverged", "S4": "diverged"},
    ),
}


def _final(method: str) -> pd.DataFrame:
    errors, statuses = ERRORS[method]
    return pd.DataFrame(
        {
            "client": list(errors),
            "status": [statuses.get(c, "ok") for c in errors],
            "test_rmse": list(errors.values()),
        }
    )


def test_the_mean_over_all_sensors_counts_every_status_and_names_the_unscored():
    got = all_sensor_means(_final("neural"), "rmse")
    assert got == {"rmse_mean_all": pytest.approx((0.5 + 1.5 + 9.0) / 3), "unscored": 1}
    roles = {
        "new": pd.Series([True, True, False, False]),
        "ref": pd.Series([False] * 2 + [True] * 2),
    }
    got = all_sensor_means(_final("neural"), "rmse", roles)
    assert got["rmse_mean_all_new"] == 1.0 and got["unscored_new"] == 0
    assert got["rmse_mean_all_ref"] == 9.0 and got["unscored_ref"] == 1


def test_the_common_mean_is_over_the_sensors_every_method_has_ok(tmp_path):
    runs, rows = {}, []
    for i, (method, seed) in enumerate([("prior", 0), ("neural", 0), ("prior", 1)]):
        path = tmp_path / f"{method}{seed}.csv"
        _final(method).to_csv(path, index=False)
        runs[i] = (path, "rmse")
        rows.append({"method": method, "seed": seed, "train_points": 0})
    out = common_sensor_means(pd.DataFrame(rows), runs)
    # seed 0: S1, S2 are ok in both methods → prior (1 + 2)/2, neural (0.5 + 1.5)/2
    assert out.loc[0, "rmse_mean_common"] == 1.5 and out.loc[1, "rmse_mean_common"] == 1.0
    assert out.loc[0, "common_sensors"] == 2 == out.loc[1, "common_sensors"]
    # seed 1 has one method only: no comparison to make, nothing written
    assert np.isnan(out.loc[2, "rmse_mean_common"])


def _table() -> pd.DataFrame:
    base = {"seed": 0, "train_points": 0, "wall_s": 1.0, "sensors": 4, "rejected": 0, "failed": 0}
    counts = {"weak": 0, "rejected_sensors": 0, "refused": 0}
    rows = [
        {**base, **counts, "method": "prior", "rmse_mean": 0.1, "rmse_worst": 0.2,
         "max_abs_worst": 0.5, "mae_mean": 0.08, "rmse_mean_pct_fs": 0.01,
         "max_abs_worst_pct_fs": 0.1, "rmse_mean_all": 0.1, "unscored": 0, "rmse_mean_common": 0.09,
         "common_sensors": 2, "excluded": 0, "unconverged": 0, "diverged": 0},
        {**base, **counts, "method": "neural", "rmse_mean": 3.1, "rmse_worst": 4.0,
         "max_abs_worst": 9.0, "mae_mean": 2.5, "rmse_mean_pct_fs": 0.3,
         "max_abs_worst_pct_fs": 0.9, "rmse_mean_all": 4.5, "unscored": 1, "rmse_mean_common": 3.1,
         "common_sensors": 2, "excluded": 2, "unconverged": 1, "diverged": 1},
    ]  # fmt: skip
    return aggregate(pd.DataFrame(rows))


def test_the_console_shows_ok_common_and_all_with_digits_that_compare():
    table = _table()
    columns = table_columns(table, "hPa", show_bytes=False)
    assert [c for c, _ in columns][:3] == ["rmse_mean", "rmse_mean_common", "rmse_mean_all"]
    console = Console(width=100, record=True, color_system=None)
    for t in rich_tables(table, columns, "hPa"):
        console.print(t)
    text = console.export_text()
    body = {line.split("│")[1].strip(): line for line in text.splitlines() if "│" in line}
    prior = [c.strip() for c in body["prior"].strip("│").split("│")]
    neural = [c.strip() for c in body["neural"].strip("│").split("│")]
    assert prior[1:4] == ["0.100", "0.0900", "0.100"]  # not "0.1" beside "3.1"
    assert neural[1:4] == ["3.10", "3.10", "4.50 +1 unscored"]
    assert "±" not in text  # one run: no spread, never "±0"
    assert "calibration points per sensor" not in text  # "all" is not said
    flat = " ".join(text.split())
    assert "common: the 2 sensors every method has ok" in flat


def test_no_like_with_like_columns_when_every_method_has_every_sensor_ok():
    table = _table()
    text = to_markdown(table, table_columns(table, "hPa", False, full=True))  # Markdown, HTML
    assert "RMSE ok (hPa) | RMSE common (hPa) | RMSE all (hPa)" in text
    assert "| neural | 3.10 | 3.10 | 4.50 +1 unscored |" in text
    table["excluded"], table["common_sensors"] = 0.0, 4.0  # every sensor ok everywhere
    for full in (False, True):
        shown = [c for c, _ in table_columns(table, "hPa", False, full=full)]
        assert "rmse_mean_common" not in shown and "rmse_mean_all" not in shown


def test_numbers_keep_their_zeros_only_where_asked():
    assert fmt_num(0.1, keep_zeros=True) == "0.100" and fmt_num(3.1, keep_zeros=True) == "3.10"
    assert fmt_num(16.0, keep_zeros=True) == "16.0" and fmt_num(2.0) == "2"
    several = pd.Series({"rmse_mean": 0.1, "rmse_mean_std": 0.01, "seeds": 3})
    assert cell(several, "rmse_mean") == "0.100 ±0.01"
    assert cell(several.drop("seeds"), "rmse_mean") == "0.100 ±0.01"
    assert cell(pd.Series({"rmse_mean": 0.1, "rmse_mean_std": 0.0, "seeds": 1}), "rmse_mean") == (
        "0.100"
    )


def test_a_suffix_that_is_no_unit_is_not_printed_as_one():
    from fedcal.report.tables import target_unit

    assert target_unit("pressure_hpa") == "hPa" and target_unit("conc_ppm") == "ppm"
    assert target_unit("pm25_ref") == "" and target_unit("p_ref") == ""  # before: "ref"
    assert target_unit("t_degc") == "°C" and target_unit("rainfall") == ""


def test_fedprior_drift_without_a_time_column_says_it_is_fedprior_in_one_line(tmp_path):
    """Issue 34: fedprior_drift on data without a time column silently equalled fedprior."""
    from dataclasses import replace

    import torch

    from fedcal.algorithms.fedprior_drift import NO_TIME
    from fedcal.config import default_config
    from fedcal.data.fleet import Fleet
    from fedcal.experiment import run_experiment

    rng = np.random.default_rng(0)
    rows = []
    for c in range(6):
        f0, k = rng.normal(33_000, 150), rng.normal(2.3, 0.2)
        for split, m in (("train", 30), ("test", 5)):
            p, t = rng.uniform(50, 1550, m), rng.uniform(-40, 60, m)
            pairs = zip(p, t, strict=True)
            rows += [(f"S{c}", f0 + k * pi + 0.4 * ti, ti, pi, split) for pi, ti in pairs]
    columns = ["sensor_id", "frequency_hz", "temperature_c", "pressure_hpa", "split"]
    cfg = default_config()
    cfg = replace(cfg, seeds=1, unconverged_tol=1.0, engine=replace(cfg.engine, rounds=2))
    notes: list[tuple[str, str]] = []
    torch.manual_seed(0)
    run_experiment(
        cfg,
        Fleet(pd.DataFrame(rows, columns=columns)),
        tmp_path,
        ["fedprior_drift"],
        on_note=lambda m, n: notes.append((m, n)),
    )
    assert ("fedprior_drift", NO_TIME) in notes and "\n" not in NO_TIME


def test_a_run_whose_sensors_are_all_excluded_still_shows_its_mean_over_every_sensor():
    # `fedcal run` on the seed protocol: every sensor unconverged, so the ok means are NaN;
    # the mean over all sensors (7.8 and 8.6 on two seeds) is shown, the ok mean is "n/a".
    summary = pd.DataFrame(
        {
            "method": ["local", "local"],
            "seed": [0, 1],
            "rmse_mean": [math.nan, math.nan],
            "rmse_worst": [math.nan, math.nan],
            "rmse_mean_all": [7.8, 8.6],
            "unscored": [0, 0],
            "sensors": [20, 20],
            "excluded": [20, 20],
        }
    )
    row = aggregate(summary).iloc[0]
    assert row["rmse_mean_all"] == pytest.approx(8.2)
    assert cell(row, "rmse_mean_all").startswith("8.20 ±")
    assert cell(row, "rmse_mean") == "n/a"
