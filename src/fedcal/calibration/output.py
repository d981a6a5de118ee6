"""A calibrate output folder: a run directory of the new units (so ``fedcal export`` and
``fedcal predict`` read it) with their coefficients, per-unit tables and QA."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pandas as pd

from fedcal.build import run_record
from fedcal.calibration.diagnostics import unit_diagnostics
from fedcal.calibration.posterior import Calibration
from fedcal.calibration.rebuild import prior_config
from fedcal.core import runnames
from fedcal.data.fleet import Fleet
from fedcal.engine.evaluation import errors
from fedcal.engine.simulation import RunResult
from fedcal.experiment import (
    MODEL_FILE,
    _write_text,
    save_models,
)
from fedcal.prior import calibrate_dir
from fedcal.prior.model import PriorModel


def coefficient_table(prior: PriorModel, result: Calibration) -> pd.DataFrame:
    """``coefficients.csv``: per unit its points, noise σ and coefficients (the package docstring).

    y = Σ_k c_k φ_k(z) in the target's unit, z = (x − x_offset) / x_scale (the prior's
    scaler), φ_k = Π_j P̃_{a_kj}(z_j) with P̃_a = √(2a+1)·P_a; the term '1' carries the offset
    (:func:`fedcal.prior.calibrate_dir.coefficient_table`, the NumPy path's too).
    """
    personal, tensors = result.personal, result.tensors
    return calibrate_dir.coefficient_table(
        prior, tensors.client_ids, personal["coef"].numpy(), personal["noise_var"].numpy(),
        tensors.train.count.numpy(),
    )  # fmt: skip


def declined_note(prior: PriorModel, result: Calibration) -> str:
    """One line: why some units calibrated from this prior get no interval ("" if none)
    (:func:`fedcal.prior.calibrate_dir.declined_note` with the discrepancy model's reasons)."""
    declined = result.personal.get("declined")
    declined = None if declined is None else (declined > 0).numpy()
    return calibrate_dir.declined_note(prior, declined, result.reasons, result.algorithm.probe_rows)


def write(out: Path, prior: PriorModel, fleet: Fleet, result: Calibration) -> pd.DataFrame:
    """A run directory for the new units (the tables: :func:`fedcal.prior.calibrate_dir.
    write_tables`, the NumPy path's too); returns the per-unit table."""
    out = Path(out)
    cfg = prior_config(prior)
    method = prior.method
    if hasattr(result.algorithm, "choose"):  # "auto" as calibrate resolved it by its data:
        params = {**cfg.method_params.get(method, {}), "choose": result.algorithm.choose}
        cfg = replace(cfg, method_params={**cfg.method_params, method: params})  # load's shapes
    run_dir = runnames.run_path(out, method)
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = run_record(cfg, [method], [0])
    _write_text(out / runnames.CONFIG, json.dumps(resolved, indent=2, sort_keys=True, default=list))
    prior.save(run_dir / runnames.PRIOR)
    run = RunResult([], [], result.personal, result.server, {}, 0.0, 0.0, 0.0)
    save_models(
        run_dir / MODEL_FILE, run, result.tensors, cfg, result.algorithm, method, 0, fleet.meta
    )
    table = coefficient_table(prior, result)
    tensors = result.tensors
    test = {}
    if int(tensors.test.count.sum()) > 0:
        test = errors(result.algorithm, result.personal, tensors.test, tensors.scaler)
        test = {k: v.numpy() for k, v in test.items()}
    per_sensor = calibrate_dir.per_sensor_table(table, test, tensors.test.count.numpy() > 0)
    tables = (table, per_sensor, *unit_diagnostics(prior, result))
    note = declined_note(prior, result)
    return calibrate_dir.write_tables(out, prior, fleet, tables, note, result.refused)
