"""A fleet prior that one hostile site or unit cannot steer: checks and weights (issue 21).

The fleet prior's M-step (:mod:`fedcal.core.bayes`, :mod:`fedcal.algorithms.fedprior`) sums
each unit's E-step terms: its posterior mean m_i, second moment S_i = m_i m_iᵀ + V_i, the GLS
terms Φ_iᵀC_i⁻¹Φ_i and Φ_iᵀC_i⁻¹(y_i − Φ_iμ), an expected residual sum of squares r_i, its
row count n_i and Gram G_i = Φ_iᵀΦ_i. A site that scales these by a factor passes any test of
size (a unit with more rows has larger sums) and, unchecked, moves the prior of every other
unit. Two defences, both pure functions of one round's per-unit uploads:

1. **Internal consistency** (:func:`inconsistencies`). Whatever a unit's data, its E-step
   under the broadcast prior N(μ, Σ) obeys identities a scaled or forged upload breaks.
   With Σ = L Lᵀ, V_i = S_i − m_i m_iᵀ and the whitened W_i = L⁻¹V_iL⁻ᵀ, H_i = LᵀΦ_iᵀC_i⁻¹Φ_iL:

   a. n_i equals the rows the unit declared (the server's count, capped at the handshake);
   b. G_i is positive semi-definite and, φ_0 ≡ 1 being the basis's first function, G_00 = n_i;
   c. r_i ≥ 0;
   d. 0 ⪯ W_i ⪯ I: the posterior covariance is PSD and never wider than the prior;
   e. H_i + W_i = I (Woodbury: A⁻¹B + A⁻¹ = I with A = I + B, B = LᵀG_iL/σ_i²);
   f. L⁻¹(m_i − μ) = Lᵀ Φ_iᵀC_i⁻¹(y_i − Φ_iμ) (both are A⁻¹g, :func:`fedcal.core.bayes.posterior`).

   Scaling every statistic by f ≠ 1 gives W' = fV + (f − f²) m mᵀ (not PSD for f > 1 once
   m mᵀ outweighs V, not below I for f < 1) and H' + W' − I = (f − 1)(…) ≠ 0: rejected at
   any factor a rounding could not produce. Each is judged in whitened, per-unit units
   (scale-free: a unit with 100× the rows is checked exactly as one with 6).

2. **Outlyingness under the others' prior** (:func:`loo_distances`, :func:`outlier_weights`).
   A unit whose data are wrong but self-consistent (a flipped reference, p → 1600 − p)
   passes 1. It is judged by where its posterior lies in the distribution the *other*
   units imply: with the others' moments c₋ᵢ = mean_j≠i m_j, R₋ᵢ = mean_j≠i S_j − c₋ᵢc₋ᵢᵀ,

       δ_i = d̃ᵀ(I + Ṽ_i)⁻¹d̃ + Σ_k min(λ_k(Ṽ_i), 1),   d̃ = L⁻¹(m_i − c₋ᵢ), Ṽ_i = L⁻¹V_iL⁻ᵀ,

   R₋ᵢ = LLᵀ: for V_i ≪ R₋ᵢ the expectation E[(c_i − c₋ᵢ)ᵀR₋ᵢ⁻¹(c_i − c₋ᵢ)] over the unit's
   posterior (its first version), while a unit's own uncertainty widens the law its mean is
   judged by and adds at most 1 per direction (issue 34.3: a 6-row unit under the vague
   start was "far" by its vagueness, not by its data). A per-unit quantity (a data-rich
   unit's δ is that of its coefficients, not of its row count). Leaving the unit out
   matters: one unit in N inflates a moment estimate that includes it until its own distance
   is at most ≈ N (masking), and M-estimators of scatter break down at 1/(p + 1) (Maronna
   1976), one unit of 20 for p = 16. Under the model δ_i follows Hotelling's leave-one-out
   law (a scaled F; χ²_p when the others are too few to name one,
   :func:`reference_quantiles`). The cut-off is its 0.999 quantile times max(1, median δ /
   its median) (a consistency factor, so a fleet whose spread is not Gaussian is judged
   against itself), and the M-step weight is w_i = min(1, (k/δ_i)²): 1 for every unit
   inside, and a redescending weight outside whose pull on Σ, w_i δ_i = k²/δ_i, vanishes as
   the unit moves away (a Huber weight k/δ_i would leave it a constant pull, which EM's
   iteration amplifies).

Both need each unit's own upload; under secure aggregation (the server sees only sums)
neither applies: with one sum the M-step is the plain sum, with groups of sites
(``secagg-groups``) their summed counterparts judge groups (:mod:`fedcal.core.group_check`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from scipy.stats import chi2
from scipy.stats import f as f_dist
from torch import Tensor

from fedcal.core.bayes import F64, safe_cholesky, sym
from fedcal.core.measures import finite_each

#: Tolerances of the consistency checks, in whitened units (a consistent upload's rounding
#: error is ≤ 1e-9 of the prior's scale at the condition numbers the EM produces; measured
#: on the default and mixed fleets, docs/safety.md). A scaled upload misses by O(f − 1).
WHITENED_TOL = 1e-4
#: Relative tolerance of G's PSD test and of G_00 = n (rows are counted exactly).
GRAM_TOL = 1e-9
#: χ²_p quantile of the outlyingness cut-off (module doc, 2).
CUTOFF_QUANTILE = 0.999
#: Units per block of the leave-one-out distances (memory: block × p² float64).
BLOCK = 4096


def _whiten(sigma: Tensor) -> tuple[Tensor, Tensor]:
    """(L, L⁻¹) of Σ = L Lᵀ (batched; :func:`safe_cholesky`)."""
    chol = safe_cholesky(sym(sigma.to(F64)), symmetric=True)[0]
    eye = torch.eye(sigma.shape[-1], dtype=F64).expand_as(chol)
    return chol, torch.linalg.solve_triangular(chol, eye, upper=False)


def whitened_tolerance(sigma: Tensor) -> Tensor:
    """Tolerance of the whitened checks for a prior Σ (…, p, p): :data:`WHITENED_TOL` plus
    10³·ε·cond(Σ) (whitening by an ill-conditioned L amplifies rounding by its condition)."""
    vals = torch.linalg.eigvalsh(sym(sigma.to(F64)))
    cond = vals[..., -1].abs() / vals[..., 0].clamp_min(1e-300)
    return WHITENED_TOL + 1e3 * torch.finfo(F64).eps * cond


@dataclass(frozen=True)
class PriorFrame:
    """What the checks read of one broadcast prior N(μ, Σ), formed once a round (not once a
    chunk of units): μ, Σ, L and L⁻¹ of Σ = L Lᵀ, and :func:`whitened_tolerance` of Σ."""

    mu: Tensor
    sigma: Tensor
    chol: Tensor
    inv: Tensor
    tol: float


def prior_frame(mu: Tensor, sigma: Tensor) -> PriorFrame:
    """The :class:`PriorFrame` of the prior N(``mu`` (p,), ``sigma`` (p, p))."""
    chol, inv = _whiten(sigma)
    return PriorFrame(mu.to(F64), sigma, chol, inv, float(whitened_tolerance(sigma)))


def _whitened_terms(stats: dict[str, Tensor], mu: Tensor, chol: Tensor, inv: Tensor):
    """W, H, H + W − I, z = L⁻¹(m − μ) and e = z − Lᵀ·gls_rhs of checks d–f (module doc, 1)."""
    m = stats["mean"].to(F64)
    p = m.shape[-1]
    tr = chol.transpose(-2, -1)
    outer = m.unsqueeze(-1) * m.unsqueeze(-2)  # S − m mᵀ formed in m mᵀ's buffer
    v = sym(torch.sub(stats["second"].to(F64), outer, out=outer))
    w = sym(inv @ v @ inv.transpose(-2, -1))
    h = sym(tr @ stats["gls_gram"].to(F64) @ chol)
    z = (inv @ (m - mu.to(F64)).unsqueeze(-1))[..., 0]
    e = z - (tr @ stats["gls_rhs"].to(F64).unsqueeze(-1))[..., 0]
    return w, h, (h + w).sub_(torch.eye(p, dtype=F64)), z, e


def whitened_gaps(
    stats: dict[str, Tensor], mu: Tensor, sigma: Tensor, frame: PriorFrame | None = None
) -> dict[str, Tensor]:
    """The measured sides of checks c–f (module doc, 1), batched over leading dims.

    ``stats``: ``mean`` (…, p), ``second``, ``gls_gram`` (…, p, p), ``gls_rhs`` (…, p),
    ``rss`` (…); ``mu`` (…, p) and ``sigma`` (…, p, p) broadcast against them (``frame``:
    their whitening, already formed). Returns ``w_low``/``w_high`` (extreme eigenvalues of
    W), ``h_low``/``h_high`` (of H), ``woodbury`` ‖H + W − I‖₂, ``rhs`` the mean/GLS gap and
    ``rss`` (…,) each.
    """
    chol, inv = (frame.chol, frame.inv) if frame is not None else _whiten(sigma)
    w, h, gap, z, e = _whitened_terms(stats, mu, chol, inv)
    w_eig, h_eig = _eigvalsh(w), _eigvalsh(h)
    return {
        "w_low": w_eig[..., 0],
        "w_high": w_eig[..., -1],
        "h_low": h_eig[..., 0],
        "h_high": h_eig[..., -1],
        # ‖·‖₂ of a symmetric matrix is its largest |eigenvalue|: eigvalsh, not an SVD (half
        # the time of the check at 10,000 units; issue 25.1)
        "woodbury": _eigvalsh(gap).abs().amax(-1),
        "rhs": _rhs_gap(z, e),
        "rss": stats["rss"].to(F64),
    }


def _eigvalsh(a: Tensor) -> Tensor:
    """Eigenvalues of symmetric matrices (…, p, p); NaN for a matrix with a non-finite entry
    (LAPACK returns NaN for some and refuses others, ending the round). Every matrix finite
    (the rule): all at once, without copying them out (the same LAPACK call per matrix)."""
    flat = a.reshape(-1, *a.shape[-2:])
    # a finite sum has no NaN or ±inf term; else each entry decides (a LAPACK factor's
    # column-major layout is summed as it lies: no copy)
    finite = torch.isfinite(flat.sum((-2, -1)))
    if bool(finite.all()):
        return torch.linalg.eigvalsh(flat).reshape(a.shape[:-1])
    finite = finite_each(flat.flatten(-2))
    out = torch.full(flat.shape[:-1], torch.nan, dtype=a.dtype)
    out[finite] = torch.linalg.eigvalsh(flat[finite])
    return out.reshape(a.shape[:-1])


#: The uploads :func:`whitened_gaps` reads.
GAP_KEYS = ("mean", "second", "gls_gram", "gls_rhs", "rss")


def _rhs_gap(z: Tensor, e: Tensor) -> Tensor:
    return e.norm(dim=-1) / (1.0 + z.norm(dim=-1))


#: Rounding allowance of a Cholesky verdict, in units of p²·ε·‖A‖_F: the factorization's
#: backward error is at most about p(p + 1)·ε·‖A‖₂ (Higham, *Accuracy and Stability of
#: Numerical Algorithms*, thm. 10.3) and eigvalsh's error about p·ε·‖A‖₂ (Weyl's bound).
ROUNDING_SLACK = 16.0


def _factors(a: Tensor, shift: Tensor | float, own: bool = False) -> Tensor:
    """Per matrix of ``a`` (c, p, p), symmetric: a + shift·I has a Cholesky factor
    (``cholesky_ex`` info = 0), i.e. λ_min(a) > −shift up to rounding. ``cholesky_ex`` lets
    ±inf through: the caller tests finiteness (:func:`_frobenius`). ``own``: ``a`` is the
    caller's temporary (−w), shifted in place."""
    shift = torch.as_tensor(shift, dtype=F64)
    if not bool(torch.isfinite(shift).all()):  # (never at the call sites: their verdict's)
        eye = torch.eye(a.shape[-1], dtype=F64)
        return torch.linalg.cholesky_ex(a + shift.reshape(-1, 1, 1) * eye).info == 0
    # the shift on the diagonal alone: the off-diagonal entries are a's (a + 0: the same
    # values, a zero's sign aside, which no pivot of the factorization reads)
    shifted = a if own else a.clone(memory_format=torch.contiguous_format)
    shifted.diagonal(dim1=-2, dim2=-1).add_(shift.unsqueeze(-1) if shift.dim() else shift)
    return torch.linalg.cholesky_ex(shifted).info == 0


