"""A stored prior made ready to score designs (:func:`planner`): its forecaster — NumPy, or
``calibrate``'s torch path for the priors NumPy does not cover — and the operating range's
nodes; :func:`plan_design`, the optimized design from Python."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from fedcal.planning.chamber import Chamber, Design, default_chamber, input_indices
from fedcal.planning.forecast import GRID, QUADRATURE, Planner, features
from fedcal.planning.search import Plan, optimize
from fedcal.prior.model import PriorModel
from fedcal.prior.plan import NumpyForecaster
from fedcal.prior.posterior import unsupported


def forecaster(prior: PriorModel, source: str = "prior.json") -> Any:
    """What forms a design's posterior: NumPy (:class:`fedcal.prior.plan.NumpyForecaster`)
    for the priors it covers; for the others ``calibrate``'s torch path
    (:class:`fedcal.planning_torch.TorchForecaster`), which needs ``fedcal[neural]``."""
    from fedcal.report.served import NeedsTorch, torch_available

    why = unsupported(prior)
    if not why:
        return NumpyForecaster(prior)
    if not torch_available():
        raise NeedsTorch(f"{source}: plan of {why}")
    from fedcal.planning_torch import TorchForecaster

    return TorchForecaster(prior)


def planner(
    prior: PriorModel,
    chamber: Chamber | None = None,
    quantile: float = 0.95,
    temperature_range: tuple[float, float] | None = None,
    forecast: Any = None,
) -> Planner:
    """Everything a design is scored with: the prior's forecaster and the range's grid.

    The operating range R is [min, max] of the chamber's pressures × the
    temperature range the fleet was calibrated over (the prior's ``input_range``;
    or ``temperature_range``): limiting the set points does not shrink where
    the unit will be used. ``forecast``: the forecaster (default :func:`forecaster`).
    """
    chamber = chamber or default_chamber(prior)
    if not 0.0 < quantile < 1.0:
        raise ValueError(f"quantile must be in (0, 1), got {quantile}")
    response, temperature = input_indices(prior)
    empty = np.zeros((0, 2))
    base = Planner(
        prior, forecast or forecaster(prior), chamber, response, temperature, empty,
        np.zeros(0), empty, quantile,
    )  # fmt: skip
    p_lo, p_hi = chamber.pressures[0], chamber.pressures[-1]
    t_lo, t_hi = temperature_range or prior.input_range[prior.features[temperature]]
    pp, tt = np.meshgrid(
        np.linspace(p_lo, p_hi, GRID[0]), np.linspace(t_lo, t_hi, GRID[1]), indexing="ij"
    )
    (pn, pw), (tn, tw) = (np.polynomial.legendre.leggauss(n) for n in QUADRATURE)
    qp, qt = np.meshgrid(
        p_lo + (p_hi - p_lo) * (pn + 1) / 2, t_lo + (t_hi - t_lo) * (tn + 1) / 2, indexing="ij"
    )
    return replace(
        base,
        field=features(base, qp.ravel(), qt.ravel()),
        weights=np.outer(pw, tw).ravel() / 4.0,
        grid=features(base, pp.ravel(), tt.ravel()),
    )


def plan_design(
    prior: PriorModel,
    plateaus: int,
    points: int,
    *,
    chamber: Chamber | None = None,
    start: Design | None = None,
    quantile: float = 0.95,
) -> Plan:
    """From Python (what ``FleetPrior.plan`` wires to): the optimized design of K plateaus
    and N points for a new unit under the stored ``prior`` (a loaded prior.json)."""
    return optimize(planner(prior, chamber, quantile), plateaus, points, start)
