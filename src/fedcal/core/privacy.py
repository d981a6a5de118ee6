"""Client-level differential privacy, by name: the accountant and a staged budget
(:mod:`fedcal.core.dp_accounting`, Opacus's RDP accountant), declared statistics clipped,
noised and projected with adaptive clipping (:mod:`fedcal.core.dp_sums`), and the staged
one-shot release of a fleet's moments (:mod:`fedcal.core.dp_release`). Callers import
them from here.
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
