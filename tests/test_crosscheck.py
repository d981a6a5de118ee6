"""studies/crosscheck.py: the independent fleet generator's physics invariants (G1–G6)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from fedcal.data.loader import load_fleet
from studies import crosscheck as cc


@pytest.fixture(scope="module")
def units() -> pd.DataFrame:
    return cc.make_units(seed=3, n_units=300, n_lots=3)


def test_frequency_hand_computed() -> None:
    """(G1)–(G3) at 25 °C (f₀ = F₀, k = K₀): mid-span P = 700 hPa carries the full
    hysteresis η (up reads P − η), the span's end none."""
    u = pd.Series({"F0": 30_000.0, "K0": 2e-4, "a1": -3e-5, "a2": 0.0, "b1": 0.0, "b2": 0.0,
                   "eta": 0.05})  # fmt: skip
    p, t = np.array([700.0, 700.0, 1300.0]), np.full(3, 25.0)
    f = cc.frequency(u, p, t, np.array([1.0, -1.0, 1.0]))
    assert f[0] == pytest.approx(30_000.0 * math.sqrt(1 + 2e-4 * 699.95), rel=1e-12)
    assert f[1] == pytest.approx(30_000.0 * math.sqrt(1 + 2e-4 * 700.05), rel=1e-12)
    assert f[2] == pytest.approx(30_000.0 * math.sqrt(1 + 2e-4 * 1300.0), rel=1e-12)
    # 10 K warmer: f₀ = F₀ (1 + a₁·10)
    warm = cc.frequency(u, np.array([1300.0]), np.array([35.0]), np.array([1.0]))
    assert warm[0] == pytest.approx(30_000.0 * (1 - 3e-4) * math.sqrt(1.26), rel=1e-12)


def test_frequency_rises_with_pressure(units: pd.DataFrame) -> None:
    """Every unit, both branches, every temperature of the box: f strictly increasing in P."""
    p = np.linspace(cc.P_LO, cc.P_HI, 241)
    for _, u in units.iloc[:50].iterrows():
        for t in (cc.T_LO, 20.0, cc.T_HI):
            for s in (1.0, -1.0):
                f = cc.frequency(u, p, np.full_like(p, t), np.full_like(p, s))
                assert np.all(np.diff(f) > 0)


def test_units_of_a_lot_are_correlated(units: pd.DataFrame) -> None:
    """Lot effects dominate (lot sd 2.5 × unit sd): most of F₀'s variance is between lots;
    and F₀, K₀ share δh, δs, so they are strongly anti-correlated (not independent)."""
    between = units.groupby("lot").F0.transform("mean").var()
    assert between / units.F0.var() > 0.6
    assert np.corrcoef(units.F0, units.K0)[0, 1] < -0.5
    # without lot effects the between-lot share is what 3 groups of ~100 leave by chance
    flat = cc.Nominal(lot_sd=(0.0, 0.0, 0.0, 0.0))
    alone = cc.make_units(seed=3, n_units=300, n_lots=3, nom=flat)
    assert alone.groupby("lot").F0.transform("mean").var() / alone.F0.var() < 0.05


def test_fleet_deterministic_and_loadable(tmp_path) -> None:
    """Same seed → the same file; another seed → other readings; fedcal's loader accepts
    it (columns, split, role, direction); designs have their point counts; test points lie
    in the box, their references clean (exact set points)."""
    a = cc.make_fleet(5, "stagger", 3, 3, 12, test_points=40)
    pd.testing.assert_frame_equal(a, cc.make_fleet(5, "stagger", 3, 3, 12, test_points=40))
    assert not np.allclose(
        a.frequency_hz, cc.make_fleet(6, "stagger", 3, 3, 12, test_points=40).frequency_hz
    )
    train = a[a.split == "train"].groupby("sensor_id").size()
    assert train.tolist() == [80, 80, 80, 12, 12, 12]
    test = a[a.split == "test"]
    assert test.groupby("sensor_id").size().eq(40).all()
    assert test.pressure_hpa.between(cc.P_LO, cc.P_HI).all()
    assert test.temperature_c.between(cc.T_LO - 0.1, cc.T_HI + 0.1).all()
    path = tmp_path / "fleet.csv"
    a.to_csv(path, index=False)
    fleet = load_fleet(path)
    assert fleet.roles == {f"U{i:03d}": "reference" if i < 3 else "new" for i in range(6)}


def test_thermal_lag_on_a_temperature_step() -> None:
    """(G4): after a +60 K step the first point's resonator is still colder than the
    recorded set point, so its f is that of T_set − 60·exp(−dwell/τ) (noise off)."""
    quiet = cc.Nominal(f_noise=0.0, t_noise=0.0, p_ref_noise=0.0)
    u = cc.make_units(0, 1).iloc[0]
    plan = cc.lhs_campaign(np.random.default_rng(0), 10)
    rows = cc.unit_rows(u, plan, np.random.default_rng(0), quiet, "train")
    lag = plan.t_step.to_numpy() * math.exp(-15.0 / u.tau)
    sign = np.where(plan.direction == "up", 1.0, -1.0)
    want = cc.frequency(u, plan.p.to_numpy(), plan.t.to_numpy() - lag, sign)
    np.testing.assert_allclose(rows.frequency_hz, want, rtol=1e-13)
    assert np.abs(lag).max() > 1e-3  # the lag is there, not a no-op
    np.testing.assert_allclose(rows.temperature_c, plan.t)  # the reading is the set point
