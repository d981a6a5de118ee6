"""From a validated configuration to the things a run needs: data, task, algorithm, policy.

The one place that builds them, used by the experiment, the CLI, the exports and the
Flower engine alike (so a method runs with the same values wherever it runs). It sits
above data, models, core and algorithms, below the experiment (which it never imports);
of the engine it uses only ``prepare`` (:func:`validate_methods`: the task's inputs).

An algorithm's parameters (:func:`method_settings`), lowest precedence first:

1. the class's defaults — the base contract's recipe (core/algorithm.py) and the
   method's own values;
2. the shipped ``[train]`` recipe, for recipe fields the method does not set itself;
3. ``[train]`` values the user set (file or command line): they beat the method's own;
4. the settings of the preset the table names (``preset = "chamber"``, :mod:`fedcal.presets`);
5. ``[methods.<base>]`` for a variant, then ``[methods.<name>]``.

The package: ``data`` (the fleet: simulator, file, row groups, chunk size), ``method``
(task and algorithm), ``policy`` (aggregation, privacy, engine settings), ``checks`` (the
methods against the configuration and the fleet, the run's record); ``checks`` uses the
other three, ``policy`` and ``method`` use ``data`` at most. This module re-exports the
names callers use.
"""

from __future__ import annotations

from fedcal.build.checks import (
    check_fit,
    check_methods,
    refuse_unprivate_scaling,
    run_record,
    validate_methods,
)
from fedcal.build.data import (
    AUTO_CHUNK_ROWS,
    FleetOutline,
    _Gather,
    auto_chunk_size,
    fleet_variants,
    load_configured,
    load_data,
    load_outline,
    load_run_data,
    valid_ranges,
    with_auto_chunk,
)
from fedcal.build.method import (
    build_algorithm,
    build_recorded,
    build_task,
    choice_note,
    client_inputs,
    method_settings,
    method_values,
    task_kind,
    with_raw_column,
)
from fedcal.build.policy import (
    UNKNOWN_UNITS_DELTA,
    build_policy,
    engine_settings,
    privacy_delta,
)

__all__ = [
    "AUTO_CHUNK_ROWS",
    "UNKNOWN_UNITS_DELTA",
    "FleetOutline",
    "_Gather",
    "auto_chunk_size",
    "build_algorithm",
    "build_policy",
    "build_recorded",
    "build_task",
    "check_fit",
    "check_methods",
    "choice_note",
    "client_inputs",
    "engine_settings",
    "fleet_variants",
    "load_configured",
    "load_data",
    "load_outline",
    "load_run_data",
    "method_settings",
    "method_values",
    "privacy_delta",
    "refuse_unprivate_scaling",
    "run_record",
    "task_kind",
    "valid_ranges",
    "validate_methods",
    "with_auto_chunk",
    "with_raw_column",
]
