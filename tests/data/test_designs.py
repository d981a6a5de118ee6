"""Chamber designs, mixed fleets, off-grid test points and the humidity generator."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from fedcal.data.fleet import Fleet
from fedcal.data.humidity import LAW, HumiditySpec, capacitance, humidity_fleet, unit_parameters
from fedcal.data.simulator import (
    FleetSpec,
    measurement_plan,
    parse_design,
    quartz_frequency,
    sensor_parameters,
    simulate_fleet,
)

NO_OFFSETS = FleetSpec(plateau_offset_c=0.0)


@pytest.mark.parametrize(
    ("design", "pressures", "temperatures"),
    [
        ("3x2", [50, 800, 1550], [-40, 60]),
        ("4x3", [50, 550, 1050, 1550], [-40, 10, 60]),
        ("6x4", [50, 350, 650, 950, 1250, 1550], [-40, -40 + 100 / 3, -40 + 200 / 3, 60]),
        ("2x1", [50, 1550], [10]),  # one plateau: the middle of the range
    ],
)
def test_grid_design_levels_counts_and_order(design, pressures, temperatures):
    plan = measurement_plan(NO_OFFSETS, 0, design)
    train = plan[plan["split"] == "train"]
    assert len(train) == len(pressures) * len(temperatures)
    # Plateau by plateau, cold to hot; one ascending sweep over every level on each.
    expected_t = np.repeat(temperatures, len(pressures))
    expected_p = np.tile(pressures, len(temperatures))
    np.testing.assert_allclose(train["temperature_true_c"], expected_t, atol=1e-12)
    np.testing.assert_allclose(train["pressure_hpa"], expected_p, atol=1e-12)
    assert (train["direction"] == "up").all() and (train["sweep"] == 0).all()
    assert train["plateau"].tolist() == list(np.repeat(range(len(temperatures)), len(pressures)))


def test_grid_test_rows_are_the_campaigns():
    spec = FleetSpec(test_design="random")
    campaign = measurement_plan(spec, 3)
    small = measurement_plan(spec, 3, "3x2")
    pd.testing.assert_frame_equal(
        campaign[campaign["split"] == "test"].reset_index(drop=True),
        small[small["split"] == "test"].reset_index(drop=True),
    )
    assert (campaign["split"] == "train").sum() == 384  # the campaign is unchanged


def test_grid_plateaus_carry_chamber_offsets():
    spec = FleetSpec(plateau_offset_c=0.2)
    train = measurement_plan(spec, 0, "4x3").query("split == 'train'")
    per_plateau = train.groupby("plateau")["temperature_true_c"]
    assert (per_plateau.nunique() == 1).all()  # one chamber temperature per plateau
    offsets = per_plateau.first().to_numpy() - np.array([-40.0, 10.0, 60.0])
    assert np.all(offsets != 0) and np.all(np.abs(offsets) < 1.0)
    # Another design is another chamber run.
    other = measurement_plan(spec, 0, "3x3").query("split == 'train'")
    other_offsets = other.groupby("plateau")["temperature_true_c"].first() - [-40.0, 10.0, 60.0]
    assert not np.allclose(other_offsets.to_numpy(), offsets)


def test_one_sweep_design_carries_ascending_hysteresis():
    # Only hysteresis on: an ascending point reads P − H·sin(π(P − Pmin)/(Pmax − Pmin)).
    ideal = dict(
        pressure_noise_hpa=0.0,
        ripple_hpa=0.0,
        temperature_noise_c=0.0,
        plateau_offset_c=0.0,
        temperature_bias_c=0.0,
        temperature_gain_std=0.0,
    )
    hyst = simulate_fleet(FleetSpec(num_sensors=1, train_design="3x2", **ideal), 0)
    flat = simulate_fleet(
        FleetSpec(num_sensors=1, train_design="3x2", hysteresis_hpa=(0.0, 0.0), **ideal), 0
    )
    prm = sensor_parameters(FleetSpec(num_sensors=1, **ideal), 0).iloc[0]
    h = prm["hysteresis_hpa"]
    rows = hyst.frame[hyst.frame["split"] == "train"]
    p = rows["pressure_hpa"].to_numpy()
    felt = p - h * np.sin(np.pi * (p - 50.0) / 1500.0)
    np.testing.assert_allclose(
        rows["frequency_hz"], quartz_frequency(felt, rows["temperature_c"], prm), rtol=1e-13
    )
    middle = flat.frame[flat.frame["split"] == "train"]["frequency_hz"].to_numpy()
    assert np.all(rows["frequency_hz"].to_numpy()[1::3] < middle[1::3])  # 800 hPa: read low


@pytest.mark.parametrize("bad", ["3y2", "x2", "3x", "1x2", "3x0", "", "campaign2"])
def test_bad_designs_are_refused_with_the_value(bad):
    with pytest.raises(ValueError, match="train_design") as err:
        FleetSpec(train_design=bad)
    assert repr(bad) in str(err.value)
    with pytest.raises(ValueError):
        parse_design(bad)
    assert parse_design("campaign") is None and parse_design("6x4") == (6, 4)


def test_mixed_fleet_roles_counts_and_units():
    spec = FleetSpec(num_reference=3, num_new=2, train_design="3x2", test_design="random")
    fleet = simulate_fleet(spec, 0)
    assert fleet.roles == {
        "S000": "reference",
        "S001": "reference",
        "S002": "reference",
        "S003": "new",
        "S004": "new",
    }
    assert fleet.meta["roles"] == fleet.roles
    counts = fleet.frame.groupby(["sensor_id", "split"]).size().unstack()
    assert counts["train"].tolist() == [384, 384, 384, 6, 6]
    assert counts["test"].tolist() == [60] * 5
    # Unit i is the same sensor as in a plain fleet, whatever its role and design.
    plain = FleetSpec(num_sensors=5, test_design="random")
    pd.testing.assert_frame_equal(sensor_parameters(spec, 0), sensor_parameters(plain, 0))
    full = simulate_fleet(plain, 0).frame
    small = simulate_fleet(dataclasses.replace(plain, train_design="3x2"), 0).frame
    cols = ["frequency_hz", "temperature_c", "pressure_hpa", "split"]
    for sid, source in [("S000", full), ("S002", full), ("S003", small), ("S004", small)]:
        mine = fleet.frame[fleet.frame["sensor_id"] == sid][cols].reset_index(drop=True)
        theirs = source[source["sensor_id"] == sid][cols].reset_index(drop=True)
        pd.testing.assert_frame_equal(mine, theirs)
    # Test rows are the same chamber points for every unit (one chamber run).
    test = fleet.frame[fleet.frame["split"] == "test"]
    per_unit = test.groupby("sensor_id")["pressure_hpa"].apply(np.asarray)
    assert all(np.array_equal(per_unit.iloc[0], v) for v in per_unit)


def test_plain_fleet_has_no_roles_and_conflicting_roles_are_refused():
    fleet = simulate_fleet(FleetSpec(num_sensors=2, train_design="4x3"), 0)
    assert fleet.roles is None and "role" not in fleet.frame.columns
    frame = fleet.frame.assign(role="new")
    frame.loc[frame.index[0], "role"] = "reference"
    with pytest.raises(ValueError, match="S000"):
        _ = Fleet(frame).roles


def test_random_test_points_cover_the_calibrated_rectangle_uniformly():
    spec = FleetSpec(test_design="random", test_points_per_plateau=1000)  # 6000 points
    test = measurement_plan(spec, 0).query("split == 'test'")
    p, t = test["pressure_hpa"].to_numpy(), test["temperature_true_c"].to_numpy()
    assert p.min() >= 50 and p.max() <= 1550 and t.min() >= -40 and t.max() <= 60
    assert p.min() < 52 and p.max() > 1548 and t.min() < -39.8 and t.max() > 59.8
    # 5 × 5 cells of the rectangle: each holds 1/25 of the points (binomial sd ≈ 15).
    cells, _, _ = np.histogram2d(p, t, bins=5, range=[[50, 1550], [-40, 60]])
    assert np.all(np.abs(cells - 240) < 5 * np.sqrt(6000 * 0.04 * 0.96)), cells
    # Independent coordinates and both directions.
    assert abs(np.corrcoef(p, t)[0, 1]) < 0.05
    assert 0.45 < (test["direction"] == "up").mean() < 0.55


# ---- the humidity generator ---------------------------------------------------


def test_humidity_fleet_is_deterministic_per_seed():
    a, b = (
        humidity_fleet(HumiditySpec(num_units=6), 4),
        humidity_fleet(HumiditySpec(num_units=6), 4),
    )
    pd.testing.assert_frame_equal(a.frame, b.frame)
    c = humidity_fleet(HumiditySpec(num_units=6), 5)
    assert not np.allclose(a.frame["capacitance_pf"][:20], c.frame["capacitance_pf"][:20])
    # Unit i does not change when units are added.
    more = humidity_fleet(HumiditySpec(num_units=9), 4).frame
    pd.testing.assert_frame_equal(more[more["sensor_id"].isin(a.client_ids)], a.frame)


def test_humidity_fleet_shape_and_outliers():
    spec = HumiditySpec(num_units=30, outlier_rate=0.2)
    fleet = humidity_fleet(spec, 0)
    assert fleet.features == ("capacitance_pf", "temperature_c", "supply_v")
    counts = fleet.frame.groupby(["sensor_id", "split"]).size().unstack()
    assert counts["train"].between(8, 15).all() and (counts["test"] == 40).all()
    assert counts["train"].nunique() > 3  # point counts differ between units
    train = fleet.frame[fleet.frame["split"] == "train"]
    assert 0.1 < train["outlier"].mean() < 0.3
    assert not fleet.frame.loc[fleet.frame["split"] == "test", "outlier"].any()
    clean = humidity_fleet(dataclasses.replace(spec, outlier_rate=0.0), 0).frame
    assert not clean["outlier"].any()
    # Outliers move only the reference reading: the sensor's inputs are unchanged.
    cols = ["capacitance_pf", "temperature_c", "supply_v"]
    pd.testing.assert_frame_equal(fleet.frame[cols], clean[cols])
    jump = (fleet.frame["rh_percent"] - clean["rh_percent"]).abs()
    assert (jump[fleet.frame["outlier"]].between(8, 20)).all()
    assert (jump[~fleet.frame["outlier"]] == 0).all()


def test_humidity_physics_by_hand():
    law = {k: v[0] for k, v in LAW.items()}
    # At 25 °C and 3.3 V: C = C0 + S·h + k·h² = 180 + 0.3·50 + 4e-4·2500 = 196 pF.
    assert capacitance(50.0, 25.0, 3.3, law) == pytest.approx(196.0)
    # 35 °C, 3.5 V: (180·(1 + 4e-3) + 15·(1 + 2e-2) + 1)·(1 + 0.01·0.2)
    assert capacitance(50.0, 35.0, 3.5, law) == pytest.approx((180.72 + 15.3 + 1.0) * 1.002)
    units = unit_parameters(HumiditySpec(num_units=400), 0)
    assert units["c0_pf"].std() / 180.0 == pytest.approx(0.03, rel=0.15)
    assert units["noise_pf"].between(0.02, 0.15).all()
    same = unit_parameters(HumiditySpec(num_units=3, heterogeneity=0.0), 0)
    assert np.allclose(same["c0_pf"], 180.0) and np.allclose(same["gamma_per_v"], 0.01)


def test_humidity_noise_differs_across_units_and_grows_with_the_signal():
    spec = HumiditySpec(num_units=40, outlier_rate=0.0, test_points=400)
    fleet, units = humidity_fleet(spec, 1), unit_parameters(spec, 1)
    # Residual of a per-unit quadratic fit on the clean test rows, low vs high humidity.
    low, high, level = [], [], []
    for sid, g in fleet.frame[fleet.frame["split"] == "test"].groupby("sensor_id"):
        x = g[["capacitance_pf", "temperature_c", "supply_v"]].to_numpy()
        z = (x - x.mean(0)) / x.std(0)
        design = np.column_stack(
            [np.ones(len(z)), z, z**2, z[:, 0] * z[:, 1], z[:, 0] * z[:, 2], z[:, 1] * z[:, 2]]
        )
        y = g["rh_percent"].to_numpy()
        resid = y - design @ np.linalg.lstsq(design, y, rcond=None)[0]
        low.append(resid[y < 30].std())
        high.append(resid[y > 70].std())
        level.append(units.loc[sid, "noise_pf"])
    assert np.median(np.array(high) / np.array(low)) > 1.5
    assert np.corrcoef(level, low)[0, 1] > 0.8
