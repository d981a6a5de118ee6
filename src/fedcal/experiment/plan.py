"""The run planned before anything trains: the configuration's checks, the fleet variants
of the sweeps, the aggregation policy and privacy (bad input stops here, before anything
is written), then the run directory opened (config.json, fleet.json, privacy.json).
"""

from __future__ import annotations

import dataclasses
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
    load_data,
    run_record,
    task_kind,
)
from fedcal.config import ConfigError, RunConfig
from fedcal.core import runnames
from fedcal.core.aggregation import AggregationPolicy
from fedcal.data.fleet import Fleet
from fedcal.experiment.rundir import _check_same_run, _data_digest, _provenance, _write_text


def refuse_unprivate_scaling(config: RunConfig, fleet: Fleet) -> None:
    """Client-level DP noises the algorithm's sums only: a column scaled by federated
    statistics (the fleet's mean and std, un-noised, sent to every site) would be released
    outside the accountant's ε, so DP is refused unless every column has a physical range."""
    from fedcal.data.scaling import PHYSICAL_RANGES, needs_moments

    mode, regression = config.data.scaling, fleet.meta.get("task") != "classification"
    if not needs_moments(fleet.features, fleet.target, mode, regression):
        return
    columns = [*fleet.features, *([fleet.target] if regression else [])]
    named = [c for c in columns if mode == "federated" or c not in PHYSICAL_RANGES]
    raise ConfigError(
        f"[data] scaling = {mode!r}: client-level DP ([privacy] epsilon > 0) needs every column "
        f"on a physical range; {', '.join(named)} would be scaled by the fleet's un-noised "
        "mean and std (released outside ε)"
    )


def fleet_variants(config: RunConfig, fleet: Fleet) -> list[tuple[dict[str, Any], Fleet]]:
    """The fleets of a run: ``fleet`` alone, or one per (fleet seed, design) of the sweeps.

    ``[run] fleet_seeds`` / ``designs`` (or ``--fleet-seeds`` / ``--designs``)
    regenerate the fleet with ``[fleet] seed`` / ``train_design`` set to each
    value; each variant is labelled by the swept fields only (they become
    summary columns ``fleet_seed`` / ``design``).
    """
    if not config.designs and not config.fleet_seeds:
        return [({}, fleet)]
    path = config.data.path
    if config.designs and path:
        raise ConfigError(
            f"[run] designs sweep the simulator's chamber designs; [data] path is {path!r}"
        )
    if config.fleet_seeds and path and not path.startswith("builtin:"):
        raise ConfigError(
            f"[run] fleet_seeds regenerate a built-in fleet; [data] path is the file {path!r}"
        )
    out = []
    for fleet_seed in config.fleet_seeds or (config.fleet.seed,):
        for design in config.designs or (config.fleet.train_design,):
            f = dataclasses.replace(config.fleet, seed=fleet_seed, train_design=design)
            labels: dict[str, Any] = {}
            if config.designs:
                labels["design"] = design
            if config.fleet_seeds:
                labels["fleet_seed"] = fleet_seed
            out.append((labels, load_data(dataclasses.replace(config, fleet=f))))
    return out


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
