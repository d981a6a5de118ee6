"""Fleet-prior calibration: planted hierarchical fleets, limits, identification, intervals."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from fedcal.algorithms.fedprior import FedPrior, term_name
from fedcal.core.bayes import F64, moments, posterior
from fedcal.core.data import ClientData
from fedcal.core.task import Task
from fedcal.core.tree import expand
from fedcal.models.basis import legendre_exponents, legendre_products
from fedcal.models.mlp import MLP
from fedcal_support.rounds import run_rounds


def planted_fleet(
    num_clients: int,
    rows: list[int] | int,
    seed: int = 0,
    noise: float = 0.01,
    orders=(1, 1),
    t_levels: tuple[float, ...] | None = None,
):
    """c_i ~ N(μ*, Σ*) on a Legendre (orders) basis, y = φ(x)ᵀc_i + N(0, noise²)."""
    gen = torch.Generator().manual_seed(seed)
    terms = legendre_exponents(2, orders=orders)
    p = len(terms)
    mu = torch.linspace(0.5, -0.5, p, dtype=F64)
    a = 0.3 * torch.randn(p, p, generator=gen, dtype=F64)
    sigma = a @ a.T + 0.01 * torch.eye(p, dtype=F64)
    coef = (
        mu + torch.randn(num_clients, p, generator=gen, dtype=F64) @ torch.linalg.cholesky(sigma).T
    )
    counts = [rows] * num_clients if isinstance(rows, int) else rows
    arrays, test = [], []
    for i, n in enumerate(counts):
        for store, m in ((arrays, n), (test, 200)):
            x = 2 * torch.rand(m, 2, generator=gen, dtype=F64) - 1
            if t_levels is not None and store is arrays:
                pick = torch.randint(len(t_levels), (m,), generator=gen)
                x[:, 1] = torch.tensor(t_levels, dtype=F64)[pick]
            y = legendre_products(x, terms) @ coef[i] + noise * torch.randn(
                m, generator=gen, dtype=F64
            )
            store.append((x.numpy(), y.unsqueeze(-1).numpy()))
    seeds = tuple(range(num_clients))
    return (
        ClientData.from_arrays(arrays, seeds, F64),
        ClientData.from_arrays(test, seeds, F64),
        mu,
        sigma,
        coef,
    )


def run(alg: FedPrior, data: ClientData, rounds: int):
    server, state, personal, metrics = run_rounds(alg, data, rounds)
    return server, state, personal, [float(m["loglik"].sum()) for m in metrics]


def make(**kw) -> FedPrior:
    return FedPrior(Task(MLP()), **{"orders": (1, 1), **kw})


def test_basis_terms_and_names():
    assert legendre_exponents(2, orders=(1, 1)) == ((0, 0), (1, 0), (0, 1), (1, 1))
    assert len(legendre_exponents(3, degree=2)) == 10  # 1 + 3 + 6
    assert term_name((2, 0, 1)) == "P2(x0)·P1(x2)" and term_name((0, 0)) == "1"
    with pytest.raises(ValueError, match="one order per input"):
        FedPrior(Task(MLP()), orders=(3,), basis="tensor")
    # auto: orders that do not fit the inputs fall back to the total-degree basis
    assert make(orders=(2,), degree=1).terms == ((0, 0), (1, 0), (0, 1))


def test_planted_hierarchical_fleet_recovers_mu_and_sigma():
    data, _, mu, sigma, _ = planted_fleet(400, 30, seed=1)
    server, _, _, _ = run(make(shrinkage_units=0.0, floor=1e-12, noise="fleet"), data, 40)
    # μ: the mean of 400 draws; standard error √(diag Σ / 400)
    se = (torch.diagonal(sigma) / 400).sqrt()
    assert torch.all((server["mu"] - mu).abs() < 4 * se)
    rel = torch.linalg.matrix_norm(server["sigma"] - sigma) / torch.linalg.matrix_norm(sigma)
    assert float(rel) < 0.15
    assert float(server["noise_var"].sqrt()) == pytest.approx(0.01, rel=0.05)


def test_ecme_never_lowers_the_marginal_likelihood():
    data, _, _, _, _ = planted_fleet(30, [3, 5, 8] * 10, seed=2)
    _, _, _, ll = run(make(shrinkage_units=0.0, floor=1e-14, noise="fleet"), data, 30)
    assert all(b >= a - 1e-7 * abs(a) for a, b in itertools.pairwise(ll))
    assert ll[-1] > ll[0]


def test_a_unit_with_fewer_points_than_coefficients_borrows_the_fleet_shape():
    """40 reference units (40 points) + 40 new units (2 points < 4 coefficients each).

    The learned prior must do about as well as the Bayes posterior under the
    true (μ*, Σ*), and far better than what a unit can do alone.
    """
    data, test, mu, sigma, _coef = planted_fleet(80, [40] * 40 + [2] * 40, seed=3)
    alg = make()
    _, _, personal, _ = run(alg, data, 30)
    new = slice(40, 80)

    def test_rmse(c):
        pred = (alg.design(test.x[new]) * c.unsqueeze(1)).sum(-1)
        return float((pred - test.y[new, :, 0]).pow(2).mean().sqrt())

    stats = moments(alg.design(data.x[new]), data.y[new, :, 0], data.mask[new])
    oracle = posterior(stats, mu, sigma, torch.full((40,), 1e-4, dtype=F64)).mean
    alone = []  # the min-norm least-squares fit of its 2 points
    for i in range(40, 80):
        phi = legendre_products(data.x[i, :2], alg.terms)
        alone.append(torch.linalg.lstsq(phi, data.y[i, :2, 0], driver="gelsd").solution)
    learned, bayes, own = (
        test_rmse(personal["coef"][new]),
        test_rmse(oracle),
        test_rmse(torch.stack(alone)),
    )
    assert learned < 1.1 * bayes
    assert learned < 0.75 * own


def test_predictive_intervals_cover_about_95_percent_on_a_well_specified_fleet():
    data, test, _, _, _ = planted_fleet(60, [30] * 30 + [3] * 30, seed=4)
    alg = make()
    _, _, personal, _ = run(alg, data, 30)
    pred, std = alg.predict(personal, test.x), alg.predictive_std(personal, test.x)
    inside = ((pred - test.y).abs() <= 1.96 * std).to(F64).mean()
    assert 0.92 <= float(inside) <= 0.98
    # σ = √(φᵀVφ + σ_i²), by hand for one point
    phi = legendre_products(test.x[5, :1], alg.terms)[0]
    var = phi @ personal["cov"][5] @ phi + personal["noise_var"][5]
    assert float(std[5, 0, 0]) == pytest.approx(float(var.sqrt()), rel=1e-10)


def test_server_update_ignores_client_order():
    data, _, _, _, _ = planted_fleet(12, [4, 9, 20] * 4, seed=5)
    alg = make(orders=(2, 1))
    server = alg.server_init({})
    down = expand(alg.broadcast(server), 12)
    reply = alg.client_update(down, alg.client_init(down), data).reply
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    a = alg.server_update(server, reply, data.count)
    b = alg.server_update(server, {k: v[perm] for k, v in reply.items()}, data.count[perm])
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_an_unobserved_direction_is_reported_and_keeps_a_vague_prior():
    """Every unit saw the second input at two levels only: its quadratic is not identified."""
    data, _, _, _, _ = planted_fleet(30, 20, seed=6, orders=(1, 2), t_levels=(-0.8, 0.8))
    alg = make(orders=(1, 2))
    server, _, personal, _ = run(alg, data, 60)
    # an unseen direction keeps its starting variance: it neither collapses nor grows
    vals, vecs = torch.linalg.eigh(server["support"])
    unseen = vecs[:, vals < alg.min_informed]
    assert unseen.shape[1] == 2  # P̃2(x1) ∝ 1 on two levels: with and without P1(x0)
    torch.testing.assert_close(
        unseen.T @ server["sigma"] @ unseen, alg.init_scale**2 * torch.eye(2, dtype=F64)
    )
    ident = alg.prior_status.identification(server)
    assert ident["weak_directions"] == 2
    assert any("P2(x1)" in t for t in ident["weak_terms"])
    # off the two levels the prediction carries the vague prior's σ (init_scale = 1)
    x_mid = torch.zeros(30, 1, 2, dtype=F64)
    assert float(alg.predictive_std(personal, x_mid).min()) > 0.3
    x_seen = torch.tensor([0.0, 0.8], dtype=F64).expand(30, 1, 2)
    assert float(alg.predictive_std(personal, x_seen).max()) < 0.1


def test_generic_features_use_a_total_degree_basis():
    alg = FedPrior(Task(MLP(in_features=3)), degree=2)
    assert alg.terms == legendre_exponents(3, degree=2)
    x = torch.rand(2, 5, 3, dtype=F64)
    assert alg.design(x).shape == (2, 5, 10)


@pytest.mark.parametrize("bad", [{"shrinkage_units": -1.0}, {"noise": "loud"}, {"rank": -1}])
def test_bad_hyperparameters_are_refused(bad):
    with pytest.raises(ValueError):
        make(**bad)


def test_export_state_is_json_and_complete():
    import json

    data, _, _, _, _ = planted_fleet(10, 20, seed=7)
    alg = make()
    server, _, _, _ = run(alg, data, 5)
    doc = json.loads(json.dumps(alg.export_state(server)))
    assert np.allclose(doc["mu"], server["mu"].numpy())
    assert np.allclose(doc["sigma"], server["sigma"].numpy())
    assert doc["terms"] == [list(t) for t in alg.terms]


# ---- complexity chosen by the fleet's evidence (select = "bic") ------------------------


def run_screened(alg: FedPrior, data: ClientData, rounds: int, poison: int | None = None):
    """``run`` through the server's default aggregation (screening at 10× the median)."""
    from fedcal.core.aggregation import AggregationPolicy, aggregate

    n = data.num_clients
    server = alg.server_init({})
    state = alg.client_init(expand(alg.broadcast(server), n))
    rejected = []
    for r in range(rounds):
        down = alg.broadcast(server)
        result = alg.client_update(expand(down, n), state, data)
        state = result.state
        server, accepted, _ = aggregate(
            alg, server, down, result.reply, data.count, AggregationPolicy(), r
        )
        rejected.append(torch.nonzero(~accepted)[:, 0].tolist())
    return server, rejected


