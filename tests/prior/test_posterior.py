"""The NumPy calibration path (fedcal.prior.posterior) against today's torch path.

A fleet prior is trained (fedprior and its variants), new units are calibrated against it
both ways — :func:`fedcal.calibration.calibrate` (FedPrior rebuilt from prior.json, torch)
and :func:`fedcal.prior.posterior.calibrate_units` (NumPy) — and every number a unit states
is compared: coefficients, covariance, noise, τ², declined, support box, prediction and
predictive σ inside and beyond the support box.

Tolerance (derived, not tuned): both paths factor Σ and A = I + LᵀGL/σ² and solve with A;
they differ in how (torch's batched cholesky_solve vs NumPy's triangular solve and
inverse), so they agree to the backward error of those solves, ≈ p·ε·κ(A) relative
(ε = 2.2e-16; p ≤ 20 terms). The test measures κ(A) of every unit and asserts that bound is
below 1e-10 (so 1e-10 relative is a bound, not a fit) and that the paths agree to 1e-10
relative to each quantity's scale.
"""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from fedcal import calibration
from fedcal.algorithms.fedprior import FedPrior
from fedcal.cli import app
from fedcal.core import bayes, identify
from fedcal.data.fleet import Fleet
from fedcal.data.loader import load_fleet
from fedcal.data.simulator import FleetSpec, simulate_fleet
from fedcal.prior import posterior as npost
from fedcal.prior import station
from fedcal.prior.model import PriorModel

