"""Judging a unit's upload by honesty, not size (issue 34.3): quantities in the target's
units, ranges a share of information must keep, and a bounded pull for what cannot be
checked.

The server's size screen compared sums that grow with a unit's rows, inputs and noise (a
residual sum, second moments, a Gram) against the fleet's median, and rejected honest
units of real networks: a unit with 10× the fleet's residual variance (3.2× its RMS) was
"10× the median". What an honest unit of any size keeps is judged instead:

* :func:`fitted_rms` — the RMS of the unit's own posterior fit over its rows, in the units
  of y: the one quantity fedprior's size screen judges;
* :func:`support_problems` — a data support is a share of information, eigenvalues in [0, 1];
* :func:`capped_residuals` — residual sums cannot be checked (the data are private): each
  enters the fleet noise at most :data:`RESIDUAL_CAP` × its rows × the fleet's typical
  per-row variance.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fedcal.core.bayes import F64, sym
from fedcal.core.robust import WHITENED_TOL, _eigvalsh, _factors, _frobenius, _rounding


def fitted_rms(mean: Tensor, gram: Tensor, rows: Tensor) -> Tensor:
    """√(m_iᵀG_im_i / G_i,00) per unit (c, p), (c, p, p), (c,) → (c,): the RMS over the
    unit's own rows of its posterior fit Φ_im_i, in the units of y (issue 34.3); G_00 = n_i
    for a design whose first function is the constant (``rows`` where G_00 ≤ 0).

    fedprior's size screen judges this instead of the sums' sizes: scale-free in the unit's
    row count, input range and the directions its points leave undetermined (they carry no
    weight in G_i), while targets × f give f × its value (a forged or mislabelled unit). A
    Gram scaled alone leaves it unchanged (the consistency check, G_00 = n, judges that)."""
    m = mean.to(F64)
    if gram.shape[-1] != m.shape[-1]:  # a design Gram of another basis: the coefficients
        return m.norm(dim=-1)
    g = sym(gram.to(F64))
    energy = (m.unsqueeze(-2) @ g @ m.unsqueeze(-1))[..., 0, 0]
    weight = torch.where(g[..., 0, 0] > 0, g[..., 0, 0], rows.to(F64).clamp_min(1.0))
    return (energy.clamp_min(0.0) / weight).sqrt()


#: A unit's residual variance enters the fleet's noise sum at most this many times the
#: fleet's median per-row variance (10² = 10× in RMS, the size screen's default factor).
RESIDUAL_CAP = 100.0


def capped_residuals(rss: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
    """(rss_i capped at :data:`RESIDUAL_CAP` · n_i · median_j(rss_j / n_j), which were capped);
    the median weighted by the rows, none when it is 0.

    Residual sums are checked for sign only (a unit's data are private): an honest noisy
    unit (a residual RMS 55× the fleet's, issue 34) is kept, and its pull on a fleet noise
    σ² = Σ rss / Σ n bounded like a forged one's: a bounded influence, not a rejection."""
    r, n = rss.to(F64), rows.to(F64).clamp_min(1.0)
    per_row = r / n
    finite = torch.isfinite(per_row)
    median = _rows_median(per_row[finite], n[finite]) if bool(finite.any()) else math.nan
    if not median > 0:  # no fleet scale (exact data: every residual ≈ 0): nothing to cap by
        return r, torch.zeros_like(finite)
    bound = RESIDUAL_CAP * median * n
    over = r > bound
    return torch.where(over, bound, r), over


def support_problems(support: Tensor) -> dict[int, str]:
    """Units whose data support I − (I + s²G/σ²)⁻¹ (c, p, p) has an eigenvalue outside
    [0, 1] (beyond :data:`WHITENED_TOL` and rounding): a support is a share of information,
    whatever the unit's rows (so it is checked for range, not judged by size)."""
    a = sym(support.to(F64))
    p, tol = a.shape[-1], WHITENED_TOL
    norm = _frobenius(a)
    ok = torch.isfinite(norm) & (_rounding(norm, p) <= 0.5 * tol)
    ok = ok & _factors(a, tol) & _factors(-a, 1.0 + tol, own=True)
    out: dict[int, str] = {}
    for i in (~ok).nonzero()[:, 0].tolist():
        vals = _eigvalsh(a[i : i + 1])[0]
        low, high = float(vals[0]), float(vals[-1])
        if not (low >= -tol and high <= 1.0 + tol):
            out[i] = f"data support outside [0, 1] (eigenvalues {low:.3g}…{high:.3g})"
    return out


def _rows_median(values: Tensor, rows: Tensor) -> float:
    """The rows-weighted (lower) median of ``values``: the fleet's typical per-row variance,
    set by the units that hold the rows (units that interpolate a few points, residual ≈ 0,
    do not pull it to 0)."""
    order = values.argsort()
    cum = rows[order].cumsum(0)
    at = int(torch.searchsorted(cum, 0.5 * cum[-1]))
    return float(values[order][min(at, len(order) - 1)])