def test_candidates_are_every_sub_basis_smallest_first():
    alg = make(orders=(2, 1), select="bic")
    assert [c["orders"] for c in alg.candidates][:3] == [[0, 0], [0, 1], [1, 0]]
    assert alg.candidates[-1] == {"orders": [2, 1]} and len(alg.candidates) == 6
    masks = alg.masks
    assert masks.shape == (6, 6) and masks[-1].sum() == 6 and masks[0].tolist()[0] == 1.0
    assert masks[0].sum() == 1  # the constant only
    # BIC's d_k: μ (p) + full Σ (p(p+1)/2) + σ²; with rank r: p·r − r(r−1)/2 loadings + p
    d = alg.selection.prior_parameters(torch.tensor([[1.0, 1, 1, 1, 0, 0]], dtype=F64))
    assert d.tolist() == [4 + 10 + 1]
    d1 = make(orders=(2, 1), select="bic", rank=1).selection.prior_parameters(masks[-1:])
    assert d1.tolist() == [6 + (6 + 6) + 1]
    total = FedPrior(Task(MLP(in_features=3)), degree=2, select="bic")
    assert total.candidates == ({"degree": 0}, {"degree": 1}, {"degree": 2})
    assert make().candidates == ({},)  # no selection: the basis itself
    with pytest.raises(ValueError, match="select"):
        make(select="aic")


