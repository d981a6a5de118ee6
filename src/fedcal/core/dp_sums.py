"""Client-level DP for sums of statistics: each declared statistic transformed, clipped,
noised and projected back to valid values (the section comment below), and the clip
bounds adapted by private quantile estimation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor

from fedcal.core.dp_accounting import F64

# ---- client-level DP for sums of statistics -------------------------------------------
#
# A "sum" server (fedprior) adds statistics of very different scale and kind: a
# posterior mean, a second moment m mᵀ + V, GLS terms that grow like Σ⁻¹, an RSS,
# a row count, a Gram matrix. One clip bound on their joint norm cannot fit them
# (they differ by 10¹¹ in scale), and Gaussian noise on a second moment breaks its
# positive semi-definiteness, so the M-step's Cholesky fails. Instead:
#
# 1. each statistic l is declared with a public map T_l (from the broadcast only, never
#    from a client's data) that makes it O(1), and a bound B_l on one client's ‖T_l x_il‖;
# 2. each client's transformed statistic is clipped to B_l, so the client's contribution,
#    with leaf l divided by B_l, has L2 norm at most √L (L statistics): the joint
#    sensitivity of the whole reply;
# 3. the sum of leaf l gets N(0, (σ √L B_l)²) noise per coordinate — the Gaussian
#    mechanism with noise multiplier σ on the normalized reply (DP-FedAvg's accounting
#    applies unchanged);
# 4. the noisy sums are projected to valid values (post-processing, no privacy cost):
#    symmetric PSD matrices, positive counts, a second moment at least the outer
#    product of its first moment over the count, and eigenvalues the noise hides set
#    to a declared value;
# 5. the sums are mapped back with T_l⁻¹.

# Eigenvalues within this factor of the noise's spectral norm count as noise: the largest
# eigenvalue of pure noise fluctuates around s √(2p), and a direction that only noise
# "resolved" would be learned from noise.
NOISE_MARGIN = 2.0

StatisticKind = Literal["vector", "psd", "positive", "second_moment"]


@dataclass(frozen=True)
class Statistic:
    """How one summed statistic is bounded, noised and made valid under client-level DP.

    ``bound``: L2 (Frobenius) bound on one client's transformed leaf. ``transform``:
    a public map T — a 0-d tensor multiplies the leaf; a (p, p) matrix maps a vector
    leaf to T (x − center) and a matrix leaf to T X Tᵀ. ``kind``: ``"vector"`` (any
    values), ``"psd"`` (a symmetric positive semi-definite matrix), ``"positive"``
    (a value ≥ 0), ``"second_moment"`` (Σ_i E[c_i c_iᵀ], taken about ``center`` like
    its first moment, the leaf named ``first``, which must have the same transform and
    center). ``minimum`` / ``maximum``: per client, the floor and ceiling of a positive
    value or of a PSD eigenvalue (the projected sum lies within the count times them).
    ``noise_floor``: a PSD or second-moment sum's eigenvalues are also raised to
    ``NOISE_MARGIN`` × the spectral norm of the noise added to it, s √(2p) for noise
    std s on p × p entries (eigenvalues below it cannot be told from noise; raising
    them keeps a noisy covariance vague rather than falsely certain).
    ``unresolved``: per client, the value such an eigenvalue takes instead of the
    floor when it is below the floor (e.g. the vague start a prior had before any
    data: what cannot be resolved is not learned, and is at most the floor).
    ``ratio`` (leaf, low, high): a positive sum lies within [low, high] × the
    (projected, transformed) sum of that leaf (e.g. a residual sum within a floor
    and a ceiling variance × the rows). ``weight``: see :func:`noise_std`.
    """

    bound: float
    kind: StatisticKind = "vector"
    transform: Tensor | None = None
    center: Tensor | None = None
    first: str | None = None
    minimum: float = 0.0
    maximum: float | None = None
    noise_floor: bool = False
    unresolved: float | None = None
    ratio: tuple[str, float, float] | None = None
    weight: float = 1.0  # the statistic's share of the noise budget (:func:`noise_std`)


def _forward(x: Tensor, stat: Statistic, first: Tensor | None = None) -> Tensor:
    """The transformed leaf of each client: x (clients, ...) → T(x) (clients, ...)."""
    t, c = stat.transform, stat.center
    x = x.to(F64)
    if stat.kind == "second_moment":
        # E[(c − c0)(c − c0)ᵀ] = S − c0 mᵀ − m c0ᵀ + c0 c0ᵀ, from the client's own m.
        if c is not None:
            c = c.to(F64)
            outer = c.unsqueeze(-1) * first.to(F64).unsqueeze(-2)
            x = x - outer - outer.transpose(-2, -1) + torch.outer(c, c)
        return x if t is None else t.to(F64) @ x @ t.to(F64).T
    if c is not None:
        x = x - c.to(F64)
    if t is None:
        return x
    if t.dim() == 0:
        return x * t.to(F64)
    if x.dim() == 2:
        return x @ t.to(F64).T
    return t.to(F64) @ x @ t.to(F64).T


def _backward(total: Tensor, stat: Statistic, count: int, first_sum: Tensor | None) -> Tensor:
    """The sum in the leaf's own coordinates from the sum of transformed leaves."""
    t, c = stat.transform, stat.center
    if t is not None and t.dim() == 0:
        total = total / t.to(F64)
    elif t is not None:
        t_inv = torch.linalg.inv(t.to(F64))
        total = t_inv @ total if total.dim() == 1 else t_inv @ total @ t_inv.T
    if c is None:
        return total
    c = c.to(F64)
    if stat.kind == "second_moment":
        outer = torch.outer(c, first_sum)
        return total + outer + outer.T - count * torch.outer(c, c)
    return total + count * c