def _frobenius(a: Tensor) -> Tensor:
    """‖a‖_F per matrix (…, p, p): finite only if every entry is (NaN and ±inf propagate; an
    overflow of a finite matrix's norm only withholds a Cholesky verdict)."""
    return a.flatten(-2).norm(dim=-1)


def _rounding(norm: Tensor, p: int) -> Tensor:
    """:data:`ROUNDING_SLACK`·p²·ε·‖a‖_F (``norm``) per p × p matrix: more than a Cholesky or
    eigvalsh verdict on it can be off by."""
    return ROUNDING_SLACK * p * p * torch.finfo(F64).eps * norm


def _clear(w: Tensor, h: Tensor, gap: Tensor, tol: float) -> Tensor:
    """Units whose checks d and e certainly pass, decided by two Cholesky factorizations and a
    norm instead of three eigenvalue problems (issue 25.1): λ(W) ∈ (−t/2, 1 + t/2) by
    Cholesky of W + (t/2)I and (1 + t/2)I − W, and ‖H + W − I‖_F ≤ t/2 − s (s: the
    rounding of these verdicts and of eigvalsh, :func:`_rounding`). Then λ(H) ∈ [−t, 1 + t]
    (H = I − W + (H + W − I): Weyl's inequality), ‖H + W − I‖₂ ≤ t: every eigenvalue test
    of :func:`inconsistencies` passes with a margin s. False is no verdict: those units'
    eigenvalues decide (rare: a consistent upload's gaps are ~1e-12, t ≥ 1e-4)."""
    p, half = w.shape[-1], 0.5 * tol
    norms = _frobenius(w), _frobenius(h), _frobenius(gap)
    slack = _rounding(sum(norms) + 1.0, p)  # non-finite if any entry is: no verdict
    small = norms[2] + slack <= half
    ok = small & _factors(w, half)
    return ok & _factors(-w, 1.0 + half, own=True)


