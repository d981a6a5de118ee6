"""The server's checks and bounds of fedprior_drift's uploads (issue 21's, for the drift).

Consistency (:func:`drift_problems`): the evidence grid must lie below what the unit's rows
allow at the broadcast σ², and at its E-step's q it must equal the evidence the server
recomputes from the unit's uploaded posterior moments (:func:`evidence_from_upload`); the
future scores below their bound; every upload, the short step's too, finite. A grid above its
bound is rejected like any inconsistent upload; below it (and away from the E-step's q)
nothing bounds it. The future scores, and the evidence grid when ``drift_fit = "evidence"``,
are bounded from above only, so the server sums each unit's gain over q = 0, clipped to
± ``drift_score_clip`` × its rows, and never the score at q = 0 itself
(:func:`bound_future_scores`: a huge common offset would swallow the honest margins in
float64); the short step's squared errors likewise (:func:`bound_short_sse`); each declared
span is capped at ``drift_span_cap`` × the median span before T is formed
(:func:`~fedcal.algorithms.fedprior_choice_parts.fleet_time_scale`): one forged unit moves
the fleet by a bounded amount, not arbitrarily.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fedcal.algorithms.fedprior_drift_walk import DRIFT_GRID
from fedcal.core.bayes import F64, safe_cholesky
from fedcal.core.tree import Tree

#: Tolerance of the drift uploads' checks, in nats per (1 + |log-evidence| + rows): a
#: consistent upload's rounding is ~1e-13 of that (measured on the planted test fleet of
#: tests/algorithms/test_fedprior_drift.py, q = 0).
EVIDENCE_TOL = 1e-6


def evidence_from_upload(main: Tree, server: Tree) -> Tensor:
    """(clients,) the log-evidence log p(y_i | μ, Σ, σ², q) of the E-step a unit uploaded
    (mean m, second moment S, expected RSS r, Gram G of its, possibly whitened, moments),
    less its −½ log|R̄| (0 at q = 0), recomputed by the server:

        −2 log p = n log 2πσ² + log|A| + (r − tr(G V))/σ² + (m − μ)ᵀΣ⁻¹(m − μ),

    A = I + LᵀGL/σ² (Σ = L Lᵀ, G restricted to the chosen basis), V = S − m mᵀ: the
    Woodbury form of :func:`fedcal.core.bayes.posterior`'s, as ‖y − Φm‖² = r − tr(G V) and
    ‖y − Φμ‖²/σ² − gᵀA⁻¹g = ‖y − Φm‖²/σ² + (m − μ)ᵀΣ⁻¹(m − μ) at the posterior mean."""
    mu, sigma = server["mu"].to(F64), server["sigma"].to(F64)
    s2 = server["noise_var"].to(F64).reshape(-1)
    m, second = main["mean"].to(F64), main["second"].to(F64)
    gram = main["gram"].to(F64)
    if "mask" in server:
        mm = server["mask"].to(F64)
        gram = gram * mm.unsqueeze(-1) * mm
    p = m.shape[-1]
    chol = safe_cholesky(0.5 * (sigma + sigma.T))[0]
    lg = chol.T @ gram @ chol / s2.reshape(-1, 1, 1)
    logdet_a = torch.linalg.slogdet(torch.eye(p, dtype=F64) + 0.5 * (lg + lg.transpose(1, 2)))[1]
    v = second - m.unsqueeze(-1) * m.unsqueeze(-2)
    fit = main["rss"].to(F64) - (gram * v).sum((-2, -1))
    z = torch.linalg.solve_triangular(chol, (m - mu).unsqueeze(-1), upper=False)[..., 0]
    n = main["n"].to(F64)
    return -0.5 * (n * torch.log(2 * math.pi * s2) + logdet_a + fit / s2 + (z * z).sum(-1))


def bound_future_scores(future: Tensor, n: Tensor, clip: float) -> Tensor:
    """Each unit's future scores as its gains over q = 0, g_i(q_k) = s_i(q_k) − s_i(0),
    clipped to ± ``clip`` · n_i nats (column 0 exactly 0).

    The server keeps the q_k of highest Σ_i g_i(q_k) (module doc, "Choosing q"): only the
    differences s_i(q_k) − s_i(0) choose. :func:`drift_problems` bounds s_i from above only,
    so a unit lowering its s_i(0) would move the fleet's choice by as many nats as it
    forges; clipped per unit, one unit moves the fleet's gain by at most ``clip`` · n_i. The
    base s_i(0) itself is dropped, not summed: an unbounded base (a huge negative one, the
    same at every q) would otherwise swallow the honest units' margins in float64 and leave
    every column tied (q = 0).
    """
    bound = (clip * n.to(F64).reshape(-1, 1)).expand_as(future)
    return torch.maximum(torch.minimum(future - future[:, :1], bound), -bound)


def bound_short_sse(sse: Tensor, held: Tensor, clip: float) -> Tensor:
    """Each unit's emulated squared errors (clients, W) as its gains over w = 1 (the last
    column), sse_i(w) − sse_i(1), clipped to ± clip · h_i · s_w (last column exactly 0).

    The server keeps the w of least summed gain (fedprior_short S3); only the differences
    between columns choose, and the server cannot recompute a unit's sums without its
    held-out rows, so a unit forging them (a huge error at every w but the one it wants)
    would move the fleet's choice by as much as it forges. h_i: the rows it held out
    (already capped at its declared rows); s_w: the median over the units that held rows
    out of max(sse_i(w), sse_i(1)) / h_i, a typical unit's squared error per row (robust: a
    minority of forgers cannot move it far; an honest unit's gain is at most its own
    max(sse_i(w), sse_i(1))). Clipped, one unit moves the fleet's preference of any w over
    w = 1 by at most clip · h_i · s_w, as the drift's future scores are clipped
    (:func:`bound_future_scores`). The base sse_i(1) itself is dropped, not summed: an
    unbounded base (the same huge value at every w) would otherwise swallow the honest
    units' margins in float64 and leave every column tied (w = 1).
    """
    sse = sse.to(F64).clamp_min(0.0)
    held = held.to(F64)
    gain = sse - sse[:, -1:]
    some = held > 0
    if not bool(some.any()):
        return gain
    level = torch.maximum(sse, sse[:, -1:])[some] / held[some].unsqueeze(1)
    scale = level.median(0).values  # (W,)
    bound = clip * held.unsqueeze(1) * scale.unsqueeze(0)
    return torch.maximum(torch.minimum(gain, bound), -bound)


def short_uploads(flat: Tree) -> Tensor | None:
    """(clients, k): a unit's short-step uploads (``drift/short/…``) side by side."""
    keys = sorted(k for k in flat if k.startswith("drift/short/"))
    if not keys:
        return None
    return torch.cat([flat[k].to(F64).reshape(flat[k].shape[0], -1) for k in keys], 1)


