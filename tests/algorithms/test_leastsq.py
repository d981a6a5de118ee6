"""Least-squares references: the total-degree basis, per-sensor and pooled fits."""

from math import comb

import numpy as np
import pytest
import torch

from fedcal.algorithms.leastsq import LeastSquares, monomial_design, total_degree_exponents
from fedcal.core.data import ClientData
from fedcal.core.task import Task
from fedcal.core.tree import expand
from fedcal.models.mlp import MLP

F64 = torch.float64


def test_total_degree_basis_by_hand():
    e = total_degree_exponents(3, 2)
    assert e.shape == (comb(3 + 2, 2), 3) == (10, 3)
    assert e[:4].tolist() == [[0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1]]
    assert len({tuple(r) for r in e.tolist()}) == 10 and (e.sum(1) <= 2).all()
    x = torch.tensor([[2.0, -1.0, 0.5]], dtype=F64)
    got = monomial_design(x, e)[0].tolist()
    # 1, a, b, c, a², ab, ac, b², bc, c²
    assert got == [1.0, 2.0, -1.0, 0.5, 4.0, -2.0, 1.0, 1.0, -0.5, 0.25]
    assert total_degree_exponents(2, 3).shape[0] == comb(5, 3)


def cohort(rows, coef, seed=0, noise=0.0):
    """Clients with 3 inputs, y = x-polynomial with each client's coefficients (+ noise)."""
    gen = torch.Generator().manual_seed(seed)
    n = coef.shape[0]
    r = max(rows)
    x = 2 * torch.rand(n, r, 3, generator=gen, dtype=F64) - 1
    e = total_degree_exponents(3, 2)
    y = (monomial_design(x, e) * coef.unsqueeze(1)).sum(-1, keepdim=True)
    y = y + noise * torch.randn(y.shape, generator=gen, dtype=F64)
    count = torch.tensor(rows)
    mask = torch.arange(r) < count.unsqueeze(1)
    y = torch.where(mask.unsqueeze(-1), y, torch.full_like(y, 1e6))  # padding must not count
    return ClientData(x, y, count, tuple(range(n)))


def fit(alg, data):
    n = data.num_clients
    server = alg.server_init({})
    down = expand(alg.broadcast(server), n)
    result = alg.client_update(down, alg.client_init(down), data)
    server = alg.server_update(server, result.reply, data.count)
    return alg.personalize(expand(alg.broadcast(server), n), result.state, data), result


def test_per_sensor_fit_recovers_each_planted_polynomial():
    coef = torch.randn(3, 10, generator=torch.Generator().manual_seed(1), dtype=F64)
    data = cohort([12, 20, 15], coef)
    alg = LeastSquares(Task(MLP(in_features=3)), ridge=1e-12)
    personal, result = fit(alg, data)
    assert torch.allclose(personal["coef"], coef, atol=1e-7)
    assert result.reply == {} and not alg.federated  # nothing leaves a sensor
    assert torch.all(result.metrics["train_loss"] < 1e-12)


def test_pooled_fit_is_least_squares_on_all_points_stacked():
    coef = torch.randn(4, 10, generator=torch.Generator().manual_seed(2), dtype=F64)
    data = cohort([9, 14, 11, 20], coef, noise=0.1)
    alg = LeastSquares(Task(MLP(in_features=3)), pooled=True, ridge=1e-12)
    assert alg.federated
    personal, _ = fit(alg, data)
    e = total_degree_exponents(3, 2)
    xs = np.concatenate(
        [monomial_design(data.x[c, :n], e).numpy() for c, n in enumerate([9, 14, 11, 20])]
    )
    ys = np.concatenate([data.y[c, :n, 0].numpy() for c, n in enumerate([9, 14, 11, 20])])
    reference = np.linalg.lstsq(xs, ys, rcond=None)[0]
    for c in range(4):  # every sensor uses the one pooled surface
        np.testing.assert_allclose(personal["coef"][c].numpy(), reference, atol=1e-9)


def test_pooled_equals_per_sensor_when_the_fleet_is_one_sensor_copied():
    coef = torch.randn(1, 10, generator=torch.Generator().manual_seed(3), dtype=F64).repeat(3, 1)
    data = cohort([15, 15, 15], coef, noise=0.05)
    same = ClientData(data.x[:1].repeat(3, 1, 1), data.y[:1].repeat(3, 1, 1), data.count, (0, 1, 2))
    pooled, _ = fit(LeastSquares(Task(MLP(in_features=3)), pooled=True, ridge=1e-12), same)
    alone, _ = fit(LeastSquares(Task(MLP(in_features=3)), ridge=1e-12), same)
    assert torch.allclose(pooled["coef"], alone["coef"], atol=1e-9)


