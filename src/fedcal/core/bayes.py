"""A hierarchical linear model, batched over a cohort: the algebra of a fleet prior.

Sensor i has a design Φ_i (n_i × p) of a basis φ(x), targets y_i, and

    y_i = Φ_i c_i + ε_i,   ε_i ~ N(0, σ_i² I),   c_i ~ N(μ, Σ)      (the fleet prior).

Everything a client needs is its *moments* G_i = Φ_iᵀΦ_i, b_i = Φ_iᵀy_i,
yy_i = y_iᵀy_i and n_i (:func:`moments`). Given (μ, Σ, σ_i²) the posterior of
c_i is Gaussian (:func:`posterior`):

    V_i = (G_i/σ_i² + Σ⁻¹)⁻¹,   m_i = V_i (b_i/σ_i² + Σ⁻¹ μ),

computed in the prior's whitened coordinates c = μ + L z (Σ = L Lᵀ), where
the system matrix A_i = I + Lᵀ G_i L / σ_i² has every eigenvalue ≥ 1: the same
code is stable for a vague prior (Σ → ∞: m_i → the sensor's own least squares)
and a tight one (Σ → 0: m_i → μ), and never inverts Σ.

The M-step (:func:`m_step`) turns sums over clients into (μ, Σ): only sums
enter it, so secure aggregation could hide each client's terms. μ is the
generalized-least-squares mean Σ_i Φ_iᵀC_i⁻¹Φ_i μ = Σ_i Φ_iᵀC_i⁻¹y_i with
C_i = σ_i² I + Φ_i Σ Φ_iᵀ — the exact maximizer of the marginal likelihood in μ
for the current Σ (an ECME step; it converges faster than EM's plain mean of
m_i and makes Σ → 0 give the pooled least-squares fit exactly); Σ is EM's
update (1/N) Σ_i E[(c_i − μ)(c_i − μ)ᵀ], then regularized (:func:`regularize`).

Float64 throughout: Gram matrices of polynomial bases square their condition
numbers.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

F64 = torch.float64


class Moments(NamedTuple):
    """A cohort's sufficient statistics: G (c, p, p), b (c, p), yy (c,), n (c,)."""

    gram: Tensor
    rhs: Tensor
    yy: Tensor
    n: Tensor


def moments(design: Tensor, y: Tensor, mask: Tensor) -> Moments:
    """Sufficient statistics of ``design`` (c, rows, p), ``y`` (c, rows), ``mask`` (c, rows).

    Padding rows (mask 0) contribute nothing.
    """
    w = mask.to(F64)
    phi = design.to(F64) * w.unsqueeze(-1)
    y = y.to(F64) * w
    # Φᵀy and Σ y² in row order (running sums): a plain .sum(1) over the rows splits them
    # into SIMD lanes and a tail by the padded length, so a unit padded to its site's
    # longest sensor and to the fleet's got different bits (1e-16, issue 36: Flower vs the
    # simulator). Padding rows are zeros at the end: they add nothing to a running sum.
    if y.shape[1] == 0:
        return Moments(phi.transpose(1, 2) @ phi, phi.sum(1), y.sum(1), w.sum(1))
    rhs = (phi * y.unsqueeze(-1)).cumsum(1)[:, -1]
    return Moments(phi.transpose(1, 2) @ phi, rhs, (y * y).cumsum(1)[:, -1], w.sum(1))


class Posterior(NamedTuple):
    """Posterior N(mean, cov) of each client's coefficients, and what the M-step sums need.

    ``mean`` (c, p), ``cov`` (c, p, p); ``gls_gram`` Φᵀ C⁻¹ Φ (c, p, p) and
    ``gls_rhs`` Φᵀ C⁻¹ (y − Φμ) (c, p) for the mean's GLS update; ``rss`` the
    expected residual sum of squares E‖y − Φc‖² (c,); ``loglik`` the marginal
    log-likelihood log p(y_i) (c,).
    """

    mean: Tensor
    cov: Tensor
    gls_gram: Tensor
    gls_rhs: Tensor
    rss: Tensor
    loglik: Tensor
    jitter: Tensor | None = None  # (c,) relative jitter :func:`safe_cholesky` added (0: none)


