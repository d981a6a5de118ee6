"""A one-shot release of a fleet's mean and covariance under client-level DP, in stages
each whitened by the one before (issue 25, item 3; the section comment below).
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from fedcal.core.dp_accounting import F64, StagedBudget
from fedcal.core.dp_sums import NOISE_MARGIN, AdaptiveClip, Statistic, private_sums, psd_projection

# ---- a one-shot release of a fleet's mean and covariance (issue 25, item 3) -------------
#
# When every contributing unit can fit its own coefficients c_i (far more points than
# terms), the fleet prior needs only their mean and covariance and a noise scale: one
# release instead of a Gaussian mechanism per EM round. The covariance spans many decades,
# and the Gaussian mechanism's noise is absolute in the coordinates of the release, so the
# release runs in stages, each whitened by the one before (the iterative preconditioning of
# Biswas, Dong, Kamath & Ullman 2020, "CoinPress"):
#
#   stage 0: the mean of c_i in the vague start's units and the mean of log σ_i²;
#   stage k: in the whitening z_i = T_k(c_i − μ_k) of the previous release, the weak block
#            U (directions whose eigenvalue that release's noise hid and raised to its
#            floor: far below 1 whitened) gets its own mean and second moment, the resolved
#            block R its mean, and the cross moment z_U z_Rᵀ, each with its own bound (one
#            bound for all would scale U's noise to R's spread); R's covariance stays I;
#            the last stage adds σ_i² / σ̂₀². A weak direction is resolved once its spread
#            exceeds the stage's noise floor, which shrinks with the weak block's spread.
#
# Every stage is one call of :func:`private_sums` (clip, Gaussian noise, projection), with
# bounds adapted by private quantile estimation when asked; every mechanism is a Gaussian
# on the whole cohort (q = 1), so their RDP adds up (:func:`staged_budget`).

LOG_NOISE_RANGE = 30.0  # declared bound on |log σ_i² − log s₀²| (nats): 13 decades either way
NOISE_RATIO_BOUND = 4.0  # declared bound on σ_i² / σ̂₀² in the last stage
UNBOUNDED = 1e300  # the no-noise release's bound: no unit reaches it (finite: 0 × it = 0)


@dataclass(frozen=True)
class Whitening:
    """A preconditioner: the center μ, the spread C = L Lᵀ and the noise scale σ₀²."""

    mean: Tensor
    cov: Tensor | None  # None: not released yet (stage 0 releases the mean only)
    noise: Tensor


def _stage(
    replies: dict[str, Tensor],
    declared: dict[str, Statistic],
    sigma: float,
    budget: StagedBudget,
    quantile: float,
    generator: torch.Generator,
) -> tuple[dict[str, Tensor], dict[str, float]]:
    """One stage: :func:`private_sums` with adapted bounds when ``quantile`` > 0."""
    adaptive = None
    if quantile > 0:
        adaptive = AdaptiveClip(
            quantile=quantile, count_multiplier=budget.counts, steps=budget.steps
        )
    return private_sums(replies, declared, sigma, generator, adaptive=adaptive)


def release_moments(
    coef: Tensor,
    noise_var: Tensor,
    budget: StagedBudget | None,
    generator: torch.Generator,
    start_scale: float = 1.0,
    start_noise: float = 0.1,
    quantile: float = 0.9,
    whiten: Whitening | None = None,
    floor: float = 1e-12,
    refresh_last: bool = False,
    scales: bool = False,
    relevant: float = 0.0,
    keys: Sequence[object] | None = None,
) -> tuple[Whitening, dict[str, float]]:
    """The fleet's mean, covariance and noise variance from the units' own fits, released
    under client-level DP in ``len(budget.sums)`` stages (the section's comment above).

    ``coef`` (N, p): each contributing unit's coefficients; ``noise_var`` (N,): its noise
    variance. ``budget`` None: no noise (the non-private moments, through the same clipping
    at bounds no unit reaches). ``whiten``: a given preconditioner (the oracle: the true
    moments), then one stage. Declared bounds: ‖c − μ‖ ≤ 2√p s in the vague start's units
    (fedprior's), twice the whitened dimension per block (:func:`_refine_leaves`; a χ²_p
    draw exceeds 2p with probability < 2 % for p ≥ 16), |log σ_i² − log s₀²| ≤ 30 and
    σ_i²/σ̂₀² ≤ 4; with ``quantile`` > 0 each is only the start of private quantile
    estimation (:func:`private_bounds`). ``refresh_last``: the last stage releases the
    whole covariance again (every direction weak), not only the weak block. ``scales``:
    stage 1 releases each coordinate's scale and median instead (:func:`_scale_stage`),
    and the next stage is whitened by them; with ``relevant`` > 0 the next stages then
    release only the block of coordinates whose scale stage variance is at least
    ``relevant`` × σ̂₀² (in prediction coordinates: the directions a unit's noisy points
    can tell apart), the others keep the scale stage's variance and median, uncorrelated
    (the noise floor of a p × p release grows as p^{3/2}: a smaller block resolves more).
    ``keys`` (N,): each unit's public key (e.g. its sensor id), a function of the unit alone;
    with ``scales`` the units are first put in the order of :func:`release_order` (a keyed
    hash of the keys, drawn from ``generator``: never of the coefficients), in which the
    scale stage takes its differences and every stage its sums. None: the positions 0..N−1,
    allowed only without noise (``budget`` None); a noisy release with ``scales`` and no
    keys is refused (removing a unit moves every later position, so the scale stage's bound
    below does not hold under removal; and replacing a unit changes its two terms by up
    to 2·30 each, 4·30√p, above the 3·30√p calibrated: without keys the scale stage's ε
    would hold under neither relation).

    Neighbouring relation: every stage is calibrated for adding or removing one unit
    (its clipped leaf in each sum, ½ in each centred count, 3·30√p in the scale stage),
    with the number of units N used as public, as every stage does (the means divide by
    it, the counts are centred on N/2, the projections' floors scale with it): N itself
    is not protected. Replacing a unit is a removal and an addition.
    Returns (μ, C, σ²) and per-stage metrics (``scales/keyed``: 1 with ``keys``).
    Refused: ``quantile`` > 0 with ``budget.counts`` 0 (the clip counts would be released
    without noise and outside ε), one stage without ``whiten`` (stage 0 releases no
    covariance), ``keys`` not one per unit or repeating, and ``scales`` with a budget but
    no ``keys``.
    """
    n, _ = coef.shape
    coef, noise_var = coef.to(F64), noise_var.to(F64)
    plain = budget is None
    if plain:  # bounds no unit reaches, no noise
        budget = StagedBudget(0.0, 0.0, (0.0,) * (1 if whiten else 2 + scales), 0.0, 1, 0.0, 0.0)
        quantile = 0.0
    _check_release(budget, quantile, whiten, scales, plain, keys, n)
    run = _Release(budget, generator, quantile, floor, plain, start_scale, refresh_last)
    metrics: dict[str, float] = {}
    if scales:  # the scale stage's path: a public order of the units, fixed before stage 0
        coef, noise_var = _in_release_order(coef, noise_var, keys, generator, metrics)
    stages = list(budget.sums)
    if whiten is None:  # stage 0: the mean and the log noise, in the vague start's units
        whiten = _first_stages(run, coef, noise_var, stages, start_noise, scales, metrics)
    if not (scales and relevant > 0):
        return _refine_stages(run, coef, noise_var, whiten, stages, metrics), metrics
    # refine the block the units' points can resolve, then put it back among the scale
    # stage's coordinates
    var = whiten.cov.diagonal()
    keep = (var >= relevant * whiten.noise) | (var == var.max())  # at least the widest
    block = Whitening(whiten.mean[keep], whiten.cov[keep][:, keep], whiten.noise)
    metrics["scales/refined"] = float(int(keep.sum()))
    block = _refine_stages(run, coef[:, keep], noise_var, block, stages, metrics)
    return _put_back(block, whiten, keep, floor), metrics


def _put_back(block: Whitening, whiten: Whitening, keep: Tensor, floor: float) -> Whitening:
    """The refined block's release in place of its coordinates of ``whiten`` (the scale
    stage's): its mean, its covariance, no correlation with the others; the new noise."""
    idx = torch.nonzero(keep)[:, 0]
    mean, cov = whiten.mean.clone(), whiten.cov.clone()
    mean[idx] = block.mean
    cov[idx.unsqueeze(1), idx.unsqueeze(0)] = block.cov
    return Whitening(mean, psd_projection(cov, floor), block.noise)


@dataclass(frozen=True)
class _Release:
    """What every stage of :func:`release_moments` shares."""

    budget: StagedBudget
    generator: torch.Generator
    quantile: float
    floor: float
    plain: bool  # no noise, bounds no unit reaches
    start_scale: float
    refresh_last: bool


def _check_release(
    budget: StagedBudget,
    quantile: float,
    whiten: Whitening | None,
    scales: bool,
    plain: bool,
    keys: Sequence[object] | None,
    n: int,
) -> None:
    """:func:`release_moments`' refusals (its docstring's last paragraph)."""
    if quantile > 0 and budget.counts == 0:  # the counts would be released without noise
        raise ValueError(
            f"release_moments: quantile = {quantile} needs a count budget (count_share > 0)"
        )
    if whiten is None and len(budget.sums) < 2:  # stage 0 releases no covariance
        raise ValueError("release_moments: 1 stage needs whiten= (a given preconditioner)")
    if scales and (whiten is not None or len(budget.sums) < 3 or not (plain or budget.counts)):
        raise ValueError(
            "release_moments: scales need stage 0 (no whiten=), >= 3 stages (stage 0, the "
            f"scales, one full; got {len(budget.sums)}) and a count budget (the medians)"
        )
    if keys is not None and len(keys) != n:
        raise ValueError(f"release_moments: {len(keys)} keys for {n} units")
    if scales and not plain and keys is None:  # positions: its ε holds for no relation
        raise ValueError(
            "release_moments: a noisy release with scales needs keys= (one public id per unit)"
        )


def _in_release_order(
    coef: Tensor,
    noise_var: Tensor,
    keys: Sequence[object] | None,
    generator: torch.Generator,
    metrics: dict[str, float],
) -> tuple[Tensor, Tensor]:
    """The units in :func:`release_order` of their keys (positions without keys)."""
    order = release_order(range(len(coef)) if keys is None else keys, generator)
    metrics["scales/keyed"] = float(keys is not None)
    return coef[order], noise_var[order]


def _first_stages(
    run: _Release,
    coef: Tensor,
    noise_var: Tensor,
    stages: list[float],
    start_noise: float,
    scales: bool,
    metrics: dict[str, float],
) -> Whitening:
    """Stage 0 (the mean and the log noise, in the vague start's units) and, with
    ``scales``, the scale stage; their multipliers taken from ``stages``."""
    n, p = coef.shape
    s = run.start_scale
    # ‖c‖ ≤ 2√p s in the start's units is ‖c / s‖ ≤ 2√p in the transformed leaf's
    declared = {
        "mean": Statistic(2 * math.sqrt(p), transform=torch.tensor(1.0 / s, dtype=F64)),
        "log_noise": Statistic(
            LOG_NOISE_RANGE, center=torch.tensor([2 * math.log(start_noise)], dtype=F64)
        ),
    }
    if run.plain:
        declared = {k: replace(v, bound=UNBOUNDED) for k, v in declared.items()}
    replies = {"mean": coef, "log_noise": noise_var.log().unsqueeze(-1)}
    sigma0 = stages.pop(0)
    sums, m = _stage(replies, declared, sigma0, run.budget, run.quantile, run.generator)
    metrics.update({f"stage0/{k}": v for k, v in m.items()})
    whiten = Whitening(sums["mean"] / n, None, (sums["log_noise"][0] / n).exp())
    if scales:
        spread0 = sigma0 * math.sqrt(2) * m.get("dp_bound/mean", 2 * math.sqrt(p)) * s / n
        whiten, m = _scale_stage(coef, whiten, spread0, stages.pop(0), run.budget, run.generator)
        metrics.update({f"scales/{k}": v for k, v in m.items()})
    return whiten


def _refine_stages(
    run: _Release,
    coef: Tensor,
    noise_var: Tensor,
    whiten: Whitening,
    stages: list[float],
    metrics: dict[str, float],
) -> Whitening:
    """The refining stages, each whitened by the one before: the weak block's mean and
    second moment, the resolved block's mean, their cross moment; the noise in the last.

    z = T(c − μ): the last release's whitening; ``weak``: its coordinates whose variance the
    noise hid (raised to the floor), where the units' whitened spread is far below 1."""
    n, p = coef.shape
    t = torch.eye(p, dtype=F64) / run.start_scale if whiten.cov is None else _whitening(whiten.cov)
    weak = torch.ones(p, dtype=torch.bool)
    for k, sigma in enumerate(stages, start=1):
        last = k == len(stages)
        if not bool(weak.any()) or (last and run.refresh_last):  # all resolved, or asked
            weak = torch.ones(p, dtype=torch.bool)
        z = (coef - whiten.mean) @ t.T
        declared, replies = _refine_leaves(z, weak)
        if last:
            declared["noise"] = Statistic(
                NOISE_RATIO_BOUND,
                "positive",
                transform=1.0 / whiten.noise.to(F64).reshape(()),
                minimum=1e-8,  # σ² never 0: the new units' posterior needs σ² > 0
            )
            replies["noise"] = noise_var
        if run.plain:
            declared = {key: replace(v, bound=UNBOUNDED) for key, v in declared.items()}
        sums, m = _stage(replies, declared, sigma, run.budget, run.quantile, run.generator)
        metrics.update({f"stage{k}/{key}": v for key, v in m.items()})
        # the weak block's floor per unit: NOISE_MARGIN × the noise's spectral norm / N
        bound = m.get("dp_bound/second_u", declared["second_u"].bound)
        std = sigma * math.sqrt(len(declared)) * bound
        level = NOISE_MARGIN * std * math.sqrt(2 * int(weak.sum())) / n
        whiten, weak, t = _next_whitening(run, sums, whiten, weak, t, level, n, last)
    return whiten


def _next_whitening(
    run: _Release,
    sums: dict[str, Tensor],
    whiten: Whitening,
    weak: Tensor,
    t: Tensor,
    level: float,
    n: int,
    last: bool,
) -> tuple[Whitening, Tensor, Tensor]:
    """A stage's release assembled: the new (μ, C, σ²), the next weak block and whitening."""
    p = len(weak)
    shift, spread = _assemble(sums, weak, n, max(level, run.floor))
    t_inv = torch.linalg.inv(t)
    mean = whiten.mean + t_inv @ shift
    cov = psd_projection(t_inv @ spread @ t_inv.T, run.floor)
    noise = sums["noise"] / n if last else whiten.noise
    vals, vecs = torch.linalg.eigh(spread)  # ascending
    # the next weak block: as many directions as the weak block's eigenvalues the noise
    # hid (raised to its floor), the smallest of the assembled spread
    block = spread[weak][:, weak]
    hidden = int((torch.linalg.eigvalsh(block) <= level * (1 + 1e-6)).sum()) if level else 0
    weak = torch.arange(p) < hidden
    t = (vecs / vals.clamp_min(run.floor).sqrt()).T @ t  # Λ^(−½) Wᵀ T: the next whitening
    return Whitening(mean, cov, noise), weak, t


# E[log χ²₁] = ψ(½) + log 2: the mean log of a squared standard normal
LOG_CHI2_1 = -1.2703628454614782
MEDIAN_WIDTH = 4.0  # the median's search: μ₀ ± 4 (stage 0's noise std + the scale)
# The scale stage's sensitivity per coordinate, in units of LOG_NOISE_RANGE: removing an
# interior unit of the path replaces two terms by one (:func:`_scale_stage`)
PATH_SENSITIVITY = 3


def release_order(keys: Sequence[object], generator: torch.Generator) -> Tensor:
    """The units' order for the scale stage: ascending keyed BLAKE2b digest of each unit's
    public key (its ``str``), under a 16-byte key drawn from ``generator``.

    Why a hash: units adjacent in a fleet file are often from the same lot, and differences
    of neighbours from one lot are smaller than the fleet's spread (the scales would come
    out low). Why keyed: the order is then independent of how the ids were assigned. The
    order depends on the key set only, never on the coefficients, and removing a unit
    leaves the others' relative order unchanged (the scale stage's bound relies on that).
    Keys that repeat (as strings) are refused: their order would depend on the rows'.
    """
    names = [str(k) for k in keys]
    if len(set(names)) != len(names):
        dup = next(k for k, c in Counter(names).items() if c > 1)
        raise ValueError(f"release_moments: unit key {dup!r} repeats (keys must be unique)")
    secret = bytes(torch.randint(0, 256, (16,), generator=generator).tolist())
    digest = [hashlib.blake2b(k.encode(), key=secret, digest_size=16).digest() for k in names]
    return torch.tensor(sorted(range(len(names)), key=digest.__getitem__), dtype=torch.long)


def _scale_stage(
    coef: Tensor,
    whiten: Whitening,
    spread0: float,
    sigma: float,
    budget: StagedBudget,
    generator: torch.Generator,
) -> tuple[Whitening, dict[str, float]]:
    """Each coordinate's scale and median, each relative to that coordinate's own spread.

    Why: the Gaussian noise on a p × p second moment is absolute, scaled to the largest
    spread in it, so spreads ten decades apart need many whitening stages; a statistic per
    coordinate whose sensitivity does not depend on the spread resolves each coordinate
    at once. Two parts, one Gaussian stage and the stage's ``budget.steps`` counts:

    - scales, free of the mean: ``coef``'s rows are the units in a public order
      (:func:`release_order`), and consecutive units form a path, d_i = c_(i+1) − c_i for
      i = 0..N−2, d_ij ~ (0, 2 v_j) along coordinate j; each term gives
      ℓ_ij = log(d_ij² / 2) − log σ₀², clipped to ±``LOG_NOISE_RANGE`` (30). Sensitivity
      under adding or removing one unit (N public, as for the counts and the
      projections): removing interior unit k replaces terms (k−1, k) and (k, k+1) by
      (k−1, k+1), |ℓ' − ℓ_a − ℓ_b| ≤ 3·30 per coordinate; removing an end unit drops one
      term (≤ 30); adding is the reverse. So ‖Δ Σ_i ℓ_i‖ ≤ 3·30·√p, the noise's
      calibration. E[ℓ_ij] = log(v_j / σ₀²) + E[log χ²₁] holds term by term (the terms
      are dependent, the mean is still unbiased), so
      v_j = σ₀² exp(Σ_i ℓ_ij / (N − 1) − E[log χ²₁]) (exact in mean for a normal coordinate);
    - medians, by noisy bisection: from μ₀ ± ``MEDIAN_WIDTH`` (s₀ + √v_j), s₀ the noise
      std of stage 0's mean (``spread0``), each step counts, per coordinate, the units
      below the midpoint (centred counts, noise z_b √p / 2 as in :func:`private_bounds`:
      the same mechanism, the stage's share of the counts) and keeps the half that holds
      the median.

    Returns (medians, diag(v), σ₀²): a preconditioner; the next stage re-releases the mean
    and covariance in its whitening.
    """
    n, p = coef.shape
    if n < 2:
        raise ValueError(f"release_moments: the scale stage needs >= 2 units, got {n}")
    noise0 = whiten.noise.to(F64).reshape(())
    d = coef[1:] - coef[:-1]  # the path's N − 1 terms
    ell = (0.5 * d * d).clamp_min(1e-300).log() - noise0.log()
    # one unit moves the ℓ-sum by ≤ 3·30 per coordinate (above): ‖Δ‖ ≤ 3·30·√p, the declared
    # bound (the sensitivity); each |ℓ_ij| ≤ 30 is clipped first, so it never binds
    declared = {"log_scale": Statistic(PATH_SENSITIVITY * LOG_NOISE_RANGE * math.sqrt(p))}
    replies = {"log_scale": ell.clamp(-LOG_NOISE_RANGE, LOG_NOISE_RANGE)}
    sums, metrics = private_sums(replies, declared, sigma, generator)
    var = noise0 * (sums["log_scale"] / (n - 1) - LOG_CHI2_1).exp()
    scale = var.sqrt()
    lo = whiten.mean - MEDIAN_WIDTH * (spread0 + scale)
    hi = whiten.mean + MEDIAN_WIDTH * (spread0 + scale)
    std = budget.counts * math.sqrt(p) / 2
    for _ in range(budget.steps):
        mid = 0.5 * (lo + hi)
        centred = (coef <= mid).sum(0).to(F64) - n / 2
        noisy = centred + std * torch.randn(p, generator=generator, dtype=F64)
        below = noisy / n + 0.5 >= 0.5  # half or more below: the median is at most mid
        hi = torch.where(below, mid, hi)
        lo = torch.where(below, lo, mid)
    return Whitening(0.5 * (lo + hi), torch.diag(var), whiten.noise), metrics


def _whitening(cov: Tensor) -> Tensor:
    """T = Λ^(−½) Wᵀ for C = W Λ Wᵀ: T C Tᵀ = I."""
    vals, vecs = torch.linalg.eigh(0.5 * (cov + cov.T))
    return (vecs / vals.clamp_min(1e-300).sqrt()).T


def _refine_leaves(z: Tensor, weak: Tensor) -> tuple[dict[str, Statistic], dict[str, Tensor]]:
    """A stage's statistics in the last whitening: the weak block's mean and second moment
    (its own bounds: its spread is far below the resolved block's, and one bound for both
    would bury it in noise), the resolved block's mean and the cross moment z_U z_Rᵀ.
    Declared bounds: twice the whitened dimension (‖z_U‖² ≤ 2 p_U, ‖z_R‖² ≤ 2 r)."""
    zu, zr = z[:, weak], z[:, ~weak]
    pu, r = zu.shape[1], zr.shape[1]
    declared = {
        "mean_u": Statistic(math.sqrt(2 * pu)),
        "second_u": Statistic(2.0 * pu, "second_moment", first="mean_u", noise_floor=True),
    }
    replies = {"mean_u": zu, "second_u": zu.unsqueeze(-1) * zu.unsqueeze(-2)}
    if r:
        declared["mean_r"] = Statistic(math.sqrt(2 * r))
        declared["cross"] = Statistic(2.0 * math.sqrt(pu * r))
        replies.update(mean_r=zr, cross=zu.unsqueeze(-1) * zr.unsqueeze(-2))
    return declared, replies


def _assemble(sums: dict[str, Tensor], weak: Tensor, n: int, level: float) -> tuple[Tensor, Tensor]:
    """The mean shift and the covariance, in the stage's whitening, from its released sums:
    the resolved block stays I (what the last release whitened to), the weak block and the
    cross block are the released centred moments; PSD, eigenvalues at least ``level``."""
    p = weak.shape[0]
    u, r = torch.nonzero(weak)[:, 0], torch.nonzero(~weak)[:, 0]
    shift = torch.zeros(p, dtype=F64)
    spread = torch.eye(p, dtype=F64)
    du = sums["mean_u"]
    shift[u] = du / n
    spread[u.unsqueeze(1), u.unsqueeze(0)] = (sums["second_u"] - torch.outer(du, du) / n) / n
    if len(r):
        dr = sums["mean_r"]
        shift[r] = dr / n
        cross = (sums["cross"] - torch.outer(du, dr) / n) / n
        spread[u.unsqueeze(1), r.unsqueeze(0)] = cross
        spread[r.unsqueeze(1), u.unsqueeze(0)] = cross.T
    return shift, psd_projection(spread, level)
