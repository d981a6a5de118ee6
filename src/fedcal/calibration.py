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
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from fedcal.algorithms.fedprior import FedPrior
from fedcal.algorithms.fedprior_deployed import DEPLOY_ROWS, deployed
from fedcal.build import build_algorithm, build_task, run_record
from fedcal.config import DataConfig, RunConfig, from_dict
from fedcal.core import hooks, runnames
from fedcal.core.bayes import F64, predictive_var
from fedcal.core.data import ClientData
from fedcal.core.tree import Tree, expand, gather
from fedcal.data.fleet import Fleet
from fedcal.data.scaling import Scaler
from fedcal.engine.evaluation import errors
from fedcal.engine.simulation import FleetTensors, RunResult
from fedcal.experiment import (
    MODEL_FILE,
    _write_text,
    save_models,
)
from fedcal.prior import calibrate_dir, qa
from fedcal.prior.discrepancy import Discrepancy
from fedcal.prior.discrepancy import expected_scale as discrepancy_scale
from fedcal.prior.find import find_prior  # noqa: F401 (torch-free; re-exported)
from fedcal.prior.model import PriorModel
from fedcal.prior.qa import (  # the range guard, QA threshold and grid: torch-free, re-exported
    GRID_POINTS,  # noqa: F401  (calibration.GRID_POINTS: tests/report/test_calibration_report.py)
    RANGE_TOLERANCE,  # noqa: F401  (calibration.RANGE_TOLERANCE: benchmarks/prior_scale.py)
    check_inputs,
    distance_threshold,
    operating_grid,
)

NOISE_ITERATIONS = 25  # fixed-point iterations of a unit's own noise level (converged: tested)
GRID_CHUNK = 512  # units per σ grid evaluation: (units, grid) float64, ~8 MB (fastest measured)
GRID_RANK_TOL = 1e-11  # singular values of the grid's pair products kept (relative): not rounding


def load_prior(path: Path) -> PriorModel:
    """The prior.json at ``path`` as a :class:`~fedcal.prior.model.PriorModel`.

    A regular file, strict JSON, validated on load (:meth:`PriorModel.load`):
    non-finite numbers, wrong lengths, a Σ that is not positive definite, a negative
    variance, an unknown part or a newer file format are one-line errors naming the field.
    """
    return PriorModel.load(path)


def _config(prior: PriorModel) -> RunConfig:
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


@dataclass(frozen=True)
class Calibration:
    algorithm: FedPrior
    tensors: FleetTensors
    personal: Tree
    server: Tree
    reasons: tuple[str, ...] = ()  # per unit, why its design gets no σ ("" if it gets one)


def calibrate(prior: PriorModel, fleet: Fleet, source: str = "data") -> Calibration:
    """Each unit's posterior under the stored prior (see the module docstring)."""
    qa.check_columns(prior, fleet, source)  # the station's checks
    check_inputs(prior, fleet, source)
    algorithm = prior_algorithm(prior, source, timed=fleet.row_times("train") is not None)
    scaler = prior.scaler

    def scaled(split: str) -> ClientData:
        arrays = [(scaler.x(x), scaler.y(y)) for x, y in fleet.arrays(split)]
        # A prior with a direction term reads the file's sweep directions (none: b = 0).
        return ClientData.from_arrays(
            arrays, dtype=F64, branch=fleet.branch_signs(split), time=fleet.row_times(split)
        )

    tensors = FleetTensors(
        scaled("train"), scaled("test"), scaler, tuple(map(str, fleet.client_ids))
    )
    server = prior_server(prior, scaler)
    reasons: list[str] = []
    personal = unit_posteriors(
        algorithm,
        server,
        tensors.train,
        discrepancy=prior.discrepancy,
        names=prior.features,
        reasons=reasons,
    )
    return Calibration(algorithm, tensors, personal, server, tuple(reasons))


