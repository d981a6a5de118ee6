"""``fedcal plan`` in NumPy (issue 37.1) against the torch path it replaced, and by hand.

A fleet prior of each shipped preset the NumPy path covers (fedprior, fedprior_branch,
fedprior_fixed, fedprior_sensor) is trained on 12 reference units + 4 of the 3x2 design
(the torch-free station test's fleet); the planner is run with the NumPy forecaster
(:class:`fedcal.prior.plan.NumpyForecaster`, what ``fedcal plan`` uses for these priors) and
with the torch one (:class:`fedcal.planning_torch.TorchForecaster`: ``calibrate``'s
``unit_posteriors`` and fedprior's ``predictive_std``, the planner's forecast before this
change).

Tolerance (derived, per design): both paths factor A = I + LᵀGL/σ² (G = Z_DᵀZ_D of the
design's rows) and solve with it by different routines, so a design's J and σ agree to the
backward error p·ε·κ(A) relative (tests/prior/test_posterior.py); κ(A) is computed for every
design compared (1e9–1e10 on the campaign's 384 rows; measured agreement 1e-12–2e-10,
10⁻⁴ of the bound). The units' RMSE draws are the same NumPy draws through C^{1/2}, so they
agree to the same bound. Sequential mode with per-unit noise adds the noise fixed point's
rounding (tests/prior/test_posterior.py ``_noise_bound``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from numpy.polynomial import legendre as npleg
from scipy.linalg import solve_triangular
from scipy.optimize import brentq

from fedcal import planning
from fedcal.api import FleetPrior
from fedcal.data.fleet import Fleet
from fedcal.data.simulator import FleetSpec, simulate_fleet
from fedcal.planning_torch import TorchForecaster
from fedcal.prior import posterior
from fedcal.prior.plan import QUANTILE_DRAWS, NumpyForecaster
from fedcal.prior.posterior import NOISE_PRIOR_POINTS

METHODS = ("fedprior", "fedprior_branch", "fedprior_fixed", "fedprior_sensor")
EPS = np.finfo(np.float64).eps


@pytest.fixture(scope="module", params=METHODS)
def both(request):
    """(prior, NumPy planner, torch planner, one new 3x2 unit) for one preset."""
    spec = FleetSpec(num_reference=12, num_new=4, train_design="3x2")
    prior = FleetPrior(method=request.param, rounds=20).fit(simulate_fleet(spec, seed=3).frame)
    model = prior.model_
    assert posterior.unsupported(model) == ""  # the NumPy path covers it: plan uses it
    assert isinstance(planning.planner(model).forecaster, NumpyForecaster)
    new = simulate_fleet(FleetSpec(num_sensors=1, train_design="3x2"), seed=9).frame
    unit = Fleet(frame=new[new["split"] == "train"].reset_index(drop=True), meta={"source": "t"})
    numpy_plan = planning.planner(model, forecast=NumpyForecaster(model))
    torch_plan = planning.planner(model, forecast=TorchForecaster(model))
    return model, numpy_plan, torch_plan, unit


def solve_bound(plan: planning.Planner, designs: list[planning.Design]) -> np.ndarray:
    """p·ε·κ(A) per design, A = I + LᵀGL/σ² of the design's rows (module docstring)."""
    prior = plan.prior
    x, b, count = planning.pack(plan, designs)
    z = posterior.design(prior, x, b) * (np.arange(x.shape[1]) < count[:, None])[..., None]
    chol = np.linalg.cholesky(prior.covariance)
    a = np.eye(len(chol)) + chol.T @ (np.swapaxes(z, 1, 2) @ z) @ chol / prior.noise.variance
    return len(chol) * EPS * np.linalg.cond(a)


def _designs(plan: planning.Planner) -> list[planning.Design]:
    """The standard grids, every one-point design (the greedy's first candidates) and the
    optimizer's 2x6 and 3x8 choices."""
    ch = plan.chamber
    out = list(planning.standard_grids(ch).values())
    out += [planning.Design((t,), ((0, p, s),)) for t in ch.temperatures for p in ch.pressures
            for s in ch.directions]  # fmt: skip
    return out + [planning.optimize(plan, k, n).design for k, n in ((2, 6), (3, 8))]


def test_the_numpy_forecast_equals_the_torch_path_on_every_design(both):
    _, numpy_plan, torch_plan, _ = both
    designs = _designs(numpy_plan)
    bound = solve_bound(numpy_plan, designs)
    assert bound.max() < 1e-3  # not vacuous
    for at in (numpy_plan.field, numpy_plan.grid):
        ours = planning.expected_variance(numpy_plan, designs, at=at)
        theirs = planning.expected_variance(torch_plan, designs, at=at)
        gap = np.abs(ours - theirs) / theirs
        assert (gap <= bound[:, None]).all(), (gap.max(), bound[np.argmax(gap.max(1))])
    for d, tol in zip(designs[:4] + designs[-2:], [*bound[:4], *bound[-2:]], strict=True):
        a, b = planning.evaluate(numpy_plan, d), planning.evaluate(torch_plan, d)
        assert a.declined == b.declined and a.minutes == b.minutes
        for key in ("rms", "worst", "mean_rmse", "quantile_rmse"):
            assert getattr(a, key) == pytest.approx(getattr(b, key), rel=tol), key


