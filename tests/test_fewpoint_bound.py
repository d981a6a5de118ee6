"""fedcal_support/fewpoint_library.py (studies/fewpoint_bound.py): the simulator's physics; its
Gaussian is Bayes."""

from __future__ import annotations

import numpy as np

from fedcal.config import load_config
from fedcal_support import fewpoint_library


def bench():
    return fewpoint_library


def test_library_physics_and_truth_match_the_simulated_fleet():
    """The vectorized physics reproduces the fleet's own rows from its units' parameters
    and noise draws; each unit's dense truth predicts its test points to the floor."""
    b = bench()
    new, prm, spec = b.fleet_units(load_config("fewpoint"), "3x2", 1)
    assert new.f.shape == (20, 6) and new.test_f.shape == (20, 60)
    assert b.check_library_physics(spec, prm, new, 1, "3x2") == 0.0
    coords = b.Coordinates(float(new.test_f.min()) - 500.0, float(new.test_f.max()) + 500.0)
    coef, fit_err = b.dense_truth(spec, prm, coords)
    assert fit_err < 1e-3  # hPa, over the dense grid
    floor = b.function_rmse(coef, new, coords)
    # hysteresis of unknown branch (≤ 0.10 hPa), ripple (≤ 0.03) and noise (0.01)
    assert 0.02 < floor.mean() < 0.06 and floor.max() < 0.12


def test_gaussian_posterior_is_the_conditional_mean_of_the_joint_gaussian():
    """μ + ΣΦᵀ(ΦΣΦᵀ + S_e)⁻¹(y − Φμ − m_e) against the joint Gaussian's conditional, by hand."""
    b = bench()
    rng = np.random.default_rng(0)
    coords = b.Coordinates(30_000.0, 40_000.0)
    f, t = rng.uniform(31_000, 39_000, (3, 6)), rng.uniform(-40, 60, (3, 6))
    units = b.Units(f, t, rng.normal(800, 400, 6), f[:, :1], t[:, :1], np.zeros(1))
    a = rng.standard_normal((30, 30))
    mu, sigma = rng.standard_normal(30), a @ a.T / 30
    m_e, s_e = 0.1 * rng.standard_normal(6), 0.05 * np.eye(6)
    got, loglik = b.gaussian_posterior(units, coords, mu, sigma, m_e, s_e)
    for i in range(3):
        phi = coords.basis(f[i], t[i])
        cov_yy = phi @ sigma @ phi.T + s_e
        gain = sigma @ phi.T @ np.linalg.inv(cov_yy)
        want = mu + gain @ (units.y - phi @ mu - m_e)
        np.testing.assert_allclose(got[i], want, rtol=1e-8, atol=1e-8)
        r = units.y - phi @ mu - m_e
        ll = -0.5 * (r @ np.linalg.solve(cov_yy, r) + np.linalg.slogdet(cov_yy)[1])
        assert abs(loglik[i] - (ll - 3 * np.log(2 * np.pi))) < 1e-8


def test_explicit_points_of_later_units_match_with_their_sensor_offset():
    """frame_units/check_library_physics on units after the first new ones, at explicit
    points with both sweeps (studies/planner_bound.py's case): exact with the units' own
    first sensor index, and not with the default one (the noise draws are per sensor)."""
    import dataclasses

    from fedcal.data.simulator import POINTS, simulate_fleet

    b = bench()
    cfg = load_config("fewpoint")
    pts = ((50.0, -20.0, "up"), (1550.0, -20.0, "down"), (750.0, 40.0, "down"))
    spec = dataclasses.replace(
        dataclasses.replace(cfg.fleet, seed=2, num_reference=2, num_new=5).spec(),
        train_design=POINTS,
        design_points=pts,
    )
    fleet = simulate_fleet(spec, 2)
    new = fleet.frame[fleet.frame["role"] == "new"]
    later = list(dict.fromkeys(new[fleet.client_column]))[3:]
    fleet = dataclasses.replace(fleet, frame=new[new[fleet.client_column].isin(later)])
    units, prm, got_spec = b.frame_units(fleet, 2)
    assert units.f.shape == (2, 3) and list(prm.index) == later
    assert b.check_library_physics(got_spec, prm, units, 2, POINTS, first=2 + 3) == 0.0
    assert b.check_library_physics(got_spec, prm, units, 2, POINTS) > 1e-3