def test_fewer_points_than_terms_gives_an_interpolant():
    coef = torch.randn(2, 10, generator=torch.Generator().manual_seed(4), dtype=F64)
    data = cohort([6, 8], coef, noise=0.3)
    alg = LeastSquares(Task(MLP(in_features=3)), ridge=1e-10)
    personal, _ = fit(alg, data)
    pred = alg.predict(personal, data.x)
    for c, n in enumerate([6, 8]):  # passes through every (noisy) point: the overfit
        assert torch.allclose(pred[c, :n], data.y[c, :n], atol=1e-4)


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="degree"):
        LeastSquares(Task(MLP()), degree=-1)
    with pytest.raises(ValueError, match="ridge"):
        LeastSquares(Task(MLP()), ridge=0.0)


def test_per_sensor_fit_is_weak_where_its_points_do_not_determine_a_direction():
    """Degree 2 in 2 inputs (1, a, b, a², ab, b²). Sensor 0: two values of b (a chamber with
    two temperatures): b² − (b₁ + b₂)b + b₁b₂ = 0 on its points, so u ∝ (b₁b₂, 0, −(b₁+b₂),
    0, 0, 1) is undetermined and its projector is uuᵀ; at test points off its two levels
    the design has a share along u → weak. Sensor 1: 20 random points → nothing undetermined."""
    gen = torch.Generator().manual_seed(0)
    b1, b2 = -0.6, 0.8
    x0 = torch.stack(
        [2 * torch.rand(8, generator=gen, dtype=F64) - 1, torch.tensor([b1, b2] * 4, dtype=F64)], -1
    )
    x1 = 2 * torch.rand(8, 2, generator=gen, dtype=F64) - 1
    extra = 2 * torch.rand(12, 2, generator=gen, dtype=F64) - 1
    x = torch.zeros(2, 20, 2, dtype=F64)
    x[0, :8], x[1, :8], x[1, 8:] = x0, x1, extra
    y = torch.randn(2, 20, 1, generator=gen, dtype=F64)
    data = ClientData(x, y, torch.tensor([8, 20]), (0, 1))
    alg = LeastSquares(Task(MLP(in_features=2)), degree=2)
    assert total_degree_exponents(2, 2).tolist() == [[0, 0], [1, 0], [0, 1], [2, 0], [1, 1], [0, 2]]
    personal, _ = fit(alg, data)
    u = torch.tensor([b1 * b2, 0.0, -(b1 + b2), 0.0, 0.0, 1.0], dtype=F64)
    u = u / u.norm()
    assert torch.allclose(personal["null"][0], torch.outer(u, u), atol=1e-8)
    assert torch.allclose(personal["null"][1], torch.zeros(6, 6, dtype=F64), atol=1e-12)
    test = 2 * torch.rand(2, 10, 2, generator=gen, dtype=F64) - 1
    flags = alg.client_status({}, personal, test, torch.ones(2, 10))
    assert flags["weak"].tolist() == [True, False]
    # at the sensor's own two temperature levels u is orthogonal to the design: not weak
    on_grid = test.clone()
    on_grid[0, :, 1] = torch.tensor([b1, b2] * 5, dtype=F64)
    assert alg.client_status({}, personal, on_grid, torch.ones(2, 10))["weak"].tolist() == [
        False,
        False,
    ]
    # a pooled fit states no per-sensor weakness
    pooled = LeastSquares(Task(MLP(in_features=2)), degree=2, pooled=True)
    assert pooled.client_status({}, fit(pooled, data)[0], test, torch.ones(2, 10)) == {}


def test_the_pooled_fit_through_the_default_policy_is_the_exact_fit_of_unequal_units():
    """Issue 34: the server's default policy (size screen, adaptive clip 3× the median) left
    the pooled fit's sums of the largest units scaled down when leastsq declared a "mean"
    reply: units with 50× and 20× the rows (and noisier targets) were clipped and the pooled
    fit was not least squares. Summed statistics are never clipped: the fit equals lstsq on
    every row pooled, to rounding, and the round records no clip."""
    from fedcal.core.aggregation import AggregationPolicy, aggregate

    rng = np.random.default_rng(1)
    coef = torch.tensor(rng.normal(0.0, 1.0, (6, 10)), dtype=F64)
    data = cohort([500, 200, 10, 10, 12, 10], coef, noise=0.3)
    alg = LeastSquares(Task(MLP(in_features=3)), degree=2, pooled=True, ridge=1e-12)
    server = alg.server_init({})
    down = alg.broadcast(server)
    reply = alg.client_update(expand(down, 6), {}, data).reply
    new, accepted, metrics = aggregate(
        alg, server, down, reply, data.count.to(F64), AggregationPolicy(), 0
    )
    assert accepted.all() and metrics.get("clipped", 0.0) == 0.0
    mask = torch.arange(data.x.shape[1]) < data.count.unsqueeze(1)
    design = monomial_design(data.x, alg.exponents)[mask]
    want = torch.linalg.lstsq(design, data.y[..., 0][mask].unsqueeze(-1)).solution[:, 0]
    assert torch.allclose(new["coef"], want, rtol=1e-8, atol=1e-10)