def unit_posteriors(
    algorithm: FedPrior,
    server: Tree,
    data: ClientData,
    noise_var: torch.Tensor | None = None,
    discrepancy: dict | None = None,
    names: tuple[str, ...] = (),
    reasons: list[str] | None = None,
    expected: bool = False,
) -> Tree:
    """Each unit's posterior under the stored prior, with what its σ is made of.

    The one place a unit's stated σ is formed off the federation on the torch path:
    :func:`calibrate` calls it on a unit's readings, the planner's torch path
    (:class:`fedcal.planning_torch.TorchForecaster`, for the variants
    :func:`fedcal.prior.posterior.unsupported` names; the others are planned in NumPy by
    :func:`fedcal.prior.posterior.calibrate_units`) on a design's expected readings, so the
    σ ``plan`` forecasts is the σ ``calibrate`` states (a term added here reaches both: the
    prior's ``discrepancy`` model, issue 33, with the features' ``names`` for its reasons,
    appended to ``reasons``). ``noise_var``
    None: each unit's own noise level, the fixed point of :func:`own_noise`; given (the
    planner: the fleet's σ²): that level — the fixed point's value for the fleet's
    typical unit, since under the prior predictive E[rss_i] = n_i σ² (rss_i = ‖y − Φm‖² +
    tr(ΦVΦᵀ) = σ⁴tr(C⁻¹) + n_iσ² −
    σ⁴tr(C⁻¹) in expectation, C = ΦΣΦᵀ + σ²I), so σ_i² = (rss_i + νσ²)/(n_i + ν) = σ².
    ``expected``: the rows are a new unit's design read at the prior mean (the planner), so
    the discrepancy model's per-unit scale is taken at its expectation (:func:`expected_scale`).
    """
    n = data.num_clients
    down = expand(algorithm.broadcast(server), n)
    state = algorithm.client_init(down)
    if noise_var is None:
        state = own_noise(algorithm, down, state, data)
    else:
        state["noise_var"] = noise_var.to(F64).expand(n).clone()
    personal = algorithm.personalize(down, state, data)
    if algorithm.deploy_rows and discrepancy is not None:  # issue 33 (fedprior_deployed)
        personal, why = deployed(algorithm, discrepancy, down, personal, data, list(names))
        if reasons is not None:  # per unit, why its design gets no σ ("" if it gets one)
            reasons.extend(why)
        if expected:  # the planner's new unit, read at the prior mean: its expected scale
            personal = expected_scale(personal, Discrepancy.from_dict(discrepancy).nu0)
    return personal


def expected_scale(personal: Tree, nu0: float) -> Tree:
    """The planner's units with the discrepancy model's per-unit scale at its expectation.

    D4 (:mod:`fedcal.prior.discrepancy`): s_i² = (ν₀ + d_i²)/(ν₀ + n_i), d_i² = rᵀC⁻¹r of
    the unit's readings about the prior mean, E[d_i²] = n_i under the model, so
    E[s_i²] = 1. The planner reads a design at the current mean (r = 0 on its new rows):
    its s_i² would be ν₀/(ν₀ + n_i), not the 1 a unit of the fleet has on average. So the
    forecast takes κ² · (t/1.96)² with s_i² = 1: s_i² at d² = 0 divided out
    (:func:`fedcal.prior.discrepancy.expected_scale`, the NumPy planner's too; ν₀ = ∞:
    s_i² = 1 already; a unit without the model's σ, ``gp_amp`` 0: untouched).
    """
    if "gp_scale" not in personal:
        return personal
    args = (personal["gp_scale"], personal["gp_amp"], personal["gp_mask"])
    return {**personal, "gp_scale": discrepancy_scale(nu0, *args)}


def own_noise(algorithm: FedPrior, down: Tree, state: Tree, data: ClientData) -> Tree:
    """The unit's noise level under the fixed prior: NOISE_ITERATIONS steps of the
    federation's fixed point σ_i² = (r_i + νσ²)/(n_i + ν) (:meth:`FedPrior.client_update`).

    Only the state of ``client_update`` is used here, so only its posterior and noise step
    are computed, on moments formed once: the same operations on the same inputs as
    ``client_update``'s (the same bits, tested), without the M-step terms it also uploads.
    """
    if algorithm.select != "none":  # candidates' noise levels too: the whole client step
        for _ in range(NOISE_ITERATIONS):
            state = algorithm.client_update(down, state, data).state
        return state
    full = algorithm._client_moments(down, data)  # fedprior_drift: whitened by its q
    for _ in range(NOISE_ITERATIONS):
        if algorithm.noise != "sensor":  # one fleet σ²: the state does not move
            break
        _, post = algorithm._posterior(down, state, full)
        state = {**state, "noise_var": algorithm._sensor_noise(post.rss, full.n, down["noise_var"])}
    return state