#: Relative jitters tried in turn by :func:`safe_cholesky` (times the largest diagonal entry).
JITTERS = (1e-12, 1e-10, 1e-8, 1e-6, 1e-4)


def safe_cholesky(a: Tensor, symmetric: bool = False) -> tuple[Tensor, Tensor]:
    """Cholesky factor of a symmetric positive semi-definite batch (…, p, p) that cannot fail.

    Near-singular Gram matrices (collinear features, many rows, a tiny noise
    level) lose positive definiteness to rounding. A matrix whose factorization
    fails gets the smallest jitter ε·max_k a_kk·I of :data:`JITTERS` that
    factors; if none does, its eigenvalues are floored at 10⁻⁴·λ_max (an
    eigenvalue floor). Returns the factor and, per matrix, the relative jitter
    used (0: none; 1: the eigenvalue floor), which the caller reports. ``symmetric``: ``a``
    is exactly symmetric already (½(x + x) = x: its ½(a + aᵀ) is ``a``, not formed).
    """
    if not symmetric:
        a = sym(a)
    chol, info = torch.linalg.cholesky_ex(a)
    used = torch.zeros(info.shape, dtype=a.dtype)
    if not bool((info != 0).any()):
        return chol, used
    eye = torch.eye(a.shape[-1], dtype=a.dtype)
    finite = torch.isfinite(a).all(-1).all(-1)  # a non-finite matrix stays NaN (diverged)
    a = torch.where(finite[..., None, None], a, eye)
    scale = torch.diagonal(a, dim1=-2, dim2=-1).abs().amax(-1).clamp_min(1e-300)
    for eps in JITTERS:
        bad = info != 0
        if not bool(bad.any()):
            break
        trial, trial_info = torch.linalg.cholesky_ex(a + (eps * scale)[..., None, None] * eye)
        fixed = bad & (trial_info == 0)
        chol = torch.where(fixed[..., None, None], trial, chol)
        used = torch.where(fixed, torch.full_like(used, eps), used)
        info = torch.where(fixed, torch.zeros_like(info), info)
    bad = info != 0
    if bool(bad.any()):
        vals, vecs = torch.linalg.eigh(a)
        vals = vals.clamp_min(1e-4 * vals.amax(-1, keepdim=True).clamp_min(1e-300))
        floored = (vecs * vals.unsqueeze(-2)) @ vecs.transpose(-2, -1)
        trial = torch.linalg.cholesky(0.5 * (floored + floored.transpose(-2, -1)))
        chol = torch.where(bad[..., None, None], trial, chol)
        used = torch.where(bad, torch.ones_like(used), used)
    chol = torch.where(finite[..., None, None], chol, torch.nan)
    return chol, used


class PriorFactor(NamedTuple):
    """Σ's factors per client, formed by the caller (:func:`repeated_factor`): L (c, p, p)
    with Σ = LLᵀ, the jitter :func:`safe_cholesky` used (c,) and L⁻¹ (c, p, p)."""

    chol: Tensor
    jitter: Tensor
    l_inv: Tensor


def repeated_factor(sigmas: Tensor, clients: int) -> PriorFactor:
    """The :class:`PriorFactor` of ``sigmas`` (k, p, p) repeated for ``clients`` clients
    (row i·k + j: matrix j, client-major as ``(clients, k, p, p).reshape(-1, p, p)``): k
    factorizations and inverses, not clients × k of the same matrices (fedprior's candidate
    priors, issue 36.1). Each matrix's LAPACK call is the one a batch of the copies makes
    (per matrix, the same input), and each copy keeps the factor's memory layout, so the
    products that read it are the same calls: the same bits (tested)."""
    k, p = sigmas.shape[0], sigmas.shape[-1]
    chol, jitter = safe_cholesky(sigmas.to(F64))
    l_inv = torch.linalg.solve_triangular(
        chol, torch.eye(p, dtype=F64).expand(k, p, p), upper=False
    )
    return PriorFactor(_repeat(chol, clients), jitter.repeat(clients), _repeat(l_inv, clients))


