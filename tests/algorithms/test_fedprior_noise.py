"""fedprior's noise model in the inputs and Student-t rows (fedprior_noise, N1–N5)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import integrate, stats

from fedcal.algorithms.fedprior import FedPrior
from fedcal.algorithms.fedprior_noise import t_weight_constant
from fedcal.core.bayes import F64
from fedcal.core.data import ClientData
from fedcal.core.task import Task
from fedcal.core.tree import expand
from fedcal.models.basis import legendre_products
from fedcal.models.mlp import MLP
from fedcal_support.rounds import run_rounds

GAMMA = (1.5, -1.0)  # planted: the noise variance grows e^3 = 20-fold along x_0


def planted(gamma, units=30, rows=60, seed=0, outliers=0.0, test=False):
    """y = 1 + a_i x_0 + b_i x_1 + ε, ε ~ N(0, σ_i² exp(γᵀx)), σ_i log-uniform in [0.05, 0.1];
    ``outliers``: that share of rows shifted by ±(1.0–1.5) (≈ 10–30 σ)."""
    units_rng = np.random.default_rng(seed)
    arrays = []
    for i in range(units):
        rng = units_rng
        coef = np.array([1.0, 0.5 + 0.1 * rng.standard_normal(), -0.3 + 0.1 * rng.normal()])
        sigma = math.exp(rng.uniform(math.log(0.05), math.log(0.1)))
        # the rows: fresh inputs and noise for the test set, the same units
        rng = np.random.default_rng([seed, i, int(test)])
        x = rng.uniform(-1, 1, (rows, 2))
        sd = sigma * np.exp(0.5 * x @ np.asarray(gamma, dtype=float))
        y = coef[0] + coef[1] * x[:, 0] + coef[2] * x[:, 1] + sd * rng.standard_normal(rows)
        bad = rng.random(rows) < outliers
        y[bad] += rng.choice([-1.0, 1.0], bad.sum()) * rng.uniform(1.0, 1.5, bad.sum())
        arrays.append((x, y[:, None]))
    return ClientData.from_arrays(arrays, tuple(range(units)), F64)


def model(**params) -> FedPrior:
    return FedPrior(Task(MLP(in_features=2)), basis="total", degree=1, **params)


@pytest.fixture(scope="module")
def hetero():
    data = planted(GAMMA)
    return data, run_rounds(model(noise_shape="inputs"), data, 12)


def test_gamma_is_recovered_from_the_fleet_sums(hetero):
    _, (server, *_rest) = hetero
    gamma = server["noise_gamma"]
    # Fisher information Σ (x − x̄)² ≈ 1800/3 per input: s.e. ≈ √(2/600) ≈ 0.06; 0.25 is 4 s.e.
    assert torch.allclose(gamma, torch.tensor(GAMMA, dtype=F64), atol=0.25), gamma
    assert float(server["noise_ratio"]) > 2 * math.log(1800)  # chosen by BIC, far beyond it


def test_a_homoscedastic_fleet_keeps_gamma_zero_and_today_s_fit():
    data = planted((0.0, 0.0), seed=1)
    inputs = run_rounds(model(noise_shape="inputs"), data, 12)
    plain = run_rounds(model(), data, 12)
    assert inputs.server["noise_gamma"].tolist() == [0.0, 0.0]  # in use: exactly zero
    assert 2 * float(inputs.server["noise_ratio"]) < 2 * math.log(1800)  # BIC keeps it out
    for key in ("coef", "cov", "noise_var"):
        torch.testing.assert_close(inputs.personal[key], plain.personal[key], rtol=1e-9, atol=0)


def test_predictive_std_is_the_hand_formula_at_the_query_input(hetero):
    _, (server, _, personal, _) = hetero
    alg = model(noise_shape="inputs")
    x = torch.tensor([[[0.9, -0.7], [-0.2, 0.3], [3.0, -3.0]]], dtype=F64)  # last: beyond
    one = {k: v[:1] for k, v in personal.items()}
    std = alg.predictive_std(one, x)[0, :, 0]
    box = one["box"][0]
    gamma = server["noise_gamma"]
    for r in range(3):
        g = torch.maximum(torch.minimum(x[0, r], box[1]), box[0])  # clamped to the unit's box
        phi = torch.tensor([1.0, math.sqrt(3) * float(x[0, r, 0]), math.sqrt(3) * x[0, r, 1]])
        phi = phi.to(F64)
        var = phi @ one["cov"][0] @ phi + one["noise_var"][0] * torch.exp(gamma @ g)
        if r == 2:  # beyond the box: + the (polynomial − tangent plane)² gap, 0 for degree 1
            assert float((legendre_products(x, alg.terms)[0, r] - phi).abs().max()) < 1e-12
        assert math.isclose(float(std[r]), math.sqrt(float(var)), rel_tol=1e-9)


def test_coverage_of_a_heteroscedastic_fleet_holds_at_low_and_high_noise(hetero):
    data, (_, _, personal, _) = hetero
    test = planted(GAMMA, rows=200, test=True)
    out = {}
    for shape in ("inputs", "constant"):
        alg = model(noise_shape=shape)
        params = personal if shape == "inputs" else run_rounds(alg, data, 12).personal
        err = (alg.predict(params, test.x) - test.y)[..., 0].abs()
        inside = err <= 1.959964 * alg.predictive_std(params, test.x)[..., 0]
        low = test.x[..., 0] - test.x[..., 1] < 0  # γᵀx < 0: the quiet half
        out[shape] = (float(inside[low].double().mean()), float(inside[~low].double().mean()))
    # 3000 points per half: a share's s.e. ≈ 0.004
    assert all(0.93 <= c <= 0.97 for c in out["inputs"]), out
    assert out["constant"][0] > 0.985 and out["constant"][1] < 0.93, out  # what it fixes


def test_dp_and_fedprior_drift_refuse_the_noise_settings_in_one_line():
    from fedcal.algorithms.fedprior_drift import FedPriorDrift
    from fedcal.core.algorithm import SettingError

    alg = model(noise_shape="inputs")
    with pytest.raises(ValueError, match="client-level DP covers noise_shape") as err:
        alg.dp_statistics(alg.broadcast(alg.server_init({})))
    assert "\n" not in str(err.value)
    for params in ({"noise_shape": "inputs"}, {"noise_tail": "student"}):
        with pytest.raises(SettingError, match="fedprior_drift supports noise_shape"):
            FedPriorDrift(Task(MLP(in_features=2)), basis="total", degree=1, **params)


def test_t_weight_constant_is_the_normal_expectation():
    for nu in (3.0, 4.0, 10.0):
        ref, _ = integrate.quad(
            lambda z, nu=nu: (nu + 1) * z * z / (nu + z * z) * stats.norm.pdf(z), -40, 40
        )
        assert math.isclose(t_weight_constant(nu), ref, rel_tol=1e-8)
    assert t_weight_constant(1e9) == pytest.approx(1.0, abs=1e-8)  # ν → ∞: E[ξ²] = 1


def test_outlier_weights_are_the_hand_computed_t_weights():
    # One unit, a prior pinned at the truth (posterior mean = μ, V ≈ 0): e_r = y_r − φ_rᵀμ.
    alg = model(noise_tail="student", noise_dof=4.0)
    s2 = 0.04
    x = torch.tensor([[[0.1, 0.2], [-0.5, 0.4], [0.7, -0.9], [0.0, 0.0]]], dtype=F64)
    mu = torch.tensor([1.0, 0.2, -0.1], dtype=F64)
    fit = (legendre_products(x, alg.terms) * mu).sum(-1)[0]
    e = torch.tensor([0.0, 0.2, 0.6, -1.4], dtype=F64)  # 0, 1, 3, 7 σ
    data = ClientData.from_arrays([(x[0].numpy(), (fit + e).numpy()[:, None])], (0,), F64)
    down = {
        "mu": mu,
        "sigma": 1e-14 * torch.eye(3, dtype=F64),
        "noise_var": torch.tensor(s2, dtype=F64),
    }
    down = expand(down, 1)
    weight, inlier = alg.noise_model.row_weights(down, data, alg.design(data.x))
    kappa = t_weight_constant(4.0)
    # By hand: three IRLS steps, z = e²/s², u = (ν+1)/(ν + z) (0 beyond 6 σ), w = u/κ, then the
    # unit's own scale s² = (Σ w e² + ν₀σ²)/(n + ν₀), ν₀ = 4 pseudo-points at σ² = 0.04.
    e2, scale = (e * e).tolist(), s2
    for _ in range(3):
        z2 = [v / scale for v in e2]
        hand = [5.0 / (4.0 + z) / kappa * (z <= 36.0) for z in z2]
        scale = (sum(w * v for w, v in zip(hand, e2, strict=True)) + 4 * s2) / (4 + 4)
    assert z2[3] > 36.0 and hand[3] == 0.0  # 1.4 against s ≈ 0.2: skipped
    torch.testing.assert_close(weight[0], torch.tensor(hand, dtype=F64), rtol=1e-9, atol=0)
    assert inlier[0].tolist() == [1.0, 1.0, 1.0, 0.0]  # and not a held-out inlier (N5)


def test_student_rows_keep_outliers_out_of_the_noise_and_cost_nothing_without_them():
    dirty = planted((0.0, 0.0), seed=2, outliers=0.05)
    clean = planted((0.0, 0.0), seed=2)
    noise = {}
    for name, data in (("dirty", dirty), ("clean", clean)):
        for tail in ("gaussian", "student"):
            run = run_rounds(model(noise_tail=tail), data, 12)
            noise[name, tail] = float(run.server["noise_var"])
    true = noise["clean", "gaussian"]  # ≈ the fleet's mean σ_i², 0.0055
    assert noise["dirty", "gaussian"] > 5 * true  # the outliers inflate the Gaussian fit
    # Outliers at 10–30 σ are beyond 6 σ: skipped, so σ² is the clean rows' (1 − f)·σ₀² summed
    # over n rows (n counts every row): the ratio (1 − f), f the share of outliers.
    f = float((dirty.y - clean.y).abs().gt(0.5).double().sum() / dirty.count.sum())
    assert abs(noise["dirty", "student"] / true / (1 - f) - 1) < 0.05, (f, noise)
    assert abs(noise["clean", "student"] / true - 1) < 0.1  # consistent at the normal (κ_ν)


def test_gamma_travels_in_prior_json_and_calibrate_states_the_same_sigma(hetero):
    from fedcal.calibration import prior_server
    from fedcal.data.scaling import Scaler
    from tests.conftest import stored_prior

    data, (server, _, personal, _) = hetero
    alg = model(noise_shape="inputs")
    prior = {
        **alg.export_state(server),
        "features": ["a", "b"],
        "input_range": {"a": [-1.0, 1.0], "b": [-1.0, 1.0]},
    }
    assert prior["noise_gamma"] == server["noise_gamma"].tolist()
    identity = Scaler(np.zeros(2), np.ones(2), np.zeros(1), np.ones(1), {})
    stored = prior_server(stored_prior(prior), identity)
    down = expand(alg.broadcast(stored), data.num_clients)
    again = alg.personalize(down, alg.client_init(down), data)
    # the training rows lie inside both support boxes: the same σ(x) as the federation's
    torch.testing.assert_close(
        alg.predictive_std(again, data.x), alg.predictive_std(personal, data.x), rtol=1e-9, atol=0
    )
    with pytest.raises(ValueError, match="noise_gamma: expected 2 value\\(s\\), one per feature"):
        stored_prior({**prior, "noise_gamma": [0.1]})


def test_tail_evidence_is_the_reference_log_likelihood_ratio():
    # One unit, a prior pinned at the truth (both fits = μ, V ≈ 0): d = ℓ_t − ℓ_N at each
    # scale's MLE, against scipy's densities and scipy's fit of the t scale (ν = 4 fixed).
    alg = model(noise_tail="auto", noise_dof=4.0)
    rng = np.random.default_rng(3)
    x = rng.uniform(-1, 1, (1, 9, 2))
    mu = torch.tensor([1.0, 0.2, -0.1], dtype=F64)
    fit = (legendre_products(torch.tensor(x), alg.terms) * mu).sum(-1)[0].numpy()
    e = np.array([0.05, -0.1, 0.2, 0.0, -0.15, 0.1, 1.4, -0.05, 0.12])  # one gross outlier
    data = ClientData.from_arrays([(x[0], (fit + e)[:, None])], (0,), F64)
    down = {"mu": mu, "sigma": 1e-14 * torch.eye(3, dtype=F64), "noise_var": torch.tensor(0.01)}
    d = alg.noise_model.tail_ratio(expand(down, 1), data, alg.design(data.x))
    gauss = stats.norm.logpdf(e, scale=math.sqrt(np.mean(e * e))).sum()
    _, _, scale = stats.t.fit(e, f0=4.0, floc=0.0)
    student = stats.t.logpdf(e, 4.0, scale=scale).sum()
    assert float(d[0]) == pytest.approx(student - gauss, rel=1e-6, abs=1e-6)
    assert student - gauss > 1.0  # the outlier: t's likelihood is the higher


@pytest.mark.parametrize("outliers, student", [(0.05, True), (0.0, False)])
def test_auto_tail_picks_student_on_outliers_and_gaussian_on_a_clean_fleet(outliers, student):
    data = planted((0.0, 0.0), seed=2, outliers=outliers)
    auto = run_rounds(model(noise_tail="auto"), data, 8).server
    # 2 Σ d_i against log Σ n = log 1800 ≈ 7.5: planted far from it either way
    assert bool(auto["noise_student"]) is student
    assert (2 * float(auto["tail_ratio"]) > math.log(1800)) is student
    # and then it is that model: σ² as the fixed choice's (t: from round 1 on; its round 0
    # is Gaussian, so the same fixed point, not the same bits)
    fixed = run_rounds(model(noise_tail="student" if student else "gaussian"), data, 8).server
    assert float(auto["noise_var"]) == pytest.approx(float(fixed["noise_var"]), rel=1e-3)


def test_the_tail_choice_travels_in_prior_json_and_calibrate_uses_it():
    from fedcal.calibration import prior_server
    from fedcal.data.scaling import Scaler
    from tests.conftest import stored_prior

    data = planted((0.0, 0.0), seed=2, outliers=0.05, units=10)
    alg = model(noise_tail="auto")
    run = run_rounds(alg, data, 6)
    assert bool(run.server["noise_student"])
    prior = {
        **alg.export_state(run.server),
        "features": ["a", "b"],
        "input_range": {"a": [-1.0, 1.0], "b": [-1.0, 1.0]},
    }
    assert prior["noise_student"] == 1
    identity = Scaler(np.zeros(2), np.ones(2), np.zeros(1), np.ones(1), {})
    down = expand(alg.broadcast(prior_server(stored_prior(prior), identity)), data.num_clients)
    again = alg.personalize(down, alg.client_init(down), data)
    # the stored choice, not the Gaussian start: the same posterior as the federation's
    torch.testing.assert_close(again["coef"], run.personal["coef"], rtol=1e-9, atol=1e-12)
    gaussian = {**down, "noise_student": torch.zeros(data.num_clients, dtype=F64)}
    plain = alg.personalize(gaussian, alg.client_init(down), data)
    assert float((plain["coef"] - run.personal["coef"]).abs().max()) > 1e-3  # outliers pull it
    with pytest.raises(ValueError, match="noise_student: must be <= 1, got 2"):
        stored_prior({**prior, "noise_student": 2})


def test_clip_evidence_is_the_hand_computed_per_unit_clip():
    from fedcal.algorithms.fedprior_noise import clip_evidence

    noise = {"ratio": torch.tensor([9.0, -1.0, -50.0]), "tail_ratio": torch.tensor([3.0, 0.0, 7.0])}
    out = clip_evidence(noise, torch.tensor([2.0, 5.0, 1.0]), 4.0)
    torch.testing.assert_close(out["ratio"], torch.tensor([8.0, -1.0, -4.0], dtype=F64))
    torch.testing.assert_close(out["tail_ratio"], torch.tensor([3.0, 0.0, 4.0], dtype=F64))


def test_one_unit_forging_its_tail_evidence_cannot_switch_the_student_rows_off():
    """Hostile site (issue 21): the tail's test adds each unit's d_i; forged to −1e6, one
    unit switched the Student-t rows off a fleet with outliers. Clipped (± NOISE_EVIDENCE_CLIP
    · n_i), the fleet keeps them; the honest sum is unchanged (no honest unit reaches it)."""
    from fedcal.algorithms.fedprior_noise import NOISE_EVIDENCE_CLIP

    data = planted((0.0, 0.0), units=12, rows=30, seed=2, outliers=0.05)
    alg = model(noise_tail="auto")
    rounds = run_rounds(alg, data, 3)
    down = expand(alg.broadcast(rounds.server), 12)
    reply = alg.client_update(down, rounds.states, data).reply
    d = reply["noise"]["tail_ratio"]
    assert float((d.abs() / data.count).max()) < NOISE_EVIDENCE_CLIP
    honest = alg.server_update(rounds.server, reply, data.count)
    assert float(honest["noise_student"]) == 1.0
    torch.testing.assert_close(honest["tail_ratio"], d.sum(), rtol=1e-12, atol=1e-9)
    forged = d.clone()
    forged[0] = -1e6
    hostile = {**reply, "noise": {**reply["noise"], "tail_ratio": forged}}
    new = alg.server_update(rounds.server, hostile, data.count)
    assert float(new["noise_student"]) == 1.0  # unclipped: Σ d_i ≈ −1e6, Gaussian rows
    bound = NOISE_EVIDENCE_CLIP * float(data.count[0])
    assert float(new["tail_ratio"]) == pytest.approx(float(d[1:].sum()) - bound, rel=1e-9)


def test_one_unit_forging_its_gamma_evidence_cannot_switch_gamma_off():
    """Hostile site (issue 21): γ's BIC test adds each unit's d_i (N3); forged to −1e6, one
    unit set γ = 0 on a heteroscedastic fleet. Clipped, its pull is exactly
    NOISE_EVIDENCE_CLIP · n_i and γ stays; honest units are below the clip."""
    from fedcal.algorithms.fedprior_noise import NOISE_EVIDENCE_CLIP

    data = planted(GAMMA, units=30, rows=30)
    alg = model(noise_shape="inputs")
    rounds = run_rounds(alg, data, 3)
    reply = alg.client_update(expand(alg.broadcast(rounds.server), 30), rounds.states, data).reply
    d = reply["noise"]["ratio"]
    assert float((d.abs() / data.count).max()) < NOISE_EVIDENCE_CLIP
    forged = d.clone()
    forged[0] = -1e6
    hostile = {**reply, "noise": {**reply["noise"], "ratio": forged}}
    new = alg.server_update(rounds.server, hostile, data.count)
    bound = NOISE_EVIDENCE_CLIP * float(data.count[0])
    assert float(new["noise_ratio"]) == pytest.approx(float(d[1:].sum()) - bound, rel=1e-9)
    assert bool((new["noise_gamma"] != 0).all())  # unclipped: Σ d_i ≈ −1e6, γ = 0


def test_trim_keeps_gaussian_weights_and_drops_only_the_t_fit_s_gross_outliers():
    """N7 on the hand-computed case above: the same inliers as the t fit (the 7 σ row out),
    every other row at weight 1 (no t down-weighting, no κ); on a fleet with outliers σ² is
    the clean rows' Gaussian one (as Student-t rows'), and without outliers the fit is the
    Gaussian model's."""
    alg = model(noise_tail="trim")
    x = torch.tensor([[[0.1, 0.2], [-0.5, 0.4], [0.7, -0.9], [0.0, 0.0]]], dtype=F64)
    mu = torch.tensor([1.0, 0.2, -0.1], dtype=F64)
    fit = (legendre_products(x, alg.terms) * mu).sum(-1)[0]
    e = torch.tensor([0.0, 0.2, 0.6, -1.4], dtype=F64)  # 0, 1, 3, 7 σ
    data = ClientData.from_arrays([(x[0].numpy(), (fit + e).numpy()[:, None])], (0,), F64)
    down = expand(
        {"mu": mu, "sigma": 1e-14 * torch.eye(3, dtype=F64), "noise_var": torch.tensor(0.04)}, 1
    )
    weight, inlier = alg.noise_model.row_weights(down, data, alg.design(data.x))
    assert weight[0].tolist() == [1.0, 1.0, 1.0, 0.0] and inlier[0].tolist() == weight[0].tolist()
    dirty = planted((0.0, 0.0), units=20, seed=2, outliers=0.05)
    clean = planted((0.0, 0.0), units=20, seed=2)
    plain = run_rounds(model(), clean, 8)
    trim = model(noise_tail="trim")
    f = float((dirty.y - clean.y).abs().gt(0.5).double().sum() / dirty.count.sum())
    trimmed = float(run_rounds(trim, dirty, 8).server["noise_var"])
    true = float(plain.server["noise_var"])
    assert f > 0.03  # so that the bias below (σ² × (1 − f), n counting the cut rows) shows
    assert abs(trimmed / true - 1) < 0.015, (f, trimmed, true)  # outliers out of σ² and of n
    # without outliers no row is cut at the Gaussian fit's prior: the fit is the Gaussian one
    down = expand(trim.broadcast(plain.server), clean.num_clients)
    weight, _ = trim.noise_model.row_weights(down, clean, trim.design(clean.x))
    assert torch.equal(weight, clean.mask.to(F64))
