"""Judging groups of units from their sums alone: the fleet prior's defence under secure
aggregation (issue 36.2; the per-unit defence is :mod:`fedcal.core.robust`).

Under SecAgg+ the server never holds a unit's upload, only sums. With the sites split into
G ≥ 3 fixed groups, each group's sum is secure on its own, and the server holds, per group
g, the sums M_g = Σ_{i∈g} m_i, S_g = Σ_{i∈g} S_i (S_i = m_i m_iᵀ + V_i) and
R_g = Σ_{i∈g} Φ_iᵀC_i⁻¹(y_i − Φ_iμ) of its n_g units. Two checks per group:

1. **Identities that survive summation** (:func:`summed_inconsistencies`). Of the per-unit
   identities of :func:`fedcal.core.robust.inconsistencies`, two hold for sums:
   (d, summed) S_g − M_gM_gᵀ/n_g = Σ_i V_i + Σ_i (m_i − m̄_g)(m_i − m̄_g)ᵀ ⪰ 0, and
   (f, linear) L⁻¹(M_g − n_gμ) = LᵀR_g, Σ = LLᵀ the broadcast prior. A site that scales its
   statistics by f ≠ 1 leaves a gap (f − 1)·L⁻¹μ per scaled unit in (f), and adds
   (f − f²)·m mᵀ to (d): the whitened gap ‖e‖/(n_g + ‖z‖) and the smallest whitened
   eigenvalue per unit are compared with the per-unit tolerance of the prior
   (:func:`~fedcal.core.robust.whitened_tolerance`).
2. **Outlyingness of the group's mean** (:func:`group_distances`), for consistent but wrong
   data (a flipped unit; a forger who fabricates a consistent dataset). The others' sums
   give the others' moments from every unit of theirs, not from G − 1 group means (this is
   what makes three groups enough):

       c₋g = (M − M_g)/N₋g,    R₋g = (S − S_g)/N₋g − c₋g c₋gᵀ   (N₋g = N − n_g),

   and d = M_g/n_g − c₋g. For n_g units drawn like the N₋g others
   Cov(d) ⪯ R₋g (1/n_g + 1/N₋g) (R₋g includes their posterior uncertainty: conservative),
   so δ_g = dᵀR₋g⁻¹d / (1/n_g + 1/N₋g) is at most Hotelling's T²(p, N₋g − 1) =
   p(N₋g − 1)/(N₋g − p) · F(p, N₋g − p) (χ²_p when N₋g ≤ p + 1); the cut-off is its 0.999
   quantile (:data:`~fedcal.core.robust.CUTOFF_QUANTILE`). Only the consistent groups are
   judged, against each other (an inconsistent group's second moments would distort the
   others' R₋g).

A group that fails either is left out of the M-step with its units. What a site can still do
(docs/safety.md, "Robust and secure together"): move its group's mean within the cut-off, i.e.
the fleet mean by at most (n_g/N)·√(k(1/n_g + 1/N₋g)) in R-whitened units, and inflate its
second moments without breaking (d) (a wider Σ: no summed identity bounds it from above).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from scipy.stats import f as f_dist
from torch import Tensor

from fedcal.core.bayes import F64, safe_cholesky
from fedcal.core.robust import CUTOFF_QUANTILE, PriorFrame


@dataclass(frozen=True)
class GroupVerdict:
    """Per group: why its sums are inconsistent (None: consistent), its distance δ_g to the
    others' moments and the cut-off (NaN: not judged, inconsistent or too few groups left)."""

    inconsistent: tuple[str | None, ...]
    distances: Tensor
    cutoffs: Tensor

    @property
    def kept(self) -> Tensor:
        ok = torch.tensor([why is None for why in self.inconsistent])
        return ok & ~(self.distances > self.cutoffs)

    def reason(self, g: int) -> str | None:
        """Why group ``g`` was left out (None: kept)."""
        if self.inconsistent[g] is not None:
            return f"secure group inconsistent: {self.inconsistent[g]}"
        d, k = float(self.distances[g]), float(self.cutoffs[g])
        if d > k:
            return f"secure group outlier: mean distance {d:.3g} > cut-off {k:.3g}"
        return None


def mean_law(dim: int, others: int) -> tuple[float, float]:
    """(0.999 quantile, median) of δ_g for a group drawn like the others (module doc, 2):
    Hotelling's T²(dim, others − 1); needs others > dim + 1 (else nobody is judged)."""
    n = float(others)
    scale = dim * (n - 1) / (n - dim)
    return (
        scale * float(f_dist.ppf(CUTOFF_QUANTILE, dim, n - dim)),
        scale * float(f_dist.median(dim, n - dim)),
    )


