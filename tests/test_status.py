"""Each sensor's status (ok / weak / rejected / unconverged / diverged / refused) on planted
fleets, means over ok sensors with the others counted, and one-round methods."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd
import pytest
import torch
from rich.console import Console

from fedcal.config import default_config
from fedcal.data.fleet import Fleet
from fedcal.experiment import fleet_stat, prepare, run_experiment
from fedcal.status import OWN_FIT_FACTOR, UNCONVERGED_TOL, own_fit_rmse, sensor_statuses

COLUMNS = ["sensor_id", "frequency_hz", "temperature_c", "pressure_hpa", "split"]


def config(rounds: int = 10, **kw):
    cfg = default_config()
    return replace(cfg, seeds=1, engine=replace(cfg.engine, rounds=rounds), **kw)


def chamber_fleet(points: dict[str, list[tuple[float, float]]], test: int = 8, seed: int = 0):
    """Sensors with the toy fleet's frequency law at the given train (P, T) points each and
    ``test`` random off-grid test points; a ``×k`` suffix in a sensor id scales its labels."""
    rng = np.random.default_rng(seed)
    rows = []
    for sid, train in points.items():
        f0, k, tc = rng.normal(33_000, 150), rng.normal(2.3, 0.2), rng.normal(0.4, 0.2)
        scale = float(sid.split("x")[-1]) if "x" in sid else 1.0
        p_test, t_test = rng.uniform(50, 1550, test), rng.uniform(-40, 60, test)
        for split, pts in (("train", train), ("test", list(zip(p_test, t_test, strict=True)))):
            for p, t in pts:
                f = f0 + k * p + tc * t + 2e-4 * p * t - 1e-4 * p**2
                rows.append((sid, f, t, scale * p, split))
    return Fleet(pd.DataFrame(rows, columns=COLUMNS))


GRID_3X2 = [(p, t) for p in (100.0, 800.0, 1500.0) for t in (-30.0, 50.0)]  # 6 points


def random_points(n: int, rng: np.random.Generator) -> list[tuple[float, float]]:
    return list(zip(rng.uniform(50, 1550, n), rng.uniform(-40, 60, n), strict=True))


# ---- weak -------------------------------------------------------------------------------
def test_fedprior_fixed_on_an_all_6_point_fleet_is_weak_never_ok(tmp_path):
    """Every unit on the same 3×2 grid: the (4, 3) basis has 20 terms, 6 are seen; the other
    directions keep the vague prior and carry the predictions' σ → every unit "weak"."""
    fleet = chamber_fleet({f"S{i}": GRID_3X2 for i in range(6)})
    summary = run_experiment(config(), fleet, tmp_path, ["fedprior_fixed"])
    per_sensor = pd.read_csv(tmp_path / "runs" / "fedprior_fixed_tp0_seed0" / "per_sensor.csv")
    assert (per_sensor["status"] == "weak").all()
    assert per_sensor["status_reason"].str.contains("do not determine").all()
    row = summary.iloc[0]
    assert row["weak"] == 6 and row["excluded"] == 6 and row["sensors"] == 6
    assert math.isnan(row["rmse_mean"])  # no number from a weak sensor


def test_fedprior_on_a_fully_calibrated_fleet_is_not_weak(tmp_path):
    rng = np.random.default_rng(3)
    fleet = chamber_fleet({f"S{i}": random_points(40, rng) for i in range(6)})
    summary = run_experiment(config(unconverged_tol=1.0), fleet, tmp_path, ["fedprior_fixed"])
    assert summary.iloc[0]["weak"] == 0 and summary.iloc[0]["excluded"] == 0
    assert np.isfinite(summary.iloc[0]["rmse_mean"])