def drift_problems(
    loglik: Tensor,
    future: Tensor,
    span: Tensor,
    n: Tensor,
    server: Tree,
    main: Tree | None,
    future_bound: bool = True,
    e_step_q: float | None = None,
    short: Tensor | None = None,
) -> dict[int, str]:
    """Units whose drift uploads cannot be what their declared rows give, with why.

    For every q of the grid the unit's rows are y ~ N(Φμ, C(q)), C(q) = σ²R̄ + ΦΣΦᵀ ⪰ σ²I,
    with log-evidence ℓ(q) = −½[n log 2π + log|C(q)| + rᵀC(q)⁻¹r] (r = y − Φμ), so

    a. every ℓ(q_k), every future score and every short-step upload (``short``, (clients,
       k): fedprior_short S2's sums, flattened) is finite, and the span ≥ 0; before the fleet's
       time scale is known (round 0) the grid is not evaluated: every entry 0;
    b. ℓ(q_k) ≤ −½ n log 2πσ² (|C| ≥ σ²ⁿ, rᵀC⁻¹r ≥ 0), n the unit's row count;
    c. at the q of its E-step (``e_step_q``, default the broadcast q), ℓ(q) + ½ log|R̄| is
       the evidence of the E-step it uploaded
       (:func:`evidence_from_upload`): equal at q = 0 (R̄ = I), ℓ(q) ≤ it for q > 0; needs
       the E-step's σ² to be the broadcast one (``main`` None: not checked);
    d. (``future_bound``, the broadcast σ²) each held-out row's predictive variance is
       ≥ σ², so a future score ≤ n · max(0, −½ log 2πσ²).

    A forged grid that lowers ℓ(0) (to make drift look better) fails c; one raising any
    ℓ(q_k) above what n rows at noise σ² allow fails b. What c and b leave open is bounded:
    a unit can raise ℓ(q_k) for q_k above the broadcast q by at most ½rᵀC⁻¹r.
    """
    s2 = server["noise_var"].to(F64).reshape(-1)
    rows = n.to(F64)
    cap = -0.5 * rows * torch.log(2 * math.pi * s2)
    tol = EVIDENCE_TOL * (1.0 + loglik.abs().amax(-1) + rows)
    q = float(server["drift"]["q"]) if e_step_q is None else e_step_q
    out: dict[int, str] = {}
    finite = torch.isfinite(loglik).all(-1) & torch.isfinite(future).all(-1)
    finite &= torch.isfinite(span) & (span >= 0)
    if short is not None:
        finite &= torch.isfinite(short).all(-1)
    high = loglik.amax(-1) > cap + tol
    gap = None
    if main is not None:
        at = int(torch.argmin((DRIFT_GRID - q).abs()))
        gap = loglik[:, at] - evidence_from_upload(main, server)
    fut_cap = rows * torch.clamp_min(-0.5 * torch.log(2 * math.pi * s2), 0.0)
    fut_high = future.amax(-1) > fut_cap + tol if future_bound else torch.zeros_like(high)
    unset = float(server["drift"]["scale"]) <= 0  # round 0: no grid evaluated
    for i in range(len(rows)):
        if not bool(finite[i]):
            out[i] = "drift evidence, span or short-step sums not finite (or a negative span)"
        elif unset:
            if bool((loglik[i] != 0).any() | (future[i] != 0).any()):
                out[i] = "drift evidence uploaded before the fleet's time scale is known"
        elif bool(high[i]):
            out[i] = (
                f"drift evidence {float(loglik[i].amax()):.6g} above what {float(rows[i]):g} rows "
                f"at the broadcast noise allow ({float(cap[i]):.6g})"
            )
        elif gap is not None and (
            abs(float(gap[i])) > float(tol[i]) if q == 0 else float(gap[i]) > float(tol[i])
        ):
            out[i] = (
                f"drift evidence at q = {q:g} disagrees with its E-step's by {float(gap[i]):.3g}"
            )
        elif bool(fut_high[i]):
            out[i] = (
                f"future score {float(future[i].amax()):.6g} above what {float(rows[i]):g} rows "
                f"at the broadcast noise allow ({float(fut_cap[i]):.6g})"
            )
    return out