@pytest.mark.parametrize("planted", [(1, 1), (2, 1), (1, 2)])
def test_bic_of_the_fleet_evidence_picks_the_planted_basis(planted):
    """Units drawn on a planted sub-basis of (2, 2): the summed evidence must find it.

    Every planted coefficient varies across units (Σ* full rank), so a smaller
    basis misfits; a larger one only adds parameters.
    """
    data, test, _, _, _ = planted_fleet(40, 25, seed=8, orders=planted)
    alg = make(orders=(2, 2), select="bic")
    server, _, personal, _ = run(alg, data, 40)
    assert alg.candidates[int(server["choice"])] == {"orders": list(planted)}
    # the chosen basis's model: terms outside it are exactly 0 and carry no variance
    out = [j for j, t in enumerate(alg.terms) if t not in legendre_exponents(2, orders=planted)]
    assert torch.all(personal["coef"][:, out] == 0) and torch.all(personal["cov"][:, out] == 0)
    # it predicts like fedprior fixed to the planted basis
    fixed = make(orders=planted)
    _, _, own, _ = run(fixed, data, 40)
    torch.testing.assert_close(
        alg.predict(personal, test.x), fixed.predict(own, test.x), rtol=0, atol=1e-6
    )


def test_a_fleet_of_few_point_units_gets_a_basis_its_points_can_learn():
    """Every unit has 8 points, the asked basis (3, 3) 16 terms: selection must back off."""
    data, test, _, _, _ = planted_fleet(30, 8, seed=9, orders=(1, 1))
    big = make(orders=(3, 3))
    chosen = make(orders=(3, 3), select="bic")
    _, _, p_big, _ = run(big, data, 40)
    server, _, p_sel, _ = run(chosen, data, 40)

    def rmse(alg, personal):
        return float((alg.predict(personal, test.x) - test.y).pow(2).mean().sqrt())

    assert chosen.candidates[int(server["choice"])] == {"orders": [1, 1]}
    # test targets carry noise 0.01; the (3, 3) prior must learn 12 near-zero terms
    assert rmse(chosen, p_sel) < 0.9 * rmse(big, p_big)


