"""The fleet-prior algebra (core/bayes.py) against direct dense computations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import multivariate_normal

from fedcal.core.bayes import (
    F64,
    data_support,
    m_step,
    moments,
    posterior,
    predictive_var,
    regularize,
)


def _problem(seed: int = 0, clients: int = 3, rows: int = 7, p: int = 4):
    g = torch.Generator().manual_seed(seed)
    design = torch.randn(clients, rows, p, generator=g, dtype=F64)
    y = torch.randn(clients, rows, generator=g, dtype=F64)
    mask = torch.ones(clients, rows, dtype=F64)
    mask[1, 5:] = 0  # client 1 has 5 real rows, 2 of padding
    a = torch.randn(p, p, generator=g, dtype=F64)
    sigma = a @ a.T + 0.5 * torch.eye(p, dtype=F64)
    mu = torch.randn(p, generator=g, dtype=F64)
    noise = torch.tensor([0.3, 0.7, 1.9], dtype=F64)
    return design, y, mask, mu, sigma, noise


def _server_step(post, mu0):
    """The M-step from the sums of a cohort's E-step, as fedprior's server takes it."""
    second = post.mean.unsqueeze(-1) * post.mean.unsqueeze(-2) + post.cov
    count = torch.tensor(float(post.mean.shape[0]), dtype=F64)
    sums = (post.gls_gram.sum(0), post.gls_rhs.sum(0), post.mean.sum(0), second.sum(0))
    return m_step(*sums, count, mu0)


def test_e_step_equals_direct_posterior_and_marginal_likelihood():
    """V = (ΦᵀΦ/σ² + Σ⁻¹)⁻¹, m = V(Φᵀy/σ² + Σ⁻¹μ); log p(y) = log N(y; Φμ, σ²I + ΦΣΦᵀ)."""
    design, y, mask, mu, sigma, noise = _problem()
    post = posterior(moments(design, y, mask), mu, sigma, noise)
    for i in range(3):
        n = int(mask[i].sum())
        phi, yi, s2 = design[i, :n].numpy(), y[i, :n].numpy(), float(noise[i])
        sig, m0 = sigma.numpy(), mu.numpy()
        v = np.linalg.inv(phi.T @ phi / s2 + np.linalg.inv(sig))
        m = v @ (phi.T @ yi / s2 + np.linalg.solve(sig, m0))
        np.testing.assert_allclose(post.mean[i].numpy(), m, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(post.cov[i].numpy(), v, rtol=1e-10, atol=1e-12)
        c = s2 * np.eye(n) + phi @ sig @ phi.T
        ll = multivariate_normal(phi @ m0, c).logpdf(yi)
        assert float(post.loglik[i]) == pytest.approx(ll, rel=1e-10)
        c_inv = np.linalg.inv(c)
        np.testing.assert_allclose(post.gls_gram[i].numpy(), phi.T @ c_inv @ phi, rtol=1e-9)
        np.testing.assert_allclose(
            post.gls_rhs[i].numpy(), phi.T @ c_inv @ (yi - phi @ m0), rtol=1e-9, atol=1e-12
        )
        # E‖y − Φc‖² under N(m, V) = ‖y − Φm‖² + tr(Φ V Φᵀ)
        rss = np.sum((yi - phi @ m) ** 2) + np.trace(phi @ v @ phi.T)
        assert float(post.rss[i]) == pytest.approx(rss, rel=1e-10)
    pv = predictive_var(design, post.cov, noise)
    direct = np.einsum("rp,pq,rq->r", design[0].numpy(), post.cov[0].numpy(), design[0].numpy())
    np.testing.assert_allclose(pv[0].numpy(), direct + 0.3, rtol=1e-12)


def test_vague_prior_gives_least_squares_and_tight_prior_gives_prior_mean():
    design, y, mask, mu, _, noise = _problem(seed=1)
    p = mu.shape[0]
    vague = posterior(moments(design, y, mask), mu, 1e8 * torch.eye(p, dtype=F64), noise)
    tight = posterior(moments(design, y, mask), mu, 1e-12 * torch.eye(p, dtype=F64), noise)
    for i in range(3):
        n = int(mask[i].sum())
        ls = np.linalg.lstsq(design[i, :n].numpy(), y[i, :n].numpy(), rcond=None)[0]
        np.testing.assert_allclose(vague.mean[i].numpy(), ls, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(tight.mean[i].numpy(), mu.numpy(), atol=1e-9)


def test_tight_prior_m_step_gives_the_pooled_least_squares_fit():
    """Σ → 0: every unit has the same coefficients, and GLS for μ is pooled least squares."""
    design, y, mask, _, _, _ = _problem(seed=2)
    p = design.shape[-1]
    noise = torch.full((3,), 0.5, dtype=F64)  # one noise level: pooled OLS = pooled GLS
    mu0 = torch.zeros(p, dtype=F64)
    post = posterior(moments(design, y, mask), mu0, 1e-14 * torch.eye(p, dtype=F64), noise)
    mu, _ = _server_step(post, mu0)
    keep = mask.bool()
    pooled = np.linalg.lstsq(design[keep].numpy(), y[keep].numpy(), rcond=None)[0]
    np.testing.assert_allclose(mu.numpy(), pooled, rtol=1e-7, atol=1e-9)


def test_m_step_sigma_is_the_expected_outer_product_about_the_new_mean():
    design, y, mask, mu0, sigma, noise = _problem(seed=3)
    post = posterior(moments(design, y, mask), mu0, sigma, noise)
    mu, sig = _server_step(post, mu0)
    direct = (
        sum(torch.outer(post.mean[i] - mu, post.mean[i] - mu) + post.cov[i] for i in range(3)) / 3
    )
    torch.testing.assert_close(sig, direct, rtol=1e-10, atol=1e-12)


def test_regularize_shrinks_floors_and_factors():
    a = torch.tensor([[4.0, 3.9, 0.0], [3.9, 4.0, 0.0], [0.0, 0.0, 1e-30]], dtype=F64)
    out = regularize(a, shrinkage=0.5, floor=1e-6)
    # off-diagonal halved, diagonal kept (up to the floor on the tiny eigenvalue)
    assert float(out[0, 1]) == pytest.approx(1.95, rel=1e-9)
    assert float(out[0, 0]) == pytest.approx(4.0, rel=1e-9)
    assert float(torch.linalg.eigvalsh(out).min()) >= 1e-6 * 0.999
    # a rank-1-plus-diagonal matrix is recovered by the factor model
    w = torch.tensor([[1.0], [2.0], [-1.0]], dtype=F64)
    d = torch.tensor([0.1, 0.2, 0.3], dtype=F64)
    planted = w @ w.T + torch.diag(d)
    torch.testing.assert_close(
        regularize(planted, shrinkage=0.0, floor=1e-12, rank=1, fa_iters=500),
        planted,
        rtol=1e-4,
        atol=1e-5,
    )


def test_data_support_counts_observed_directions():
    """A unit that saw x only at two levels cannot inform the quadratic direction."""
    x = torch.tensor([-1.0, -1.0, 1.0, 1.0], dtype=F64)
    design = torch.stack([torch.ones_like(x), x, x**2], -1).unsqueeze(0)  # 1, x, x² collinear
    stats = moments(design, torch.zeros(1, 4, dtype=F64), torch.ones(1, 4, dtype=F64))
    support = data_support(stats.gram, torch.tensor([1e-4], dtype=F64), scale=1.0)
    vals = torch.linalg.eigvalsh(support[0])
    assert float(vals[0]) == pytest.approx(0.0, abs=1e-9)  # x² − 1 = 0 on the data: unseen
    assert float(vals[1]) > 0.999 and float(vals[2]) > 0.999
