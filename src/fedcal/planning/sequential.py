"""Sequential mode: whether a unit part-way through its calibration meets the spec, and
else its next chamber points, chosen by the reduction of J per chamber minute."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from fedcal.planning.chamber import Chamber, Design, snap
from fedcal.planning.forecast import Expected, Planner, pack, posteriors
from fedcal.prior.plan import Base, Forecast


@dataclass(frozen=True)
class NextStep:
    now: Expected  # the unit as it is (its actual posterior)
    done: bool  # its predicted RMS σ over the range meets the spec
    steps: tuple[tuple[float, float, str, float, float], ...]  # (P, T, dir, RMS σ after, min)


def _candidates(ch: Chamber, current: float | None) -> tuple[list, np.ndarray]:
    """Every chamber point (P, T, direction) and its cost in minutes: a point on the current
    plateau (set point ``current``) costs point_minutes, one on another also plateau_minutes."""
    cands, costs = [], []
    for t in ch.temperatures:
        same = current is not None and abs(t - current) < 1e-9
        for p in ch.pressures:
            for s in ch.directions:
                cands.append((p, t, s))
                costs.append(ch.point_minutes + (0.0 if same else ch.plateau_minutes))
    return cands, np.array(costs)


def next_points(
    plan: Planner,
    base: Base,
    now: Forecast,
    spec: float,
    count: int = 1,
    current: float | None = None,
) -> NextStep:
    """Whether the unit meets ``spec`` (its actual posterior ``now``'s RMS predictive σ over
    the range), and if not the next ``count`` points, chosen greedily by the reduction of J
    per chamber minute (:func:`_candidates`; ``current``: the unit's last temperature
    snapped to the chamber). Candidate points' responses are the unit's own posterior
    mean's."""
    var = float(now.variance(plan.field)[0] @ plan.weights)
    worst = float(now.variance(plan.grid)[0].max())
    nan = float("nan")
    state = Expected(
        var**0.5 * plan.y_scale, worst**0.5 * plan.y_scale, nan, nan, 0.0, 0, len(base.x)
    )
    if not math.isfinite(state.rms):  # the prior states no interval for this unit's design
        raise ValueError(
            "the prior states no predictive σ for this unit (its interval is declined: "
            "see the prior's interval reason), so no next point can be chosen by it"
        )
    if state.rms <= spec:
        return NextStep(state, True, ())
    # the unit's own coefficients solve its candidate points' inputs (a cache of its own)
    own = replace(plan, coef=base.coef, cache={}, table=[])
    value = var
    chosen: list[tuple[float, float, str]] = []
    steps = []
    for _ in range(count):
        cands, costs = _candidates(plan.chamber, current)
        designs = [as_design([*chosen, c]) for c in cands]
        j = posteriors(plan, *pack(own, designs), base).variance(plan.field) @ plan.weights
        i = int(np.argmax((value - j) / costs))
        chosen.append(cands[i])
        value = float(j[i])
        current = cands[i][1]
        steps.append((*cands[i], value**0.5 * plan.y_scale, float(costs[i])))
        if value**0.5 * plan.y_scale <= spec:
            break
    return NextStep(state, False, tuple(steps))


def as_design(points: list[tuple[float, float, str]]) -> Design:
    temps = tuple(dict.fromkeys(t for _, t, _ in points))
    return Design(temps, tuple((temps.index(t), p, s) for p, t, s in points))


def unit_next(
    plan: Planner, fleet: Any, spec: float, count: int = 1, source: str = "unit"
) -> NextStep:
    """Sequential mode for the one unit of ``fleet`` (its calibration points so far): its
    actual posterior under the prior (``calibrate``'s: the planner's forecaster), whether it
    meets ``spec``, and else its next ``count`` points (:func:`next_points`). The current
    plateau is the set point nearest its last point's temperature."""
    if fleet.num_clients != 1:
        raise ValueError(f"{source}: holds {fleet.num_clients} units; --next takes one unit")
    base, now = plan.forecaster.unit(fleet, source)
    rows = fleet.frame[fleet.frame["split"] == "train"]
    last = float(rows[plan.prior.features[plan.temperature]].iloc[-1])
    current = snap(np.array([last]), plan.chamber.temperatures)[0]
    return next_points(plan, base, now, spec, count, current)