# ---- rejected ---------------------------------------------------------------------------
def test_a_poisoned_unit_is_rejected_and_said_so(tmp_path):
    """One unit's labels ×1000: its statistics are screened out every round → "rejected",
    with the round, the measured size and the threshold; the honest units stay ok."""
    rng = np.random.default_rng(4)
    points = {f"S{i}": random_points(30, rng) for i in range(6)}
    points["Sx1000"] = random_points(30, rng)
    notes = []
    summary = run_experiment(
        config(unconverged_tol=1.0),
        chamber_fleet(points),
        tmp_path,
        ["fedprior_fixed"],
        on_status=lambda label, note: notes.append(note),
    )
    run = tmp_path / "runs" / "fedprior_fixed_tp0_seed0"
    per_sensor = pd.read_csv(run / "per_sensor.csv").set_index("client")
    assert per_sensor.loc["Sx1000", "status"] == "rejected"
    assert "round 10: size" in per_sensor.loc["Sx1000", "status_reason"]
    honest = per_sensor.drop(index="Sx1000")
    assert not (honest["status"] == "rejected").any()
    rejections = pd.read_csv(run / "rejections.csv")
    assert set(rejections["client"]) == {"Sx1000"} and len(rejections) == 10
    assert (rejections["ratio"] > rejections["threshold"]).all()
    assert (rejections["threshold"] == 10.0).all()
    assert any("server rejected Sx1000's reply in 10 round(s) (1–10): size" in n for n in notes)
    row = summary.iloc[0]
    ok = per_sensor[per_sensor["status"] == "ok"]
    assert row["rejected_sensors"] == 1 and row["excluded"] == len(per_sensor) - len(ok)
    assert row["rmse_mean"] == pytest.approx(ok["test_rmse"].mean())


# ---- unconverged ------------------------------------------------------------------------
def history(e1: float, e2: float, rounds=(40, 50)) -> pd.DataFrame:
    return pd.DataFrame({"client_index": [0, 0], "round": list(rounds), "train_rmse": [e1, e2]})


FINAL = pd.DataFrame([{"client_index": 0, "client": "S0", "status": "ok"}])


def test_unconverged_by_hand():
    # 1.0 → 0.95 over 10 rounds: 0.5 %/round > 0.1 %/round
    status, why = sensor_statuses(FINAL, history(1.0, 0.95), [], {}, 50, "rmse")
    assert status == ["unconverged"] and "0.5 %/round" in why[0]
    # 1.0 → 0.999 over 10 rounds: 0.01 %/round: converged
    assert sensor_statuses(FINAL, history(1.0, 0.999), [], {}, 50, "rmse")[0] == ["ok"]
    assert UNCONVERGED_TOL == 1e-3
    # a rising train error is not "still improving"
    assert sensor_statuses(FINAL, history(1.0, 1.2), [], {}, 50, "rmse")[0] == ["ok"]
    # a unit whose train error is ≈ 0 (it interpolates its points) is judged on the fleet's
    # scale: 1e-4 → 0.9e-4 is 1 %/round of itself but 1e-6 of the fleet median (1.0)
    final = pd.DataFrame([{"client_index": i, "client": f"S{i}", "status": "ok"} for i in range(3)])
    rows = [(0, 40, 1.0), (0, 50, 1.0), (1, 40, 1.0), (1, 50, 0.9), (2, 40, 1e-4), (2, 50, 0.9e-4)]
    hist = pd.DataFrame(rows, columns=["client_index", "round", "train_rmse"])
    status, _ = sensor_statuses(final, hist, [], {}, 50, "rmse")
    assert status == ["ok", "unconverged", "ok"]
    # accuracy: its error rate 1 − accuracy is judged (0.90 → 0.95 is still improving)
    acc = pd.DataFrame({"client_index": [0, 0], "round": [40, 50], "train_accuracy": [0.9, 0.95]})
    assert sensor_statuses(FINAL, acc, [], {}, 50, "accuracy")[0] == ["unconverged"]
    acc["train_accuracy"] = [0.95, 0.9]
    assert sensor_statuses(FINAL, acc, [], {}, 50, "accuracy")[0] == ["ok"]
    # the configured tolerance: 1 never flags
    status, _ = sensor_statuses(FINAL, history(1.0, 0.5), [], {}, 50, "rmse", tolerance=1.0)
    assert status == ["ok"]


