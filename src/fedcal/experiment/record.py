"""A trained run written and scored: metrics, aggregation, rejections and per-sensor tables,
the models, the valid ranges, the fitted prior, the summary row and what the run output
says about it; done.json last (a run without it is redone).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from fedcal.build import FleetOutline, valid_ranges
from fedcal.core import hooks, runnames
from fedcal.core.algorithm import Algorithm
from fedcal.engine.history import as_frame
from fedcal.engine.simulation import RunResult
from fedcal.experiment import notes
from fedcal.experiment.builds import Cell
from fedcal.experiment.hooks import Hooks
from fedcal.experiment.judging import judge_sensors
from fedcal.experiment.modelfiles import _asked_choose, export_state, save_models
from fedcal.experiment.plan import RunPlan
from fedcal.experiment.rundir import (
    CHECKPOINT_FILE,
    MODEL_FILE,
    _where,
    _write_csv,
    _write_text,
)
from fedcal.experiment.scoring import coverage_checks, summary_row


@dataclass(frozen=True)
class Trained:
    """One finished (method, seed) of a cell: what :func:`record_run` writes and scores."""

    method: str
    algorithm: Algorithm
    seed: int
    label: str  # the run as the output names it: method, sweep labels, budget, seed
    run_dir: Path
    result: RunResult


def record_run(plan: RunPlan, cell: Cell, run: Trained, hooks: Hooks) -> dict[str, Any]:
    """Every file of a finished run, and its summary row (also in done.json, written last)."""
    config, run_dir = plan.config, run.run_dir
    (run_dir / "failed.txt").unlink(missing_ok=True)
    history = write_history(run)
    final, rejections, statuses = write_sensors(plan, cell, run, history)
    save_models(
        run_dir / MODEL_FILE,
        run.result,
        cell.tensors,
        config,
        run.algorithm,
        run.method,
        run.seed,
        cell.subset.meta,
    )
    if cell.task.kind == "regression":
        outline = isinstance(cell.subset, FleetOutline)
        ranges = cell.subset.valid_ranges if outline else valid_ranges(cell.subset)
        _write_text(run_dir / runnames.VALID_RANGE, json.dumps(ranges, indent=1))
    row = {
        **cell.labels,
        **summary_row(
            run.method,
            run.seed,
            cell.train_points,
            run.result,
            cell.full_scale,
            cell.task,
            cell.roles,
            statuses,
        ),
    }
    for note in notes.status_notes(final, rejections):
        hooks.status(run.label, note)
    checked, loud = judge_intervals(final, cell, run.seed, plan.config.seeds)
    row.update(checked)
    for note in loud:
        hooks.note(run.method, note)
    if plan.privacy:
        row["epsilon"] = plan.privacy["epsilon"]
        row["noise_multiplier"] = plan.privacy["noise_multiplier"]
    record_prior(row, final, plan, cell, run, hooks)
    run_notes(row, history, run, hooks)
    _write_text(run_dir / runnames.DONE, json.dumps(row, indent=2))
    (run_dir / CHECKPOINT_FILE).unlink(missing_ok=True)
    return row


def write_history(run: Trained) -> pd.DataFrame:
    """metrics.csv (per round and sensor) and aggregation.csv (per round); the history."""
    history = as_frame(run.result.history)
    history.insert(0, "method", run.method)
    history.insert(1, "seed", run.seed)
    _write_csv(run.run_dir / runnames.METRICS, history)
    _write_csv(run.run_dir / "aggregation.csv", pd.DataFrame(run.result.extra["aggregation"]))
    return history


def write_sensors(
    plan: RunPlan, cell: Cell, run: Trained, history: pd.DataFrame
) -> tuple[pd.DataFrame, pd.DataFrame, list[str]]:
    """rejections.csv and per_sensor.csv (each sensor's errors, status and reason, the
    algorithm's own unit columns, its role); the final table, rejections and statuses."""
    config, algorithm, result, tensors = plan.config, run.algorithm, run.result, cell.tensors
    statuses, reasons, rejections = judge_sensors(
        algorithm,
        result,
        tensors,
        history,
        cell.task.primary_metric,
        config.unconverged_tol,
        config.engine.chunk_size,
    )
    _write_csv(run.run_dir / runnames.REJECTIONS, rejections)
    final = pd.DataFrame(result.final)
    final["status"], final["status_reason"] = statuses, reasons
    final.insert(0, "method", run.method)
    final.insert(1, "seed", run.seed)
    if isinstance(algorithm, hooks.UnitColumns):  # e.g. recalibrate_at
        with torch.no_grad():
            extra = algorithm.unit_columns(result.personal, tensors.train)
        extra = hooks.labelled_units(algorithm, extra)  # e.g. fallback codes as names
        for name, values in extra.items():
            final[name] = np.asarray(values)[final["client_index"].to_numpy(int)]
    if cell.roles is not None:  # mixed fleets: each sensor's role beside its id
        role_column = final["client"].astype(str).map(cell.roles)
        final.insert(final.columns.get_loc("client") + 1, "role", role_column)
    _write_csv(run.run_dir / runnames.PER_SENSOR, final)
    return final, rejections, statuses


def judge_intervals(
    final: pd.DataFrame, cell: Cell, seed: int, seeds: int
) -> tuple[dict[str, str], list[str]]:
    """The stated intervals judged on the test rows: the row's fields and the loud notes,
    each naming the run when the cell has several (sweep labels, budget, seed)."""
    has_test = cell.tensors.test.count.cpu().numpy()[final["client_index"].to_numpy(int)]
    checked, check_notes = coverage_checks(final, cell.roles, has_test)
    tp = cell.train_points
    where = (_where(cell.labels) + f" tp={tp}" * bool(tp) + f" seed={seed}" * (seeds > 1)).strip()
    return checked, [f"{where}: {note}" if where else note for note in check_notes]


def record_prior(
    row: dict[str, Any],
    final: pd.DataFrame,
    plan: RunPlan,
    cell: Cell,
    run: Trained,
    hooks: Hooks,
) -> None:
    """The fitted fleet prior (fedprior) saved as prior.json, with its deployment
    discrepancy (issue 33); what it says about identification, drift, the choice and the
    interval goes into ``row`` and the notes."""
    method, algorithm, result = run.method, run.algorithm, run.result
    choose = _asked_choose(plan.config, method)
    fitted = export_state(algorithm, result.server, cell.subset, cell.tensors, method, choose)
    deploy = getattr(algorithm, "deploy_state", None)  # fedprior: issue 33
    if fitted is not None and deploy is not None:
        model = deploy(result.server, cell.tensors.train)
        if model is not None:
            fitted = dataclasses.replace(fitted, discrepancy=model)
    if fitted is None:
        return
    fitted.save(run.run_dir / runnames.PRIOR)
    exported = fitted.to_dict()
    note = notes.identification_note(exported)
    if "identification" in exported:
        row["weak_directions"] = exported["identification"]["weak_directions"]
    if note:
        hooks.note(method, note)
    drift = exported.get("drift")
    if isinstance(drift, dict) and drift.get("note"):
        hooks.note(method, drift["note"])  # e.g. no time column: fedprior's model
    chosen = notes.selection_note(exported, final)
    if chosen:  # the time-respecting choice (algorithms/fedprior_choice.py)
        row["selection_note"] = chosen
        hooks.note(method, chosen)
    reason = (exported.get("interval") or {}).get("reason", "")
    if reason:  # no interval stated: coverage is empty (NaN), and why
        row["coverage_note"] = reason
        hooks.note(method, reason)


def run_notes(row: dict[str, Any], history: pd.DataFrame, run: Trained, hooks: Hooks) -> None:
    """The algorithm's own note, Gram jitter, rounds the robust M-step judged nobody."""
    method = run.method
    own_note = getattr(run.algorithm, "note", "")  # e.g. a basis reduced to fit its limit
    if own_note:
        hooks.note(method, own_note)
    if "jitter" in history and (history["jitter"] > 0).any():
        worst = float(history["jitter"].max())
        hooks.note(method, notes.jitter_note(history["jitter"], worst))
    note = notes.unjudged_note(run.result.extra["aggregation"])
    if note:  # the robust M-step judged nobody: marked in the row, and said
        row["unjudged_rounds"] = int(note.split(" ", 1)[0])
        hooks.note(method, note.split(" ", 1)[1])
