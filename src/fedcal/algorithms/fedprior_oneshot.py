"""The fleet prior released once under client-level DP (issue 25, item 3; docs/safety.md).

fedprior's EM releases eight noisy sums every round; its DP cost is the noise on the summed
second moment, round after round (docs/safety.md, "Many units"). A unit with far more points
than terms identifies its own coefficients, so the prior N(μ, Σ) and the noise σ² follow
from the moments of the units' own fits, released once:

1. each contributing unit (at least ``min_rows`` rows, public: the full campaign, and an
   identified fit: its Gram G_i has a Cholesky factor and condition number below
   ``MAX_CONDITION``) fits its coefficients by least squares on the fedprior design,
   ĉ_i = G_i⁻¹ Φ_iᵀy_i, and its noise σ_i² = ‖y_i − Φ_i ĉ_i‖² / (n_i − p);
2. the server receives the mean and covariance of the ĉ_i and the mean σ_i², released in
   stages by :func:`fedcal.core.privacy.release_moments` (whitened by the stage before,
   clipped, Gaussian noise, projected to PSD), at the budget of
   :func:`fedcal.core.privacy.staged_budget`;
3. every unit, few-point or not, is calibrated under the released prior (fedprior's
   ``personalize``): units below ``min_rows`` contribute nothing, they cannot identify c_i.

Cov(ĉ_i) = Σ + E[σ_i² G_i⁻¹] counts each fit's own error as spread; without DP it gave the
same new-unit error as fedprior's EM (the docs' table, "no noise" row: 2,000 reference units,
the measurement error of a 384-point fit is far below the units' spread along every
direction that matters), so no deconvolution is released. The fleet's input box (the
extrapolation guard, ``fedprior_support``) is the reference units' design, taken as public
(the campaign): not released under DP here.

Coordinates (issue 25, item 3, a public preconditioner): with ``coordinates`` R (from
:func:`prediction_coordinates` on a public design, e.g. a grid over the fleet's public input
box), the release runs on u_i = R ĉ_i, where the basis is orthonormal over that design
(‖R(c − c')‖² is the mean squared difference of the two surfaces' predictions over its
points), and maps back: μ = R⁻¹ μ_u, Σ = R⁻¹ Σ_u R⁻ᵀ. R is data-independent, so it costs no
budget — only if the design is: an R built from the units' own readings (their pooled
Gram) shapes every released number (u = Rĉ, stage 0's clip scale s‖R‖₂, the map back)
and is outside the ε the accountant reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from fedcal.algorithms.fedprior import FedPrior
from fedcal.core.bayes import F64, moments
from fedcal.core.data import ClientData
from fedcal.core.privacy import StagedBudget, Whitening, psd_projection, release_moments
from fedcal.core.tree import Tree

# A Gram whose eigenvalues span more than this ratio does not identify c_i: 40 rows at one
# (P, T) point give any coefficients along the unseen directions (float64's 1e-16 rounding
# grows by the condition number: at 1e12 the fit keeps ~4 digits)
MAX_CONDITION = 1e12


def identified(gram: Tensor) -> Tensor:
    """(N,) bool: each Gram (N, p, p) has a Cholesky factor and λ_max / λ_min below
    ``MAX_CONDITION`` (step 1: the unit's least-squares fit is determined by its data)."""
    _, info = torch.linalg.cholesky_ex(gram)
    vals = torch.linalg.eigvalsh(gram)  # ascending
    return (info == 0) & (vals[:, 0] > 0) & (vals[:, -1] < MAX_CONDITION * vals[:, 0])


def local_fits(
    algorithm: FedPrior, data: ClientData, min_rows: int
) -> tuple[Tensor, Tensor, Tensor, int]:
    """Step 1: (ĉ_i (K, p), σ_i² (K,), contributing (N,) bool, skipped) of the units with
    ≥ ``min_rows`` rows and an identified fit (:func:`identified`); ``skipped``: how many
    had the rows but not an identified fit (they contribute nothing)."""
    p = algorithm.num_features
    if min_rows <= p:
        raise ValueError(f"oneshot min_rows = {min_rows}: expected > {p} (the basis's terms)")
    design = algorithm.design(data.x, data.branch)
    m = moments(design, data.y[..., 0], data.mask)
    rows = m.n >= min_rows
    if not bool(rows.any()):
        raise ValueError(f"oneshot: no unit has >= {min_rows} rows to fit its own coefficients")
    used = rows.clone()
    used[rows] = identified(m.gram[rows])
    skipped = int(rows.sum() - used.sum())
    if not bool(used.any()):
        raise ValueError(f"oneshot: no unit with >= {min_rows} rows has an identified fit")
    gram, rhs = m.gram[used], m.rhs[used]
    coef = torch.linalg.solve(gram, rhs)
    rss = (m.yy[used] - (coef * rhs).sum(-1)).clamp_min(0.0)
    noise = rss / (m.n[used] - p)
    # log σ² must exist: an exact fit is 1e-300
    return coef, noise.clamp_min(1e-300), used, skipped


def prediction_coordinates(gram: Tensor, rows: float) -> Tensor:
    """R (p, p), upper triangular with Rᵀ R = G / rows: G = ΦᵀΦ the Gram of a PUBLIC design
    Φ (rows × p), e.g. a grid over the fleet's public input box. u = R c has ‖u‖² = ‖Φ c‖² /
    rows, the mean squared prediction over the design's points (a QR of Φ / √rows: Φ / √rows
    = Q R). Refused, as a unit's fit is (:func:`identified`), when G has no Cholesky factor or
    λ_max / λ_min ≥ ``MAX_CONDITION``: 11 points on 12 terms factor in float64 (rounding
    makes the rank-11 Gram look positive definite) with cond(G) ≈ 1e16, and R⁻¹ then maps
    the release back along a direction the points do not see."""
    g = gram.to(F64) / rows
    g = 0.5 * (g + g.T)
    chol, info = torch.linalg.cholesky_ex(g)
    vals = torch.linalg.eigvalsh(g)  # ascending
    if int(info) != 0 or not bool(identified(g.unsqueeze(0))[0]):
        ratio = float(vals[-1] / vals[0]) if float(vals[0]) > 0 else float("inf")
        raise ValueError(
            f"prediction_coordinates: the design's Gram is singular (Cholesky info {int(info)}, "
            f"eigenvalue ratio {ratio:.3g}, limit {MAX_CONDITION:.0e}): its points do not "
            "determine the basis's terms"
        )
    return chol.T


def oneshot_prior(
    algorithm: FedPrior,
    data: ClientData,
    budget: StagedBudget | None,
    generator: torch.Generator,
    min_rows: int = 0,
    whiten: Whitening | None = None,
    coordinates: Tensor | None = None,
    keys: Sequence[object] | None = None,
    **release: Any,
) -> tuple[Tree, dict[str, float]]:
    """Steps 1–2: the broadcast (μ, Σ, σ², box) of the released prior, and the release's
    metrics. ``min_rows`` 0: twice the basis's terms. ``budget`` None: no noise;
    ``whiten``: the oracle's preconditioner; ``coordinates``: a
    public R (:func:`prediction_coordinates`), the release then runs on u = R ĉ (``whiten``
    stays in c's coordinates) and is mapped back; ``keys``: one public key per unit of ``data``
    (its sensor id), the contributing units' order the scale stage's path follows (None:
    positions, whose caveat :func:`fedcal.core.privacy.release_moments` states).
    ``release``: :func:`fedcal.core.privacy.release_moments`' options as they are, with its
    defaults (declared there once): ``quantile``; ``refresh_last``, the last stage re-releases
    the whole covariance; ``scales``, stage 1 releases each coordinate's scale and median;
    ``relevant``, the next stages refine only the coordinates whose variance is at least that
    × σ̂₀² (meaningful in prediction ``coordinates``)."""
    p = algorithm.num_features
    if keys is not None and len(keys) != data.num_clients:
        raise ValueError(f"oneshot keys: {len(keys)} for {data.num_clients} units")
    coef, noise, used, skipped = local_fits(algorithm, data, min_rows or 2 * p)
    if keys is not None:  # the contributing units' keys
        keys = [k for k, u in zip(keys, used.tolist(), strict=True) if u]
    scale = algorithm.init_scale
    if coordinates is not None:
        r = coordinates.to(F64)
        if r.shape != (p, p):
            raise ValueError(f"oneshot coordinates: shape {tuple(r.shape)}, expected ({p}, {p})")
        coef = coef @ r.T
        if whiten is not None:
            whiten = Whitening(r @ whiten.mean, r @ whiten.cov @ r.T, whiten.noise)
        # ‖c‖ ≤ 2√p s (the vague start's bound) gives ‖u‖ ≤ ‖R‖₂ 2√p s
        scale = scale * float(torch.linalg.matrix_norm(r, ord=2))
    released, metrics = release_moments(
        coef,
        noise,
        budget,
        generator,
        scale,
        algorithm.init_noise,
        whiten=whiten,
        floor=algorithm.floor,
        keys=keys,
        **release,
    )
    mean, cov = released.mean, released.cov
    if coordinates is not None:  # back to c: μ = R⁻¹ μ_u, Σ = R⁻¹ Σ_u R⁻ᵀ, eigenvalues ≥ floor
        r_inv = torch.linalg.inv(coordinates.to(F64))
        mean = r_inv @ mean
        cov = psd_projection(r_inv @ cov @ r_inv.T, algorithm.floor)
    gram = moments(algorithm.design(data.x[used]), data.y[used][..., 0], data.mask[used]).gram
    down = {
        "mu": mean,
        "sigma": cov,
        "noise_var": released.noise.to(F64).reshape(()),
        # public: the reference campaign's design
        "box": algorithm.support_box.fleet_box(gram.sum(0)),
    }
    metrics["oneshot_units"] = float(used.sum())
    metrics["oneshot_unidentified"] = float(skipped)  # enough rows, fit not identified
    return down, metrics