def test_a_short_sgd_run_is_unconverged_and_excluded(tmp_path, make_fleet):
    summary = run_experiment(config(rounds=3), make_fleet(num_clients=3), tmp_path, ["local"])
    per_sensor = pd.read_csv(tmp_path / "runs" / "local_tp0_seed0" / "per_sensor.csv")
    history_csv = pd.read_csv(tmp_path / "runs" / "local_tp0_seed0" / "metrics.csv")
    last = history_csv[history_csv["round"] >= 2].pivot(
        index="client_index", columns="round", values="train_rmse"
    )
    falling = (last[2] - last[3]) / last[2]  # per round (consecutive evaluations)
    # the other rule: final train RMSE > 10 × the unit's own least-squares fit's (scaled ×
    # y_scale), fleet median as the floor
    cfg = config(rounds=3)
    tensors = prepare(make_fleet(num_clients=3), cfg.data.scaling, cfg.engine.dtype)
    scale = float(np.asarray(tensors.scaler.y_scale).ravel()[0])
    own = own_fit_rmse(tensors.train.x, tensors.train.y[..., :1], tensors.train.mask).numpy()
    own = np.maximum(own * scale, np.median(own * scale))
    far = last[3].to_numpy() > OWN_FIT_FACTOR * own
    expected = np.where((falling > UNCONVERGED_TOL) | far, "unconverged", "ok")
    assert per_sensor["status"].tolist() == expected.tolist()
    assert summary.iloc[0]["unconverged"] == (expected == "unconverged").sum()


# ---- diverged, refused, precedence ------------------------------------------------------
def test_diverged_and_refused_by_hand():
    final = pd.DataFrame(
        [
            {"client_index": 0, "client": "A", "status": "diverged"},
            {"client_index": 1, "client": "B", "status": "diverged"},
            {"client_index": 2, "client": "C", "status": "ok"},
        ]
    )
    refused = {"refused": np.array([False, True, False]), "weak": np.array([True, True, True])}
    statuses, _ = sensor_statuses(final, pd.DataFrame(), [], refused, 1, "rmse")
    # a refusal is not a divergence; a non-finite model is not "weak"
    assert statuses == ["diverged", "refused", "weak"]


def test_polynomial_refusal_is_refused_not_diverged_and_not_in_the_mean(tmp_path):
    rng = np.random.default_rng(5)
    points = {f"S{i}": random_points(30, rng) for i in range(3)}
    points["S3"] = [(200.0, 0.0), (900.0, 0.0), (1400.0, 0.0)]  # one temperature: no surface
    summary = run_experiment(config(rounds=50), chamber_fleet(points), tmp_path, ["polynomial"])
    per_sensor = pd.read_csv(tmp_path / "runs" / "polynomial_tp0_seed0" / "per_sensor.csv")
    per_sensor = per_sensor.set_index("client")
    assert per_sensor.loc["S3", "status"] == "refused"
    assert (per_sensor.drop(index="S3")["status"] == "ok").all()
    row = summary.iloc[0]
    assert row["refused"] == 1 and row["diverged"] == 0 and row["excluded"] == 1
    assert row["rmse_mean"] == pytest.approx(per_sensor.drop(index="S3")["test_rmse"].mean())
    assert row["rmse_worst"] == pytest.approx(per_sensor.drop(index="S3")["test_rmse"].max())


# ---- coverage, tables -------------------------------------------------------------------
def test_coverage_worst_is_the_minimum():
    values = pd.Series([0.97, 0.41, 0.93])
    assert fleet_stat(values, "worst", "coverage95") == 0.41
    assert fleet_stat(values, "worst", "rmse") == 0.97