def coefficient_table(prior: PriorModel, result: Calibration) -> pd.DataFrame:
    """``coefficients.csv``: per unit its points, noise σ and coefficients (module docstring).

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
    cfg = _config(prior)
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
    calibrate_dir.write_tables(out, prior, fleet, tables, declined_note(prior, result))
    return per_sensor


def fleet_distance(
    algorithm: FedPrior, server: Tree, noise_var: torch.Tensor, data: ClientData
) -> tuple[np.ndarray, np.ndarray]:
    """Each unit's squared distance from the fleet d²_i and its degrees of freedom.

    d²_i = (m_i − μ)ᵀ(Σ − V_i)⁺(m_i − μ): the Mahalanobis distance of the unit's
    posterior mean m_i under the distribution it has when the unit is drawn from
    the prior, N(μ, Σ − V_i) (V_i its posterior covariance). Computed in data
    space, where it is well conditioned: with C_i = Φ_iΣΦ_iᵀ + σ_i²I = L Lᵀ,
    e = L⁻¹(y_i − Φ_iμ) and A = L⁻¹Φ_i, m_i − μ = ΣΦ_iᵀL⁻ᵀe and Σ − V_i =
    ΣΦ_iᵀC_i⁻¹Φ_iΣ, so d²_i = ‖P_A e‖² (P_A the projection on A's columns) and,
    for a unit of the fleet, d²_i ~ χ² with rank(A) degrees of freedom (Φ_i of
    full row rank: d²_i = eᵀe, the whitened residual of its points under the
    prior predictive). The linear algebra is :func:`fedcal.prior.qa.distances` (NumPy: the
    station's too), on this algorithm's design.
    """
    real = (data.mask > 0).to(F64)
    design = algorithm.design(data.x, data.branch).to(F64) * real.unsqueeze(-1)
    return qa.distances(
        design.numpy(), data.y[..., 0].to(F64).numpy(), real.numpy(),
        server["mu"].to(F64).numpy(), server["sigma"].to(F64).numpy(), noise_var.to(F64).numpy(),
    )  # fmt: skip


def grid_sigma(alg: FedPrior, personal: Tree, grid: torch.Tensor) -> np.ndarray:
    """Predictive σ of each unit (scaled) at every point of the shared ``grid``: (units, grid).

    :meth:`FedPrior.predictive_std` at ``grid`` for every unit. The grid lies in the prior's
    input range, inside every unit's support box (:func:`prior_server`), so no point is
    extrapolated and the design z(grid) is every unit's: it is formed once, not per unit
    (the same numbers; a unit whose box does not hold the grid takes the general path, and
    so does a unit calibrated from the prior's discrepancy model: its σ is D2–D4's).
    """
    box = personal["box"].to(F64)
    inside = ((grid >= box[:, :1]) & (grid <= box[:, 1:])).all()
    n = box.shape[0]
    if not bool(inside) or "gp_x" in personal:
        return alg.predictive_std(personal, grid.expand(n, -1, -1))[..., 0].numpy()
    q, s = alg.variance_form(personal)
    design = alg.variance_design(grid.unsqueeze(0)).expand(n, -1, -1)
    return predictive_var(design, q, s).sqrt().numpy()


@dataclass(frozen=True)
class GridForm:
    """σ² over a shared grid as a low-rank product: σ²(grid) = s + Q_u · left · rightᵀ.

    z(x)ᵀQz(x) = Σ_{j≤k} w_jk(x) Q_jk with w_jk = (2 − δ_jk) z_j z_k: linear in the upper
    triangle Q_u of the unit's symmetric Q (:meth:`FedPrior.variance_form`). The grid's
    matrix W (grid × pairs) has the rank of the polynomials the products z_j z_k span
    (63 for orders (4, 3): degree ≤ (8, 6)), not the number of pairs (210), so its thin
    SVD W = U S Vᵀ, truncated where S is rounding (``GRID_RANK_TOL``), gives σ² on the
    whole grid for (pairs × r + r × grid) multiply-adds per unit instead of grid × p².
    ``moment`` M = mean over the grid of z zᵀ: the mean of σ² is s + tr(Q M) (tested).
    """

    rows: torch.Tensor  # upper-triangle indices (2, pairs)
    left: torch.Tensor  # V_r S_r (pairs, r)
    right: torch.Tensor  # U_r (grid, r)
    moment: torch.Tensor  # (p, p)


def grid_form(alg: FedPrior, grid: torch.Tensor) -> GridForm:
    """The :class:`GridForm` of ``grid`` (scaled inputs) for ``alg``'s variance design."""
    z = alg.variance_design(grid.unsqueeze(0))[0].to(F64)  # (grid, p)
    p = z.shape[-1]
    rows = torch.triu_indices(p, p)
    twice = torch.where(rows[0] == rows[1], 1.0, 2.0).to(F64)
    w = z[:, rows[0]] * z[:, rows[1]] * twice
    u, sv, vt = torch.linalg.svd(w, full_matrices=False)
    keep = sv > GRID_RANK_TOL * sv[0]
    return GridForm(rows, vt[keep].mT * sv[keep], u[:, keep], z.mT @ z / z.shape[0])


def grid_sigma_summary(
    alg: FedPrior, personal: Tree, grid: torch.Tensor, form: GridForm | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Per unit the mean and the max of the predictive σ over the shared ``grid`` (scaled).

    The same dense grid as :func:`grid_sigma` (equal to it within rounding, ~1e-13
    relative: tested), through :class:`GridForm`. A chunk whose units' boxes do not
    all hold the grid takes :func:`grid_sigma`, and so do units calibrated from the prior's
    discrepancy model (their σ is not z(x)ᵀQz(x) + s: D2–D4, ``gp_*`` parameters).
    """
    form = grid_form(alg, grid) if form is None else form
    box = personal["box"].to(F64)
    inside = bool(((grid >= box[:, :1]) & (grid <= box[:, 1:])).all())
    if not inside or "gp_x" in personal:
        sigma = grid_sigma(alg, personal, grid)
        return sigma.mean(-1), sigma.max(-1)
    q, s = alg.variance_form(personal)
    var = (q[:, form.rows[0], form.rows[1]] @ form.left) @ form.right.mT + s.unsqueeze(-1)
    sigma = var.clamp_min(0.0).sqrt()  # ≥ 0 up to rounding (Q is PSD)
    return sigma.mean(-1).numpy(), sigma.amax(-1).numpy()


def unit_diagnostics(prior: PriorModel, result: Calibration) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per unit: status, fleet distance, σ over the operating range, calibration residuals.

    Returns (units, points): ``units`` one row per unit — ``d2`` and ``dof``
    (:func:`fleet_distance`), ``d2_threshold`` (its quantile at
    ``QA_LEVEL``: :func:`distance_threshold`), ``p_value``, ``unlike_fleet`` (d²
    above the threshold: a QA finding), ``sigma_mean``/``sigma_max`` (predictive σ
    over a grid of the prior's input range, target units), ``resid_rms``/``resid_max_abs`` at its
    calibration points and ``status`` ("ok", "unlike the fleet", or "failed"
    when its posterior is not finite); ``points`` one row per calibration point
    with its prediction, residual (calibrated − reference) and σ.
    """
    alg, tensors, personal = result.algorithm, result.tensors, result.personal
    scaler = tensors.scaler
    y_scale = abs(float(np.asarray(scaler.y_scale).ravel()[0]))
    train = tensors.train
    d2, dof = fleet_distance(alg, result.server, personal["noise_var"], train)
    threshold, p_value = distance_threshold(d2, dof, prior.num_units)
    grid = torch.as_tensor(scaler.x(operating_grid(prior)), dtype=F64)
    n = tensors.num_clients
    with torch.no_grad():
        form = grid_form(alg, grid)
        parts = [
            grid_sigma_summary(alg, gather(personal, rows), grid, form)
            for rows in torch.arange(n).split(GRID_CHUNK)
        ]
        sigma_mean = np.concatenate([m for m, _ in parts]) * y_scale
        sigma_max = np.concatenate([m for _, m in parts]) * y_scale
        pred = scaler.y_inverse(alg.predict(personal, train.x.to(F64)).numpy().reshape(-1, 1))
        pred_std = alg.predictive_std(personal, train.x.to(F64))[..., 0].numpy() * y_scale
    pred = pred.reshape(n, -1)
    ref = scaler.y_inverse(train.y[..., 0].double().numpy().reshape(-1, 1)).reshape(n, -1)
    raw_x = (
        train.x.double().numpy().reshape(-1, train.x.shape[-1]) * scaler.x_scale + scaler.x_offset
    )
    raw_x = raw_x.reshape(n, -1, train.x.shape[-1])
    status = qa.unit_status(personal["coef"].numpy(), d2, threshold)  # the station's rule
    unlike = np.isfinite(d2) & (d2 > threshold)
    checks = {
        "status": status, "d2": d2, "dof": dof, "d2_threshold": threshold, "p_value": p_value,
        "unlike_fleet": unlike, "sigma_mean": sigma_mean, "sigma_max": sigma_max,
    }  # fmt: skip
    mask = train.mask.numpy() > 0
    table, points = calibrate_dir.residual_tables(
        prior, tensors.client_ids, raw_x, ref, pred, pred_std, mask, checks
    )
    if isinstance(alg, hooks.UnitColumns):  # fedprior_drift: recalibrate_at
        with torch.no_grad():
            table = table.assign(**hooks.labelled_units(alg, alg.unit_columns(personal, train)))
    return table, points


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
    cfg = _config(prior)
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


RECORD_FEATURES = range(1, 9)  # input counts the torch-free calibrate's record covers


def record_template() -> dict[str, Any]:
    """What a calibrate output's config.json and model file hold that is fedcal's defaults,
    not the prior's: the run record of the default configuration (:func:`_config` less the
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


if __name__ == "__main__":  # rewrite the shipped record (fedcal/prior/calibrate_record.json)
    from fedcal.prior.calibrate_dir import TEMPLATE

    _write_text(TEMPLATE, json.dumps(record_template(), indent=1) + "\n")
    print(f"wrote {TEMPLATE}")
