"""Privacy accounting for client-level DP, by Opacus's RDP accountant.

One federated round of DP-FedAvg (McMahan et al. 2018) is one application of
the sampled Gaussian mechanism to the *clients*: each client's update is
clipped to L2 norm C, the sum gets N(0, σ²C²) noise, and a client takes part
with probability q (``participation``). Rényi-DP composition over rounds and
the conversion to (ε, δ) are Opacus's (``opacus.accountants.RDPAccountant``,
Mironov 2017; Mironov, Talwar & Zhang 2019; conversion of Balle et al. 2020),
an established, tested implementation rather than ours.

With ``participation = 1`` every client takes part every round and the
accountant is exact (the Gaussian mechanism, RDP α/2σ² per round). With
``participation < 1`` the engine draws a fixed-size cohort, while the
accountant assumes Poisson sampling with rate q; the reported ε is then the
customary approximation, and says so (``poisson_assumed``).
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor

F64 = torch.float64


@dataclass(frozen=True)
class PrivacySpent:
    epsilon: float
    delta: float
    noise_multiplier: float
    sample_rate: float
    rounds: int
    poisson_assumed: bool
    # adaptive clipping (:class:`AdaptiveClip`): the counts' noise multiplier and how many
    # counts each round releases (0: the bounds are declared, not adapted)
    count_multiplier: float = 0.0
    quantile_steps: int = 0


def epsilon_spent(noise_multiplier: float, sample_rate: float, rounds: int, delta: float) -> float:
    """ε after ``rounds`` sampled Gaussian mechanisms (σ, q), at δ (RDP accountant)."""
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = [(noise_multiplier, sample_rate, rounds)]
    return float(accountant.get_epsilon(delta=delta))


def noise_for_epsilon(epsilon: float, delta: float, sample_rate: float, rounds: int) -> float:
    """The smallest noise multiplier σ whose ε after ``rounds`` is at most ``epsilon``."""
    from opacus.accountants.utils import get_noise_multiplier

    if not epsilon > 0:
        raise ValueError(f"privacy epsilon = {epsilon}: expected > 0")
    if not 0 < delta < 1:
        raise ValueError(f"privacy delta = {delta}: expected 0 < δ < 1")
    return float(
        get_noise_multiplier(
            target_epsilon=epsilon,
            target_delta=delta,
            sample_rate=sample_rate,
            steps=rounds,
            accountant="rdp",
            epsilon_tolerance=0.001,
        )
    )


def account(epsilon: float, delta: float, sample_rate: float, rounds: int) -> PrivacySpent:
    """σ for a target ε and the ε actually spent with it (≤ the target)."""
    sigma = noise_for_epsilon(epsilon, delta, sample_rate, rounds)
    return PrivacySpent(
        epsilon=epsilon_spent(sigma, sample_rate, rounds, delta),
        delta=delta,
        noise_multiplier=sigma,
        sample_rate=sample_rate,
        rounds=rounds,
        poisson_assumed=sample_rate < 1.0,
    )


def composed_epsilon(mechanisms: list[tuple[float, float, int]], delta: float) -> float:
    """ε of a composition of sampled Gaussian mechanisms [(σ, q, steps), ...] at δ.

    Opacus's RDP accountant adds the mechanisms' RDP curves order by order before the
    conversion to (ε, δ) (RDP composition, Mironov 2017, Prop. 1): its ``history`` holds
    one (σ, q, steps) entry per kind of mechanism.
    """
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = [(float(s), float(q), int(n)) for s, q, n in mechanisms]
    return float(accountant.get_epsilon(delta=delta))


def account_adaptive(
    epsilon: float, delta: float, sample_rate: float, rounds: int, steps: int, share: float
) -> PrivacySpent:
    """σ of the sums and z_b of the clip counts that together spend at most ``epsilon``.

    Per round, one Gaussian mechanism on the sums (σ) and ``steps`` on the counts of
    adaptive clipping (z_b). The counts get the share ``share`` of the budget in RDP
    terms (Andrew et al. 2021, §3: σ_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2) splits one noise
    multiplier z between the two): 1/σ² = (1 − f)/z², steps/z_b² = f/z², with z the
    multiplier one mechanism per round would need. At q = 1 this is exact (the
    Gaussian's RDP α/2σ² adds up); the ε reported is Opacus's for the composed history.
    """
    if not 0 < share < 1:
        raise ValueError(f"privacy quantile_share = {share}: expected 0 < share < 1")
    if steps < 1:
        raise ValueError(f"privacy quantile_steps = {steps}: expected >= 1")
    z = noise_for_epsilon(epsilon, delta, sample_rate, rounds)

    def spent(scale: float) -> float:
        sums, counts = scale * z / math.sqrt(1 - share), scale * z * math.sqrt(steps / share)
        return composed_epsilon(
            [(sums, sample_rate, rounds), (counts, sample_rate, rounds * steps)], delta
        )

    # q < 1: the split is not exact; raise both multipliers together until ε fits.
    scale = 1.0
    while spent(scale) > epsilon:
        scale *= 1.001
    sigma = scale * z / math.sqrt(1 - share)
    count = scale * z * math.sqrt(steps / share)
    return PrivacySpent(
        epsilon=spent(scale),
        delta=delta,
        noise_multiplier=sigma,
        sample_rate=sample_rate,
        rounds=rounds,
        poisson_assumed=sample_rate < 1.0,
        count_multiplier=count,
        quantile_steps=steps,
    )


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
class StagedBudget:
    """Noise multipliers of a staged release that together spend ``epsilon`` at ``delta``.

    ``sums``: one multiplier per stage's sums; ``counts``: adaptive clipping's count
    multiplier z_b (0: declared bounds), ``steps`` counts per stage; ``base``: the
    multiplier z of a single Gaussian mechanism spending the whole budget; ``spent``: the
    ε of the composition by Opacus's RDP accountant.
    """

    epsilon: float
    delta: float
    sums: tuple[float, ...]
    counts: float
    steps: int
    base: float
    spent: float

    def mechanisms(self) -> list[tuple[float, float, int]]:
        """The composed history [(σ, q, steps), ...] (Opacus's RDP accountant's)."""
        out = [(s, 1.0, 1) for s in self.sums]
        if self.counts:
            out.append((self.counts, 1.0, len(self.sums) * self.steps))
        return out


def staged_budget(
    epsilon: float,
    delta: float,
    stages: int,
    first_share: float = 0.1,
    count_share: float = 0.0,
    steps: int = 12,
) -> StagedBudget:
    """Split one Gaussian mechanism's budget over ``stages`` releases (and their counts).

    The Gaussian mechanism with multiplier σ has RDP α/(2σ²) at every order α (Mironov 2017,
    Prop. 7), and RDP adds under composition (Prop. 1): releases with 1/z² = Σ_k 1/σ_k² +
    S·steps/z_b² spend exactly what one mechanism of multiplier z spends. The counts get
    ``count_share`` of 1/z²; of the rest, stage 0 gets ``first_share`` (with more than one
    stage) and the others equal parts.
    """
    if stages < 1:
        raise ValueError(f"privacy stages = {stages}: expected >= 1")
    if not 0 < first_share < 1:
        raise ValueError(f"privacy first_share = {first_share}: expected 0 < share < 1")
    if not 0 <= count_share < 1:
        raise ValueError(f"privacy count_share = {count_share}: expected 0 <= share < 1")
    z = noise_for_epsilon(epsilon, delta, 1.0, 1)
    rest = 1.0 - count_share
    if stages == 1:
        shares = [rest]
    else:
        shares = [rest * first_share] + [rest * (1 - first_share) / (stages - 1)] * (stages - 1)
    sums = tuple(z / math.sqrt(f) for f in shares)
    counts = z * math.sqrt(stages * steps / count_share) if count_share > 0 else 0.0
    budget = StagedBudget(epsilon, delta, sums, counts, steps, z, 0.0)
    return replace(budget, spent=composed_epsilon(budget.mechanisms(), delta))


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
    n, p = coef.shape
    coef, noise_var = coef.to(F64), noise_var.to(F64)
    plain = budget is None
    if plain:  # bounds no unit reaches, no noise
        budget = StagedBudget(0.0, 0.0, (0.0,) * (1 if whiten else 2 + scales), 0.0, 1, 0.0, 0.0)
        quantile = 0.0
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
    metrics: dict[str, float] = {}
    if scales:  # the scale stage's path: a public order of the units, fixed before stage 0
        order = release_order(range(n) if keys is None else keys, generator)
        coef, noise_var = coef[order], noise_var[order]
        metrics["scales/keyed"] = float(keys is not None)
    stages = list(budget.sums)
    if whiten is None:  # stage 0: the mean and the log noise, in the vague start's units
        s = start_scale
        # ‖c‖ ≤ 2√p s in the start's units is ‖c / s‖ ≤ 2√p in the transformed leaf's
        declared = {
            "mean": Statistic(2 * math.sqrt(p), transform=torch.tensor(1.0 / s, dtype=F64)),
            "log_noise": Statistic(
                LOG_NOISE_RANGE, center=torch.tensor([2 * math.log(start_noise)], dtype=F64)
            ),
        }
        if plain:
            declared = {k: replace(v, bound=UNBOUNDED) for k, v in declared.items()}
        replies = {"mean": coef, "log_noise": noise_var.log().unsqueeze(-1)}
        sigma0 = stages.pop(0)
        sums, m = _stage(replies, declared, sigma0, budget, quantile, generator)
        metrics.update({f"stage0/{k}": v for k, v in m.items()})
        whiten = Whitening(sums["mean"] / n, None, (sums["log_noise"][0] / n).exp())
        if scales:
            spread0 = (
                sigma0 * math.sqrt(2) * m.get("dp_bound/mean", 2 * math.sqrt(p)) * start_scale / n
            )
            whiten, m = _scale_stage(coef, whiten, spread0, stages.pop(0), budget, generator)
            metrics.update({f"scales/{k}": v for k, v in m.items()})
    # z = T(c − μ): the last release's whitening; ``weak``: its coordinates whose variance the
    # noise hid (raised to the floor), where the units' whitened spread is far below 1
    outer = None
    if scales and relevant > 0:  # refine the block the units' points can resolve
        var = whiten.cov.diagonal()
        keep = (var >= relevant * whiten.noise) | (var == var.max())  # at least the widest
        outer = (whiten, keep)
        coef = coef[:, keep]
        whiten = Whitening(whiten.mean[keep], whiten.cov[keep][:, keep], whiten.noise)
        p = int(keep.sum())
        metrics["scales/refined"] = float(p)
    t = torch.eye(p, dtype=F64) / start_scale if whiten.cov is None else _whitening(whiten.cov)
    weak = torch.ones(p, dtype=torch.bool)
    for k, sigma in enumerate(stages, start=1):
        last = k == len(stages)
        if not bool(weak.any()) or (last and refresh_last):  # all resolved, or asked
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
        if plain:
            declared = {key: replace(v, bound=UNBOUNDED) for key, v in declared.items()}
        sums, m = _stage(replies, declared, sigma, budget, quantile, generator)
        metrics.update({f"stage{k}/{key}": v for key, v in m.items()})
        # the weak block's floor per unit: NOISE_MARGIN × the noise's spectral norm / N
        bound = m.get("dp_bound/second_u", declared["second_u"].bound)
        std = sigma * math.sqrt(len(declared)) * bound
        level = NOISE_MARGIN * std * math.sqrt(2 * int(weak.sum())) / n
        shift, spread = _assemble(sums, weak, n, max(level, floor))
        t_inv = torch.linalg.inv(t)
        mean = whiten.mean + t_inv @ shift
        cov = psd_projection(t_inv @ spread @ t_inv.T, floor)
        noise = sums["noise"] / n if last else whiten.noise
        vals, vecs = torch.linalg.eigh(spread)  # ascending
        # the next weak block: as many directions as the weak block's eigenvalues the noise
        # hid (raised to its floor), the smallest of the assembled spread
        block = spread[weak][:, weak]
        hidden = int((torch.linalg.eigvalsh(block) <= level * (1 + 1e-6)).sum()) if level else 0
        weak = torch.arange(p) < hidden
        t = (vecs / vals.clamp_min(floor).sqrt()).T @ t  # Λ^(−½) Wᵀ T: the next whitening
        whiten = Whitening(mean, cov, noise)
    if outer is not None:  # the refined block back among the scale stage's coordinates
        start, keep = outer
        idx = torch.nonzero(keep)[:, 0]
        mean, cov = start.mean.clone(), start.cov.clone()
        mean[idx] = whiten.mean
        cov[idx.unsqueeze(1), idx.unsqueeze(0)] = whiten.cov
        whiten = Whitening(mean, psd_projection(cov, floor), whiten.noise)
    return whiten, metrics


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
