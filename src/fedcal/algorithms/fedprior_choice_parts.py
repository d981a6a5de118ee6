"""fedprior_choice's pieces that are plain functions of tensors: a unit's row subsets,
scores from moments, the ridge solve, the broadcast pooled lines and index helpers
(:mod:`fedcal.algorithms.fedprior_choice`)."""

from __future__ import annotations

import torch
from torch import Tensor

from fedcal.core.bayes import F64, Moments, moments
from fedcal.core.data import ClientData
from fedcal.core.tree import Tree

FOLDS = 2


def row_times(data: ClientData) -> Tensor:
    """(clients, rows) each row's time: the data's time column, or the row order without one."""
    if data.time is not None:
        return data.time.to(F64)
    return torch.arange(data.x.shape[1], dtype=F64).expand(data.x.shape[:2])


def subset(data: ClientData, keep: Tensor) -> ClientData:
    """The unit's rows where ``keep`` (clients, rows) is set, gathered to the front
    (``count`` = their number); the others after them as padding."""
    keep = keep > 0
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)

    def take(v: Tensor | None) -> Tensor | None:
        if v is None:
            return None
        idx = order.reshape(*order.shape, *([1] * (v.dim() - 2))).expand_as(v)
        return torch.gather(v, 1, idx)

    return ClientData(
        take(data.x),
        take(data.y),
        keep.sum(1),
        data.seeds,
        data.index,
        take(data.branch),
        take(data.time),
        None,
    )


def late_sse(late: Moments, coef: Tensor) -> Tensor:
    """Σ (y − φᵀc)² over the scored rows from their moments: yy − 2cᵀb + cᵀGc."""
    quad = (coef.unsqueeze(-2) @ late.gram @ coef.unsqueeze(-1))[..., 0, 0]
    return (late.yy - 2 * (coef * late.rhs).sum(-1) + quad).clamp_min(0.0)


def ridge_solve(gram: Tensor, rhs: Tensor) -> Tensor:
    """Least squares from moments, a 1e-9 ridge relative to the Gram's mean diagonal and at
    least 1e-9 (absolute: a unit with no rows gets the line 0, never NaN), so that a unit
    without enough rows (or a constant input) still gets a (poor) line, never a crash."""
    eye = torch.eye(gram.shape[-1], dtype=F64)
    scale = gram.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1.0)
    a = gram + 1e-9 * scale.unsqueeze(-1).unsqueeze(-1) * eye
    return torch.linalg.solve(a, rhs.unsqueeze(-1))[..., 0]


def pooled_lines(down: Tree, terms: int) -> tuple[Tensor, Tensor] | None:
    """The broadcast pooled lines ((1 or clients, folds, L), (1 or clients, L)), or None
    before the fleet has summed any (a broadcast may carry a clients axis)."""
    if "pooled_ok" not in down or not float(down["pooled_ok"].reshape(-1)[0]) > 0:
        return None
    fold = down["pooled_fold"].to(F64).reshape(-1, FOLDS, terms)
    return fold, down["pooled_all"].to(F64).reshape(-1, terms)


def repeat_moments(stats: Moments, k: int) -> Moments:
    """Moments (clients, …) repeated for k candidates: (clients, k, …)."""
    return Moments(
        stats.gram.unsqueeze(1).expand(-1, k, -1, -1),
        stats.rhs.unsqueeze(1).expand(-1, k, -1),
        stats.yy.unsqueeze(1).expand(-1, k),
        stats.n.unsqueeze(1).expand(-1, k),
    )


def pick_err(err: Tensor, best: Tensor) -> Tensor:
    """err (3, clients, rows) at each client's ``best`` candidate: (clients, rows)."""
    return err.permute(1, 0, 2)[torch.arange(err.shape[1]), best]


def pick_mse(mse: Tensor, best: Tensor) -> Tensor:
    """mse (3, clients) at each client's ``best``: (clients,)."""
    return mse.T[torch.arange(mse.shape[1]), best]


def linear_index(terms: tuple[tuple[int, ...], ...], inputs: int) -> list[int] | None:
    """Indices of the constant and of each input's P̃₁ term, or None if any is missing."""
    where = {t: i for i, t in enumerate(terms)}
    wanted = [tuple([0] * inputs)]
    wanted += [tuple(1 if j == k else 0 for j in range(inputs)) for k in range(inputs)]
    if any(w not in where for w in wanted):
        return None
    return [where[w] for w in wanted]


def fleet_time_scale(span: Tensor, order: Tensor, cap: float) -> Tensor:
    """The fleet's time scale T: the mean declared span, each capped at ``cap`` × the median.

    One forged, huge span would otherwise make T (and so q/T) as large (small) as it likes,
    switching the drift off; capped, it moves T by at most (cap − 1)·median/units. Honest
    fleets whose spans lie within ``cap`` × their median get the plain mean. A median of 0
    (most units at a single time) leaves the spans uncapped.
    """
    span = span.to(F64)
    med = span.median()
    if float(med) > 0:
        span = span.clamp_max(cap * med)
    return span[order].sum(0) / max(float(span.shape[0]), 1.0)


def ship_simple(
    out: Tree,
    data: ClientData,
    design: Tensor,
    best: Tensor,
    worse: Tensor,
    val: Tensor,
    lin: Tensor,
    raw_coef: Tensor | None,
    pooled: tuple[Tensor, Tensor] | None,
) -> Tree:
    """The no-harm fall-back (fedprior_choice): the ``worse`` units' model ``out`` replaced
    by their ``best`` simple candidate fitted on all rows (0: own line on the linear terms
    ``lin``, 1: the fleet's ``pooled`` line, 2: the raw reading ``raw_coef``), with their
    validation MSE ``val`` (at least the in-sample one) as σ_i² and no τ²."""
    y = data.y[..., 0].to(F64)
    full = moments(design, y, data.mask.to(F64))
    g, r = full.gram[:, lin][:, :, lin], full.rhs[:, lin]
    p = design.shape[-1]
    coef = torch.zeros(data.num_clients, 3, p, dtype=F64)
    coef[:, 0, lin] = ridge_solve(g, r)
    if pooled is not None:
        coef[:, 1, lin] = pooled[1]
    if raw_coef is not None:
        coef[:, 2] = raw_coef
    chosen = coef[torch.arange(data.num_clients), best]
    resid = late_sse(full, chosen) / full.n.clamp_min(1.0)
    cov = torch.zeros(data.num_clients, p, p, dtype=F64)
    own_cov = torch.linalg.pinv(g) * resid.unsqueeze(-1).unsqueeze(-1)
    cov[:, lin.unsqueeze(1), lin.unsqueeze(0)] = own_cov
    cov = torch.where((best == 0).reshape(-1, 1, 1), cov, 0.0)
    w = worse.reshape(-1, 1)
    out["coef"] = torch.where(w, chosen, out["coef"].to(F64))
    out["cov"] = torch.where(w.unsqueeze(-1), cov, out["cov"].to(F64))
    noise = torch.maximum(val, resid)  # its error on its own future, at least in-sample
    out["noise_var"] = torch.where(worse, noise, out["noise_var"].to(F64).expand_as(noise))
    if "disc_var" in out:
        out["disc_var"] = torch.where(worse, 0.0, out["disc_var"].to(F64))
    out["fallback"] = torch.where(worse, 1.0 + best.to(F64), 0.0)
    out["val_mse"] = torch.where(worse, val, out["val_mse"])
    return out
