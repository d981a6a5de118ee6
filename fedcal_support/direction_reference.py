"""The sweep-direction model of ``studies/fewpoint_direction.py``, fitted by hand.

    y = φ(x)ᵀc_i + d·ψ(x)ᵀh_i + ε,   d = +1 ascending, −1 descending,   (c_i, h_i) ~ N(μ, Σ)

fedprior's hierarchical model on the features [φ(x), d·ψ(x)], its EM written out
round by round with core/bayes.py's functions (the study's docstring has the
model and the prediction). The reference the tests hold fedprior's own
``branch_orders`` to (tests/algorithms/test_fedprior_branch.py,
tests/test_fewpoint_direction.py), and what the study runs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fedcal.algorithms.fedprior import FedPrior
from fedcal.core.bayes import F64, data_support, m_step, moments, posterior, regularize
from fedcal.models.basis import legendre_exponents, legendre_products

PHI_ORDERS = (3, 3)
DEFAULTS = FedPrior.__dataclass_fields__  # fedprior's shrinkage, floor, start, hyperprior


def default(name: str):
    return DEFAULTS[name].default


def bases(x: Tensor, psi: tuple | None) -> tuple[Tensor, Tensor]:
    """φ(x) (clients, rows, p) and ψ(x) (clients, rows, q; q = 0 when ``psi`` is None)."""
    phi = legendre_products(x, legendre_exponents(2, orders=PHI_ORDERS))
    if psi is None:
        return phi, phi[..., :0]
    return phi, legendre_products(x, legendre_exponents(2, orders=psi))


def features(phi: Tensor, psi: Tensor, d: Tensor) -> Tensor:
    """The candidate model's design [φ(x), d·ψ(x)] (clients, rows, p + q)."""
    return torch.cat([phi, psi * d.unsqueeze(-1)], -1)


def fit_prior(
    design: Tensor, y: Tensor, mask: Tensor, rounds: int
) -> tuple[Tensor, Tensor, Tensor, float]:
    """fedprior's EM (select = "none", one fleet noise) on given features: (μ, Σ, σ², BIC).

    Round: E-step :func:`posterior` per unit under the broadcast prior; M-step
    :func:`m_step` (GLS mean with the N(0, s²) hyperprior), Σ̂ shrunk toward its
    diagonal in the fleet's design metric by λ = ν0/(N + ν0) and floored
    (:func:`regularize`); directions informed by fewer than ``min_informed``
    units keep the vague start; σ² = Σ r_i / Σ n_i (FedPrior._prior_update). BIC: the
    fleet's Σ_i log p(y_i) at the result − ½ d log N, d = p + p(p + 1)/2 + 1.
    """
    stats = moments(design, y, mask)
    c, p = stats.rhs.shape
    init_scale = default("init_scale")
    mu = torch.zeros(p, dtype=F64)
    sigma = init_scale**2 * torch.eye(p, dtype=F64)
    noise = torch.tensor(default("init_noise") ** 2, dtype=F64)
    count = torch.tensor(float(c), dtype=F64)
    metric = stats.gram.sum(0) / stats.n.sum()
    lam = default("shrinkage_units") / (c + default("shrinkage_units"))
    for _ in range(rounds):
        noise_c = noise.expand(c)
        post = posterior(stats, mu, sigma, noise_c)
        second = post.mean.unsqueeze(-1) * post.mean.unsqueeze(-2) + post.cov
        support = data_support(stats.gram, noise_c, init_scale).sum(0)
        new_mu, sigma_hat = m_step(
            post.gls_gram.sum(0),
            post.gls_rhs.sum(0),
            post.mean.sum(0),
            second.sum(0),
            count,
            mu,
            default("mean_scale"),
        )
        new_sigma = regularize(sigma_hat, lam, default("floor"), None, metric)
        vals, vecs = torch.linalg.eigh(0.5 * (support + support.T))
        weak = vecs[:, vals < default("min_informed")]
        if weak.shape[1]:
            proj_weak = weak @ weak.T
            proj_seen = torch.eye(p, dtype=F64) - proj_weak
            new_sigma = proj_seen @ new_sigma @ proj_seen + init_scale**2 * proj_weak
            new_mu = proj_seen @ new_mu + proj_weak @ mu
        mu, sigma = new_mu, new_sigma
        noise = post.rss.sum() / stats.n.sum()
    loglik = posterior(stats, mu, sigma, noise.expand(c)).loglik.sum()
    bic = float(loglik) - 0.5 * (p + p * (p + 1) / 2 + 1) * math.log(c)
    return mu, sigma, noise, bic


def predict(
    mu: Tensor, sigma: Tensor, noise: Tensor, train: tuple, phi: Tensor, psi: Tensor, d: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Branch-averaged mean φᵀm_c and variance φᵀV_ccφ + σ² + ψᵀ(m_h m_hᵀ + V_hh)ψ.

    ``train`` = (features, y, mask) of the units; ``phi``, ``psi`` the test rows'
    bases, ``d`` their true directions, used only by the third output: the
    direction-known mean φᵀm_c + d ψᵀm_h.
    """
    design, y, mask = train
    c, p = design.shape[0], phi.shape[-1]
    post = posterior(moments(design, y, mask), mu, sigma, noise.expand(c))
    mean_c, cov_cc = post.mean[:, :p], post.cov[:, :p, :p]
    mean_h, cov_hh = post.mean[:, p:], post.cov[:, p:, p:]
    pred = (phi * mean_c.unsqueeze(1)).sum(-1)
    second_h = mean_h.unsqueeze(-1) * mean_h.unsqueeze(-2) + cov_hh  # E[h hᵀ]
    var = ((phi @ cov_cc) * phi).sum(-1) + noise + ((psi @ second_h) * psi).sum(-1)
    known = pred + d * (psi * mean_h.unsqueeze(1)).sum(-1)
    return pred, var, known
