"""Every method built for every fleet variant and calibration-point budget before anything
trains (its aggregation policy checked too): a method that cannot run is known before the
first round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedcal.build import (
    FleetOutline,
    build_algorithm,
    build_task,
    client_inputs,
    with_raw_column,
)
from fedcal.config import ConfigError, RunConfig
from fedcal.core.aggregation import AggregationError, check_policy
from fedcal.core.algorithm import Algorithm
from fedcal.core.task import Task
from fedcal.data.fleet import Fleet
from fedcal.engine.simulation import FleetTensors, prepare
from fedcal.experiment.plan import RunPlan
from fedcal.experiment.scoring import full_scale


@dataclass(frozen=True)
class Cell:
    """One fleet variant at one budget: its data as trained on, its task and its methods."""

    labels: dict[str, Any]  # the swept fields (design, fleet_seed), summary columns
    variant: Fleet | FleetOutline  # the fleet of the sweep
    train_points: int  # 0: all
    subset: Fleet | FleetOutline  # the variant with that budget of calibration points
    tensors: FleetTensors
    task: Task
    built: list[tuple[str, Algorithm]]
    full_scale: float  # the variant's calibrated span of the target (%FS)
    roles: dict[str, str] | None  # a mixed fleet's sensor → role


def cell_data(
    config: RunConfig, variant: Fleet | FleetOutline, tp: int
) -> tuple[Fleet | FleetOutline, FleetTensors]:
    """A variant's data at ``tp`` calibration points per sensor, and its tensors (an outline's
    as built)."""
    if isinstance(variant, FleetOutline):
        return variant, variant.tensors
    subset = variant.with_train_points(tp or None, seed=config.data.split_seed)
    return subset, prepare(subset, config.data.scaling, config.engine.dtype)


def build_cells(plan: RunPlan) -> tuple[list[Cell], dict[str, str]]:
    """Every (variant, budget) with its built methods, and the methods refused (method → the
    reason, the first met)."""
    config = plan.config
    cells, refused = [], {}
    for labels, variant in plan.variants:
        for tp in plan.train_points:
            subset, tensors = cell_data(config, variant, tp)
            inputs = client_inputs(tensors)
            task = build_task(config, tensors.train.x.shape[-1], subset.meta, inputs)
            built = []
            for method in plan.methods:
                try:
                    algorithm = build_algorithm(method, config, task)
                    algorithm = with_raw_column(algorithm, config, tensors)
                    check_policy(algorithm, plan.policy)
                except (ConfigError, AggregationError) as err:
                    refused.setdefault(method, str(err))
                    continue
                built.append((method, algorithm))
            scale, roles = full_scale(variant), variant.roles
            cells.append(Cell(labels, variant, tp, subset, tensors, task, built, scale, roles))
    return cells, refused