def inconsistencies(
    stats: dict[str, Tensor],
    mu: Tensor,
    sigma: Tensor,
    declared: Tensor | None = None,
    constant_first: bool = True,
    frame: PriorFrame | None = None,
) -> list[str | None]:
    """Per unit, why its E-step upload cannot be what its declared data give (module doc, 1).

    ``stats``: ``mean`` (c, p), ``second`` (c, p, p), ``gls_gram`` (c, p, p), ``gls_rhs``
    (c, p), ``rss`` (c,), and optionally ``n`` (c,) and ``gram`` (c, q, q) (the full design's
    Gram). ``mu`` (p,), ``sigma`` (p, p): the prior the E-step was computed under (``frame``:
    :func:`prior_frame` of them, if already formed once a round). ``declared`` (c,): the
    rows the server counts for each unit. Returns one entry per unit: None (consistent) or
    the first failed check, in one line with the measured value.

    Every threshold is on an extreme eigenvalue (checks b, d, e): units that certainly pass
    are found by Cholesky (:func:`_clear`, :func:`gram_problems`), and only the others' —
    the rejected and the few near a threshold — eigenvalues are computed, for the verdict
    and its message: the same verdicts and messages as eigenvalues of every unit (tested).
    """
    frame = prior_frame(mu, sigma) if frame is None else frame
    tol = frame.tol
    w, h, gap, z, e = _whitened_terms(stats, frame.mu, frame.chol, frame.inv)
    rhs, rss = _rhs_gap(z, e), stats["rss"].to(F64)
    # NaN fails every comparison: "not within" (~(x <= t)), never "beyond" (x > t), rejects it
    suspect = ~(rss >= 0) | ~torch.isfinite(rss) | ~(rhs <= tol) | ~_clear(w, h, gap, tol)
    n, gram = stats.get("n"), stats.get("gram")
    if n is not None and declared is not None:
        suspect |= n.to(F64) != declared.to(F64)
    idx = suspect.nonzero()[:, 0]
    bad = torch.zeros(len(idx), dtype=torch.bool)
    if len(idx):  # the eigenvalues of the units Cholesky did not clear (few): the verdict
        g = whitened_gaps({k: stats[k][idx] for k in GAP_KEYS}, frame.mu, frame.sigma, frame)
        bad = (
            ~(g["rss"] >= 0)
            | ~torch.isfinite(g["rss"])
            | (g["w_low"] < -tol)
            | (g["w_high"] > 1 + tol)
            | (g["h_low"] < -tol)
            | (g["h_high"] > 1 + tol)
            | (g["woodbury"] > tol)
            | ~(g["rhs"] <= tol)
            | ~torch.isfinite(g["woodbury"])
        )
        if n is not None and declared is not None:
            bad |= n[idx].to(F64) != declared[idx].to(F64)
    out: list[str | None] = [None] * len(rss)
    if gram is not None:
        for i, why in gram_problems(gram, n, constant_first).items():
            out[i] = why
    rows = None if n is None or declared is None else (n, declared)
    for j in bad.nonzero()[:, 0].tolist():
        i = int(idx[j])
        if out[i] is None:
            out[i] = _verdict({k: float(v[j]) for k, v in g.items()}, i, rows, tol)
    return out


