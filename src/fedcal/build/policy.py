"""The server's aggregation policy and privacy accounting (δ = 1/N² unless set), and the
engine's settings, from the configuration.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fedcal.config import ConfigError, RunConfig
from fedcal.core.aggregation import AggregationError, AggregationPolicy

# δ when [privacy] delta is omitted and the number of units is not known before the run
# (a Flower server), and the largest default δ of any fleet (1/N² above it for N < 317)
UNKNOWN_UNITS_DELTA = 1e-5


def privacy_delta(config: RunConfig, units: int | None) -> tuple[float, str]:
    """δ and how it was chosen: ``[privacy] delta`` if set, else min(1/N², 1e-5) with N the
    run's ``units`` (δ well below 1/N: a mechanism that released one unit's data whole with
    probability δ would expose 1/N of the fleet in expectation; the 1e-5 cap keeps a small
    fleet from a meaningless δ such as 1/9 for 3 units), else UNKNOWN_UNITS_DELTA."""
    if config.privacy.delta is not None:
        return config.privacy.delta, "set in [privacy] delta"
    if units and 1.0 / units**2 < UNKNOWN_UNITS_DELTA:
        return 1.0 / units**2, f"1/N^2, N = {units} units"
    if units:
        return UNKNOWN_UNITS_DELTA, f"1e-5 (1/N^2 would be larger: N = {units} units)"
    return UNKNOWN_UNITS_DELTA, "1e-5: the number of units is not known before the run"


def _account(config: RunConfig, delta: float):
    """The accountant's split: the sums' σ alone, or with adaptive clipping's counts."""
    from fedcal.core.privacy import account, account_adaptive

    p, e = config.privacy, config.engine
    if p.quantile > 0:
        args = (p.epsilon, delta, e.participation, e.rounds, p.quantile_steps, p.quantile_share)
        return account_adaptive(*args)
    return account(p.epsilon, delta, e.participation, e.rounds)


def build_policy(
    config: RunConfig, units: int | None = None
) -> tuple[AggregationPolicy, dict[str, Any]]:
    """The server's aggregation policy, with DP noise calibrated by the accountant.

    ``units``: the run's number of units N (δ = 1/N² when ``[privacy] delta`` is omitted;
    :func:`privacy_delta`). Returns the policy and what the run records about privacy
    (empty without DP).
    """
    a, p = config.aggregation, config.privacy
    privacy: dict[str, Any] = {}
    adaptive: dict[str, Any] = {}
    sigma, secret = 0.0, None
    if p.epsilon > 0:
        if p.clip <= 0:
            raise ConfigError("[privacy] clip: epsilon > 0 needs clip > 0 (the update norm bound)")
        try:
            delta, rule = privacy_delta(config, units)
            spent = _account(config, delta)
        except ValueError as err:
            raise ConfigError(f"[privacy]: {err}") from None
        sigma = spent.noise_multiplier
        privacy = {**asdict(spent), "clip": p.clip, "accountant": "opacus RDP", "noise": p.noise}
        privacy["delta_rule"] = rule
        if p.noise == "secret":  # drawn here, never recorded (config.PrivacySection.noise)
            import secrets

            secret = secrets.randbits(63)
        if p.quantile > 0:
            privacy.update(quantile=p.quantile, quantile_share=p.quantile_share)
            adaptive = dict(
                dp_quantile=p.quantile,
                dp_quantile_steps=p.quantile_steps,
                dp_quantile_rate=p.quantile_rate,
                dp_count_multiplier=spent.count_multiplier,
            )
    try:
        policy = AggregationPolicy(
            **asdict(a),
            dp_noise_multiplier=sigma,
            dp_clip=p.clip if sigma else 0.0,
            dp_noise_secret=secret,
            **adaptive,
        )
    except AggregationError as err:
        raise ConfigError(f"[aggregation]: {err}") from None
    return policy, privacy


def engine_settings(config: RunConfig) -> dict[str, Any]:
    """``[engine]`` as keyword arguments of the engine's EngineConfig (its EngineSettings).

    The run loop adds the seed and the aggregation policy; ``checkpoint_every`` is an
    argument of the loop, not of the engine's config.
    """
    return {k: v for k, v in asdict(config.engine).items() if k != "checkpoint_every"}
