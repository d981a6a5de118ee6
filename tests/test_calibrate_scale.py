"""`fedcal calibrate`'s batched solves equal the per-unit computations they replace.

A prior with per-unit noise (fedprior_sensor) from 12 units with a 4x3 design (5 EM
rounds), then 5 new units, one of
them with only 4 of its 6 points (so padding rows are exercised): the noise fixed
point equals 25 full client steps to the bit, the σ grid equals
``predictive_std`` to the bit, its low-rank summary (units.csv's mean and max σ) equals
the dense grid's within 1e-12 and the closed form s + tr(QM) of the mean of σ², the
fleet distance batched (2 units a chunk) equals a unit-by-unit computation, and the
range check names the first unit outside.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcal import calibration
from fedcal.api import FleetPrior
from fedcal.core.bayes import F64
from fedcal.core.tree import expand
from fedcal.data.fleet import Fleet
from fedcal.data.simulator import FleetSpec, simulate_fleet


@pytest.fixture(scope="module")
def setup():
    reference = simulate_fleet(FleetSpec(num_sensors=12, train_design="4x3"), seed=3).frame
    # Per-unit noise levels: the fixed point then moves each unit's σ_i².
    prior = FleetPrior(method="fedprior_sensor", rounds=5).fit(reference)
    new = simulate_fleet(FleetSpec(num_sensors=5, train_design="3x2"), seed=4)
    frame = new.frame[new.frame["split"] == "train"]
    short = frame.index[frame["sensor_id"] == frame["sensor_id"].iloc[0]][:2]
    frame = frame.drop(short).reset_index(drop=True)  # the first unit: 4 points
    fleet = Fleet(frame, new.features, new.target, new.client_column, new.meta)
    return prior.model_, fleet, calibration.calibrate(prior.model_, fleet)


def test_noise_fixed_point_equals_the_full_client_steps(setup):
    _, _, result = setup
    alg, train = result.algorithm, result.tensors.train
    down = expand(alg.broadcast(result.server), train.num_clients)
    state = alg.client_init(down)
    for _ in range(calibration.NOISE_ITERATIONS):
        state = alg.client_update(down, state, train).state
    assert torch.equal(state["noise_var"], result.personal["noise_var"])
    assert (state["noise_var"] != down["noise_var"]).all()  # each unit's σ_i² moved


def test_grid_sigma_equals_predictive_std(setup):
    prior, _, result = setup
    alg = result.algorithm
    grid = torch.as_tensor(result.tensors.scaler.x(calibration.operating_grid(prior)), dtype=F64)
    n = result.tensors.num_clients
    # 3x2 units get no interval from this prior (declined: σ NaN); without that flag, the
    # posterior's σ: both must agree to the bit.
    for personal in (
        result.personal,
        {k: v for k, v in result.personal.items() if k != "declined"},
    ):
        reference = alg.predictive_std(personal, grid.expand(n, -1, -1))[..., 0].numpy()
        fast = calibration.grid_sigma(alg, personal, grid)
        assert np.array_equal(fast, reference, equal_nan=True)
    assert np.isfinite(fast).all() and (fast > 0).all()


def _distance_one_by_one(alg, server, noise_var, data):
    """The per-unit loop fleet_distance replaced (d² = ‖P_A e‖², module doc there)."""
    design = alg.design(data.x, data.branch).to(F64)
    resid = data.y[..., 0].to(F64) - design @ server["mu"].to(F64)
    d2, dof = [], []
    for i in range(design.shape[0]):
        rows = data.mask[i] > 0
        phi, r = design[i][rows], resid[i][rows]
        cov = phi @ server["sigma"].to(F64) @ phi.T + noise_var[i] * torch.eye(len(r), dtype=F64)
        chol = torch.linalg.cholesky(cov)
        e = torch.linalg.solve_triangular(chol, r.unsqueeze(-1), upper=False)[:, 0]
        a = torch.linalg.solve_triangular(chol, phi, upper=False)
        u, sv, _ = torch.linalg.svd(a, full_matrices=False)
        rank = int((sv > 1e-10 * sv.max()).sum())
        proj = u[:, :rank].T @ e
        d2.append(float(proj @ proj))
        dof.append(rank)
    return np.array(d2), np.array(dof)


def test_batched_fleet_distance_equals_unit_by_unit(setup, monkeypatch):
    _, _, result = setup
    from fedcal.prior import qa  # the batched solve both calibrate paths use

    monkeypatch.setattr(qa, "DISTANCE_CHUNK", 2)  # 3 chunks, the last of 1 unit
    train, noise = result.tensors.train, result.personal["noise_var"]
    d2, dof = calibration.fleet_distance(result.algorithm, result.server, noise, train)
    ref_d2, ref_dof = _distance_one_by_one(result.algorithm, result.server, noise, train)
    assert train.count.tolist() == [4, 6, 6, 6, 6]
    assert dof.tolist() == ref_dof.tolist() and (dof > 0).all()
    np.testing.assert_allclose(d2, ref_d2, rtol=1e-9)


def test_range_check_names_the_first_unit_outside(setup):
    prior, fleet, _ = setup
    frame = fleet.frame.copy()
    lo, hi = prior.input_range["temperature_c"]
    for sid in ("S003", "S001"):  # two units beyond: the first in the file is named
        frame.loc[frame["sensor_id"] == sid, "temperature_c"] += 2.0 * (hi - lo)
    moved = Fleet(frame, fleet.features, fleet.target, fleet.client_column, fleet.meta)
    with pytest.raises(ValueError, match=r"sensor S001: temperature_c spans .* outside"):
        calibration.check_inputs(prior, moved, "new.csv")
    calibration.check_inputs(prior, fleet, "new.csv")  # the units as simulated: inside


def test_grid_summary_equals_the_dense_grid_and_the_closed_form_mean(setup):
    """Mean and max of σ from the low-rank grid form equal the dense grid's (predictive_std
    at every point) within rounding, and the mean of σ² is s + tr(Q M) (M the grid's mean
    of z zᵀ, formed once): the truncated SVD dropped nothing but rounding."""
    prior, _, result = setup
    alg = result.algorithm
    grid = torch.as_tensor(result.tensors.scaler.x(calibration.operating_grid(prior)), dtype=F64)
    n = result.tensors.num_clients
    personal = {k: v for k, v in result.personal.items() if k != "declined"}
    dense = alg.predictive_std(personal, grid.expand(n, -1, -1))[..., 0].double().numpy()
    form = calibration.grid_form(alg, grid)
    p = alg.variance_design(grid[:1].unsqueeze(0)).shape[-1]
    assert form.left.shape[0] == p * (p + 1) // 2 and 0 < form.right.shape[1] < p * (p + 1) // 2
    mean, top = calibration.grid_sigma_summary(alg, personal, grid, form)
    np.testing.assert_allclose(mean, dense.mean(-1), rtol=1e-12)
    np.testing.assert_allclose(top, dense.max(-1), rtol=1e-12)
    q, s = alg.variance_form(personal)
    closed = s + (q * form.moment).sum((-2, -1))  # tr(Q M), Q and M symmetric
    np.testing.assert_allclose(closed.numpy(), (dense**2).mean(-1), rtol=1e-12)
    # A declined unit (no interval): σ is NaN over the whole grid, as predictive_std says.
    mean, top = calibration.grid_sigma_summary(alg, result.personal, grid, form)
    declined = result.personal["declined"].numpy() > 0
    assert declined.any() and np.isnan(mean[declined]).all() and np.isnan(top[declined]).all()