def _repeat(t: Tensor, clients: int) -> Tensor:
    """(k, p, p) → (clients·k, p, p), client-major, each matrix in ``t``'s layout (LAPACK's
    column-major factors stay column-major)."""
    k, p, q = t.shape
    if t.stride(-2) == 1 and p > 1:  # column-major matrices
        out = torch.empty_strided((clients * k, p, q), (p * q, 1, p), dtype=t.dtype)
    else:
        out = torch.empty((clients * k, p, q), dtype=t.dtype)
    out.unflatten(0, (clients, k)).copy_(t.unsqueeze(0).expand(clients, k, p, q))
    return out


def posterior(
    m: Moments,
    mu: Tensor,
    sigma: Tensor | None,
    noise_var: Tensor,
    factor: PriorFactor | None = None,
) -> Posterior:
    """The E-step: each client's posterior under the prior N(mu, sigma) and noise σ_i².

    ``mu`` (p,) or (c, p), ``sigma`` (p, p) or (c, p, p), positive definite (``factor``:
    its factors, formed by the caller; ``sigma`` is then not read);
    ``noise_var`` (c,). In whitened coordinates z = L⁻¹(c − μ):

        A = I + Lᵀ G L / σ²,  g = Lᵀ (b − G μ) / σ²,  z̄ = A⁻¹ g,
        m = μ + L z̄,          V = L A⁻¹ Lᵀ,
        −2 log p(y) = n log 2πσ² + log|A| + (‖y − Φμ‖² / σ² − gᵀ A⁻¹ g)   (Woodbury).
    """
    gram, rhs, yy, n = m
    c, p = rhs.shape
    mu = mu.to(F64).expand(c, p)
    s2 = noise_var.to(F64).reshape(c, 1, 1)
    w = _whitened(m, mu, sigma, noise_var, factor)
    chol, b, a_chol, g, z, mean, cov = w.chol, w.b, w.a_chol, w.g, w.z, w.mean, w.cov
    eye = torch.eye(p, dtype=F64)
    # In whitened coordinates, with B = LᵀGL/σ² = A − I (Woodbury):
    #   Lᵀ Φᵀ C⁻¹ Φ L = A⁻¹ B   and   Lᵀ Φᵀ C⁻¹ (y − Φμ) = A⁻¹ g = z̄.
    # A⁻¹B is a solve, not a difference: the direct (G − G L A⁻¹ Lᵀ G/σ²)/σ² cancels
    # catastrophically on collinear features, and I − A⁻¹ does under a tight prior.
    one = _one_matrix(chol)
    if factor is not None:
        l_inv = factor.l_inv
    elif one is not None:  # one prior for every client: L⁻¹ once (per client's within rounding)
        l_inv = torch.linalg.solve_triangular(one, eye, upper=False).expand(c, p, p)
    else:
        l_inv = torch.linalg.solve_triangular(chol, eye.expand(c, p, p), upper=False)
    gls_gram = l_inv.transpose(1, 2) @ torch.cholesky_solve(b, a_chol) @ l_inv
    gls_gram = sym(gls_gram)
    gls_rhs = l_inv.transpose(1, 2) @ z
    # E‖y − Φc‖² = ‖y − Φm‖² + tr(G V)
    mean_col = mean.unsqueeze(-1)
    rss = (
        yy
        - 2 * (rhs * mean).sum(-1)
        + (mean_col.transpose(1, 2) @ gram @ mean_col)[..., 0, 0]
        + (gram * cov).sum((-2, -1))
    )
    rss = rss.clamp_min(0.0)
    quad = yy - 2 * (rhs * mu).sum(-1) + (mu.unsqueeze(1) @ gram @ mu.unsqueeze(-1))[..., 0, 0]
    logdet_a = 2 * torch.diagonal(a_chol, dim1=-2, dim2=-1).log().sum(-1)
    s2f = s2[..., 0, 0]
    loglik = -0.5 * (
        n * torch.log(2 * math.pi * s2f) + logdet_a + quad / s2f - (g * z).sum((-2, -1))
    )
    jitter = torch.maximum(w.jitter_sigma, w.jitter_a)
    return Posterior(mean, cov, gls_gram, gls_rhs[..., 0], rss, loglik, jitter)