def test_the_printed_table_counts_excluded_sensors_and_fits_100_columns():
    from fedcal.report.tables import aggregate, excluded_note, rich_tables, table_columns

    base = {"train_points": 0, "wall_s": 1234.5, "bytes_up_per_round": 1.41e6, "sensors": 40}
    base.update(rejected=0, failed=0)
    rows = [
        {
            "method": "fedprior",
            "seed": 0,
            "rmse_mean": 0.0735,
            "rmse_worst": 0.31,
            "max_abs_worst": 1.2,
            "rmse_mean_pct_fs": 0.005,
            "coverage95_mean": 0.83,
            "coverage95_worst": 0.41,
            "excluded": 0,
            "weak": 0,
            "unconverged": 0,
            "rejected_sensors": 0,
            "diverged": 0,
            "refused": 0,
        },
        {
            "method": "fedprior_fixed",
            "seed": 0,
            "rmse_mean": float("nan"),
            "rmse_worst": float("nan"),
            "max_abs_worst": float("nan"),
            "rmse_mean_pct_fs": float("nan"),
            "coverage95_mean": float("nan"),
            "coverage95_worst": float("nan"),
            "excluded": 40,
            "weak": 40,
            "unconverged": 0,
            "rejected_sensors": 0,
            "diverged": 0,
            "refused": 0,
        },
        {
            "method": "fedpoly_p3_longer_name",
            "seed": 0,
            "rmse_mean": 655.0,
            "rmse_worst": 1991.0,
            "max_abs_worst": 5123.0,
            "rmse_mean_pct_fs": 43.7,
            "coverage95_mean": float("nan"),
            "coverage95_worst": float("nan"),
            "excluded": 20,
            "weak": 0,
            "unconverged": 0,
            "rejected_sensors": 20,
            "diverged": 0,
            "refused": 0,
        },
    ]
    table = aggregate(pd.DataFrame([{**base, **r} for r in rows]))
    console = Console(width=100, record=True, color_system=None)
    for t in rich_tables(table, table_columns(table, "hPa", show_bytes=True), "hPa"):
        console.print(t)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 100 and "…" not in text
    body = {line.split("│")[1].strip(): line for line in text.splitlines() if "│" in line}
    assert "n/a" in body["fedprior_fixed"] and "0.83/0.41" in body["fedprior"]
    assert "diverged" not in text  # excluded is not diverged
    cells = [c.strip() for c in body["fedpoly_p3_longer_name"].strip("│").split("│")]
    assert "—" in cells and "20" in cells  # coverage not stated; 20 sensors excluded
    notes = excluded_note(table)
    assert notes == [
        "fedprior_fixed: 40 of 40 sensors excluded from the means: 40 weak",
        "fedpoly_p3_longer_name: 20 of 40 sensors excluded from the means: 20 rejected",
    ]


# ---- one round for closed-form methods --------------------------------------------------
def test_a_one_shot_method_runs_one_round_with_the_same_numbers(make_fleet):
    from fedcal.algorithms.polynomial import PolynomialCalibration
    from fedcal.core.task import Task
    from fedcal.core.tree import flatten
    from fedcal.engine.simulation import EngineConfig, prepare, simulate
    from fedcal.models.mlp import MLP

    @dataclass(frozen=True)
    class Repeated(PolynomialCalibration):  # the same method, run every round as before
        one_shot = False

    fleet = prepare(make_fleet(num_clients=3, train=[30, 18, 25]), dtype="float64")
    config_ = EngineConfig(rounds=20, seed=2, dtype="float64")
    assert PolynomialCalibration.one_shot
    one = simulate(PolynomialCalibration(Task(MLP())), fleet, config_)
    many = simulate(Repeated(Task(MLP())), fleet, config_)
    assert one.rounds_done == 1 and many.rounds_done == 20
    assert {r["round"] for r in one.history} == {1}
    for key, value in flatten(many.personal).items():
        assert torch.equal(value, flatten(one.personal)[key]), key
    last = [{k: v for k, v in r.items() if k != "round"} for r in many.history[-3:]]
    assert [{k: v for k, v in r.items() if k != "round"} for r in one.history] == last
    assert one.final == many.final


