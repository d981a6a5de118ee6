"""The run's stated 95 % intervals judged on its test rows (issue 20 item 2): planted per-unit
coverages against hand-computed means, standard errors and Student-t quantiles; the summary
fields and notes per role; the table's marker and legend; a tiny run whose note and column
appear; the no-probe decline sentence."""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from rich.console import Console

from fedcal.algorithms.fedprior_interval import DECLINE, NO_PROBE
from fedcal.calibration import declined_note
from fedcal.config import default_config
from fedcal.core.coverage import coverage_check
from fedcal.data.fleet import Fleet
from fedcal.experiment import coverage_checks, run_experiment
from fedcal.report.tables import (
    CHECK_LEGEND,
    NO_INTERVAL,
    aggregate,
    cell,
    rich_tables,
    table_columns,
)

T99 = {4: 3.746947, 5: 3.364930, 9: 2.821438}  # t₀.₉₉ by degrees of freedom (tables)


def test_under_beyond_chance_is_flagged_by_hand():
    # 5 units at 0.80, 5 at 0.90: mean 0.85, s = 0.05·√(10/9), SE = s/√10 = 0.05/3
    check = coverage_check([0.80] * 5 + [0.90] * 5)
    assert check.units == 10 and check.mean == pytest.approx(0.85)
    assert check.se == pytest.approx(0.05 / 3) and check.quantile == pytest.approx(T99[9])
    assert check.verdict == "under"  # 0.85 + 2.821 · 0.0167 = 0.897 < 0.95
    text = check.message("new units")
    assert "covered 0.850 of the test points of the 10 new units" in text
    assert "below 95 % beyond chance" in text and "0.850 + 2.82·0.017 = 0.897" in text
    assert "under-state this fleet's error" in text


def test_under_within_chance_is_low_not_under():
    # 3 at 0.80, 3 at 1.00: mean 0.90, SE = 0.1/√5 = 0.0447; 0.90 + 3.365 · 0.0447 = 1.05:
    # not under beyond chance, but below the 93–97 % band beyond the points' binomial noise
    # (40 points each: SE_b = √(0.0475/240) = 0.0141; 0.90 + 2.326 · 0.0141 = 0.933 < 0.95)
    check = coverage_check([0.80, 1.0, 0.80, 1.0, 0.80, 1.0], [40] * 6)
    assert check.se_points == pytest.approx(math.sqrt(0.0475 / 240))
    assert check.se == pytest.approx(0.1 / math.sqrt(5)) and check.quantile == pytest.approx(T99[5])
    assert check.verdict == "low"
    text = check.message("new units")
    assert "covered 0.900 of the test points of the 6 new units" in text
    assert "below the 93–97 % band and off 95 % beyond the binomial noise" in text
    assert "SE 0.0141" in text and "within chance across units (SE 0.045)" in text
    # the same coverages on 4 points a unit: SE_b = 0.0445, 0.90 + 2.326 · 0.0445 = 1.00: ok
    assert coverage_check([0.80, 1.0, 0.80, 1.0, 0.80, 1.0], [4] * 6).verdict == "ok"
    # inside the band: ok, nothing said (0.94 and 0.96 → mean 0.95)
    assert coverage_check([0.94] * 5 + [0.96] * 5).verdict == "ok"
    assert coverage_check([0.94] * 5 + [0.96] * 5).message("units") == ""
    # mean 0.90, s² = 0.004/4, SE = 0.01414: the normal quantile would flag it
    # (0.90 + 2.326 · 0.01414 = 0.933 < 0.95), Student's t with 4 dof does not (0.953)
    check = coverage_check([0.88, 0.90, 0.92, 0.86, 0.94])
    assert check.se == pytest.approx(math.sqrt(0.001 / 5)) and check.quantile == pytest.approx(
        T99[4]
    )
    assert check.verdict == "low"  # mean 0.90 < 0.93, within chance


def test_over_beyond_chance_is_over_and_near_99_is_not():
    assert coverage_check([1.0] * 8).verdict == "over"  # SE 0: 1.0 > 0.99
    # 5 at 1.0, 5 at 0.995: mean 0.9975, SE = 0.0025/3; 0.9975 − 2.821 · 0.00083 = 0.9952
    check = coverage_check([1.0] * 5 + [0.995] * 5)
    assert check.se == pytest.approx(0.0025 / 3) and check.verdict == "over"
    assert "above 99 % beyond chance" in check.message("units")
    # mean 0.99: not above 99 % beyond chance, but above the band: "high"
    assert coverage_check([1.0, 1.0, 1.0, 1.0, 0.95]).verdict == "high"
    assert "above the 93–97 % band" in coverage_check([1.0, 1.0, 1.0, 1.0, 0.95]).message("u")


