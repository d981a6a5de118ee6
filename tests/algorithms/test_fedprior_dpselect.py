"""fedprior's basis chosen under client-level DP (select_by = "marginal", issue 25.3)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import MultivariateNormal

from fedcal.core.aggregation import AggregationPolicy
from fedcal.core.bayes import F64
from fedcal.core.privacy import (
    clip_statistics,
    composed_epsilon,
    epsilon_spent,
    noise_for_epsilon,
    noise_std,
)
from fedcal.core.tree import expand
from fedcal.models.basis import legendre_products

from .test_fedprior import make, planted_fleet
from .test_fedprior_dp import _rounds


def marginal(**kw):
    kw = {"orders": (2, 2), "select": "bic", "select_by": "marginal", **kw}
    return make(**kw)


def test_a_units_score_is_its_evidence_under_the_marginal_prior():
    """s_ik = log N(y; Φ_k μ_k, Φ_k Σ_kk Φ_kᵀ + σ²I) − the full basis's, by torch's
    MultivariateNormal on the unit's raw rows (a reference, not the moments' closed form)."""
    alg = marginal(select_clip=1e6)
    data, _, _, _, _ = planted_fleet(3, [5, 9, 14], seed=5, orders=(1, 1))
    gen = torch.Generator().manual_seed(0)
    p = alg.num_features
    a = 0.4 * torch.randn(p, p, generator=gen, dtype=F64)
    down = {
        "mu": 0.3 * torch.randn(p, generator=gen, dtype=F64),
        "sigma": a @ a.T + 0.05 * torch.eye(p, dtype=F64),
        "noise_var": torch.tensor(0.02, dtype=F64),
        "mask": alg.masks[-1],
    }
    full = alg._moments(data)
    scores = alg.selection.marginal_scores(expand(down, 3), expand(down, 3)["noise_var"], full)
    for i in range(3):
        n = int(data.count[i])
        x, y = data.x[i, :n].to(F64), data.y[i, :n, 0].to(F64)
        phi = legendre_products(x, alg.terms)

        evidence = []
        for mask in alg.masks:
            f = phi * mask
            cov = f @ down["sigma"] @ f.T + 0.02 * torch.eye(n, dtype=F64)
            evidence.append(MultivariateNormal(f @ down["mu"], cov).log_prob(y))
        ref = torch.stack(evidence) - evidence[-1]
        torch.testing.assert_close(scores[i], ref, rtol=1e-8, atol=1e-8)
    assert float(scores[:, -1].abs().max()) == 0.0


def test_the_scores_are_clipped_per_candidate_and_their_l2_bound_is_b_sqrt_k():
    """Hand-computed: b = 2, K = 9 candidates → each entry within ±2 and B = 2·3 = 6; a
    reply of norm 10 (an upload that ignored the per-candidate clip) is scaled to 6."""
    alg = marginal(select_clip=2.0)
    data, _, _, _, _ = planted_fleet(6, 40, seed=6, orders=(1, 1))
    server, _, result = _rounds(alg, data, 2)
    scores = result.reply["select"]
    assert scores.shape == (6, 9) and float(scores.abs().max()) <= 2.0
    assert float(scores.min()) == -2.0  # a 40-row unit misses the planted terms by far more
    declared = alg.dp_statistics(alg.broadcast(server))
    assert declared["select"].bound == pytest.approx(6.0)
    replies = {key: result.reply[key] for key in declared}
    replies["select"] = torch.zeros(6, 9, dtype=F64)
    replies["select"][0, :2] = torch.tensor([6.0, -8.0], dtype=F64)  # norm 10
    replies["select"][1, :2] = torch.tensor([3.0, -4.0], dtype=F64)  # norm 5 < 6: kept
    clipped, _ = clip_statistics(replies, declared)
    torch.testing.assert_close(clipped["select"][0, :2], torch.tensor([3.6, -4.8], dtype=F64))
    torch.testing.assert_close(clipped["select"][1, :2], torch.tensor([3.0, -4.0], dtype=F64))


def test_the_selections_share_is_accounted_in_the_runs_epsilon():
    """The scores' noise is σB/√f; the sums' joint multiplier σ/√(1 − f): composed by
    Opacus's RDP accountant, and by the closed form of the Gaussian's RDP (α R/2σ² per
    order, Opacus's (ε, δ) conversion), they spend exactly the run's ε of σ alone."""
    from opacus.accountants.analysis.rdp import get_privacy_spent
    from opacus.accountants.rdp import RDPAccountant

    alg = marginal(select_clip=3.0, dp_select_share=0.2)
    down = alg.broadcast(alg.server_init({}))
    declared = alg.dp_statistics(down)
    sigma, rounds, delta, f = 2.0, 6, 1e-6, 0.2
    stds = noise_std(declared, sigma)
    b = 3.0 * 3.0  # select_clip · √9
    assert stds["select"] == pytest.approx(sigma * b / math.sqrt(f), rel=1e-12)
    rest = math.sqrt(sum(s.weight**2 for k, s in declared.items() if k != "select"))
    assert stds["mean"] == pytest.approx(
        sigma / math.sqrt(1 - f) * rest * declared["mean"].bound, rel=1e-12
    )
    run = epsilon_spent(sigma, 1.0, rounds, delta)
    split = composed_epsilon(
        [(sigma / math.sqrt(1 - f), 1.0, rounds), (sigma / math.sqrt(f), 1.0, rounds)], delta
    )
    assert split == pytest.approx(run, rel=1e-9)
    orders = RDPAccountant.DEFAULT_ALPHAS
    rdp = [a * rounds * ((1 - f) + f) / (2 * sigma**2) for a in orders]
    closed, _ = get_privacy_spent(orders=orders, rdp=rdp, delta=delta)
    assert run == pytest.approx(float(closed), rel=1e-9)


def test_dp_selection_picks_the_planted_basis_at_a_generous_epsilon():
    """400 units of 20 rows, coefficients planted on (1, 1) inside the (2, 2) basis: at
    ε = 8 (δ = 1/N², 4 rounds, q = 1) the noisy BIC picks (1, 1), as without DP."""
    alg = marginal(select_clip=1.0, interval="posterior")
    data, _, _, _, _ = planted_fleet(400, 20, seed=7, orders=(1, 1))
    plain, _, _ = _rounds(alg, data, 4)
    sigma = noise_for_epsilon(8.0, 1 / 400**2, 1.0, 4)
    private, _, _ = _rounds(alg, data, 4, AggregationPolicy(dp_noise_multiplier=sigma, dp_clip=1))
    planted = alg.candidates.index({"orders": [1, 1]})
    assert int(plain["choice"]) == planted
    assert int(private["choice"]) == planted
    assert not torch.allclose(private["scores"], plain["scores"])  # noise was added


def test_marginal_em_with_a_noise_model_runs_on_the_full_basis():
    """select_by = "marginal" runs its EM on the full basis whatever the candidate chosen:
    with σ²(x) and Student-t rows, a unit's uploads (E-step sums, γ's terms, t weights)
    under a broadcast whose chosen basis is a sub-basis equal those of the same model
    without selection (review2: γ's residuals were the full posterior's on the chosen
    terms only, and the t weights the sub-basis fit's)."""
    noise = {"orders": (2, 2), "noise_shape": "inputs", "noise_tail": "student"}
    alg, plain = marginal(**noise), make(**noise)
    data, _, _, _, _ = planted_fleet(4, [9, 12, 20, 30], seed=3, orders=(2, 2))
    gen = torch.Generator().manual_seed(1)
    p = alg.num_features
    a = 0.3 * torch.randn(p, p, generator=gen, dtype=F64)
    down = {
        "mu": 0.3 * torch.randn(p, generator=gen, dtype=F64),
        "sigma": a @ a.T + 0.05 * torch.eye(p, dtype=F64),
        "noise_var": torch.tensor(0.02, dtype=F64),
        "noise_gamma": torch.tensor([0.4, -0.3], dtype=F64),
        "noise_gamma_fit": torch.tensor([0.5, -0.2], dtype=F64),
    }
    sub = {**down, "mask": alg.masks[2]}  # a chosen sub-basis: (2, 2) without some terms
    assert float(alg.masks[2].sum()) < p
    got = alg.client_update(expand(sub, 4), alg.client_init(expand(sub, 4)), data).reply
    ref = plain.client_update(expand(down, 4), plain.client_init(expand(down, 4)), data).reply
    for key in ("mean", "second", "rss", "gls_rhs"):
        torch.testing.assert_close(got[key], ref[key], rtol=1e-10, atol=1e-12)
    for key in ("score", "info", "ratio"):
        torch.testing.assert_close(got["noise"][key], ref["noise"][key], rtol=1e-10, atol=1e-12)


def test_marginal_bic_counts_no_parameter_for_the_pinned_direction_term():
    """With the direction term out of the model (every unit swept one way: all of ψ pinned),
    BIC counts no parameter for it, as the candidates' EM does (fedprior module doc).
    Hand-computed, (1, 1) with ψ = (1, 1) in every candidate, 8 units (½ log 8 = 1.04):
    summed scores −18 for the constant basis, 0 for the full one (the others far below).
    Without ψ: d = 3 and 15, BIC −21.1 and −15.6 → the full basis; with ψ's 4 pinned
    terms counted, d = 21 and 45, −39.8 and −46.8 → the constant (review2)."""
    import numpy as np

    from fedcal.core.data import ClientData

    alg = marginal(orders=(1, 1), branch_orders=(1, 1))
    data, _, _, _, _ = planted_fleet(8, 20, seed=4, orders=(1, 1))
    one_way = ClientData.from_arrays(
        [(data.x[i].numpy(), data.y[i].numpy()) for i in range(8)],
        dtype=F64,
        branch=[np.ones(20) for _ in range(8)],
    )
    server = alg.server_init({})
    down = expand(alg.broadcast(server), 8)
    reply = dict(alg.client_update(down, alg.client_init(down), one_way).reply)
    k = len(alg.candidates)
    assert [len(c["orders"]) for c in alg.candidates] == [2] * k and k == 4
    reply["select"] = torch.full((8, k), -10.0, dtype=F64)
    reply["select"][:, 0], reply["select"][:, -1] = -18.0 / 8, 0.0
    new = alg.server_update(server, reply, one_way.count)
    assert new["pinned"].tolist() == [0.0] * 4 + [1.0] * 4
    half_log = 0.5 * math.log(8)
    expected = torch.tensor([-18.0 - 3 * half_log, -80.0 - 6 * half_log], dtype=F64)
    torch.testing.assert_close(new["scores"][:2], expected)
    assert int(new["choice"]) == k - 1


def test_a_selection_score_beyond_the_clip_is_rejected_by_the_consistency_check():
    """The scores are unscreened (not judged by size): without DP nothing else bounds them,
    so one unit uploading 10⁶ for a candidate would pick the fleet's basis (review2)."""
    alg = marginal(select_clip=2.0)
    data, _, _, _, _ = planted_fleet(6, 40, seed=6, orders=(1, 1))
    server, state, _ = _rounds(alg, data, 2)
    result = alg.client_update(expand(alg.broadcast(server), 6), state, data)
    everyone = torch.ones(6, dtype=torch.bool)
    assert alg.inconsistent_replies(server, result.reply, data.count, everyone) == {}
    forged = {**result.reply, "select": result.reply["select"].clone()}
    forged["select"][2, 0] = 1e6
    forged["select"][4, -1] = 0.5  # the full basis scores itself 0
    bad = alg.inconsistent_replies(server, forged, data.count, everyone)
    assert sorted(bad) == [2, 4] and "selection scores" in bad[2]
    new = alg.server_update(server, forged, data.count)
    assert int(new["choice"]) == 0  # what the forged upload does when nothing rejects it