runner = CliRunner(env={"COLUMNS": "200"})
METHODS = ("fedprior", "fedprior_sensor", "fedprior_branch", "fedprior_fixed")
COLS = ["sensor_id", "frequency_hz", "temperature_c", "pressure_hpa", "split", "direction"]
EPS = np.finfo(np.float64).eps
TOL = 1e-10


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One run of every variant on 12 reference units + 4 with a 3x2 design (the interval's
    probe), and 5 new units: three 3x2 sweeps, one of 2 points, one of 20 (off-grid)."""
    root = tmp_path_factory.mktemp("posterior")
    fleet_file = root / "fleet.csv"
    spec = FleetSpec(num_reference=12, num_new=4, train_design="3x2")
    simulate_fleet(spec, seed=3).frame.to_csv(fleet_file, index=False)
    cfg = root / "prior.toml"
    cfg.write_text("[engine]\nrounds = 30\neval_every = 30\n")
    out = root / "fleet_run"
    args = ["run", "--data", str(fleet_file), "--methods", ",".join(METHODS), "--seeds", "1"]
    result = runner.invoke(app, [*args, "--config", str(cfg), "--out", str(out)])
    assert result.exit_code == 0, result.output
    new = simulate_fleet(FleetSpec(num_sensors=3, train_design="3x2", test_design="random"), 9)
    many = simulate_fleet(FleetSpec(num_sensors=2, train_design="5x4", test_design="random"), 11)
    frame = new.frame.assign(sensor_id="NEW-" + new.frame["sensor_id"])
    more = many.frame.assign(sensor_id="BIG-" + many.frame["sensor_id"])
    two = more["sensor_id"] == "BIG-S000"
    keep = ~two | (more.groupby("sensor_id").cumcount() < 2) | (more["split"] == "test")
    new_file = root / "new_units.csv"
    frame = pd.concat([frame[COLS], more[keep][COLS]], ignore_index=True)
    frame.to_csv(new_file, index=False)
    return out, new_file


def _both(run, new_file, method):
    prior = PriorModel.load(calibration.find_prior(run, method))
    fleet = _fleet(new_file, prior)
    assert npost.unsupported(prior) == ""
    torch_path = calibration.calibrate(prior, fleet)
    x, y, mask, branch = npost.padded_rows(prior, fleet)
    return prior, torch_path, npost.calibrate_units(prior, x, y, mask, branch), x, y, mask


def _fleet(new_file, prior: PriorModel) -> Fleet:
    return load_fleet(
        new_file, prior.features, prior.target, test_fraction=0.0, min_train_points=1,
        min_test_points=0,
    )  # fmt: skip


def _close(a, b, what, tol):
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    assert a.shape == b.shape, what
    assert (np.isnan(a) == np.isnan(b)).all(), what
    scale = np.nanmax(np.abs(b)) if np.isfinite(b).any() else 1.0
    diff = np.nanmax(np.abs(a - b)) if np.isfinite(b).any() else 0.0
    assert diff <= tol * scale, f"{what}: {diff:.3g} > {tol:g} x {scale:.3g}"


def _noise_bound(prior: PriorModel, units, y, mask) -> float:
    """The relative rounding a unit's own σ_i² carries (module docstring, noise = "sensor").

    rss_i = yᵀy − 2rᵀm + mᵀGm + tr(GV) sums terms of the size of yᵀy to a result of the size
    of n_iσ_i²: each term rounds by ≲ p·ε·yᵀy, 4 terms; the fixed point σ² ← (rss + νσ²)/(n + ν)
    contracts by n/(n + ν), so the error grows at most (n + ν)/ν-fold: |δσ_i²| ≤
    4pε·yᵀy/ν. Relative to σ_i² that is the bound; the posterior's mean, covariance and the
    predictive σ move by at most that relative amount (their elasticity in σ² is ≤ 1: V =
    (Σ⁻¹ + G/σ²)⁻¹). Fleet noise (σ² given): 0."""
    if prior.noise.kind != "sensor":
        return 0.0
    nu = prior.provenance.method_params.get("noise_prior_points", npost.NOISE_PRIOR_POINTS)
    yy = ((y * mask) ** 2).sum(1)
    return float((4 * units.coef.shape[1] * EPS * yy / (nu * units.noise_var)).max())


@pytest.mark.parametrize("method", METHODS)
def test_numpy_units_equal_the_torch_path(trained, method):
    prior, ref, units, _x, y, mask = _both(*trained, method)
    tol = TOL + _noise_bound(prior, units, y, mask)
    assert tol < 1e-4  # not vacuous (measured: σ_i² of fedprior_sensor agree to 5e-8, bound 2e-6)
    personal = {k: v.numpy() for k, v in ref.personal.items() if torch.is_tensor(v)}
    _close(units.coef, personal["coef"], "coef", tol)
    _close(units.cov, personal["cov"], "cov", tol)
    _close(units.noise_var, personal["noise_var"], "noise_var", tol)
    _close(units.box, personal["box"], "box", 0.0)
    assert (prior.interval is None) == (units.disc_var is None)
    if units.disc_var is not None:
        _close(units.disc_var, personal["disc_var"], "disc_var", 0.0)
        assert (units.declined == (personal["declined"] > 0)).all()
    # predictions and σ on a grid reaching 30 % beyond the prior's range (the guard)
    alg = ref.algorithm
    grid = np.stack(np.meshgrid(np.linspace(-1.3, 1.3, 9), np.linspace(-1.3, 1.3, 7)), -1)
    grid = np.broadcast_to(grid.reshape(1, -1, 2), (len(units.coef), 63, 2)).copy()
    with torch.no_grad():
        t_pred = alg.predict(ref.personal, torch.as_tensor(grid))[..., 0].numpy()
        t_std = alg.predictive_std(ref.personal, torch.as_tensor(grid))[..., 0].numpy()
    _close(npost.predict(units, grid), t_pred, "predict", tol)
    _close(npost.predictive_std(units, grid), t_std, "predictive_std", tol)
    assert np.isfinite(t_std).any()  # some unit states a σ: the comparison is not vacuous


@pytest.mark.parametrize("method", ["fedprior_sensor", "fedprior_branch"])
def test_the_planner_s_units_equal_the_torch_path(trained, method):
    """``plan`` calibrates a design's expected readings at the fleet's σ² (noise given):
    :func:`fedcal.calibration.unit_posteriors` with ``noise_var`` against NumPy's."""
    prior, ref, _, x, y, mask = _both(*trained, method)
    sigma2 = prior.noise.variance
    with torch.no_grad():
        theirs = calibration.unit_posteriors(
            ref.algorithm, ref.server, ref.tensors.train, noise_var=torch.tensor(sigma2)
        )
    branch = npost.padded_rows(prior, _fleet(trained[1], prior))[3]
    ours = npost.calibrate_units(prior, x, y, mask, branch, noise_var=sigma2)
    assert (ours.noise_var == sigma2).all()
    _close(ours.coef, theirs["coef"].numpy(), "coef", TOL)
    _close(ours.cov, theirs["cov"].numpy(), "cov", TOL)
    if ours.disc_var is not None:
        assert (ours.declined == (theirs["declined"].numpy() > 0)).all()