@pytest.mark.parametrize("budget", [(2, 6), (3, 8), (1, 3)])
def test_the_numpy_plan_chooses_the_torch_plan_s_design(both, budget):
    """The same design, or (a tie within rounding) one whose J equals it within the bound."""
    _, numpy_plan, torch_plan, _ = both
    ours, theirs = planning.optimize(numpy_plan, *budget), planning.optimize(torch_plan, *budget)
    tol = solve_bound(numpy_plan, [theirs.design])[0]
    if ours.design != theirs.design:  # measured: never (every preset, every budget here)
        j = planning.criterion(torch_plan, [ours.design, theirs.design])
        assert abs(j[0] - j[1]) <= tol * j[1]
    else:  # the same design: the same figures within the bound
        assert ours.design.frame().equals(theirs.design.frame())
        assert ours.expected.worst == pytest.approx(theirs.expected.worst, rel=tol)
    assert ours.expected.rms == pytest.approx(theirs.expected.rms, rel=tol)


def test_sequential_mode_equals_the_torch_path(both):
    """``--next``: the unit calibrated by the station's NumPy path vs ``calibrate`` (torch);
    the same next points, their σ within the bound (+ the per-unit noise fixed point's)."""
    model, numpy_plan, torch_plan, unit = both
    ours = planning.unit_next(numpy_plan, unit, spec=1e-3, count=3)
    theirs = planning.unit_next(torch_plan, unit, spec=1e-3, count=3)
    assert not ours.done and not theirs.done and len(ours.steps) == 3
    assert [s[:3] + s[4:] for s in ours.steps] == [s[:3] + s[4:] for s in theirs.steps]
    tol = 1e-10
    if model.noise.kind == "sensor":  # 4pε·yᵀy/(ν σ_i²): tests/prior/test_posterior.py
        x, y, mask, _ = posterior.padded_rows(model, unit)
        units = posterior.calibrate_units(model, x, y, mask)
        yy = ((y * mask) ** 2).sum()
        tol += float(4 * len(model.mean) * EPS * yy / (NOISE_PRIOR_POINTS * units.noise_var[0]))
    for a, b in [(ours.now.rms, theirs.now.rms), (ours.now.worst, theirs.now.worst)] + [
        (s[3], t[3]) for s, t in zip(ours.steps, theirs.steps, strict=True)
    ]:
        assert a == pytest.approx(b, rel=tol)


# ---- by hand: the posterior variance of a linear-Gaussian model at a point -------------
def _phi(prior, x: np.ndarray, terms) -> np.ndarray:
    """φ_k(x) = Π_j √(2a+1)·P_a(x_j) by numpy's Legendre series (not fedcal's recurrence)."""
    cols = []
    for term in terms:
        col = np.ones(len(x))
        for j, a in enumerate(term):
            col = col * math.sqrt(2 * a + 1) * npleg.legval(x[:, j], np.eye(a + 1)[a])
        cols.append(col)
    return np.stack(cols, -1)


def _hand_inputs(prior, plan, pressure: float, temperature: float) -> np.ndarray:
    """Scaled (response, temperature) where the prior-mean unit reads ``pressure``: root of
    φ(r, t)ᵀμ_c = P by Brent's method."""
    r_i, t_i = plan.response, plan.temperature
    t = (temperature - prior.scaler.x_offset[t_i]) / prior.scaler.x_scale[t_i]
    target = (pressure - prior.scaler.y_offset[0]) / prior.scaler.y_scale[0]
    mu = prior.mean[: len(prior.basis.terms)]

    def at(r: float) -> np.ndarray:
        x = np.zeros((1, 2))
        x[0, r_i], x[0, t_i] = r, t
        return x

    r = brentq(lambda r: float(_phi(prior, at(r), prior.basis.terms)[0] @ mu) - target, -3, 3)
    return at(r)[0]


