"""A run from its configuration, top down: planned (:mod:`.plan`: checks, fleet variants,
policy; the run directory opened), every method built for every cell (:mod:`.builds`),
each (method, seed) trained (:mod:`.execute`), recorded and scored (:mod:`.record`), the
summary written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd

from fedcal.build import FleetOutline
from fedcal.config import ConfigError, RunConfig
from fedcal.data.fleet import Fleet
from fedcal.experiment.builds import build_cells
from fedcal.experiment.execute import Summary, run_method
from fedcal.experiment.hooks import Hooks
from fedcal.experiment.plan import open_run_directory, plan_run


def run_experiment(
    config: RunConfig,
    fleet: Fleet | FleetOutline,
    out: Path,
    methods: Sequence[str],
    train_points: Sequence[int] = (0,),
    on_progress: Callable[[str, int, dict], None] | None = None,
    on_skip: Callable[[str, str], None] | None = None,
    on_fail: Callable[[str, str], None] | None = None,
    on_note: Callable[[str, str], None] | None = None,
    on_status: Callable[[str, str], None] | None = None,
) -> pd.DataFrame:
    """Run every (fleet variant, train_points, method, seed); return (and write) the summary.

    Fleet variants come from the design and fleet-seed sweeps of ``config``
    (see :func:`fleet_variants`); without them ``fleet`` is the only one. With
    ``methods=["all"]`` a method that cannot run on this model (e.g. one
    that needs a shared body when the model is all head) is skipped and
    reported through ``on_skip(method, reason)``; a method named explicitly
    that cannot run is an error (raised before anything trains). A method that
    raises while training is reported through ``on_fail(label, one-line reason)``,
    gets a summary row with ``failed = 1`` and no numbers, and the others go on.
    Summary rows count each run's ``diverged`` sensors (non-finite personalized
    model) and ``rejected`` replies; fleet means are NaN when a sensor diverged.
    What a user must know about a finished run (e.g. a fleet prior that the data do
    not identify) goes to ``on_note(method, message)``; which sensors are not ``ok``
    and every client the server rejected (round, reason, ratio vs threshold) to
    ``on_status(run label, message)`` (:func:`status_notes`). Each sensor's status
    (:mod:`fedcal.status`) is in per_sensor.csv with its reason, every rejection in
    the run's rejections.csv; summary means are over ok sensors, with the others
    counted (``excluded``, ``weak``, ``unconverged``, ``rejected_sensors``,
    ``diverged``, ``refused``).

    ``fleet`` may be a :class:`FleetOutline` (a Parquet file read by row groups,
    :func:`fedcal.build.load_outline`): its tensors are used as built, and it has no
    calibration-point budgets (``train_points`` other than 0 need the frame).
    """
    plan = plan_run(config, fleet, out, methods, train_points)
    open_run_directory(plan)
    cells, refused = build_cells(plan)
    if refused and not plan.expand_all:
        raise ConfigError("; ".join(refused.values()))
    hooks = Hooks(on_progress, on_skip, on_fail, on_note, on_status)
    for method, reason in refused.items():
        hooks.skip(method, reason)
    summary = Summary(plan.out)
    for cell in cells:
        for method, algorithm in cell.built:
            run_method(plan, cell, method, algorithm, hooks, summary)
    return summary.finish()