def _verdict(one: dict[str, float], i: int, rows: tuple[Tensor, Tensor] | None, tol: float) -> str:
    """Why unit ``i``'s upload is inconsistent, from its whitened gaps ``one``: the first
    failed check in :func:`inconsistencies`' order, in one line with the measured value
    (``rows``: the declared row counts in its statistics and as the server counts them)."""
    if rows is not None and float(rows[0][i]) != float(rows[1][i]):
        n, declared = rows
        return f"declares {float(n[i]):g} rows in its statistics, {float(declared[i]):g} counted"
    if not math.isfinite(one["rss"]):
        return f"residual sum of squares not finite ({one['rss']:.3g})"
    if not one["rss"] >= 0:
        return f"negative residual sum of squares {one['rss']:.3g}"
    if one["w_low"] < -tol:
        return (
            "posterior covariance S − m mᵀ not positive semi-definite "
            f"(whitened eigenvalue {one['w_low']:.3g})"
        )
    if one["w_high"] > 1 + tol:
        return f"posterior wider than the prior (whitened eigenvalue {one['w_high']:.3g})"
    if one["h_low"] < -tol or one["h_high"] > 1 + tol:
        return (
            f"GLS Gram outside [0, Σ⁻¹] (whitened eigenvalues {one['h_low']:.3g}…"
            f"{one['h_high']:.3g})"
        )
    if one["woodbury"] > tol or one["woodbury"] != one["woodbury"]:
        return f"GLS Gram and posterior covariance disagree (gap {one['woodbury']:.3g})"
    if not math.isfinite(one["rhs"]):
        return f"GLS right-hand side or posterior mean not finite (gap {one['rhs']:.3g})"
    return f"posterior mean and GLS right-hand side disagree (gap {one['rhs']:.3g})"


