"""Experiments: methods × seeds (× calibration-point budgets) on one fleet, in a run directory.

Layout of a run directory::

    config.json            the configuration (fedcal.config layout), the values each method
                           ran with ("resolved") and the data's digest (refuses to mix
                           with another configuration or with changed data)
    fleet.json             where the data came from (file or simulator settings)
    summary.csv            one row per (method, train_points, seed), rewritten after each run
                           (and per design / fleet seed when those are swept)
    runs/<method>_tp<N>_seed<S>/    (sweeps: <method>_<design>_fs<F>_tp<N>_seed<S>)
        metrics.csv        per round and sensor: test/train errors, train loss
        per_sensor.csv     final errors of each sensor's personalized model (and its role)
        model.safetensors  personalized weights of every sensor (tensors) + JSON: scaler,
                           model settings (no pickle: the model is rebuilt from config.json)
        valid_range.json   per sensor, the span of its calibration points (exports carry it)
        prior.json         fedprior: the fleet prior, for `fedcal calibrate`
        done.json          the summary row; written last, so a run without it is redone
        checkpoint.safetensors  while running (removed when done): resume point

Every file is written atomically (:mod:`fedcal.core.atomic`: temporary file,
fsync, rename, fsync of the directory): an interrupted
or failed run never leaves a half-written file, and results already written
stay intact. Running the same command again resumes: finished runs are read
back, an interrupted run continues from its checkpoint with the same numbers.

The package, top down (a run's configuration walks down it, never back up): ``run``
(:func:`run_experiment`) → ``plan`` (checks, fleet variants, policy, the directory opened)
→ ``builds`` (every method built per cell) → ``execute`` (each (method, seed) trained,
resumed or failed) → ``record`` (files, the summary row, notes) → ``scoring``,
``judging``, ``modelfiles``, ``notes``, ``rundir``, ``hooks``. Each module imports only
the ones after it; this module re-exports the names callers use.
"""

from fedcal.build import (
    FleetOutline,
    build_algorithm,
    build_policy,
    build_task,
    check_fit,
    check_methods,
    client_inputs,
    engine_settings,
    fleet_variants,
    load_data,
    method_settings,
    refuse_unprivate_scaling,
    run_record,
    task_kind,
    valid_ranges,
    with_raw_column,
)
from fedcal.engine.simulation import prepare
from fedcal.experiment.judging import REJECTION_COLUMNS, _own_fit, judge_sensors
from fedcal.experiment.modelfiles import export_state, load_model_file, rebuild_task, save_models
from fedcal.experiment.notes import (
    identification_note,
    jitter_note,
    selection_note,
    status_notes,
    unjudged_note,
)
from fedcal.experiment.run import run_experiment
from fedcal.experiment.rundir import (
    CHECKPOINT_FILE,
    MODEL_FILE,
    SUMMARY_COLUMNS,
    RunDirectoryError,
    _write_csv,
    _write_text,
    one_line,
)
from fedcal.experiment.scoring import (
    HIGHER_IS_BETTER,
    all_sensor_means,
    common_sensor_means,
    coverage_checks,
    fleet_stat,
    full_scale,
    summary_row,
)

# What callers import from fedcal.experiment (the CLI, the API, calibration, report, tests,
# studies, benchmarks); the builders are build's, re-exported for the studies.
__all__ = [
    "CHECKPOINT_FILE",
    "HIGHER_IS_BETTER",
    "MODEL_FILE",
    "REJECTION_COLUMNS",
    "SUMMARY_COLUMNS",
    "FleetOutline",
    "RunDirectoryError",
    "_own_fit",
    "_write_csv",
    "_write_text",
    "all_sensor_means",
    "build_algorithm",
    "build_policy",
    "build_task",
    "check_fit",
    "check_methods",
    "client_inputs",
    "common_sensor_means",
    "coverage_checks",
    "engine_settings",
    "export_state",
    "fleet_stat",
    "fleet_variants",
    "full_scale",
    "identification_note",
    "jitter_note",
    "judge_sensors",
    "load_data",
    "load_model_file",
    "method_settings",
    "one_line",
    "prepare",
    "rebuild_task",
    "refuse_unprivate_scaling",
    "run_experiment",
    "run_record",
    "save_models",
    "selection_note",
    "status_notes",
    "summary_row",
    "task_kind",
    "unjudged_note",
    "valid_ranges",
    "with_raw_column",
]
