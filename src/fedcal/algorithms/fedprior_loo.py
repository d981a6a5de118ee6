"""A reference unit's prior without itself (issue 33, fedprior_deploy E2): a reference
unit emulates a new unit's calibration, and a new unit is not in the prior it is
calibrated from. The mean is removed with the unit's GLS weight (exact at the M-step's
fixed point for a fixed Σ); the covariance to first order in 1/N.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fedcal.algorithms.fedprior_select import _masked
from fedcal.core.bayes import F64, moments, posterior
from fedcal.core.data import ClientData
from fedcal.core.tree import Tree, gather

LOO_CHUNK = 256  # units per pass of _leave_one_out's fleet sums (bounded memory)


def _gls_terms(alg, down: Tree, data: ClientData, units: Tensor):
    """The posterior (mean, cov masked to the basis in use) and the M-step's GLS terms
    (gls_gram, gls_rhs: :func:`~fedcal.core.bayes.posterior`) of ``units``, each from all
    its rows under the broadcast prior and the fleet's σ²."""
    sub = gather(down, units)
    x, y = data.x[units].to(F64), data.y[units][..., 0].to(F64)
    z = alg.design(x, None if data.branch is None else data.branch[units]).to(F64)
    stats = moments(z, y, data.mask[units].to(F64))
    model = alg._model_mask(sub)
    stats = stats if model is None else _masked(stats, model)
    post = posterior(stats, sub["mu"].to(F64), sub["sigma"].to(F64), sub["noise_var"].to(F64))
    coef, cov = post.mean, post.cov
    if "mask" in sub:
        m = sub["mask"].to(F64)
        coef, cov = coef * m, cov * m.unsqueeze(-1) * m.unsqueeze(-2)
    return coef, cov, post.gls_gram, post.gls_rhs


def _gls_solve(gram: Tensor, target: Tensor, mean_scale: float, rcond: float = 1e-10) -> Tensor:
    """(G + I/s²)⁺ t, batched: :func:`~fedcal.core.bayes.m_step`'s solve (s = ∞: the
    pseudo-inverse dropping eigenvalues below ``rcond`` times the largest)."""
    p = gram.shape[-1]
    gram = 0.5 * (gram + gram.mT)
    if math.isfinite(mean_scale):
        gram = gram + torch.eye(p, dtype=F64) / mean_scale**2
    vals, vecs = torch.linalg.eigh(gram)
    keep = vals > rcond * vals.amax(-1, keepdim=True).clamp_min(torch.finfo(F64).tiny)
    inv = torch.where(keep, 1.0 / torch.where(keep, vals, 1.0), torch.zeros_like(vals))
    return (vecs @ (inv * (vecs.mT @ target.unsqueeze(-1))[..., 0]).unsqueeze(-1))[..., 0]


def _leave_one_out(alg, down: Tree, data: ClientData, refs: Tensor) -> Tree:
    """The prior of each unit of ``refs`` without itself (E2), rows in ``refs``' order.

    μ: the M-step's GLS solve (:func:`~fedcal.core.bayes.m_step`, Σ fixed) without unit
    i's terms, relative to the solve with them: with G = Σ_j G_j + I/s², R = Σ_j R_j − μ/s²
    (G_j, R_j the gls_gram, gls_rhs of unit j's posterior, s the mean's hyperprior scale),
    μ_(−i) = μ + (G − G_i)⁺(R − R_i) − G⁺R; at the M-step's fixed point (R = 0) that is
    μ − (G − G_i)⁺R_i: unit i is removed with its GLS weight (a 384-point reference among
    6-point units carries far more than 1/N). The fleet sums G, R are one pass over the
    fleet in chunks of :data:`LOO_CHUNK` units (memory bounded; the fits that emulate are
    the references' alone). Σ: to first order in 1/N, with m_i, V_i unit i's posterior
    and S_i = (m_i − μ)(m_i − μ)ᵀ + V_i its share of the M-step's second moment,
    whitened by Σ (M_i = Σ^(−½) S_i Σ^(−½)), Σ_(−i) = Σ^(½) [I + (1 − λ)(I − M_i)/(N − 1)]₊
    Σ^(½) (λ the M-step's shrinkage; the bracket's eigenvalues kept ≥ ½: a first-order
    removal is not trusted to shrink a direction more, e.g. the vague start's). A
    reference unit emulates as a new unit is calibrated: against a prior it is not in."""
    n = data.num_clients
    gram, rhs = 0.0, 0.0
    for start in range(0, n, LOO_CHUNK):
        chunk = torch.arange(start, min(start + LOO_CHUNK, n))
        _, _, g, r = _gls_terms(alg, down, data, chunk)
        gram, rhs = gram + g.sum(0), rhs + r.sum(0)
    coef, cov, g_i, r_i = _gls_terms(alg, down, data, refs)
    first = gather(down, refs[:1])
    mu, sigma = first["mu"][0].to(F64), first["sigma"][0].to(F64)
    scale = float(getattr(alg, "mean_scale", math.inf))
    total = rhs - (mu / scale**2 if math.isfinite(scale) else 0.0)
    base = _gls_solve(gram, total, scale)
    mu_loo = mu + _gls_solve(gram - g_i, total - r_i, scale) - base
    keep = first["mask"][0].to(F64) if "mask" in first else torch.ones_like(mu)
    mu_loo = mu + (mu_loo - mu) * keep
    dev = (coef - mu) * keep
    share = dev.unsqueeze(-1) * dev.unsqueeze(-2) + cov
    lam = alg.shrinkage_units / (n + alg.shrinkage_units)
    vals, vecs = torch.linalg.eigh(0.5 * (sigma + sigma.mT))
    root = vecs * vals.clamp_min(1e-300).sqrt().unsqueeze(-2)  # Σ^(½) = root rootᵀ ... up to U
    inv = vecs / vals.clamp_min(1e-300).sqrt().unsqueeze(-2)
    white = inv.mT @ share @ inv
    eye = torch.eye(mu.shape[-1], dtype=F64)
    inner = eye + (1 - lam) * (eye - white) / max(n - 1, 1)
    w, u = torch.linalg.eigh(0.5 * (inner + inner.mT))
    inner = (u * w.clamp_min(0.5).unsqueeze(-2)) @ u.mT
    return {"mu": mu_loo, "sigma": root @ inner @ root.mT}
