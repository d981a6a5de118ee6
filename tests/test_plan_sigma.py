"""``plan``'s forecast σ is the σ ``calibrate`` then states for the same design (issue 33).

A prior from 12 fully calibrated units + 4 units of the 3x2 design (so the fleet learned
the model error τ² of 6-point designs); ``plan`` chooses a 2-plateau, 8-point design and
forecasts its RMS σ over the operating range; 20 new units are then measured at exactly
that design (the simulator's ``design_points``) and calibrated against the same prior.
Their stated σ, at the planner's own quadrature nodes of the range, has an RMS over units
within 10 % of the forecast (both come from :func:`fedcal.calibration.unit_posteriors`; the
forecast takes the fleet's σ², the expected value of each unit's own noise fixed point).
Measured (fleet seeds 3–5, 20 units, designs 2×8, 3×12, 2×6): ratio 1.002–1.005 for
fedprior; 0.969–1.012 for fedprior_branch, whose units' σ differ with their direction term
(3×12: 0.024–0.076 hPa around a forecast of 0.048) while the forecast is the fleet's mean.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcal import calibration, planning
from fedcal.api import FleetPrior
from fedcal.core.bayes import F64
from fedcal.data.simulator import FleetSpec, simulate_fleet

UNITS = 20


@pytest.fixture(scope="module", params=["fedprior", "fedprior_branch"])
def prior(request):
    spec = FleetSpec(num_reference=12, num_new=4, train_design="3x2")
    return FleetPrior(method=request.param, rounds=30).fit(simulate_fleet(spec, seed=3).frame)


def stated_rms(units, plan: planning.Planner) -> np.ndarray:
    """Each unit's stated σ, RMS over the planner's quadrature of the range (target units)."""
    result = units.result
    field = plan.field.unsqueeze(0).expand(result.tensors.num_clients, -1, -1)
    with torch.no_grad():
        sd = result.algorithm.predictive_std(result.personal, field)[..., 0].to(F64)
    return (sd**2 @ plan.weights).sqrt().numpy() * plan.y_scale


def test_the_forecast_sigma_is_within_10_percent_of_what_calibrate_states(prior):
    plan = planning.planner(prior.model_)
    chosen = planning.optimize(plan, plateaus=2, points=8).design
    forecast = planning.evaluate(plan, chosen)
    assert not forecast.declined  # 8 points ≥ the fleet's smallest design: a stated σ
    points = tuple(
        (float(r.pressure_hpa), float(r.temperature_c), str(r.direction))
        for r in chosen.frame().itertuples()
    )
    spec = FleetSpec(num_sensors=UNITS, train_design="points", design_points=points)
    frame = simulate_fleet(spec, seed=11).frame
    units = prior.calibrate(frame[frame["split"] == "train"])
    assert (units.result.tensors.train.count.numpy() == 8).all()
    assert not bool((units.result.personal.get("declined", torch.zeros(1)) > 0).any())
    stated = stated_rms(units, plan)
    ratio = float(np.sqrt(np.mean(stated**2))) / forecast.rms
    assert abs(ratio - 1.0) < 0.10, (ratio, forecast.rms, stated)


def test_the_planner_forms_the_posterior_with_calibrate_s_own_function(prior, monkeypatch):
    """Whatever calibrate's σ is made of reaches the forecast: a term added in
    :func:`calibration.unit_posteriors` moves the planner's σ by exactly that term."""
    plan = planning.planner(prior.model_)
    design = planning.grid_design(plan.chamber, 4, 3)
    before = planning.expected_variance(plan, [design])[0]
    original = calibration.unit_posteriors
    extra = 1e-3  # scaled units²

    def wider(algorithm, server, data, noise_var=None):
        params = original(algorithm, server, data, noise_var)
        return {**params, "noise_var": params["noise_var"] + extra}

    monkeypatch.setattr(planning, "unit_posteriors", wider)
    after = planning.expected_variance(plan, [design])[0]
    torch.testing.assert_close(after - before, torch.full_like(before, extra), rtol=0, atol=1e-9)
