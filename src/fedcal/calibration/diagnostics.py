"""Each calibrated unit's QA (:func:`unit_diagnostics`): its distance from the fleet, its
predictive σ over the prior's operating range and its residuals at its calibration points."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from fedcal.algorithms.fedprior import FedPrior
from fedcal.calibration.posterior import Calibration
from fedcal.core import hooks
from fedcal.core.bayes import F64, predictive_var
from fedcal.core.data import ClientData
from fedcal.core.tree import Tree, gather
from fedcal.prior import calibrate_dir, qa
from fedcal.prior.model import PriorModel
from fedcal.prior.qa import distance_threshold, operating_grid

GRID_CHUNK = 512  # units per σ grid evaluation: (units, grid) float64, ~8 MB (fastest measured)
GRID_RANK_TOL = 1e-11  # singular values of the grid's pair products kept (relative): not rounding


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