def _one_matrix(batch: Tensor) -> Tensor | None:
    """The matrix every entry of ``batch`` (c, p, p) is when it is a broadcast view of one
    (stride 0 along the clients, as :func:`fedcal.core.tree.expand` makes the server's
    broadcast), else None. A factorization of it equals each entry's within rounding (to the
    bit at small p; ~1e-12 apart at p = 35, where the batched and single LAPACK paths round
    differently: tested), so the round's per-client work on the broadcast prior is done once."""
    if batch.dim() != 3 or batch.shape[0] == 0 or batch.stride(0) != 0:
        return None
    return batch[0]


class _Whitened(NamedTuple):
    chol: Tensor
    b: Tensor
    a_chol: Tensor
    g: Tensor
    z: Tensor
    mean: Tensor
    cov: Tensor
    jitter_sigma: Tensor
    jitter_a: Tensor


def _whitened(
    m: Moments, mu: Tensor, sigma: Tensor | None, noise_var: Tensor, factor: PriorFactor | None
) -> _Whitened:
    """:func:`posterior`'s whitened solve: L, B, chol(A), g, z̄, and the posterior mean and
    covariance (its docstring's equations)."""
    gram, rhs = m.gram, m.rhs
    c, p = rhs.shape
    mu = mu.to(F64).expand(c, p)
    s2 = noise_var.to(F64).reshape(c, 1, 1)
    if factor is not None:  # the caller's (:func:`repeated_factor`)
        chol, jitter_sigma = factor.chol, factor.jitter
    else:
        chol, jitter_sigma = _prior_chol(sigma.to(F64).expand(c, p, p))
    eye = torch.eye(p, dtype=F64)
    lg = (chol.transpose(1, 2) @ gram @ chol).div_(s2)
    b = sym(lg)  # B = LᵀGL/σ², symmetric by construction
    a = eye + b  # exactly symmetric, as b is
    a_chol, jitter_a = safe_cholesky(a, symmetric=True)
    resid_rhs = rhs - (gram @ mu.unsqueeze(-1))[..., 0]  # Φᵀ(y − Φμ)
    g = (chol.transpose(1, 2) @ resid_rhs.unsqueeze(-1)) / s2
    z = torch.cholesky_solve(g, a_chol)
    mean = mu + (chol @ z)[..., 0]
    a_inv = torch.cholesky_inverse(a_chol)
    cov = sym(chol @ a_inv @ chol.transpose(1, 2))
    return _Whitened(chol, b, a_chol, g, z, mean, cov, jitter_sigma, jitter_a)


def sym(a: Tensor) -> Tensor:
    """½(a + aᵀ) of a batch (…, p, p): exactly symmetric (x + y = y + x in floating point),
    the product formed in the sum's buffer (x·½ = ½·x: the same bits as ``0.5 * (a + aᵀ)``,
    one temporary fewer). Shared by the E-step and the robust checks (core/robust.py)."""
    return (a + a.transpose(-2, -1)).mul_(0.5)


def _prior_chol(sigma: Tensor) -> tuple[Tensor, Tensor]:
    """L of each client's Σ = LLᵀ (c, p, p) and its jitter (c,) (:func:`safe_cholesky`)."""
    one = _one_matrix(sigma)
    if one is None:
        return safe_cholesky(sigma)
    # one prior for every client (a broadcast): factored once, not c times
    chol, jitter = safe_cholesky(one)  # L (never fails: see safe_cholesky)
    c, p = sigma.shape[0], sigma.shape[-1]
    return chol.expand(c, p, p), jitter.expand(c)