def test_screening_judges_only_the_chosen_basis_and_still_rejects_a_poisoned_unit():
    """Mixed fleet (40-point and 3-point units) under the default screening.

    Honest units are never rejected although misfitting candidates' statistics
    differ wildly between them; a unit whose targets are ×1000 is rejected every round.
    """
    data, _, _, _, _ = planted_fleet(24, [40] * 12 + [3] * 12, seed=10, orders=(1, 1))
    alg = make(orders=(2, 2), select="bic")
    server, rejected = run_screened(alg, data, 15)
    assert all(r == [] for r in rejected)
    assert alg.candidates[int(server["choice"])] == {"orders": [1, 1]}
    y = data.y.clone()
    y[5] *= 1000.0
    bad = ClientData(data.x, y, data.count, data.seeds)
    server_bad, rejected_bad = run_screened(alg, bad, 15)
    assert all(r == [5] for r in rejected_bad)
    torch.testing.assert_close(server_bad["mu"], server["mu"], rtol=0, atol=0.1)


def test_the_chosen_prior_exports_as_its_own_basis_and_calibrates_alike():
    import json

    data, _, _, _, _ = planted_fleet(30, 20, seed=11, orders=(1, 1))
    alg = make(orders=(2, 2), select="bic")
    server, _, personal, _ = run(alg, data, 30)
    doc = json.loads(json.dumps(alg.export_state(server)))
    assert doc["selection"]["chosen"] == {"orders": [1, 1]}
    assert len(doc["selection"]["scores"]) == len(alg.candidates) == 9
    assert doc["terms"] == [list(t) for t in legendre_exponents(2, orders=(1, 1))]
    # what `fedcal calibrate` rebuilds: the chosen basis, fixed, from the exported prior
    fixed = make(orders=(1, 1))
    prior = {k: torch.tensor(doc[k], dtype=F64) for k in ("mu", "sigma", "noise_var")}
    down = expand(fixed.broadcast(prior), 30)
    again = fixed.personalize(down, fixed.client_init(down), data)
    idx = torch.tensor([alg.terms.index(tuple(t)) for t in doc["terms"]])
    torch.testing.assert_close(again["coef"], personal["coef"][:, idx], rtol=1e-9, atol=1e-12)