def test_the_forecast_sigma_is_the_closed_form_posterior_variance(both):
    """s²(x | D) = zᵀVz + σ² + τ², V = (Σ⁻¹ + Φ_DᵀΦ_D/σ²)⁻¹ (the posterior covariance of
    y = zᵀc + ε, c ~ N(μ, Σ), from the design's rows Φ_D, which the readings do not enter),
    z = [φ(x), 0] (the field's sweep unknown), τ² the fleet's for designs under twice the
    probe's rows, and with a direction term ψᵀ(μ_hμ_hᵀ + Σ_hh)ψ; at every quadrature node
    inside the fleet's range, for the planned 2x6 design; √(Σ w s²) is the printed RMS σ.

    By hand: the design's inputs by Brent's method on numpy's Legendre series, and V⁻¹ = RᵀR
    from the QR factorization of [Φ_D/σ; L⁻¹] (L = chol Σ), so zᵀVz = ‖R⁻ᵀz‖²: backward
    stable, relative error ≤ 2(n + p)·ε·(κ(R) + κ(L)) (the squared norm, the two factors)."""
    prior, plan, _, _ = both
    design = planning.optimize(plan, 2, 6).design
    p = len(prior.basis.terms)
    rows = []
    for k, pressure, sweep in design.points:
        x = _hand_inputs(prior, plan, pressure, design.temperatures[k])[None]
        z = _phi(prior, x, prior.basis.terms)[0]
        if prior.basis.branch_terms:
            b = 1.0 if sweep == "up" else -1.0
            z = np.concatenate([z, b * _phi(prior, x, prior.basis.branch_terms)[0]])
        rows.append(z)
    sigma, s2 = prior.covariance, prior.noise.variance
    chol = np.linalg.cholesky(sigma)
    inv_chol = solve_triangular(chol, np.eye(len(chol)), lower=True)
    r = np.linalg.qr(np.vstack([np.array(rows) / math.sqrt(s2), inv_chol]), mode="r")
    tol = 2 * (len(rows) + len(chol)) * EPS * (np.linalg.cond(r) + np.linalg.cond(chol))
    assert tol < 1e-6  # a check of the σ's digits, not of its order of magnitude
    iv = prior.interval
    tau2 = 0.0  # fedprior "Intervals" I2: the fleet's τ² for designs under twice the probe's
    if iv is not None:
        small = len(rows) < 2 * iv.probe_rows
        tau2 = iv.discrepancy_var if small else float(iv.discrepancy_var_own or 0.0)
    span = np.array([prior.input_range[c] for c in prior.features]).T
    lo, hi = prior.scaler.x(span)
    inside = ((plan.field >= lo) & (plan.field <= hi)).all(1)
    assert inside.sum() >= 20  # most of the range's nodes: the check is not vacuous
    got = planning.expected_variance(plan, [design])[0]
    for g in np.flatnonzero(inside):
        x = plan.field[g][None]
        zc = np.zeros(len(prior.mean))
        zc[:p] = _phi(prior, x, prior.basis.terms)[0]
        want = np.sum(solve_triangular(r, zc, trans="T") ** 2) + s2 + tau2
        if prior.basis.branch_terms:
            psi = _phi(prior, x, prior.basis.branch_terms)[0]
            want += (psi @ prior.mean[p:]) ** 2 + psi @ sigma[p:, p:] @ psi
        assert got[g] == pytest.approx(want, rel=tol), (g, got[g], want, tol)
    if inside.all():
        rms = planning.evaluate(plan, design).rms
        assert rms == pytest.approx(math.sqrt(got @ plan.weights) * plan.y_scale, rel=1e-12)


def test_the_printed_quantiles_moved_within_sampling_error(both):
    """The units' RMSE figures drawn by NumPy's generator (seed 0) against the torch
    generator's draws the planner printed before (``torch.randn``, seed 0, C's root Q√Λ):
    two independent samples of 4,000; the means differ by < 5 standard errors of their
    difference, and each 95th percentile lies within the other sample's distribution-free
    band of order statistics nq ± 5√(nq(1 − q))."""
    prior, plan, _, _ = both
    p = len(prior.basis.terms)
    for design in (
        planning.optimize(plan, 2, 6).design,
        *planning.standard_grids(plan.chamber).values(),
    ):
        post = planning.posteriors(plan, *planning.pack(plan, [design]), planning.prior_base(prior))
        j = float(post.variance(plan.field)[0] @ plan.weights)
        shift = np.zeros(len(prior.mean))
        shift[p:] = prior.mean[p:]
        cov = post.cov[0]
        vals, vecs = np.linalg.eigh(0.5 * (cov + cov.T))
        root = torch.as_tensor(vecs * np.sqrt(np.maximum(vals, 0.0)))
        gen = torch.Generator().manual_seed(0)
        draws = torch.randn(QUANTILE_DRAWS, len(cov), generator=gen, dtype=torch.float64)
        z = (draws @ root.T).numpy() + shift
        quad = 0
        for sign in (1.0, -1.0):
            rows = posterior.design(prior, plan.field, np.full(len(plan.field), sign))
            quad = quad + 0.5 * ((z @ rows.T) ** 2) @ plan.weights
        old = np.sqrt(np.maximum(j + quad - quad.mean(), 0.0)) * plan.y_scale
        new = planning.evaluate(plan, design)
        se = math.sqrt(2 * old.var() / QUANTILE_DRAWS)
        assert abs(new.mean_rmse - old.mean()) < 5 * se, (new.mean_rmse, old.mean(), se)
        n, q = QUANTILE_DRAWS, plan.quantile
        band = 5 * math.sqrt(n * q * (1 - q))
        lo, hi = np.sort(old)[[max(int(n * q - band), 0), min(math.ceil(n * q + band), n - 1)]]
        assert lo <= new.quantile_rmse <= hi, (new.quantile_rmse, lo, hi)