def posterior_moments(
    m: Moments, mu: Tensor, sigma: Tensor, noise_var: Tensor
) -> tuple[Tensor, Tensor]:
    """:func:`posterior`'s mean and covariance alone (the same operations, so the same bits),
    without the M-step's GLS terms and the evidence: for fits that only predict."""
    w = _whitened(m, mu, sigma, noise_var, None)
    return w.mean, w.cov


def data_support(gram: Tensor, noise_var: Tensor, scale: float) -> Tensor:
    """How far each client's data alone pin its coefficients down: I − (I + s² G/σ²)⁻¹.

    The shrinkage matrix of a vague N(0, s² I) prior (c, p, p): an eigenvalue
    near 1 is a direction the data determine to much better than ``scale``, near
    0 one they do not see. Summed over clients, its eigenvalues count the units
    that inform each direction — a property of where units were calibrated,
    not of the learned prior (a tight prior is not an unobserved one).
    """
    p = gram.shape[-1]
    eye = torch.eye(p, dtype=F64)
    a = sym(eye + (scale**2 * gram.to(F64)).div_(noise_var.to(F64).reshape(-1, 1, 1)))
    inv, info = torch.linalg.inv_ex(a)
    bad = info != 0
    if bool(bad.any()):  # (finiteness read only then: it cost a quarter of the inverse)
        bad &= torch.isfinite(a).all(-1).all(-1)
    if bool(bad.any()):  # numerically singular (σ² → 0): the same map by eigenvalues, exact
        vals, vecs = torch.linalg.eigh(a[bad])
        inv[bad] = (vecs / vals.clamp_min(1.0).unsqueeze(-2)) @ vecs.transpose(-2, -1)
    return eye - inv


def predictive_var(design: Tensor, cov: Tensor, noise_var: Tensor) -> Tensor:
    """Predictive variance φ(x)ᵀ V φ(x) + σ² of each row: ``design`` (c, rows, p) → (c, rows).

    (φV)·φ is formed in place in the product φV (a new tensor): the same operations, the
    same bits, one (c, rows, p) array fewer (a third of its time at 1,000 units × 384 rows).
    """
    design = design.to(F64)
    quad = design @ cov.to(F64)
    return quad.mul_(design).sum(-1) + noise_var.to(F64).unsqueeze(-1)


def mixture_mass(width: Tensor, shift: Tensor, sd: Tensor) -> Tensor:
    """P(|e| ≤ w) for e ~ ½N(m, s²) + ½N(−m, s²) (:func:`mixture_halfwidth`'s equation):
    increasing in w, so |e| is inside the mixture's ``level`` interval iff its mass ≤ level."""
    w, m, s = width.to(F64), shift.to(F64).abs(), sd.to(F64).clamp_min(1e-300)
    cdf = torch.special.ndtr
    return 0.5 * (cdf((w - m) / s) - cdf((-w - m) / s) + cdf((w + m) / s) - cdf((-w + m) / s))


def mixture_halfwidth(shift: Tensor, sd: Tensor, level: float = 0.95) -> Tensor:
    """Half-width w of the central ``level`` interval of ½N(m, s²) + ½N(−m, s²) around 0.

    P(|e| ≤ w) = ½[Φ((w−m)/s) − Φ((−w−m)/s) + Φ((w+m)/s) − Φ((−w+m)/s)] = level, solved
    by bisection on [0, |m| + 6s] (60 halvings); m = 0 gives z·s (the Gaussian's). NaN in
    either input gives NaN. The error of a prediction made without knowing a binary sign
    (fedprior's sweep direction b = ±1) has this law.
    """
    m, s = shift.to(F64).abs(), sd.to(F64).clamp_min(1e-300)
    lo, hi = torch.zeros_like(m), m + 6.0 * s
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        low = mixture_mass(mid, m, s) < level
        lo, hi = torch.where(low, mid, lo), torch.where(low, hi, mid)
    return torch.where(torch.isnan(shift) | torch.isnan(sd), math.nan, 0.5 * (lo + hi))


