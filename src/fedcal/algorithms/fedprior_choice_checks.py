"""The server's checks of fedprior_choice's uploads (issue 34, review B).

The ``choice/`` uploads are not size-screened (a unit's scores and moments scale with nothing
the fleet shares), so each is bounded or tied to a screened upload here, as
:func:`~fedcal.algorithms.fedprior_drift_checks.drift_problems` does for the drift's:

a. every entry finite;
b. each score s_ik in [0, ``choice_clip``] (the client's clip of log MSE ratios), ``scored``
   0 or 1: so one unit moves the fleet's summed score of a candidate by at most the clip;
c. each fold's linear Gram has its constant term (P̃₀ = 1: the fold's row count) in [0, n];
d. ``fit_rhs`` = (G_i m_i) on the linear terms, G_i the unit's design Gram and m_i its
   posterior mean (both screened: the consistency check and the fit RMS): the pooled line a
   unit falls back to is fitted from these (Σ_i G_i,lin Σ_i (G_i m_i)_lin), so no unit
   moves it by more than its own screened fit does;
e. the interval after calibration's uploads (``fwd_*``, its span): coverage fractions in
   [0, 1] rising in κ, bounded scores, a finite span ≥ 0 and ``span_n`` 1
   (:func:`~fedcal.algorithms.fedprior_forward.forward_problems`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fedcal.algorithms.fedprior_forward import forward_problems
from fedcal.core.bayes import F64

REL = 1e-9  # relative rounding allowed in (G m)'s recomputation (float64, p ≤ a few 100)


def fitted_rhs(gram: Tensor, mean: Tensor, lin: Tensor) -> Tensor:
    """(G m) on the linear terms: Σ_r φ_lin(x_r) ŷ_r, ŷ the posterior's fitted values."""
    return (gram.to(F64)[..., lin, :] @ mean.to(F64).unsqueeze(-1))[..., 0]


def choice_problems(sub: dict[str, Tensor], clip: float, lin: Tensor) -> dict[int, str]:
    """{row of ``sub``: why} for units whose ``choice/`` uploads break a.–d. (module doc).
    ``sub``: the flattened replies of the accepted units."""
    score, scored = sub["choice/score"].to(F64), sub["choice/scored"].to(F64)
    gram, rhs = sub["choice/lin_gram"].to(F64), sub["choice/lin_rhs"].to(F64)
    fit = sub["choice/fit_rhs"].to(F64)
    n = sub["n"].to(F64).reshape(-1)
    c = score.shape[0]
    parts = [score, scored, gram, rhs, fit]
    finite = torch.stack([torch.isfinite(v.reshape(c, -1)).all(1) for v in parts]).all(0)
    whys: dict[int, str] = {}
    for j in (~finite).nonzero()[:, 0].tolist():
        whys[j] = "choice uploads not finite"
    tol = 1 + REL
    bad = ~((score >= 0) & (score <= clip * tol)).all(1) | ~((scored == 0) | (scored == 1))
    for j in bad.nonzero()[:, 0].tolist():
        whys.setdefault(j, f"choice scores outside [0, {clip:g}] or scored not 0/1")
    rows = gram[..., 0, 0]  # (clients, folds)
    bad = ~((rows >= 0) & (rows <= n.unsqueeze(1) * tol + REL)).all(1)
    for j in bad.nonzero()[:, 0].tolist():
        whys.setdefault(j, "choice fold rows outside [0, n]")
    want = fitted_rhs(sub["gram"], sub["mean"], lin)
    scale = sub["gram"].to(F64).abs().amax((-2, -1)) * sub["mean"].to(F64).abs().amax(-1)
    off = (fit - want).abs().amax(-1) > REL * len(sub["mean"][0]) * scale.clamp_min(1e-300)
    for j in (off & finite).nonzero()[:, 0].tolist():
        whys.setdefault(j, "choice fit_rhs is not the unit's Gram times its posterior mean")
    if "choice/fwd_units" in sub:  # e.
        for j, why in forward_problems(sub).items():
            whys.setdefault(j, why)
        span, one = sub["choice/span"].to(F64), sub["choice/span_n"].to(F64)
        bad = ~(torch.isfinite(span) & (span >= 0) & (one == 1))
        for j in bad.nonzero()[:, 0].tolist():
            whys.setdefault(j, "choice span not finite and ≥ 0, or span_n not 1")
    return whys
