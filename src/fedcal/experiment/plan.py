"""The run planned before anything trains: the configuration's checks, the fleet variants
of the sweeps, the aggregation policy and privacy (bad input stops here, before anything
is written), then the run directory opened (config.json, fleet.json, privacy.json).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedcal.build import (
    FleetOutline,
    build_policy,
    check_fit,
    check_methods,
    fleet_variants,
    refuse_unprivate_scaling,
    run_record,
    task_kind,
)
from fedcal.config import ConfigError, RunConfig
from fedcal.core import runnames
from fedcal.core.aggregation import AggregationPolicy
from fedcal.data.fleet import Fleet
from fedcal.experiment.rundir import _check_same_run, _data_digest, _provenance, _write_text


@dataclass(frozen=True)
class RunPlan:
    """What a run is, checked: the methods as resolved, the fleet variants, the budgets, the
    aggregation policy and its privacy record, where it is written."""

    config: RunConfig
    out: Path
    methods: list[str]
    train_points: Sequence[int]
    expand_all: bool  # methods=["all"]: a method that cannot run is skipped, not an error
    variants: list[tuple[dict[str, Any], Fleet]]
    policy: AggregationPolicy
    privacy: dict[str, Any] | None


def plan_run(
    config: RunConfig,
    fleet: Fleet | FleetOutline,
    out: Path,
    methods: Sequence[str],
    train_points: Sequence[int],
) -> RunPlan:
    """The run's checks, before anything is written; δ = 1/N² for N units unless set;
    ``[engine] eval_every = "auto"`` resolved from the fleet's units (the value used is the
    one config.json records)."""
    config = with_eval_every(config, fleet.num_clients)
    if isinstance(fleet, FleetOutline) and any(train_points):
        raise ConfigError("train_points need the fleet's frame: load the file whole")
    expand_all = list(methods) == ["all"]
    methods = check_methods(methods, config, task_kind(fleet))
    check_fit(config, fleet)
    variants = fleet_variants(config, fleet)
    policy, privacy = build_policy(config, fleet.num_clients)
    if policy.dp:
        refuse_unprivate_scaling(config, fleet)
    return RunPlan(config, Path(out), methods, train_points, expand_all, variants, policy, privacy)


def with_eval_every(config: RunConfig, units: int) -> RunConfig:
    """``config`` with ``[engine] eval_every`` a number of rounds: "auto" resolved for a fleet
    of ``units`` (:func:`fedcal.engine.settings.resolve_eval_every`), else unchanged."""
    from fedcal.config import override
    from fedcal.engine.settings import resolve_eval_every

    every = config.engine.eval_every
    if every != "auto":
        return config
    resolved = resolve_eval_every(every, units)
    return override(config, {"engine": {"eval_every": resolved}}, "eval_every")


def open_run_directory(plan: RunPlan) -> None:
    """The run directory with its configuration (refused if it holds another run, or one
    made from other data), where the data came from, and the privacy accounting."""
    out = plan.out
    out.mkdir(parents=True, exist_ok=True)
    resolved = run_record(plan.config, plan.methods, plan.train_points)
    config_path = out / runnames.CONFIG
    text = json.dumps(resolved, indent=2, sort_keys=True, default=list)
    # The data's content, not just its path: a file replaced at the same path is another run.
    digest = _data_digest(plan.variants)
    if config_path.exists():
        _check_same_run(config_path, json.loads(text), digest, out)
    _write_text(
        config_path,
        json.dumps({**resolved, "data_sha256": digest}, indent=2, sort_keys=True, default=list),
    )
    provenance = json.dumps(_provenance(plan.variants), indent=2, sort_keys=True, default=str)
    _write_text(out / runnames.FLEET, provenance)
    if plan.privacy:
        _write_text(out / runnames.PRIVACY, json.dumps(plan.privacy, indent=2))