def regularize(
    cov: Tensor,
    shrinkage: float,
    floor: float,
    rank: int | None = None,
    metric: Tensor | None = None,
    fa_iters: int = 50,
) -> Tensor:
    """Make an estimated prior covariance safe to use: shrink, optionally factor, floor.

    1. shrink toward its own diagonal, (1 − λ) Σ̂ + λ diag(Σ̂) (a MAP update under
       an inverse-Wishart hyperprior centred on the diagonal; Ledoit–Wolf's
       target): a fleet with fewer units than coefficients gives a Σ̂ whose
       between-unit part has rank N − 1, and a new unit would be told its
       coefficients cannot move along the other directions;
    2. ``rank`` k: Σ ≈ W Wᵀ + D, k factors plus a diagonal, fitted to the
       shrunk Σ̂ by iterated principal factors (factor analysis): D is refit to
       what W Wᵀ leaves on the diagonal, W from the top-k eigenpairs of
       Σ̂ − D. Fewer parameters when units of a design vary along few directions;
    3. every eigenvalue floored at ``floor`` (an absolute variance), so the
       prior stays positive definite.

    With ``metric`` M (the fleet's mean Gram matrix of the basis, p × p) steps 1
    and 2 act in coordinates c' = Rc, M = RᵀR, where the basis is orthonormal
    over where the fleet was calibrated: "toward the diagonal" then means
    "toward independent effects on the predictions". In raw polynomial
    coordinates neighbouring terms of a narrow input span are nearly collinear,
    and shrinking toward that diagonal destroys correlations the fleet measured
    (measured: 15 % worse at 4×3 points). A ridge of 1e-6 of M's scale keeps R
    invertible along directions no unit saw (those are reset by the caller).
    """
    p = cov.shape[-1]
    cov = 0.5 * (cov + cov.transpose(-2, -1))
    if metric is not None:
        m = 0.5 * (metric + metric.T).to(F64)
        m = m + 1e-6 * torch.diagonal(m).abs().max().clamp_min(1e-300) * torch.eye(p, dtype=F64)
        r = safe_cholesky(m)[0].T  # M = Rᵀ R
        r_inv = torch.linalg.solve_triangular(r, torch.eye(p, dtype=F64), upper=True)
        cov = r_inv @ _shrink_and_factor(r @ cov @ r.T, shrinkage, rank, fa_iters) @ r_inv.T
    else:
        cov = _shrink_and_factor(cov, shrinkage, rank, fa_iters)
    vals, vecs = torch.linalg.eigh(0.5 * (cov + cov.transpose(-2, -1)))
    vals = vals.clamp_min(floor)
    out = vecs @ torch.diag_embed(vals) @ vecs.transpose(-2, -1)
    return 0.5 * (out + out.transpose(-2, -1))


def _shrink_and_factor(cov: Tensor, shrinkage: float, rank: int | None, fa_iters: int) -> Tensor:
    p = cov.shape[-1]
    diag = torch.diag_embed(torch.diagonal(cov, dim1=-2, dim2=-1))
    cov = (1 - shrinkage) * cov + shrinkage * diag
    if rank is not None and rank < p:
        d = torch.diagonal(cov, dim1=-2, dim2=-1).clamp_min(0) * 0.5
        for _ in range(fa_iters):
            vals, vecs = torch.linalg.eigh(cov - torch.diag_embed(d))
            top_vals = vals[..., -rank:].clamp_min(0)
            w = vecs[..., -rank:] * top_vals.sqrt().unsqueeze(-2)
            d = (torch.diagonal(cov, dim1=-2, dim2=-1) - (w * w).sum(-1)).clamp_min(0)
        cov = w @ w.transpose(-2, -1) + torch.diag_embed(d)
    return cov


