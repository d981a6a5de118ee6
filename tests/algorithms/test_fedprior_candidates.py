"""Every candidate basis's EM as a part (fedprior_candidates, C2 and C4): each candidate's
E-step is the sub-basis model's, and the BIC choice is Schwarz's score computed by hand."""

from __future__ import annotations

import math

import torch

from fedcal.core.bayes import F64
from fedcal.core.tree import expand

from .test_fedprior import make, planted_fleet

EPS = torch.finfo(F64).eps


def test_each_candidate_s_e_step_is_the_sub_basis_model():
    """C2: candidate k's batched E-step on the masked moments equals the posterior of fedprior
    fixed to candidate k's orders, on its terms; its other coordinates keep the prior (0)."""
    data, *_ = planted_fleet(6, 12, seed=1, orders=(2, 1))
    alg = make(orders=(2, 1), select="bic")
    n = data.num_clients
    down = expand(alg.broadcast(alg.server_init({})), n)
    out, own = alg.candidate_ems.e_step(
        down, alg.client_init(down), alg._moments(data), alg._e_step_sums
    )
    assert out["mean"].shape == (n, len(alg.candidates), len(alg.terms)) and own.shape == (n, 6)
    for k, cand in enumerate(alg.candidates):
        sub = make(orders=tuple(cand["orders"]))
        idx = torch.nonzero(alg.masks[k])[:, 0]
        assert sub.terms == tuple(alg.terms[j] for j in idx.tolist())  # the same columns
        sub_down = expand(sub.broadcast(sub.server_init({})), n)
        stats, post = sub._posterior(sub_down, sub.client_init(sub_down), sub._moments(data))
        # both solve the p_k × p_k system Σ⁻¹ + G/σ² (the batched one padded by the prior's
        # unit rows): backward-stable, so relative error ≤ c·p·ε·κ, c = 10 for the factor,
        # solve and products
        p = len(idx)
        prec = torch.eye(p, dtype=F64) / alg.init_scale**2 + stats.gram / alg.init_noise**2
        tol = 10 * p * EPS * float(torch.linalg.cond(prec).max())
        mean = out["mean"][:, k]
        torch.testing.assert_close(
            mean[:, idx], post.mean, rtol=tol, atol=tol * float(post.mean.abs().max())
        )
        rest = torch.ones(len(alg.terms), dtype=torch.bool)
        rest[idx] = False
        assert torch.all(mean[:, rest] == 0)  # no data there: the prior mean, 0
        scale = float(post.loglik.abs().max())
        torch.testing.assert_close(out["loglik"][:, k], post.loglik, rtol=tol, atol=tol * scale)


def test_the_bic_choice_is_schwarz_s_score_by_hand():
    """C4: BIC_k = Σ_i log p(y_i | θ_k) − ½ d_k log N, d_k = p + p(p + 1)/2 + 1; with R1's
    sample, N is the sample's count (``unit``), not the fleet's."""
    alg = make(orders=(1, 1), select="bic")
    assert alg.masks.sum(1).tolist() == [1.0, 2.0, 2.0, 4.0]  # p_k of (0,0), (0,1), (1,0), (1,1)
    d = torch.tensor([3.0, 6.0, 6.0, 15.0], dtype=F64)  # p + p(p+1)/2 + 1
    loglik = torch.tensor([0.0, 10.0, 5.0, 20.0], dtype=F64)
    none = torch.zeros(4, dtype=torch.bool)
    scores, choice, same = alg.candidate_ems.choice({"loglik": loglik}, torch.tensor(10.0), none)
    torch.testing.assert_close(scores, loglik - 0.5 * d * math.log(10.0), rtol=0, atol=1e-14)
    assert choice == 1 and not bool(same.any())  # 10 − 3·ln 10 = 3.09 > 20 − 7.5·ln 10 = 2.73
    # N = 2 sampled units: the penalty is ½ d_k ln 2, and the largest candidate wins
    sampled = {"loglik": loglik, "unit": torch.full((4,), 2.0, dtype=F64)}
    scores, choice, _ = alg.candidate_ems.choice(sampled, torch.tensor(10.0), none)
    torch.testing.assert_close(scores, loglik - 0.5 * d * math.log(2.0), rtol=0, atol=1e-14)
    assert choice == 3


def test_a_candidate_that_differs_only_in_pinned_terms_is_no_rival():
    """C4 with the direction term selected: when both ψ coordinates are out of the model
    (pinned), a candidate with ψ is its ψ-less candidate, counts the same parameters and never
    wins, however large its evidence."""
    alg = make(orders=(1, 1), select="bic", branch_orders=(1, 0), branch_select=True)
    k = len(alg.candidates)
    pinned = torch.tensor([False] * 4 + [True] * 2)
    with_psi = torch.tensor([bool(c["branch_orders"]) for c in alg.candidates])
    loglik = torch.where(with_psi, 100.0, 0.0).to(F64)
    _, choice, same = alg.candidate_ems.choice({"loglik": loglik}, torch.tensor(10.0), pinned)
    assert torch.equal(same, with_psi) and alg.candidates[choice]["branch_orders"] == []
    zero = {"loglik": torch.zeros(k, dtype=F64)}  # the scores are then −½ d_k ln N alone
    penalty, _, _ = alg.candidate_ems.choice(zero, torch.tensor(10.0), pinned)
    for j in torch.nonzero(with_psi)[:, 0].tolist():  # its ψ-less twin: the same penalty
        twin = next(
            i
            for i in range(k)
            if alg.candidates[i]["orders"] == alg.candidates[j]["orders"]
            and not alg.candidates[i]["branch_orders"]
        )
        assert float(penalty[j]) == float(penalty[twin]) < 0