def test_few_test_points_are_not_evidence():
    # 5 units all covered on 4 points each: s_c = 0, but SE is floored at the binomial
    # SE_b = √(0.0475/20) = 0.0487: 1 − 3.747 · 0.0487 = 0.817 (not over), and
    # 1 − 2.326 · 0.0487 = 0.887 < 0.95 (not high): ok
    check = coverage_check([1.0] * 5, [4] * 5)
    assert check.se == pytest.approx(math.sqrt(0.0475 / 20)) and check.verdict == "ok"
    # the cross-check's batch: 20 units, 40 points each, mean 0.874, units spread (sd 0.168)
    cov = [0.874 - 0.168, 0.874 + 0.168] * 10
    check = coverage_check(cov, [40] * 20)
    assert check.verdict == "low"  # 0.874 + 2.326 · √(0.0475/800) = 0.892 < 0.95
    # all 1.0 on 200 points each: SE_b 0.0069 → 1 − 3.747 · 0.0069 = 0.974: high, not over
    assert coverage_check([1.0] * 5, [200] * 5).verdict == "high"


def test_fewer_than_5_units_are_not_judged_and_unstated_units_do_not_count():
    check = coverage_check([0.5] * 4 + [math.nan] * 6)  # 4 units state an interval
    assert check.verdict == "" and check.units == 4
    assert "not judged: 4 units state an interval (the check needs at least 5" in check.message(
        "units"
    )
    assert coverage_check([math.nan] * 10).message("units") == ""  # no interval: nothing said
    assert coverage_check([0.5] * 5).verdict == "under"  # 5 units: judged (SE 0)


def final_rows(coverage: dict[str, list[float]], status: dict[str, str] | None = None):
    rows = [
        {"client_index": i, "client": f"{role}{j}", "test_coverage95": c, "status": "ok"}
        for i, (role, c, j) in enumerate(
            (r, c, j) for r, cs in coverage.items() for j, c in enumerate(cs)
        )
    ]
    final = pd.DataFrame(rows)
    for client, s in (status or {}).items():
        final.loc[final["client"] == client, "status"] = s
    return final, {c: c.rstrip("0123456789") for c in final["client"]}


def test_mixed_fleet_judges_each_role_over_its_ok_units_with_test_rows():
    final, roles = final_rows(
        {"new": [0.80] * 5 + [0.90] * 5, "reference": [0.95] * 6 + [0.10]},
        status={"reference6": "weak"},  # not ok: left out, as from the means
    )
    fields, notes = coverage_checks(final, roles, np.full(len(final), 40))
    assert fields == {
        "coverage_check_new": "under",
        "coverage_check_reference": "ok",  # six at 0.95 (the weak unit's 0.10 left out)
        "coverage_check": "under",
        "coverage_check_note": notes[0],
    }
    assert len(notes) == 1 and "of the 10 new units" in notes[0]
    # units without test rows are not judged: 4 new units left → not judged, said
    has_test = np.array([40] * 4 + [0] * 6 + [40] * 7)
    fields, notes = coverage_checks(final, roles, has_test)
    assert fields["coverage_check_new"] == "" and fields["coverage_check"] == "ok"
    assert notes == [
        "coverage not judged: 4 new units state an interval (the check needs at least 5 units)"
    ]
    # a method without the column states no interval: nothing
    assert coverage_checks(final.drop(columns="test_coverage95"), roles, has_test) == ({}, [])


