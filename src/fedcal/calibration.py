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
when the file marks rows as ``test``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from fedcal.algorithms.fedprior import DECLINE, FedPrior
from fedcal.build import build_algorithm, build_task, run_record
from fedcal.config import DataConfig, RunConfig, from_dict
from fedcal.core.bayes import F64
from fedcal.core.data import ClientData
from fedcal.core.tree import Tree, expand
from fedcal.data.fleet import Fleet
from fedcal.data.scaling import Scaler
from fedcal.engine.evaluation import errors
from fedcal.engine.simulation import FleetTensors, RunResult
from fedcal.experiment import (
    MODEL_FILE,
    _write_csv,
    _write_text,
    fleet_stat,
    full_scale,
    save_models,
    valid_ranges,
)

RANGE_TOLERANCE = 0.05  # inputs may exceed the fleet's calibrated range by 5 % of its span
NOISE_ITERATIONS = 25  # fixed-point iterations of a unit's own noise level (converged: tested)


def find_prior(path: str | Path, method: str = "fedprior", seed: int = 0, train_points: int = 0):
    """``prior.json`` itself, or the one of ``method``/``seed`` in a run directory."""
    path = Path(path)
    if path.is_file():
        return path
    candidate = path / "runs" / f"{method}_tp{train_points}_seed{seed}" / "prior.json"
    if not candidate.exists():
        found = sorted(p.parent.name for p in path.glob("runs/*/prior.json"))
        hint = f"; runs with a prior: {', '.join(found)}" if found else ""
        raise FileNotFoundError(f"no fleet prior at {candidate}{hint}")
    return candidate


