"""κ as a function of the design's size, chosen by the server from the references' sums
(issue 33, session 12: fedprior_deploy E4; the model's D3 in :mod:`fedcal.prior.discrepancy`).

E4a. **Knots.** Each emulated design b (a pseudo-unit of n_b points) is shared between the
     two knots of :data:`KNOTS` around it, in log n: w_bk = 1 − |log n_b − log n_k| /
     (log n_{k±1} − log n_k) for the neighbours k, 0 elsewhere (Σ_k w_bk = 1; a design
     below the first knot or beyond the last is the end knot's). A unit uploads, per knot,
     ν₀ and κ of the grids, Σ_b w_bk · (its held-out rows of b inside the 95 % interval),
     Σ_b w_bk h_b (h_b its held-out rows of b), Σ_b w_bk h_b log n_b and Σ_b w_bk · (their
     Student-t log density).
E4b. **κ_k** (:func:`choose`): for each ν₀, at every knot holding at least
     :data:`MIN_KNOT_HELD` weighted held-out rows, the smallest κ whose weighted pooled
     coverage reaches 95 % (:func:`first_covering`: linear between grid values). The
     knot is placed at the weighted geometric mean size of its designs,
     n̄_k = exp(Σ_b w_bk h_b log n_b / Σ_b w_bk h_b), so a knot sits where its designs
     are, never beyond the largest emulated; a knot within :data:`KNOT_GAP` (10 %) of
     the previous one's size is dropped (the same designs). ν₀ is the one whose summed
     log score at its knots' κ_k is highest (∞ included). The pooled κ (every design at
     once) is kept as the record's summary ``kappa``. A design of n points then takes
     κ(n) of D3 (log κ linear in log n between the knots (n̄_k, κ_k)).
E4c. **E[s²] per knot** (issue 33, the planner's forecast): each unit also uploads, per knot
     and ν₀, Σ_b w_bk s_b² (s_b² of D4 for its emulated design b, at that ν₀) and Σ_b w_bk;
     the server keeps, for the chosen ν₀, ē_k = Σ w_bk s_b² / Σ w_bk at each kept knot
     (one per knot of κ(n); no knots: the pooled mean over every design). The mean of s²,
     not of s: the forecast is an expected variance (its RMS σ), and a unit's stated
     variance is κ² s_i² (t/1.96)² v(x), linear in s_i², so its mean over units is
     κ² E[s²] (t/1.96)² v(x) where s_i² varies independently of v (D3–D4). ν₀ = ∞: ē_k = 1.

Why per size (measured, docs/uncertainty.md "Deployment"): with one κ pooled over 6- to
40-point designs, the 40-point family covered 0.81–0.92 of its held-out rows at that κ and
new units of 36–48 points 0.92–0.93; the few-point ones over-covered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from fedcal.core.bayes import F64
from fedcal.prior.discrepancy import KAPPA_RANGE

NU_GRID = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, math.inf)  # E4
KAPPA_GRID = torch.logspace(*(math.log10(k) for k in KAPPA_RANGE), 151, dtype=F64)
KNOTS = (6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0)  # E4a: design sizes, ×1.33–1.5 apart
MIN_KNOT_HELD = 256.0  # E4b: weighted held-out rows a knot needs (about 2 designs' worth)
KNOT_GAP = 1.1  # E4b: a knot's size at least this × the previous knot's


def knot_weights(points: Tensor) -> Tensor:
    """w_bk of E4a: (designs, knots), each row summing to 1."""
    ln = torch.tensor(KNOTS, dtype=F64).log()
    x = points.to(F64).clamp(KNOTS[0], KNOTS[-1]).log()
    i = (torch.searchsorted(ln, x.contiguous()) - 1).clamp(0, len(KNOTS) - 2)
    w = (x - ln[i]) / (ln[i + 1] - ln[i])
    out = torch.zeros(len(points), len(KNOTS), dtype=F64)
    rows = torch.arange(len(points))
    out[rows, i] = 1.0 - w
    out[rows, i + 1] += w
    return out


def first_covering(share: Tensor, target: float = 0.95) -> float:
    """The smallest κ of :data:`KAPPA_GRID` whose coverage ``share`` reaches ``target``
    (linear between grid values); NaN if none."""
    ok = torch.nonzero(share >= target)
    if ok.numel() == 0:
        return math.nan
    g = int(ok[0, 0])
    if g == 0:
        return float(KAPPA_GRID[0])
    w = float((target - share[g - 1]) / (share[g] - share[g - 1]))
    return float(KAPPA_GRID[g - 1] + w * (KAPPA_GRID[g] - KAPPA_GRID[g - 1]))


def _grid_index(kappa: float) -> int:
    at = torch.searchsorted(KAPPA_GRID, torch.tensor(kappa, dtype=F64))
    return int(at.clamp_max(len(KAPPA_GRID) - 1))


@dataclass(frozen=True)
class KappaChoice:
    """E4b's result: ``nu`` the index of ν₀ in :data:`NU_GRID` (−1: no κ covers), the
    pooled ``kappa`` and the knots (n̄_k, κ_k) of κ(n); ``scales`` E4c's mean s² at each
    knot (no knots: one, pooled)."""

    nu: int
    kappa: float
    knots: tuple[tuple[float, float], ...]
    scales: tuple[float, ...] = ()


def choose(sums: dict[str, Tensor]) -> KappaChoice:
    """E4b's server step from the pooled uploads ``inside`` (units, knots, ν₀, κ), ``held``
    (units, knots), ``logn`` (units, knots): Σ w log n, ``score`` (units, knots, ν₀, κ),
    ``designs`` (units, knots): Σ w, ``s2`` (units, knots, ν₀): Σ w s² (E4c)."""
    inside, held = sums["inside"].sum(0), sums["held"].sum(0)  # (K, N, G), (K,)
    score, logn = sums["score"].sum(0), sums["logn"].sum(0)
    mean_s2 = sums["s2"].sum(0) / sums["designs"].sum(0).clamp_min(1e-300).unsqueeze(-1)
    used = [k for k in range(len(KNOTS)) if float(held[k]) >= MIN_KNOT_HELD]
    best = KappaChoice(-1, math.nan, ())
    best_score = -math.inf
    for n in range(len(NU_GRID)):
        pooled = first_covering(inside[:, n].sum(0) / held.sum().clamp_min(1.0))
        if math.isnan(pooled):
            continue
        knots, total = [], 0.0
        for k in used:
            kappa = first_covering(inside[k, n] / held[k])
            if math.isnan(kappa):  # no κ of the grid covers these designs: knot unusable
                knots = None
                break
            knots.append((math.exp(float(logn[k] / held[k])), kappa, float(mean_s2[k, n])))
            total += float(score[k, n, _grid_index(kappa)])
        if knots is None:
            continue
        if not knots:
            total = float(score[:, n, _grid_index(pooled)].sum())
            pooled_s2 = float(sums["s2"].sum((0, 1))[n] / sums["designs"].sum().clamp_min(1e-300))
            choice = KappaChoice(n, pooled, (), (pooled_s2,))
        else:
            kept = _ascending(knots)
            choice = KappaChoice(n, pooled, tuple(k[:2] for k in kept), tuple(k[2] for k in kept))
        if total > best_score:
            best, best_score = choice, total
    return best


def _ascending(knots: list[tuple[float, float, float]]) -> list[tuple[float, float, float]]:
    """The knots (n̄_k, κ_k, ē_k), each at least :data:`KNOT_GAP` × the previous one's size
    (a knot closer than that is dropped: two knots whose designs are the same ones, e.g.
    40-point designs shared by the 32- and 48-point knots when none is larger, say the same
    thing)."""
    out: list[tuple[float, float, float]] = []
    for n, kappa, s2 in knots:
        if not out or n >= out[-1][0] * KNOT_GAP:
            out.append((round(n, 4), kappa, s2))
    return out