def summed_inconsistencies(
    sums: dict[str, Tensor], counts: Tensor, frame: PriorFrame
) -> list[str | None]:
    """Per group, the identity of :func:`fedcal.core.robust.inconsistencies` that its sums
    break (module doc, 1), or None: ``sums`` ``mean`` (G, p), ``second`` (G, p, p),
    ``gls_rhs`` (G, p), sums over each group's ``counts`` (G,) units; ``frame`` the
    broadcast prior."""
    m, s, n = sums["mean"].to(F64), sums["second"].to(F64), counts.to(F64)
    own = s - m.unsqueeze(-1) * m.unsqueeze(-2) / n.reshape(-1, 1, 1)
    white = frame.inv @ (0.5 * (own + own.transpose(-2, -1))) @ frame.inv.T
    low = torch.linalg.eigvalsh(0.5 * (white + white.transpose(-2, -1)))[:, 0] / n
    z = (frame.inv @ (m - n.unsqueeze(-1) * frame.mu).unsqueeze(-1))[..., 0]
    e = z - (frame.chol.T @ sums["gls_rhs"].to(F64).unsqueeze(-1))[..., 0]
    gap = e.norm(dim=-1) / (n + z.norm(dim=-1))
    out: list[str | None] = []
    for g in range(m.shape[0]):
        if not (torch.isfinite(low[g]) and torch.isfinite(gap[g])):
            out.append("non-finite sums")
        elif low[g] < -frame.tol:
            out.append(f"group covariance not positive semi-definite ({float(low[g]):.3g})")
        elif gap[g] > frame.tol:
            out.append(f"posterior mean and GLS right-hand side disagree ({float(gap[g]):.3g})")
        else:
            out.append(None)
    return out


def group_distances(mean_sums: Tensor, second_sums: Tensor, counts: Tensor) -> Tensor:
    """δ_g of each group against the others' moments (module doc, 2): ``mean_sums`` (G, p)
    the groups' Σ m_i, ``second_sums`` (G, p, p) their Σ S_i, ``counts`` (G,) their units."""
    m, s, n = mean_sums.to(F64), second_sums.to(F64), counts.to(F64)
    others = n.sum() - n
    centre = (m.sum(0) - m) / others.unsqueeze(-1)
    spread = (s.sum(0) - s) / others.reshape(-1, 1, 1)
    spread = spread - centre.unsqueeze(-1) * centre.unsqueeze(-2)
    chol = safe_cholesky(0.5 * (spread + spread.transpose(-2, -1)))[0]
    d = m / n.unsqueeze(-1) - centre
    dw = torch.linalg.solve_triangular(chol, d.unsqueeze(-1), upper=False)[..., 0]
    return dw.pow(2).sum(-1) / (1 / n + 1 / others)


def group_verdict(
    sums: dict[str, Tensor], counts: Tensor, frame: PriorFrame, used: Tensor | slice
) -> GroupVerdict:
    """The groups whose sums are consistent (:func:`summed_inconsistencies`), then each of
    those judged against the other consistent ones in the coordinates ``used`` (the chosen
    basis's: :func:`group_distances`), when at least 3 are left (with two, neither can be
    told from the other)."""
    why = summed_inconsistencies(sums, counts, frame)
    ok = [g for g, w in enumerate(why) if w is None]
    dist = torch.full((len(why),), torch.nan, dtype=F64)
    cut = torch.full((len(why),), torch.nan, dtype=F64)
    if len(ok) < 3:
        return GroupVerdict(tuple(why), dist, cut)
    idx = torch.tensor(ok)
    m = sums["mean"].to(F64)[idx][:, used]
    p = m.shape[-1]
    others = (counts[idx].sum() - counts[idx]).tolist()
    if min(others) <= p + 1:  # the others' moments cannot name a law for δ: not judged
        return GroupVerdict(tuple(why), dist, cut)
    s = sums["second"].to(F64)[idx][:, used][:, :, used]
    d = group_distances(m, s, counts[idx])
    laws = torch.tensor([mean_law(p, int(o)) for o in others], dtype=F64)
    # a consistency factor, as for units (core/robust.py): a fleet whose spread is not
    # Gaussian is judged against itself, by the groups' median distance over the law's
    factor = max(1.0, float((d / laws[:, 1]).median()))
    dist[idx], cut[idx] = d, laws[:, 0] * factor
    return GroupVerdict(tuple(why), dist, cut)
