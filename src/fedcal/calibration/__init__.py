"""Calibrate new units against a trained fleet prior, without re-running the fleet.

A fedprior run leaves, per run, ``prior.json``: the fleet prior N(μ, Σ), the
noise level, the basis, the scaler and the input range the fleet was
calibrated over (see :func:`fedcal.experiment.export_state`). A new unit
with a handful of chamber points is then calibrated alone: its posterior
under that prior is the same closed form the federation computes
(:meth:`fedcal.algorithms.fedprior.FedPrior.personalize`), with its own noise
level settled by the same fixed-point the federation iterates. Nothing of the
fleet's units is needed, only the prior.

The output directory is a run directory like ``fedcal run`` writes (so
``fedcal export`` and ``fedcal predict`` read it) plus ``coefficients.csv``
(one row per unit: its coefficients on the named basis terms, in the
target's unit — with a direction term also h on the terms b·ψ, b = ±1
up/down — where x0, x1, … are the inputs scaled by the prior's scaler and P_k
the normalized Legendre polynomials; and its noise σ)
and ``per_sensor.csv`` (points used, and test errors and interval coverage
when the file marks rows as ``test``), and the per-unit QA of
:func:`unit_diagnostics`: ``units.csv`` (status, distance from the fleet,
predictive σ over the prior's operating range, residuals at the calibration
points) and ``calibration_points.csv`` (each calibration point's residual and σ),
which ``fedcal report --html`` turns into a calibration report per unit.

The modules, top down (each imports only those below it; an import contract):

    output       the output folder (:func:`write`): coefficients, per-unit tables, QA
    diagnostics  each unit's QA: fleet distance, σ over the operating range, residuals
    posterior    each unit's posterior (:func:`calibrate`, :func:`unit_posteriors`)
    rebuild      the stored prior's configuration, algorithm and server state
"""

from fedcal.calibration.diagnostics import (
    GRID_CHUNK,
    GRID_RANK_TOL,
    GridForm,
    fleet_distance,
    grid_form,
    grid_sigma,
    grid_sigma_summary,
    unit_diagnostics,
)
from fedcal.calibration.output import coefficient_table, declined_note, write
from fedcal.calibration.posterior import (
    NOISE_ITERATIONS,
    Calibration,
    calibrate,
    expected_scale,
    own_noise,
    unit_posteriors,
)
from fedcal.calibration.rebuild import (
    RECORD_FEATURES,
    load_prior,
    prior_algorithm,
    prior_config,
    prior_server,
    record_template,
)
from fedcal.prior.find import find_prior  # torch-free
from fedcal.prior.qa import (  # the range guard, QA threshold and grid: torch-free
    GRID_POINTS,
    RANGE_TOLERANCE,
    check_inputs,
    distance_threshold,
    operating_grid,
)

__all__ = [
    "GRID_CHUNK",
    "GRID_POINTS",
    "GRID_RANK_TOL",
    "NOISE_ITERATIONS",
    "RANGE_TOLERANCE",
    "RECORD_FEATURES",
    "Calibration",
    "GridForm",
    "calibrate",
    "check_inputs",
    "coefficient_table",
    "declined_note",
    "distance_threshold",
    "expected_scale",
    "find_prior",
    "fleet_distance",
    "grid_form",
    "grid_sigma",
    "grid_sigma_summary",
    "load_prior",
    "operating_grid",
    "own_noise",
    "prior_algorithm",
    "prior_config",
    "prior_server",
    "record_template",
    "unit_diagnostics",
    "unit_posteriors",
    "write",
]