def clip_statistics(
    replies: dict[str, Tensor], declared: dict[str, Statistic], scale: float = 1.0
) -> tuple[dict[str, Tensor], Tensor]:
    """Each client's transformed statistics, each clipped to ``scale`` × its bound.

    Returns the clipped transformed leaves (clients, ...) in float64 and, per client,
    how many of its statistics were clipped (clients,).
    """
    undeclared = sorted(set(replies) - set(declared))
    if undeclared:
        raise ValueError(f"privacy: statistics {undeclared} have no declared bound")
    out: dict[str, Tensor] = {}
    clipped = None
    for key, stat in declared.items():
        first = replies[stat.first] if stat.first else None
        x = _forward(replies[key], stat, first)
        n = x.shape[0]
        norms = x.reshape(n, -1).norm(dim=1)
        bound = stat.bound * scale
        factor = torch.where(norms > bound, bound / norms.clamp_min(1e-300), 1.0)
        out[key] = x * factor.reshape(n, *([1] * (x.dim() - 1)))
        hit = (norms > bound).to(torch.int64)
        clipped = hit if clipped is None else clipped + hit
    return out, clipped


def noise_std(declared: dict[str, Statistic], noise_multiplier: float, scale: float = 1.0):
    """Per statistic, the noise std σ √(Σ_j w_j²) B_l / w_l on its transformed sum.

    Leaf l enters the normalized reply as w_l x_l / B_l (``weight`` w_l, 1 by default),
    so the reply's L2 sensitivity is √(Σ_j w_j²) (√L with unit weights) and the Gaussian
    mechanism with multiplier σ adds σ √(Σ_j w_j²) to each normalized coordinate: a
    larger weight gives a statistic a larger share of the same budget.
    """
    joint = math.sqrt(sum(s.weight**2 for s in declared.values()))
    return {k: noise_multiplier * joint * s.bound * scale / s.weight for k, s in declared.items()}