def m_step(
    sum_gls_gram: Tensor,
    sum_gls_rhs: Tensor,
    sum_mean: Tensor,
    sum_second: Tensor,
    num_clients: Tensor,
    mu: Tensor,
    mean_scale: float = math.inf,
    rcond: float = 1e-10,
) -> tuple[Tensor, Tensor]:
    """The server's update from client sums: (μ_new, Σ̂) before :func:`regularize`.

    μ_new maximizes the marginal likelihood for the current Σ (GLS), under a
    N(0, s² I) hyperprior on μ with s = ``mean_scale`` (∞: none):

        (Σ_i Φ_iᵀC_i⁻¹Φ_i + I/s²) μ_new = Σ_i Φ_iᵀC_i⁻¹y_i
                                    = Σ_i Φ_iᵀC_i⁻¹(y_i − Φ_iμ) + (Σ_i Φ_iᵀC_i⁻¹Φ_i) μ;

    Σ̂ = (1/N) Σ_i E[(c_i − μ_new)(c_i − μ_new)ᵀ]
       = (1/N) Σ_i S_i − μ_new m̄ᵀ − m̄ μ_newᵀ + μ_new μ_newᵀ,  S_i = m_i m_iᵀ + V_i.

    Why the hyperprior: along a direction the units' points barely inform, the
    GLS precision is tiny and the plain solution is noise divided by it; the
    hyperprior keeps μ there near 0 (s ≫ any plausible coefficient: the target
    and the basis are scaled to O(1)). Without one (s = ∞) the solve is a
    pseudo-inverse: eigenvalues below ``rcond`` times the largest are dropped, so
    μ stays where it was along unseen directions.
    """
    p = mu.shape[-1]
    gram = 0.5 * (sum_gls_gram + sum_gls_gram.T)
    target = sum_gls_rhs + gram @ mu
    if math.isfinite(mean_scale):
        gram = gram + torch.eye(p, dtype=F64) / mean_scale**2
    vals, vecs = torch.linalg.eigh(gram)
    keep = vals > rcond * vals.max().clamp_min(torch.finfo(F64).tiny)
    inv = torch.where(keep, 1.0 / torch.where(keep, vals, 1.0), torch.zeros_like(vals))
    # Along dropped directions (no hyperprior only) μ keeps its old value.
    kept = vecs @ (inv * (vecs.T @ target))
    dropped = vecs @ (torch.where(keep, 0.0, 1.0) * (vecs.T @ mu))
    mu_new = kept + dropped
    mean_bar = sum_mean / num_clients
    outer = torch.outer(mu_new, mean_bar)
    sigma = sum_second / num_clients - outer - outer.T + torch.outer(mu_new, mu_new)
    return mu_new, 0.5 * (sigma + sigma.T)


def count_within(err2: Tensor, var: Tensor, grid: Tensor, weight: Tensor, z: float) -> Tensor:
    """Σ_rows w · [err² ≤ z²·(v + τ_k)] for each τ_k of the ascending ``grid``: (c, grid).

    ``err2``, ``var``, ``weight`` (c, rows). The predicate is monotone in τ, so each row's
    first τ_k that holds it is found by bisection (⌈log₂ K⌉ evaluations of the very same
    predicate, not K) and the counts are a cumulative sum of the rows' weights at those
    indices: O(c·rows·log K) instead of a (c, rows, K) tensor. Equal to the dense count
    when the weights are 0/1 (exact integer sums; NaN rows hold for no τ, as there).
    """
    k = grid.shape[0]
    z2 = z**2
    lo = torch.zeros(err2.shape, dtype=torch.int64)  # first index that may hold
    hi = torch.full(err2.shape, k, dtype=torch.int64)  # k: held by no τ
    while bool((lo < hi).any()):
        mid = (lo + hi) // 2
        holds = err2 <= z2 * (var + grid[mid.clamp_max(k - 1)])
        active = lo < hi
        hi = torch.where(active & holds, mid, hi)
        lo = torch.where(active & ~holds, mid + 1, lo)
    counts = torch.zeros(err2.shape[0], k + 1, dtype=weight.dtype)
    counts.scatter_add_(1, lo, weight)
    return counts[:, :k].cumsum(1)