def test_the_table_marks_a_judged_coverage_and_says_what_the_mark_means():
    rows = []
    for method, checks in (("fedprior", ["under", "ok", "ok"]), ("fedprior_b", ["over"] * 3)):
        for seed, check in enumerate(checks):
            rows.append(
                {"method": method, "seed": seed, "train_points": 0, "rmse_mean": 0.05,
                 "rmse_worst": 0.2, "max_abs_worst": 0.4, "coverage95_mean": 0.874,
                 "coverage95_worst": 0.45, "wall_s": 1.0, "coverage_check": check}
            )  # fmt: skip
    rows.append({**rows[0], "method": "polynomial", "coverage95_mean": math.nan})
    rows[-1]["coverage_check"] = math.nan  # read back from CSV: not judged
    table = aggregate(pd.DataFrame(rows))
    by = table.set_index("method")
    assert by.loc["fedprior", "coverage_check"] == "under"
    assert by.loc["fedprior", "coverage_check_runs"] == 1
    assert cell(by.loc["fedprior"], "coverage95") == "0.87!/0.45"
    assert cell(by.loc["fedprior_b"], "coverage95") == "0.87^/0.45"
    assert cell(by.loc["fedprior"], "coverage95_mean") == "0.874!"
    role = pd.Series({"coverage95_mean_new": 0.998, "coverage95_mean_new_std": 0.01,
                      "coverage_check_new": "over"})  # fmt: skip
    assert cell(role, "coverage95_mean_new") == "0.998^ ±0.01"  # the mark on the mean
    # a mixed fleet's all-unit mean (0.977) is not marked by its new units' verdict
    mixed = pd.Series({**role, "coverage95_mean": 0.977, "coverage_check": "over"})
    assert cell(mixed, "coverage95_mean") == "0.977"
    assert cell(by.loc["polynomial"], "coverage95_mean") == NO_INTERVAL  # no mark on "no σ"
    console = Console(width=100, record=True, force_terminal=False, color_system=None)
    for t in rich_tables(table, table_columns(table, "hPa", show_bytes=False), "hPa"):
        console.print(t)
    text = " ".join(console.export_text().split())
    assert "fedprior: stated 95 % intervals covered below 95 % beyond chance in 1 of 3" in text
    assert "fedprior_b: stated 95 % intervals covered above 99 %" in text
    assert " ".join(CHECK_LEGEND.split()) in text


def test_a_run_whose_test_rows_are_off_prints_the_note_and_writes_the_column(tmp_path):
    """6 units, 40 random points each (the toy law: fedprior's basis holds it); every test
    target planted 50 hPa off: every unit's coverage is 0 → "under", said in a note."""
    rng = np.random.default_rng(0)
    rows = []
    for c in range(6):
        f0, k, tc = rng.normal(33_000, 150), rng.normal(2.3, 0.2), rng.normal(0.4, 0.2)
        for split, m, off in (("train", 40, 0.0), ("test", 5, 50.0)):
            p, t = rng.uniform(50, 1550, m), rng.uniform(-40, 60, m)
            f = f0 + k * p + tc * t + 2e-4 * p * t - 1e-4 * p**2
            rows += [(f"S{c}", fi, ti, pi + off, split) for fi, ti, pi in zip(f, t, p, strict=True)]
    fleet = Fleet(pd.DataFrame(rows, columns=["sensor_id", "frequency_hz", "temperature_c",
                                              "pressure_hpa", "split"]))  # fmt: skip
    cfg = default_config()
    cfg = replace(cfg, seeds=1, unconverged_tol=1.0, engine=replace(cfg.engine, rounds=3))
    notes = []
    torch.manual_seed(0)
    summary = run_experiment(
        cfg, fleet, tmp_path, ["fedprior"], on_note=lambda m, n: notes.append((m, n))
    )
    row = summary.iloc[0]
    assert row["coverage95_mean"] == 0.0 and row["coverage_check"] == "under"
    said = [n for m, n in notes if m == "fedprior" and "stated 95 % intervals covered" in n]
    assert said == [row["coverage_check_note"]]
    assert said[0].startswith(
        "stated 95 % intervals covered 0.000 of the test points of the 6 units"
    )
    written = pd.read_csv(tmp_path / "summary.csv")
    assert written.loc[0, "coverage_check"] == "under"


def test_the_no_probe_decline_is_its_own_sentence():
    declined = SimpleNamespace(personal={"declined": torch.tensor([1.0, 0.0])},
                               algorithm=SimpleNamespace(probe_rows=32), reasons=())  # fmt: skip
    none = SimpleNamespace(interval=SimpleNamespace(reason="", probe_rows=0.0))
    assert declined_note(none, declined) == NO_PROBE.format(n=32)
    assert declined_note(none, declined).startswith(
        "no interval for units of at most 32 points (probe_rows): the fleet had no unit"
    )
    six = SimpleNamespace(interval=SimpleNamespace(reason="", probe_rows=6.0))
    assert declined_note(six, declined) == (
        "no interval for units with fewer points than the fleet's smallest design (6 points): "
        "their model error was not learned"
    )
    assert DECLINE[4].format(n=6) == declined_note(six, declined)