def project_sums(
    sums: dict[str, Tensor],
    declared: dict[str, Statistic],
    count: int,
    stds: dict[str, float] | None = None,
) -> dict[str, Tensor]:
    """Noisy transformed sums → valid values (symmetric PSD, positive, moment order).

    ``stds``: the noise std of each sum, for the statistics declared with ``noise_floor``.
    """
    out = dict(sums)
    for key, stat in declared.items():
        x = sums[key]
        low = stat.minimum * count
        below = None
        if stat.noise_floor and stds and x.dim() == 2:
            low = max(low, NOISE_MARGIN * stds[key] * math.sqrt(2 * x.shape[0]))
            # What the noise hides is at most the floor: the declared value when smaller.
            below = None if stat.unresolved is None else min(low, stat.unresolved * count)
        high = None if stat.maximum is None else stat.maximum * count
        if stat.kind == "positive":
            out[key] = x.clamp(min=low, max=high)
        elif stat.kind == "psd" and stat.center is not None:
            # A centred PSD leaf (T(X − C)Tᵀ): the sum plus k·TCTᵀ is what must be PSD.
            shift = count * _forward(stat.center.unsqueeze(0), replace(stat, center=None))[0]
            out[key] = psd_projection(x + shift, low, high, below) - shift
        elif stat.kind == "psd":
            out[key] = psd_projection(x, low, high, below)
        elif stat.kind == "second_moment":
            # Σ_i z_i z_iᵀ ⪰ (Σ_i z_i)(Σ_i z_i)ᵀ / k (Cauchy–Schwarz): project the centred part.
            d = out[stat.first]
            centred = psd_projection(x - torch.outer(d, d) / count, low, high, below)
            out[key] = centred + torch.outer(d, d) / count
    for key, stat in declared.items():
        if stat.ratio is not None:
            other, low, high = stat.ratio
            out[key] = out[key].clamp(min=low * out[other], max=high * out[other])
    return out


def psd_projection(
    matrix: Tensor, floor: float = 0.0, ceiling: float | None = None, below: float | None = None
) -> Tensor:
    """The nearest symmetric matrix (Frobenius) with eigenvalues in [floor, ceiling].

    A floor above the ceiling gives way to the ceiling. With ``below``, eigenvalues
    under the floor are set to ``below`` instead of raised to the floor.
    """
    sym = 0.5 * (matrix + matrix.T)
    vals, vecs = torch.linalg.eigh(sym)
    raised = vals.clamp_min(floor) if below is None else torch.where(vals < floor, below, vals)
    vals = raised if ceiling is None else raised.clamp(max=ceiling)
    out = vecs @ torch.diag(vals) @ vecs.T
    return 0.5 * (out + out.T)


# ---- adaptive clipping by private quantile estimation ----------------------------------


@dataclass(frozen=True)
class AdaptiveClip:
    """Adaptive clipping (Andrew, Thakkar, McMahan & Ramaswamy 2021): each statistic's
    bound moves toward the ``quantile`` γ of the clients' norms by ``steps`` geometric
    updates per round (:func:`quantile_step`, initial rate η = ``rate``), each from a
    fresh noisy count of the clients under the bound (noise multiplier
    ``count_multiplier``). See :func:`private_bounds` for the step-size rule.
    """

    quantile: float
    count_multiplier: float
    steps: int = 12
    rate: float = 2.0


def quantile_step(bound: float, fraction: float, quantile: float, rate: float) -> float:
    """Andrew et al. 2021, eq. (2), the geometric update C ← C · exp(−η (b̄ − γ)).

    b̄: the (noisy) fraction of clients whose norm is at most C; the update lowers C
    when more than γ of them are under it and raises it when fewer are.
    """
    return bound * math.exp(-rate * (fraction - quantile))


