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

import math
from dataclasses import dataclass, replace

import torch

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