# ---- unconverged: far above the unit's own fit ------------------------------------------
def test_own_fit_rmse_equals_numpy_least_squares():
    """The own fit: total degree 3 on a 1-input unit of 20 points (4 terms ≤ 10) equals
    numpy's cubic least squares; 2 inputs and 6 points: degree 1 (3 terms); 5 points: none."""
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, 20)
    y = np.sin(3 * x) + 0.1 * rng.normal(size=20)
    want = np.sqrt(np.mean((np.polyval(np.polyfit(x, y, 3), x) - y) ** 2))
    mask = torch.ones(1, 20)
    got = own_fit_rmse(torch.tensor(x).reshape(1, 20, 1), torch.tensor(y).reshape(1, 20), mask)
    assert float(got[0]) == pytest.approx(want, rel=1e-9)
    # 2 inputs, padded rows: 6 points → a plane (3 terms); 5 points → no check (NaN)
    x2 = torch.tensor(rng.uniform(-1, 1, (2, 7, 2)))
    y2 = torch.tensor(rng.normal(size=(2, 7)))
    m2 = torch.tensor([[1.0] * 6 + [0.0], [1.0] * 5 + [0.0, 0.0]])
    got2 = own_fit_rmse(x2, y2, m2)
    a = np.c_[np.ones(6), x2[0, :6].numpy()]
    res = y2[0, :6].numpy() - a @ np.linalg.lstsq(a, y2[0, :6].numpy(), rcond=None)[0]
    assert float(got2[0]) == pytest.approx(np.sqrt(np.mean(res**2)), rel=1e-9)
    assert math.isnan(float(got2[1]))


def test_unconverged_when_far_above_its_own_fit_by_hand():
    final = pd.DataFrame([{"client_index": i, "client": f"S{i}", "status": "ok"} for i in range(4)])
    flat = pd.DataFrame(
        {"client_index": [0, 0, 1, 1, 2, 2, 3, 3], "round": [40, 50] * 4, "train_rmse": [1.0] * 8}
    )
    # (final train error, own fit's): 15.2 vs 0.107 (the S11) → unconverged; 0.5 vs
    # 0.1 → ok; an own fit that interpolates (1e-6) is judged on the fleet median (0.1);
    # no own fit (NaN) → no check
    own = {0: (15.2, 0.107), 1: (0.5, 0.1), 2: (0.5, 1e-6), 3: (50.0, math.nan)}
    status, why = sensor_statuses(final, flat, [], {}, 50, "rmse", own_fit=own)
    assert status == ["unconverged", "ok", "ok", "ok"]
    assert "142× its own least-squares fit's 0.107" in why[0] and OWN_FIT_FACTOR == 10.0
    # the tolerance 1 turns it off too
    status, _ = sensor_statuses(final, flat, [], {}, 50, "rmse", 1.0, own_fit=own)
    assert status == ["ok"] * 4


def test_a_role_with_no_ok_sensor_reads_n_a_not_diverged():
    """Mixed fleet where every new unit is weak but the reference units are ok: the new units'
    cells say n/a (nothing to show), never "diverged" (summary's diverged count is 0)."""
    from fedcal.report.tables import cell

    row = pd.Series(
        {
            "rmse_mean": 0.05,
            "rmse_mean_new": float("nan"),
            "rmse_mean_reference": 0.05,
            "sensors": 40,
            "excluded": 20,
            "sensors_new": 20,
            "excluded_new": 20,
            "sensors_reference": 20,
            "excluded_reference": 0,
            "diverged": 0,
        }
    )
    assert cell(row, "rmse_mean_new", short=True) == "n/a"
    assert (
        cell(row, "rmse_mean_reference", short=True) == "0.0500"
    )  # 3 significant digits, zeros kept (issue 37.2)
    # a role with one ok sensor whose value is NaN is a real non-finite number: "diverged"
    partly = row.copy()
    partly["excluded_new"] = 19
    assert cell(partly, "rmse_mean_new", short=True) == "diverged"


def test_a_role_named_with_an_underscore_with_no_ok_sensor_reads_n_a():
    """A role is any value of the fleet's role column (here "new_unit"): its cells are
    found by the role's whole name, not by the column name's last part."""
    from fedcal.report.tables import cell

    row = pd.Series(
        {
            "rmse_mean": 0.05,
            "rmse_mean_new_unit": float("nan"),
            "sensors": 40,
            "excluded": 20,
            "sensors_new_unit": 20,
            "excluded_new_unit": 20,
            "sensors_reference": 20,
            "excluded_reference": 0,
        }
    )
    assert cell(row, "rmse_mean_new_unit", short=True) == "n/a"
    partly = row.copy()
    partly["excluded_new_unit"] = 19
    assert cell(partly, "rmse_mean_new_unit", short=True) == "diverged"