def private_bounds(
    norms: dict[str, Tensor],
    start: dict[str, float],
    clip: AdaptiveClip,
    generator: torch.Generator,
) -> dict[str, float]:
    """Each statistic's bound after ``clip.steps`` noisy geometric updates (Andrew et al.).

    At each step every client's bit b_il = 1[‖T_l x_il‖ ≤ C_l] is counted, centred as
    b − ½ (one client changes each count by ½: Andrew et al. §3), and the L counts get
    N(0, (z_b √L / 2)²) each: a Gaussian mechanism with noise multiplier z_b on the L
    counts jointly (L2 sensitivity √L/2), which :func:`account_adaptive` accounts.

    Step size (ours; Andrew et al. run a constant η over hundreds of rounds, a fleet
    prior converges in a few): η is divided by 1 − γ when lowering C and by γ when
    raising it, so either way one step moves C by at most e^η, and η halves each time
    the direction flips (the update then brackets the quantile, as a bisection in
    log C would). Every round starts from the declared bound (× the policy's scale),
    and a bound never exceeds it (the declared worst case is already a valid bound).
    The number of clients k is taken as public, as in the sums' projection.
    """
    keys = list(norms)
    k = next(iter(norms.values())).shape[0]
    std = clip.count_multiplier * math.sqrt(len(keys)) / 2
    gamma = clip.quantile
    bounds, rates = dict(start), dict.fromkeys(keys, clip.rate)
    going: dict[str, float] = {}
    for _ in range(clip.steps):
        for key in keys:  # declaration order: the same draws for the same declaration
            centred = float((norms[key] <= bounds[key]).sum()) - k / 2
            noisy = centred + std * float(torch.randn((), generator=generator, dtype=F64))
            fraction = noisy / k + 0.5
            sign = math.copysign(1.0, fraction - gamma)
            if key in going and going[key] != sign:
                rates[key] /= 2
            going[key] = sign
            scale = (1 - gamma) if sign > 0 else gamma
            step = quantile_step(bounds[key], fraction, gamma, rates[key] / scale)
            bounds[key] = min(step, start[key])
    return bounds


def leaf_norms(replies: dict[str, Tensor], declared: dict[str, Statistic]) -> dict[str, Tensor]:
    """Per statistic, each client's norm ‖T_l x_il‖ in its declared coordinates."""
    out = {}
    for key, stat in declared.items():
        first = replies[stat.first] if stat.first else None
        x = _forward(replies[key], stat, first)
        out[key] = x.reshape(x.shape[0], -1).norm(dim=1)
    return out


def private_sums(
    replies: dict[str, Tensor],
    declared: dict[str, Statistic],
    noise_multiplier: float,
    generator: torch.Generator,
    scale: float = 1.0,
    adaptive: AdaptiveClip | None = None,
) -> tuple[dict[str, Tensor], dict[str, float]]:
    """Clip, sum, noise, project and map back a cohort's statistics (steps 1–5 above).

    ``replies`` (clients, ...) per statistic; returns the private sums (no clients
    axis, float64) and metrics: how many (client, statistic) pairs were clipped and
    the noise multiplier on the joint normalized reply. With ``adaptive``, the bounds
    (declared × ``scale`` at the start) are first adapted by :func:`private_bounds`
    (their noisy counts come first from ``generator``); the metrics then give each
    adapted bound as ``dp_bound/<statistic>`` (a released, private value).
    """
    count = next(iter(replies.values())).shape[0]
    adapted = {}
    if adaptive is not None:
        start = {key: stat.bound * scale for key, stat in declared.items()}
        adapted = private_bounds(leaf_norms(replies, declared), start, adaptive, generator)
        declared = {key: replace(stat, bound=adapted[key]) for key, stat in declared.items()}
        scale = 1.0
    clipped, hits = clip_statistics(replies, declared, scale)
    stds = noise_std(declared, noise_multiplier, scale)
    noisy = {}
    for key in declared:  # declaration order: the same draws for the same declaration
        total = clipped[key].sum(0)
        noise = torch.randn(total.shape, generator=generator, dtype=F64)
        noisy[key] = total + stds[key] * noise
    valid = project_sums(noisy, declared, count, stds)
    out = {}
    for key, stat in declared.items():
        first = out.get(stat.first) if stat.first else None
        if stat.first and first is None:
            first = _backward(valid[stat.first], declared[stat.first], count, None)
        out[key] = _backward(valid[key], stat, count, first)
    metrics = {"dp_clipped_statistics": float(hits.sum()), "dp_statistics": float(len(declared))}
    metrics.update({f"dp_bound/{key}": bound for key, bound in adapted.items()})
    return out, metrics
