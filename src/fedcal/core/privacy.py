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

The module gathers the names of three: :mod:`fedcal.core.dp_accounting` (the accountant,
a staged release's budget), :mod:`fedcal.core.dp_sums` (declared statistics clipped,
noised and projected; adaptive clipping) and :mod:`fedcal.core.dp_release` (the one-shot
staged release of a fleet's moments); callers import them from here.
"""

from __future__ import annotations

from fedcal.core.dp_accounting import (
    F64,
    PrivacySpent,
    StagedBudget,
    account,
    account_adaptive,
    composed_epsilon,
    epsilon_spent,
    noise_for_epsilon,
    staged_budget,
)
from fedcal.core.dp_release import (
    LOG_CHI2_1,
    LOG_NOISE_RANGE,
    MEDIAN_WIDTH,
    NOISE_RATIO_BOUND,
    PATH_SENSITIVITY,
    UNBOUNDED,
    Whitening,
    release_moments,
    release_order,
)
from fedcal.core.dp_sums import (
    NOISE_MARGIN,
    AdaptiveClip,
    Statistic,
    StatisticKind,
    clip_statistics,
    leaf_norms,
    noise_std,
    private_bounds,
    private_sums,
    project_sums,
    psd_projection,
    quantile_step,
)

__all__ = [
    "F64",
    "LOG_CHI2_1",
    "LOG_NOISE_RANGE",
    "MEDIAN_WIDTH",
    "NOISE_MARGIN",
    "NOISE_RATIO_BOUND",
    "PATH_SENSITIVITY",
    "UNBOUNDED",
    "AdaptiveClip",
    "PrivacySpent",
    "StagedBudget",
    "Statistic",
    "StatisticKind",
    "Whitening",
    "account",
    "account_adaptive",
    "clip_statistics",
    "composed_epsilon",
    "epsilon_spent",
    "leaf_norms",
    "noise_for_epsilon",
    "noise_std",
    "private_bounds",
    "private_sums",
    "project_sums",
    "psd_projection",
    "quantile_step",
    "release_moments",
    "release_order",
    "staged_budget",
]
