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

from dataclasses import dataclass


@dataclass(frozen=True)
class PrivacySpent:
    epsilon: float
    delta: float
    noise_multiplier: float
    sample_rate: float
    rounds: int
    poisson_assumed: bool


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