def load_prior(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not a fleet prior (invalid JSON: {err})") from None
    missing = [
        k for k in ("mu", "sigma", "noise_var", "terms", "features", "scaler") if k not in doc
    ]
    if doc.get("kind") != "fedprior" or missing:
        raise ValueError(f"{path}: not a fedprior fleet prior (missing {', '.join(missing)})")
    return doc


def _config(prior: dict[str, Any]) -> RunConfig:
    """The configuration that rebuilds this prior's algorithm (and its run directory)."""
    method = prior["method"]
    params = {k: v for k, v in prior["method_params"].items()}
    if "selection" in prior:  # the fleet chose a sub-basis by its evidence: that basis, fixed
        params.update(prior["selection"]["chosen"], select="none")
    if method != "fedprior":
        params["base"] = "fedprior"
    cfg = from_dict({"methods": {method: params}}, "prior.json")
    data = DataConfig(features=tuple(prior["features"]), target=prior["target"])
    return replace(cfg, data=data, methods=(method,), seeds=1)


def check_inputs(prior: dict[str, Any], fleet: Fleet, source: str) -> None:
    """Refuse units calibrated outside the range the fleet's prior was learned over."""
    for c, (lo, hi) in prior["input_range"].items():
        slack = RANGE_TOLERANCE * (hi - lo)
        for sensor, rows in fleet.frame.groupby(fleet.client_column, sort=False):
            values = rows[c].to_numpy(float)
            if values.min() < lo - slack or values.max() > hi + slack:
                raise ValueError(
                    f"{source}: sensor {sensor}: {c} spans {values.min():.6g}…{values.max():.6g}, "
                    f"outside the prior fleet's calibrated range {lo:.6g}…{hi:.6g} (±5 %): "
                    "this prior cannot calibrate it"
                )


@dataclass(frozen=True)
class Calibration:
    algorithm: FedPrior
    tensors: FleetTensors
    personal: Tree
    server: Tree


def calibrate(prior: dict[str, Any], fleet: Fleet, source: str = "data") -> Calibration:
    """Each unit's posterior under the stored prior (see the module docstring)."""
    if tuple(fleet.features) != tuple(prior["features"]) or fleet.target != prior["target"]:
        raise ValueError(
            f"{source}: columns {list(fleet.features)} → {fleet.target} do not match the prior's "
            f"{prior['features']} → {prior['target']}"
        )
    check_inputs(prior, fleet, source)
    cfg = _config(prior)
    task = build_task(cfg, len(prior["features"]))
    algorithm = build_algorithm(prior["method"], cfg, task)
    if not isinstance(algorithm, FedPrior):
        raise ValueError(f"{source}: prior method {prior['method']!r} is not a fedprior method")
    if [list(t) for t in algorithm.terms] != prior["terms"] or [
        list(t) for t in algorithm.branch_terms
    ] != prior.get("branch_terms", []):
        raise ValueError("prior.json: its basis terms do not match its method parameters")
    scaler = Scaler.from_dict(prior["scaler"])

    def scaled(split: str) -> ClientData:
        arrays = [(scaler.x(x), scaler.y(y)) for x, y in fleet.arrays(split)]
        # A prior with a direction term reads the file's sweep directions (none: b = 0).
        return ClientData.from_arrays(arrays, dtype=F64, branch=fleet.branch_signs(split))

    tensors = FleetTensors(
        scaled("train"), scaled("test"), scaler, tuple(map(str, fleet.client_ids))
    )
    server = {
        "mu": torch.tensor(prior["mu"], dtype=F64),
        "sigma": torch.tensor(prior["sigma"], dtype=F64),
        "noise_var": torch.tensor(prior["noise_var"], dtype=F64),
    }
    if "interval" in prior:  # the fleet's hold-out (fedprior "Intervals"): τ², probe, decline
        iv = prior["interval"]
        for key, name in (("disc_var", "discrepancy_var"), ("probe_n", "probe_rows")):
            server[key] = torch.tensor(float(iv[name]), dtype=F64)
        server["declined"] = torch.tensor(float(iv["declined"]), dtype=F64)
    n = tensors.num_clients
    down = expand(algorithm.broadcast(server), n)
    state = algorithm.client_init(down)
    for _ in range(NOISE_ITERATIONS):  # the unit's own noise level under the fixed prior
        state = algorithm.client_update(down, state, tensors.train).state
    personal = algorithm.personalize(down, state, tensors.train)
    return Calibration(algorithm, tensors, personal, server)


def declined_note(prior: dict[str, Any], result: Calibration) -> str:
    """One line: why some units calibrated from this prior get no interval ("" if none)."""
    declined = result.personal.get("declined")
    if declined is None or not bool((declined > 0).any()):
        return ""
    iv = prior["interval"]
    return iv.get("reason") or DECLINE[4].format(
        n=int(iv["probe_rows"]) or result.algorithm.probe_rows
    )


def write(out: Path, prior: dict[str, Any], fleet: Fleet, result: Calibration) -> pd.DataFrame:
    """A run directory for the new units; returns the per-unit table."""
    out = Path(out)
    cfg = _config(prior)
    method = prior["method"]
    run_dir = out / "runs" / f"{method}_tp0_seed0"
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = run_record(cfg, [method], [0])
    _write_text(out / "config.json", json.dumps(resolved, indent=2, sort_keys=True, default=list))
    _write_text(run_dir / "prior.json", json.dumps(prior, indent=1))
    run = RunResult([], [], result.personal, result.server, {}, 0.0, 0.0, 0.0)
    save_models(
        run_dir / MODEL_FILE, run, result.tensors, cfg, result.algorithm, method, 0, fleet.meta
    )

    ids = result.tensors.client_ids
    names = prior.get("term_names") or [str(t) for t in prior["terms"]]
    names = names + prior.get("branch_term_names", [])  # b·ψ: half the up−down split
    scaler = result.tensors.scaler
    y_scale = float(np.asarray(scaler.y_scale).ravel()[0])
    # In the target's unit: y = offset + scale·Σ c_k φ_k, and φ_0 = 1 carries the offset.
    coef = result.personal["coef"].numpy() * y_scale
    coef[:, 0] += float(np.asarray(scaler.y_offset).ravel()[0])
    table = pd.DataFrame(coef, columns=names)
    table.insert(0, "sensor_id", ids)
    table.insert(1, "points", result.tensors.train.count.numpy())
    table.insert(2, "noise_sd", np.sqrt(result.personal["noise_var"].numpy()) * y_scale)
    _write_csv(out / "coefficients.csv", table)

    per_sensor = table[["sensor_id", "points", "noise_sd"]].copy()
    if int(result.tensors.test.count.sum()) > 0:
        test = errors(result.algorithm, result.personal, result.tensors.test, result.tensors.scaler)
        has_test = result.tensors.test.count.numpy() > 0
        for k, v in test.items():
            per_sensor[f"test_{k}"] = np.where(has_test, v.numpy(), np.nan)
    _write_csv(out / "per_sensor.csv", per_sensor)
    # What the report and the exports read from a run directory: the valid input range of
    # each unit and a summary row.
    _write_text(run_dir / "valid_range.json", json.dumps(valid_ranges(fleet), indent=1))
    row: dict[str, Any] = {"method": method, "seed": 0, "train_points": 0}
    for col in per_sensor.columns:
        if col.startswith("test_"):
            name = col.removeprefix("test_")
            row[f"{name}_mean"] = fleet_stat(per_sensor[col], "mean", name)
            row[f"{name}_worst"] = fleet_stat(per_sensor[col], "worst", name)
    if declined_note(prior, result):
        row["coverage_note"] = declined_note(prior, result)  # why some units have no interval
    if "rmse_mean" in row:
        fs = full_scale(fleet)
        row["rmse_mean_pct_fs"] = 100.0 * row["rmse_mean"] / fs
        row["max_abs_worst_pct_fs"] = 100.0 * row["max_abs_worst"] / fs
    row.update(wall_s=0.0, bytes_up_per_round=0.0, bytes_down_per_round=0.0)
    _write_csv(out / "summary.csv", pd.DataFrame([row]))
    return per_sensor