def gram_problems(gram: Tensor, n: Tensor | None, constant_first: bool) -> dict[int, str]:
    """Units whose G = ΦᵀΦ (c, q, q) cannot be one (not PSD, or G_00 ≠ n with φ_0 ≡ 1): why.

    PSD means λ_min(G) ≥ −:data:`GRAM_TOL`·max_k |G_kk|. A unit whose G + (that bound / 2)·I
    has a Cholesky factor, with the bound / 2 above the rounding of both verdicts
    (:func:`_rounding`), certainly passes; only the others' eigenvalues are computed."""
    g = sym(gram.to(F64))
    scale = torch.diagonal(g, dim1=-2, dim2=-1).abs().amax(-1).clamp_min(1e-300)
    bound = GRAM_TOL * scale
    norm = _frobenius(g)  # not finite for a non-finite G: no verdict (NaN eigenvalues: rejected)
    small = torch.isfinite(norm) & (_rounding(norm, g.shape[-1]) <= 0.5 * bound)
    clear = small & _factors(g, 0.5 * bound)
    low = torch.zeros_like(scale)  # 0: cleared (only the sign of low + bound is read)
    doubt = (~clear).nonzero()[:, 0]
    if len(doubt):
        low[doubt] = _eigvalsh(g[doubt])[:, 0]
    not_psd = ~(low >= -bound)
    off = torch.zeros_like(not_psd)
    if constant_first and n is not None:
        rows = n.to(F64)
        off = ~((g[..., 0, 0] - rows).abs() <= GRAM_TOL * rows.clamp_min(1.0))
    out: dict[int, str] = {}
    for i in (not_psd | off).nonzero()[:, 0].tolist():
        if bool(not_psd[i]):
            out[i] = f"Gram matrix not positive semi-definite (eigenvalue {float(low[i]):.3g})"
        else:
            out[i] = (
                f"Gram's constant term {float(g[i, 0, 0]):.6g} is not its row count {float(n[i]):g}"
            )
    return out