@pytest.mark.parametrize("method", ["fedprior", "fedprior_sensor", "fedprior_branch"])
def test_the_station_s_checks_equal_the_torch_path(trained, method):
    """Range guard passed, fleet distance d², its dof and threshold, and the status written
    to units.csv (:func:`fedcal.calibration.unit_diagnostics`) against NumPy's. d² = ‖P_A e‖²
    is a sum of squares of whitened residuals: both paths factor the same C_i, so it agrees
    to the backward error of that factorization (≈ n·ε·κ(C_i), n ≤ 20 rows; measured below
    1e-9 relative with the fleet's σ²: asserted at 1e-8), plus, with per-unit noise, the
    relative error σ_i² carries (:func:`_noise_bound`: d² moves with C_i, elasticity ≤ 1
    in σ_i²; measured 5e-8). The status at its threshold: equal. Both paths compute d² with
    :func:`fedcal.prior.qa.distances` (the torch path hands it its design): with the fleet's
    σ² the same inputs, so d² is equal to the bit."""
    prior, ref, units, _, y, mask = _both(*trained, method)
    ours = station.calibrate_fleet(prior, _fleet(trained[1], prior))
    table, _ = calibration.unit_diagnostics(prior, ref)
    assert list(ours.ids) == list(map(str, table["sensor_id"]))
    tol = 1e-8 + _noise_bound(prior, units, y, mask)
    _close(ours.checks["d2"], table["d2"].to_numpy(), "d2", tol)
    if method != "fedprior_sensor":  # one function (qa.distances) of the same design and σ²
        np.testing.assert_array_equal(ours.checks["d2"], table["d2"].to_numpy())
    assert (ours.checks["dof"] == table["dof"].to_numpy()).all()
    _close(ours.checks["d2_threshold"], table["d2_threshold"].to_numpy(), "threshold", 0.0)
    assert list(ours.status) == list(table["status"])
    for col in ("sigma_mean", "sigma_max"):  # the torch path's low-rank grid form: ~1e-13
        _close(ours.checks[col], table[col].to_numpy(), col, tol)
    assert (ours.checks["unlike_fleet"] == table["unlike_fleet"].to_numpy()).all()


def test_a_unit_outside_the_prior_s_range_is_refused_like_calibrate(trained, tmp_path):
    prior = PriorModel.load(calibration.find_prior(trained[0], "fedprior"))
    frame = pd.read_csv(trained[1])
    frame.loc[0, "temperature_c"] = 95.0  # a calibration row of NEW-S000 beyond the range
    moved = tmp_path / "moved.csv"
    frame.to_csv(moved, index=False)
    fleet = _fleet(moved, prior)
    ours = station.calibrate_fleet(prior, fleet, "moved.csv")  # refused alone (issue 33)
    theirs = calibration.calibrate(prior, fleet, "moved.csv")
    assert ours.refused == theirs.refused and [r.unit for r in ours.refused] == ["NEW-S000"]
    assert "NEW-S000" not in ours.ids and ours.ids == theirs.tensors.client_ids
    with pytest.raises(ValueError) as ours:  # --strict: the whole file, as before
        station.calibrate_fleet(prior, fleet, "moved.csv", strict=True)
    with pytest.raises(ValueError) as theirs:
        calibration.calibrate(prior, fleet, "moved.csv", strict=True)
    assert str(ours.value) == str(theirs.value) and "NEW-S000" in str(ours.value)


def test_the_covered_variants_and_the_declined_units_are_exercised(trained):
    """The fixture reaches what the comparison claims: per-unit noise that moved from the
    fleet's, a direction term, and (the 2-point unit) a declined interval."""
    _, _, units, *_ = _both(*trained, "fedprior_sensor")
    prior = PriorModel.load(calibration.find_prior(trained[0], "fedprior_sensor"))
    assert np.ptp(units.noise_var) > 0
    assert not np.allclose(units.noise_var, prior.noise.variance, rtol=1e-3, atol=0)
    prior_b, _, units_b, *_ = _both(*trained, "fedprior_branch")
    assert prior_b.basis.branch_terms and units_b.coef.shape[1] > len(prior_b.basis.terms)
    _, _, units_f, *_ = _both(*trained, "fedprior")
    assert units_f.declined is not None and units_f.declined.any() and not units_f.declined.all()


def test_constants_equal_the_training_side():
    defaults = {f.name: f.default for f in fields(FedPrior)}
    assert defaults["noise_prior_points"] == npost.NOISE_PRIOR_POINTS
    assert defaults["probe_rows"] == npost.PROBE_ROWS
    assert npost.NOISE_ITERATIONS == calibration.NOISE_ITERATIONS
    assert npost.UNLEARNED_SHARE == identify.UNLEARNED_SHARE
    assert npost.JITTERS == bayes.JITTERS


def test_safe_cholesky_jitters_a_singular_matrix_like_the_torch_one():
    a = np.array([[1.0, 1.0], [1.0, 1.0]])  # rank 1: needs the smallest jitter that factors
    ours = npost.safe_cholesky(a)
    theirs, used = bayes.safe_cholesky(torch.as_tensor(a))
    assert float(used) > 0
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=0, atol=1e-15)
