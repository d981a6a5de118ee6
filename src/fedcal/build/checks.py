"""A run's methods checked against the configuration and the fleet before anything
trains (names, task kind, fit on the data, a private run's scaling), and the run's record
(config.json).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from fedcal.algorithms import REGISTRY
from fedcal.build.data import FleetOutline
from fedcal.build.method import (
    build_algorithm,
    build_task,
    client_inputs,
    method_settings,
    method_values,
    task_kind,
)
from fedcal.build.policy import build_policy
from fedcal.config import ConfigError, RunConfig, to_layout
from fedcal.core.errors import did_you_mean
from fedcal.data.fleet import Fleet


def check_methods(
    methods: Sequence[str], config: RunConfig | None = None, task_kind: str = "regression"
) -> list[str]:
    """Expand ``all`` (every method and config variant for ``task_kind``); refuse unknown names.

    ``all`` runs each system once: a registered method whose class a config variant of
    *another* method builds (a setting selects it, :meth:`Algorithm.built_class`: FedGMI's
    ``interpolation = "posterior"`` builds ``fedgmi_bayes``) runs as that variant only,
    which is its documented configuration; by name it stays usable.
    """
    variants = {
        name: params["base"]
        for name, params in (config.method_params.items() if config else [])
        if "base" in params
    }
    if list(methods) == ["all"]:
        extra = [
            v for v, b in variants.items() if b in REGISTRY and REGISTRY[b].task_kind == task_kind
        ]
        reached = set()  # classes a variant of another registered method builds
        for v in extra:
            try:
                cls, _ = method_settings(v, config)
            except ConfigError:
                continue  # a bad table is refused where the variant is built
            if cls is not REGISTRY[variants[v]]:
                reached.add(cls)
        names = [
            n
            for n in sorted(REGISTRY)
            if REGISTRY[n].task_kind == task_kind and REGISTRY[n] not in reached
        ]
        names += extra
    else:
        names = list(methods)
    unknown = [m for m in names if m not in REGISTRY and variants.get(m) not in REGISTRY]
    if unknown:
        raise ConfigError(
            f"unknown method(s) {', '.join(unknown)}{did_you_mean(unknown, [*REGISTRY, *variants])}"
            f"; known: {', '.join(sorted(REGISTRY))}"
        )
    # a classification method needs classes; a regression method (FedAvg…) may run on either
    other = [
        m for m in names if REGISTRY[variants.get(m, m)].task_kind == "classification" != task_kind
    ]
    if other:
        raise ConfigError(
            f"[run] methods: {', '.join(other)} is written for classification and cannot "
            f"run on this {task_kind} fleet"
        )
    return names


def validate_methods(config: RunConfig, fleet: Fleet | FleetOutline) -> list[str]:
    """Every method name and parameter, checked before anything trains.

    Unknown names, unknown or invalid method parameters and methods that cannot
    run on the configured model raise ConfigError (with ``all``, such methods
    are skipped by the experiment instead, so only names are checked).
    """
    from fedcal.engine.simulation import prepare  # the task's inputs, as the engine scales them

    names = check_methods(config.methods, config, task_kind(fleet))
    check_fit(config, fleet)
    try:  # an outline's tensors are built already (load_outline)
        tensors = (
            fleet.tensors
            if isinstance(fleet, FleetOutline)
            else prepare(fleet, config.data.scaling, config.engine.dtype)
        )
    except ValueError as err:
        raise ConfigError(f"[data] scaling: {err}") from None
    if list(config.methods) != ["all"]:
        task = build_task(config, tensors.train.x.shape[-1], fleet.meta, client_inputs(tensors))
        for name in names:
            build_algorithm(name, config, task)
    build_policy(config, fleet.num_clients)
    return names


def check_fit(config: RunConfig, fleet: Fleet) -> None:
    """Rules between the configuration and the fleet it runs on (its number of clients)."""
    n = fleet.num_clients
    e, a = config.engine, config.aggregation
    per_round = n if e.participation >= 1.0 else round(e.participation * n)
    if per_round < 1:
        raise ConfigError(
            f"[engine] participation: {e.participation} of {n} clients is no client per round"
        )
    if a.rule == "krum" and per_round < 2 * a.krum_byzantine + 3:
        raise ConfigError(
            f"[aggregation] krum_byzantine: Krum tolerates f attackers among n >= 2f + 3 "
            f"clients per round; f = {a.krum_byzantine} with n = {per_round}"
        )
    if a.rule == "krum" and a.krum_select > per_round:
        raise ConfigError(
            f"[aggregation] krum_select: {a.krum_select} > the {per_round} clients per round"
        )
    if not config.data.path and config.fleet.num_lots > n:
        raise ConfigError(f"[fleet] num_lots: {config.fleet.num_lots} lots for {n} sensors")


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


def run_record(
    config: RunConfig, methods: Sequence[str], train_points: Sequence[int]
) -> dict[str, Any]:
    """A run directory's ``config.json``: the layout (methods expanded) and the values used.

    ``resolved`` holds the full ``[train]`` recipe and, per method, every parameter
    it runs with — what ``fedcal methods`` shows — so a reader needs no defaults.
    :func:`fedcal.config.from_json` reads the file back.
    """
    cfg = dataclasses.replace(config, methods=tuple(methods))
    resolved = {
        "train": asdict(config.train),
        "methods": {m: method_values(m, config) for m in methods},
    }
    layout = to_layout(cfg)
    return {**layout, "resolved": resolved, "train_points_sweep": list(train_points)}