def loo_distances(mean: Tensor, second: Tensor) -> Tensor:
    """δ_i of each unit against the moments of the others (module doc, 2): (c,) float64.

    ``mean`` (c, p) posterior means m_i, ``second`` (c, p, p) S_i = m_i m_iᵀ + V_i. Needs
    c ≥ 2. R₋ᵢ is factored by :func:`safe_cholesky` (never fails; a degenerate one is
    floored).
    """
    m = mean.to(F64)
    s = second.to(F64)
    c = m.shape[0]
    if c < 2:
        return torch.zeros(c, dtype=F64)
    total_m, total_s = m.sum(0), s.sum(0)
    out = []
    for lo in range(0, c, BLOCK):
        mb, sb = m[lo : lo + BLOCK], s[lo : lo + BLOCK]
        centre = (total_m - mb) / (c - 1)
        # (S − S_i)/(c − 1) − c₋ᵢc₋ᵢᵀ, each step in one buffer (the same operations)
        scatter = (total_s - sb).div_(c - 1).sub_(centre.unsqueeze(-1) * centre.unsqueeze(-2))
        scatter = sym(scatter)
        d = mb - centre
        chol = safe_cholesky(scatter, symmetric=True)[0]
        out.append(_honest_distance(d, sym(sb - mb.unsqueeze(-1) * mb.unsqueeze(-2)), chol))
    return torch.cat(out)


def _honest_distance(d: Tensor, v: Tensor, chol: Tensor) -> Tensor:
    """δ_i = d̃ᵀ(I + Ṽ)⁻¹d̃ + Σ_k min(λ_k(Ṽ), 1) per unit, d̃ = L⁻¹d, Ṽ = L⁻¹VL⁻ᵀ, R = LLᵀ
    (module doc, 2; issue 34.3): a unit's own uncertainty V_i widens the law its mean is
    judged by (a few-row unit's mean is far from the others' by its noise, not by a lie)
    and adds at most 1 per direction. With V_i ≪ R it is dᵀR⁻¹d + tr(R⁻¹V_i), the
    expectation of before; a data-rich unit is judged as before. V_i ⪯ Σ is checked
    (:func:`inconsistencies`, d), so a forger gains at most Σ's width."""
    lower = torch.linalg.solve_triangular(chol, v, upper=False)
    white = sym(torch.linalg.solve_triangular(chol, lower.transpose(-2, -1), upper=False))
    dw = torch.linalg.solve_triangular(chol, d.unsqueeze(-1), upper=False)
    eye = torch.eye(v.shape[-1], dtype=F64)
    widened = safe_cholesky(white + eye, symmetric=True)[0]
    far = torch.linalg.solve_triangular(widened, dw, upper=False)[..., 0].pow(2).sum(-1)
    trace = torch.diagonal(white, dim1=-2, dim2=-1).sum(-1)
    own = trace.clone()
    doubt = (~(trace <= 1.0)).nonzero()[:, 0]  # λ_max ≤ tr (PSD): below 1, nothing capped
    if len(doubt) == len(trace):  # every unit (the vague start): no copy of them
        own = _eigvalsh(white).clamp(min=0.0, max=1.0).sum(-1)
    elif len(doubt):
        own[doubt] = _eigvalsh(white[doubt]).clamp(min=0.0, max=1.0).sum(-1)
    return far + own