# ---- down-weighted is not rejected (issue 37.2) ------------------------------------------
def test_a_down_weighting_in_the_final_rounds_is_ok_and_said_as_such():
    """fedprior's M-step weight is recorded like a rejection (reason "prior outlier: …"), but
    the reply was aggregated: status ok, its reason says down-weighted; a size rejection in
    the same rounds is still "rejected". The run's notes say which is which."""
    from fedcal.experiment import status_notes

    low = "prior outlier: distance 120 > cut-off 64.8, M-step weight 0.29"
    flat = history(1.0, 1.0)
    final = pd.DataFrame(
        [{"client_index": 0, "client": "S0", "status": "ok"},
         {"client_index": 1, "client": "S1", "status": "ok"}]
    )  # fmt: skip
    records = [
        {"round": 50, "client_index": 0, "client": "S0", "reason": low, "ratio": 120.0,
         "threshold": 64.8},
        {"round": 50, "client_index": 1, "client": "S1", "reason": "size", "ratio": 52.0,
         "threshold": 10.0},
    ]  # fmt: skip
    status, why = sensor_statuses(final, flat, records, {}, 50, "rmse")
    assert status == ["ok", "rejected"]
    assert why[0] == f"down-weighted in round 50 (still aggregated): {low}"
    final["status"] = status
    notes = status_notes(final, pd.DataFrame(records))
    assert f"server down-weighted S0's reply in 1 round(s) (50): {low} (still aggregated)" in notes
    assert "server rejected S1's reply in 1 round(s) (50): size 52 > threshold 10" in notes
    assert not any("rejected S0" in n for n in notes)


def test_the_status_vocabulary_is_one_enum_in_order_of_precedence():
    """Status is declared once, least severe first; its members are the strings the files
    hold; the first rule that applies in sensor_statuses is the most severe one."""
    from fedcal.report.figures import sensor_points
    from fedcal.report.tables import STATUS_COUNTS
    from fedcal.status import COUNT_COLUMNS, NOT_OK, STATUSES, Status, most_severe

    assert [str(s) for s in STATUSES] == [
        "ok", "unconverged", "weak", "rejected", "diverged", "refused"
    ]  # fmt: skip
    assert Status.WEAK == "weak" and f"{Status.REFUSED}" == "refused"
    assert NOT_OK == ("refused", "diverged", "rejected", "weak", "unconverged")
    assert set(COUNT_COLUMNS) == set(STATUSES[1:])
    assert sorted(STATUS_COUNTS.values()) == sorted(str(s) for s in STATUSES[1:])
    # every pair of flags: the more severe one wins, by the rules' order
    final = pd.DataFrame([{"client_index": 0, "client": "A", "status": "ok"}])
    flags = {"refused": np.array([True]), "weak": np.array([True])}
    got, _ = sensor_statuses(final, pd.DataFrame(), [], flags, 1, "rmse")
    assert got == [most_severe(["refused", "weak"])] == ["refused"]
    assert type(got[0]) is str  # a plain string in per_sensor.csv, not an enum member
    # a status no member spells ranks just above ok (another fedcal's file)
    assert most_severe(["ok", "mystery"]) == "mystery"
    assert most_severe(["mystery", "unconverged"]) == "unconverged"
    table = pd.DataFrame(
        {
            "method": ["m"] * 4,
            "client": ["A", "A", "B", "B"],
            "test_rmse": [1.0, 1.0, 2.0, 2.0],
            "status": ["weak", "unconverged", "ok", None],
        }
    )
    points = sensor_points(table, ["m"]).set_index("client")
    assert points.loc["A", "status"] == "weak" and points.loc["B", "status"] == "diverged"
    assert not points.loc["B", "drawn"]
