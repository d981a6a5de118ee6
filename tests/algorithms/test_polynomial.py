"""The per-sensor polynomial: exact leave-one-out, order choice, supported orders, refusals."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from fedcal.algorithms.polynomial import (
    PolynomialCalibration,
    count_levels,
    least_squares,
    lebesgue_constant,
    tensor_design,
)
from fedcal.core.data import ClientData
from fedcal.core.task import Task
from fedcal.core.tree import flatten
from fedcal.engine.simulation import EngineConfig, prepare, simulate
from fedcal.models.mlp import MLP

F64 = torch.float64


def task(inputs: int = 2) -> Task:
    return Task(MLP(in_features=inputs, hidden=(3,)))


def planted(true_orders, rows=150, noise=0.0, seed=0, max_orders=(4,)):
    """Clients whose target is an exact tensor polynomial of the given orders (raw monomials)."""
    inputs = len(true_orders[0])
    alg = PolynomialCalibration(task(inputs), max_orders=max_orders)
    gen = torch.Generator().manual_seed(seed)
    n = len(true_orders)
    x = torch.rand(n, rows, inputs, generator=gen, dtype=F64) * 1.6 - 0.8
    exps = alg.exponents.to(F64)
    monomials = x.unsqueeze(-2).pow(exps).prod(-1)  # (clients, rows, terms)
    coef = torch.randn(n, len(exps), generator=gen, dtype=F64)
    coef = coef * torch.stack([alg.term_mask(o) for o in true_orders]).to(F64)
    y = (monomials * coef.unsqueeze(1)).sum(-1, keepdim=True)
    y = y + noise * torch.randn(y.shape, generator=gen, dtype=F64)
    return ClientData(x, y, torch.full((n,), rows), tuple(range(11, 11 + n))), monomials, coef


def params_of(fit):
    return {k: fit[k] for k in ("coef", "orders", "lo", "hi")}


def grid_cohort(p_levels, t_levels, seed=0, coupling=0.01):
    """One sensor on a P × T grid: f shifts a little with T (as a real resonator's does)."""
    gen = np.random.default_rng(seed)
    p, t = np.meshgrid(np.linspace(-0.8, 0.8, p_levels), np.linspace(-0.5, 0.5, t_levels))
    p, t = p.ravel(), t.ravel()
    f = p + coupling * t + 1e-5 * gen.standard_normal(p.size)
    y = 0.3 + p + 0.2 * p**2 - 0.05 * p**3 + 0.1 * t + 0.02 * p * t
    x = np.stack([f, t], 1)
    return ClientData.from_arrays([(x, y[:, None])], dtype=F64)


# ---- exact leave-one-out ---------------------------------------------------------
def test_press_equals_refitting_without_each_row():
    """e_i/(1 − h_ii) from one QR equals the residual of a fit without row i (brute force)."""
    data, _, _ = planted([(2, 1)], rows=11, noise=0.05, seed=4)
    alg = PolynomialCalibration(task(), criterion="loo")
    x, y = data.x[0].numpy(), data.y[0, :, 0].numpy()
    u = 2 * (x - x.min(0)) / (x.max(0) - x.min(0)) - 1
    used = alg.term_mask((2, 1))
    design = tensor_design(torch.as_tensor(u), alg.exponents)[:, used].numpy()
    brute = []
    for i in range(11):
        keep = np.arange(11) != i
        a = np.linalg.lstsq(design[keep], y[keep], rcond=None)[0]
        brute.append(y[i] - design[i] @ a)
    brute = np.array(brute)
    mask = torch.ones(1, 11, dtype=F64)
    ls = least_squares(torch.as_tensor(design)[None], torch.as_tensor(y)[None], mask, 1e-10)
    press = (ls.resid / (1 - ls.leverage))[0].numpy()
    assert np.allclose(press, brute, rtol=1e-10, atol=1e-12)
    k = design.shape[1]
    n = torch.tensor([11.0], dtype=F64)
    score = alg.score(ls.resid, ls.leverage, mask, n, k)
    assert score.item() == pytest.approx(np.sqrt(np.mean(brute**2)), rel=1e-10)
    # GCV and AICc, by their textbook formulas.
    rss = float((ls.resid**2).sum())
    gcv = PolynomialCalibration(task(), criterion="gcv").score(ls.resid, ls.leverage, mask, n, k)
    assert gcv.item() == pytest.approx(np.sqrt(11 * rss) / (11 - k), rel=1e-12)
    aicc = 11 * np.log(rss / 11) + 2 * k + 2 * k * (k + 1) / (11 - k - 1)
    got = PolynomialCalibration(task(), criterion="aicc").score(ls.resid, ls.leverage, mask, n, k)
    assert got.item() == pytest.approx(np.exp(aicc / 22), rel=1e-12)


# ---- order choice ----------------------------------------------------------------
def test_recovers_an_exact_surface_and_its_orders():
    true = [(3, 2), (1, 1), (4, 3), (2, 1)]
    data, _, coef = planted(true)
    alg = PolynomialCalibration(task())
    fit = alg.fit(data)
    assert fit["orders"].tolist() == [list(map(float, o)) for o in true]
    probe, monomials, _ = planted(true, rows=50, seed=1)  # new points (and coefficients)
    exact = (monomials * coef.unsqueeze(1)).sum(-1, keepdim=True)  # the surface of `data`
    pred = alg.predict(params_of(fit), probe.x)
    assert (pred - exact).abs().max() < 1e-8  # scaled units, float64


@pytest.mark.parametrize("criterion", ["loo", "gcv"])
def test_picks_the_true_orders_under_noise(criterion):
    """Noise 1e-4 (≈0.08 hPa in scaled units): bigger orders fit noise, smaller miss a term."""
    true = [(3, 2), (2, 1), (1, 3)]
    data, _, _ = planted(true, rows=200, noise=1e-4, seed=3)
    fit = PolynomialCalibration(task(), criterion=criterion).fit(data)
    assert fit["orders"].tolist() == [list(map(float, o)) for o in true]
    assert fit["saturated"].tolist() == [0.0] * 3 and fit["dof"].min() > 150


def test_three_inputs_are_all_used():
    true = [(2, 1, 1), (1, 2, 3)]
    data, _, _ = planted(true, rows=300, noise=1e-5, seed=5, max_orders=(3,))
    alg = PolynomialCalibration(task(3), max_orders=(3,))
    fit = alg.fit(data)
    assert fit["orders"].tolist() == [list(map(float, o)) for o in true]
    assert (fit["orders"] >= 1).all()  # no input is ever dropped
    pred = alg.predict(params_of(fit), data.x)
    assert (pred - data.y).pow(2).mean().sqrt() < 2e-5
    with pytest.raises(ValueError, match="one order per input"):
        PolynomialCalibration(task(3), max_orders=(4, 3))


# ---- supported orders, saturation, refusal --------------------------------------
def test_levels_count_a_noisy_plateau_once():
    data = grid_cohort(3, 2)
    assert count_levels(data.x, data.mask, 0.05).tolist() == [[3.0, 2.0]]
    assert count_levels(grid_cohort(4, 3).x, grid_cohort(4, 3).mask, 0.05).tolist() == [[4.0, 3.0]]
    # A coupling larger than the gap splits the frequency levels (then rank decides).
    wide = grid_cohort(3, 2, coupling=0.2)
    assert count_levels(wide.x, wide.mask, 0.05).tolist() == [[6.0, 2.0]]


def test_a_3x2_grid_supports_p_up_to_2_and_q_up_to_1():
    data = grid_cohort(3, 2)
    for p, q in itertools.product(range(1, 4), range(1, 3)):
        fit = PolynomialCalibration(task(), orders=(p, q)).fit(data)
        supported = p <= 2 and q <= 1
        assert fit["refused"].item() == (0.0 if supported else 1.0), (p, q)
        assert torch.isnan(fit["coef"]).any().item() != supported
    # The choice: the grid's interpolant (2, 1), flagged as saturated with 0 dof.
    fit = PolynomialCalibration(task()).fit(data)
    assert fit["orders"].tolist() == [[2.0, 1.0]]
    assert fit["saturated"].item() == 1.0 and fit["dof"].item() == 0.0
    assert fit["refused"].item() == 0.0
    pred = PolynomialCalibration(task()).predict(params_of(fit), data.x)
    assert torch.allclose(pred, data.y, atol=1e-10)  # it interpolates
    # Never saturating leaves (1, 1), the only order a 3 × 2 grid can cross-validate.
    fit = PolynomialCalibration(task(), saturate="never").fit(data)
    assert fit["orders"].tolist() == [[1.0, 1.0]] and fit["dof"].item() == 2.0


def test_a_4x3_grid_gets_its_full_interpolant_3_2():
    fit = PolynomialCalibration(task()).fit(grid_cohort(4, 3))
    assert fit["orders"].tolist() == [[3.0, 2.0]] and fit["saturated"].item() == 1.0


def test_last_resort_prefers_the_saturated_order_that_amplifies_least():
    """Six scattered points, two levels of T: only (1, 1) can be cross-validated; of the
    saturated orders only (2, 1) is supported, so it is chosen (and flagged)."""
    gen = np.random.default_rng(0)
    f = np.array([-0.9, -0.1, 0.8, -0.7, 0.2, 0.9]) + 1e-3 * gen.standard_normal(6)
    t = np.array([-0.5, -0.5, -0.5, 0.5, 0.5, 0.5])
    y = f + 0.3 * f**2 + 0.1 * t
    data = ClientData.from_arrays([(np.stack([f, t], 1), y[:, None])], dtype=F64)
    fit = PolynomialCalibration(task(), saturate="last_resort").fit(data)
    assert fit["orders"].tolist() == [[2.0, 1.0]] and fit["saturated"].item() == 1.0
    assert PolynomialCalibration(task(), saturate="grid").fit(data)["orders"].tolist() == [
        [1.0, 1.0]
    ]


def test_lebesgue_constant_of_a_3x2_grid_interpolant_is_5_over_4():
    """Quadratic interpolation at −1, 0, 1: Σ|ℓ_i| peaks at u = ±1/2 with 1/8 + 3/4 + 3/8 =
    5/4; linear interpolation between the two ends adds nothing (Σ|ℓ_i| = 1)."""
    alg = PolynomialCalibration(task())
    u = torch.tensor([[f, t] for f in (-1.0, 0.0, 1.0) for t in (-1.0, 1.0)], dtype=F64)
    used = alg.term_mask((2, 1))
    design = tensor_design(u, alg.exponents)[:, used][None]
    ls = least_squares(design, torch.zeros(1, 6, dtype=F64), torch.ones(1, 6, dtype=F64), 1e-10)
    probe = alg.probe_design()[:, used]  # 9 × 9 points on the box, ±1/2 among them
    assert lebesgue_constant(ls, probe).item() == pytest.approx(1.25, abs=1e-12)


def test_fewer_points_than_the_smallest_model_is_refused_and_never_a_number():
    """Three points cannot fit 1, f, T, f·T; one temperature cannot support order 1 in T."""
    few = np.array([[0.1, 0.2], [0.5, -0.3], [0.9, 0.4]])
    one_t = np.stack([np.linspace(-1, 1, 8), np.full(8, 0.3)], 1)
    good = np.random.default_rng(1).uniform(-1, 1, (10, 2))
    arrays = [(few, few[:, :1]), (one_t, one_t[:, :1]), (good, good.sum(1, keepdims=True))]
    data = ClientData.from_arrays(arrays, dtype=F64)
    alg = PolynomialCalibration(task())
    result = alg.client_update({}, alg.client_init({"x": torch.zeros(3)}), data)
    m = result.metrics
    assert m["refused"].tolist() == [1.0, 1.0, 0.0]
    assert torch.isnan(m["dof"][:2]).all() and m["dof"][2].item() == 6.0  # (1, 1): 10 − 4
    assert m["order_0"].tolist() == [0.0, 0.0, 1.0] and m["order_1"].tolist() == [0.0, 0.0, 1.0]
    assert m["coefficients"].tolist() == [0.0, 0.0, 4.0] and m["saturated"].tolist() == [0] * 3
    pred = alg.predict(alg.personalize({}, result.state, data), data.x)
    assert torch.isnan(pred[:2]).all() and torch.isfinite(pred[2]).all()
    assert torch.isnan(m["train_loss"][:2]).all()


# ---- least squares and rounds ----------------------------------------------------
def test_fixed_orders_equal_numpy_least_squares_on_monomials():
    data, _, _ = planted([(4, 3), (2, 2)], rows=60, noise=0.05, seed=2)
    data = ClientData(data.x, data.y, torch.tensor([60, 41]), data.seeds)  # ragged client
    alg = PolynomialCalibration(task(), orders=(2, 1))
    fit = alg.fit(data)
    assert fit["orders"].tolist() == [[2.0, 1.0], [2.0, 1.0]]
    probe = torch.rand(2, 30, 2, generator=torch.Generator().manual_seed(9), dtype=F64) - 0.5
    pred = alg.predict(params_of(fit), probe)
    for c, n in enumerate([60, 41]):
        f, t = data.x[c, :n, 0].numpy(), data.x[c, :n, 1].numpy()
        design = np.stack([f**i * t**j for i in range(3) for j in range(2)], axis=1)
        oracle = np.linalg.lstsq(design, data.y[c, :n, 0].numpy(), rcond=None)[0]
        pf, pt = probe[c, :, 0].numpy(), probe[c, :, 1].numpy()
        expected = np.stack([pf**i * pt**j for i in range(3) for j in range(2)], 1) @ oracle
        assert np.allclose(pred[c, :, 0].numpy(), expected, rtol=0, atol=1e-10)


def test_is_idempotent_over_rounds_and_reports_its_fit(make_fleet):
    fleet = prepare(make_fleet(num_clients=3, train=[30, 18, 25]), dtype="float64")
    alg = PolynomialCalibration(task())
    one = simulate(alg, fleet, EngineConfig(rounds=1, seed=4, dtype="float64"))
    three = simulate(alg, fleet, EngineConfig(rounds=3, seed=4, dtype="float64"))
    for key, value in flatten(one.personal).items():
        assert torch.equal(value, flatten(three.personal)[key]), key
    state = alg.client_update({}, one.states, fleet.train.with_seeds((7, 8, 9))).state
    for key, value in flatten(one.states).items():
        assert torch.equal(value, state[key]), key
    assert not alg.federated and one.bytes_up_per_round == 0.0
    row = three.history[-1]
    assert {"order_0", "order_1", "coefficients", "dof", "saturated", "refused"} <= set(row)
    assert row["dof"] == row_points(fleet, row["client_index"]) - row["coefficients"]


def row_points(fleet, client: int) -> float:
    return float(fleet.train.count[client])


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="criterion"):
        PolynomialCalibration(task(), criterion="kfold")
    with pytest.raises(ValueError, match="saturate"):
        PolynomialCalibration(task(), saturate="always")
    with pytest.raises(ValueError, match="orders"):
        PolynomialCalibration(task(), orders=(2, 0))  # would drop temperature
    with pytest.raises(ValueError, match="max_orders"):
        PolynomialCalibration(task(), max_orders=(4, 0))