@dataclass(frozen=True)
class OutlierWeights:
    """The M-step weights w_i, the distances δ_i they come from and the cut-off k."""

    weights: Tensor
    distances: Tensor
    cutoff: float


def reference_quantiles(dim: int, others: int | None = None) -> tuple[float, float]:
    """(0.999 quantile, median) of δ for a unit drawn like the others (module doc, 2).

    With ``others`` = n units estimating the moments it is judged by and n > dim + 1:
    Hotelling's leave-one-out law δ ~ (n + 1)/n · dim(n − 1)/(n − dim) · F(dim, n − dim)
    (a unit of a small fleet lies far from the others' estimate by chance); else χ²_dim.
    """
    if others is not None and others > dim + 1:
        n = float(others)
        scale = (n + 1) / n * dim * (n - 1) / (n - dim)
        return (
            scale * float(f_dist.ppf(CUTOFF_QUANTILE, dim, n - dim)),
            scale * float(f_dist.median(dim, n - dim)),
        )
    return float(chi2.ppf(CUTOFF_QUANTILE, dim)), float(chi2.median(dim))


def outlier_weights(distances: Tensor, dim: int, others: int | None = None) -> OutlierWeights:
    """w_i = min(1, (k/δ_i)²), k = q · max(1, median δ / m) (module doc, 2).

    q, m: the 0.999 quantile and median of :func:`reference_quantiles` (``others``: the
    units each δ_i is judged against, c − 1). A non-finite δ_i gets weight 0.
    """
    d = distances.to(F64)
    finite = torch.isfinite(d)
    med = float(d[finite].median()) if bool(finite.any()) else float("nan")
    q, m = reference_quantiles(dim, others)
    k = q * (max(1.0, med / m) if med == med else 1.0)
    w = torch.where(d > k, (k / d.clamp_min(1e-300)) ** 2, torch.ones_like(d))
    w = torch.where(finite, w, torch.zeros_like(d))
    return OutlierWeights(w, d, k)


def explained_rms(gram: Tensor, moment: Tensor, rows: Tensor) -> Tensor:
    """√(mᵀG⁺m / n) per unit (c, q, q), (c, q), (c,) → (c,): the RMS of the unit's own
    least-squares fit ŷ = Φc, c = G⁺m (ŷᵀŷ = mᵀG⁺m for m = Φᵀy in G's range).

    A size screen's scale-free view of the moment Φᵀy (issue 20 item 3): in the units of y,
    whatever the unit's row count or input range (raw, Φᵀy grows with both), and ≤ the RMS
    of y, so a unit whose targets are f × an honest unit's has f × its value."""
    g = sym(gram.to(F64))
    m = moment.to(F64).unsqueeze(-1)
    coef = torch.linalg.pinv(g, hermitian=True, rtol=1e-12) @ m
    energy = (m * coef).sum((-2, -1)).clamp_min(0.0)  # ≥ 0 up to rounding for a PSD G
    return (energy / rows.to(F64).clamp_min(1.0)).sqrt()


def count_problems(count: Tensor, rows: Tensor) -> dict[int, str]:
    """Units whose uploaded row count is not the rows they declared (check a, module doc)."""
    c, r = count.to(F64), rows.to(F64)
    off = ~((c - r).abs() <= GRAM_TOL * r.clamp_min(1.0))
    return {
        i: f"row count {float(c[i]):g} is not its declared {float(r[i]):g}"
        for i in off.nonzero()[:, 0].tolist()
    }
