"""A stored prior made ready to calibrate: its configuration, the fedprior algorithm it was
learned with (its basis fixed) and the server state it gives a new unit; and the record of
fedcal's defaults the torch-free calibrate ships (:func:`record_template`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedcal.algorithms.fedprior import FedPrior
from fedcal.algorithms.fedprior_deployed import DEPLOY_ROWS
from fedcal.build import build_algorithm, build_task, run_record
from fedcal.config import DataConfig, RunConfig, from_dict
from fedcal.core import hooks
from fedcal.core.bayes import F64
from fedcal.core.tree import Tree
from fedcal.data.scaling import Scaler
from fedcal.prior import calibrate_dir
from fedcal.prior.model import PriorModel

RECORD_FEATURES = range(1, 9)  # input counts the torch-free calibrate's record covers


def load_prior(path: Path) -> PriorModel:
    """The prior.json at ``path`` as a :class:`~fedcal.prior.model.PriorModel`.

    A regular file, strict JSON, validated on load (:meth:`PriorModel.load`):
    non-finite numbers, wrong lengths, a Σ that is not positive definite, a negative
    variance, an unknown part or a newer file format are one-line errors naming the field.
    """
    return PriorModel.load(path)


def prior_config(prior: PriorModel) -> RunConfig:
    """The configuration that rebuilds this prior's algorithm (and its run directory)."""
    method = prior.method
    params = calibrate_dir.fixed_params(prior)  # the chosen sub-basis fixed, a variant's base
    if prior.discrepancy is not None and params.get("interval") == "calibrated":  # issue 33
        params["deploy_rows"] = DEPLOY_ROWS
    cfg = from_dict({"methods": {method: params}}, "prior.json")
    data = DataConfig(
        features=prior.features, target=prior.target, client_column=prior.sensor_column
    )
    return replace(cfg, data=data, methods=(method,), seeds=1)


def prior_server(prior: PriorModel, scaler: Scaler | None = None) -> Tree:
    """The server state a stored prior gives a new unit: (μ, Σ, σ²) and the support box.

    The box is the fleet's calibrated input range (scaled): inside it no prediction is
    extrapolated (the guard of :meth:`FedPrior.predict`). With a calibrated interval the
    fleet's hold-out result too (fedprior "Intervals", I2–I3): τ², the probe's size and the
    decline code, so a new unit gets the σ the federation gives a unit of its design. What
    ``calibrate`` and the planner's torch path (:mod:`fedcal.planning_torch`) broadcast. The
    parts were validated when the value was made (:mod:`fedcal.prior.model`).
    """
    scaler = prior.scaler if scaler is None else scaler
    span = np.array([prior.input_range[c] for c in prior.features], dtype=float).T
    server = {
        "mu": torch.tensor(prior.mean, dtype=F64),
        "sigma": torch.tensor(prior.covariance, dtype=F64),
        "noise_var": torch.tensor(prior.noise.variance, dtype=F64),
        "box": torch.tensor(scaler.x(span), dtype=F64),
    }
    iv = prior.interval
    if iv is not None:
        server["disc_var"] = torch.tensor(iv.discrepancy_var, dtype=F64)
        server["probe_n"] = torch.tensor(iv.probe_rows, dtype=F64)
        server["declined"] = torch.tensor(float(iv.declined), dtype=F64)
        if iv.weak_projector is not None:  # I3: each new unit's own test (FedPrior.weak_units)
            server["weak_proj"] = torch.tensor(iv.weak_projector, dtype=F64)
        if iv.has_own:  # fedprior I4: None = no τ² covered (declined)
            own = iv.discrepancy_var_own
            server["disc_own"] = torch.tensor(math.nan if own is None else float(own), dtype=F64)
    basis = prior.basis
    if basis.pinned:  # ψ terms out of the model (fedprior_pins.BranchPins.unidentified)
        out = [0.0] * len(basis.terms) + [float(t in basis.pinned) for t in basis.branch_terms]
        server["pinned"] = torch.tensor(out, dtype=F64)
    if prior.noise.gamma is not None:  # the noise in the inputs, σ² exp(γᵀx) (fedprior_noise)
        server["noise_gamma"] = torch.tensor(prior.noise.gamma, dtype=F64)
    if prior.noise.student is not None:  # noise_tail = "auto": t rows if chosen (N6)
        server["noise_student"] = torch.tensor(float(prior.noise.student), dtype=F64)
    if prior.drift is not None:  # fedprior_drift: the fleet's drift variance and time scale
        drift = prior.drift
        server["drift"] = {
            "q": torch.tensor(drift.q, dtype=F64),
            "scale": torch.tensor(drift.time_scale, dtype=F64),
            "seen": torch.tensor(drift.seen, dtype=F64),
        }
        if drift.short is not None:  # a short co-location's weight and τ² (fedprior_short, S4)
            short = drift.short
            tau = math.nan if short.tau is None else short.tau
            server["drift"]["short"] = {
                "window": torch.tensor(short.window, dtype=F64),
                "temper": torch.tensor(short.temper, dtype=F64),
                "tau": torch.tensor(tau, dtype=F64),
                "held": torch.tensor(short.held, dtype=F64),
                "q": torch.tensor(short.q, dtype=F64),
            }
    return server


def prior_algorithm(prior: PriorModel, source: str = "prior.json", timed: bool = False) -> FedPrior:
    """The fedprior algorithm a stored prior was learned with (its chosen basis, fixed).

    What :func:`calibrate` builds, and readers of a prior that have no units' data yet
    (``fedcal plan``): the prior's configuration, its basis terms checked against it. A
    prior recorded with ``choose = "auto"`` has the time-respecting choice on only for data
    with their own time column (``timed``): a file without one is not read as if its row
    order were time. Its raw reading's map is the prior's scaler's (``with_scaler``).
    """
    cfg = prior_config(prior)
    algorithm = build_algorithm(prior.method, cfg, build_task(cfg, len(prior.features)))
    if not isinstance(algorithm, FedPrior):
        raise ValueError(f"{source}: prior method {prior.method!r} is not a fedprior method")
    if prior.provenance.method_params.get("choose") == "auto":
        algorithm = replace(algorithm, choose="time" if timed else "off")
    algorithm = hooks.with_scaler(algorithm, prior.scaler)
    if tuple(map(tuple, algorithm.terms)) != prior.basis.terms or (
        tuple(map(tuple, algorithm.branch_terms)) != prior.basis.branch_terms
    ):
        raise ValueError("prior.json: its basis terms do not match its method parameters")
    return algorithm


def record_template() -> dict[str, Any]:
    """What a calibrate output's config.json and model file hold that is fedcal's defaults,
    not the prior's: the run record of the default configuration (:func:`prior_config` less the
    prior's columns and method), the model settings and, per input count, the task model's
    repr and head layers. Shipped as ``fedcal/prior/calibrate_record.json`` for
    :mod:`fedcal.prior.calibrate_dir` (no torch); tests/prior/test_calibrate_dir.py holds
    the file equal to this (``python -m fedcal.calibration`` rewrites it)."""
    cfg = replace(from_dict({}, "defaults"), data=DataConfig(), methods=(), seeds=1)
    tasks = {str(n): build_task(cfg, n) for n in RECORD_FEATURES}
    return {
        "config": run_record(cfg, [], [0]),
        "model": dataclasses.asdict(cfg.model),
        "model_repr": {n: repr(t.model) for n, t in tasks.items()},
        "head_layers": {n: t.head_layers for n, t in tasks.items()},
    }
