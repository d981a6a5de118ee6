"""The evaluation step, shared by the simulator and a Flower site.

After round ``t`` each client's personal model is ``personalize(broadcast,
state, train rows)`` with the client's personalize seeds of round ``t``
(:func:`fedcal.engine.schedule.personalize_seeds`); it is scored on the
client's test and train rows in the target's unit, and flagged when one of
its floating leaves is not finite (the row's ``status`` then says
"diverged", :func:`fedcal.engine.schedule.result_row`). The simulator runs
this per chunk of its fleet, a Flower site once over its sensors: one
function, so the two engines cannot score differently.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from fedcal.core.aggregation import finite_rows
from fedcal.core.algorithm import Algorithm
from fedcal.core.data import ClientData
from fedcal.core.hooks import TimedStd
from fedcal.core.tree import Tree, expand
from fedcal.data.scaling import Scaler
from fedcal.models.families import reused_designs


class CohortEvaluation(NamedTuple):
    """A cohort's evaluation: every leaf (and metric) has a leading clients axis."""

    personal: Tree  # the personal models
    test: dict[str, Tensor]  # the task's metrics on the test rows, (clients,) each
    train: dict[str, Tensor]  # ... on the train rows
    finite: Tensor  # (clients,) bool: the personal model is finite


def evaluate_cohort(
    algorithm: Algorithm,
    down: Tree,
    states: Tree,
    train: ClientData,
    test: ClientData,
    scaler: Scaler,
    personal: Tree | None = None,
) -> CohortEvaluation:
    """Personalize a cohort and score it on its test and train rows.

    ``down`` is the server's broadcast (no clients axis), ``states`` the
    cohort's private states and ``train`` its train rows carrying the
    personalize seeds of the round evaluated. Given ``personal`` (the cohort's
    personal models), scores those instead of personalizing.
    """
    n = train.num_clients
    if personal is None:
        personal = algorithm.personalize(expand(down, n), states, train)
    finite = finite_rows(personal)
    return CohortEvaluation(
        personal,
        errors(algorithm, personal, test, scaler),
        errors(algorithm, personal, train, scaler),
        finite if finite.numel() else torch.ones(n, dtype=torch.bool),  # no floating leaf
    )


def errors(
    algorithm: Algorithm, params: Tree, data: ClientData, scaler: Scaler
) -> dict[str, Tensor]:
    """The task's per-client metrics of ``params`` on ``data`` (target units).

    The prediction, σ, interval and support guard each form the basis design of the same
    rows: within :func:`~fedcal.models.families.reused_designs` it is formed once (the same
    bits; at 10,000 units the designs were 2/3 of an evaluation's seconds, issue 36.1).
    """
    with torch.no_grad(), reused_designs():
        pred = algorithm.predict(params, data.x)
        # fedprior_drift: its σ grows with time since calibration (σ at each row's time); the
        # interval is stated for that σ(t) as for σ (±1.96 σ(t), or the sweep mixture's)
        if isinstance(algorithm, TimedStd):
            std = algorithm.predictive_std_timed(params, data)
        else:
            std = algorithm.predictive_std(params, data.x)
        half = algorithm.interval_halfwidth(params, data.x, std) if std is not None else None
        # the rows the guard linearized (the fraction below)
        guard = algorithm.beyond_support
        beyond = None if guard is None else guard(params, data.x)
    scale = torch.as_tensor(scaler.y_scale, dtype=pred.dtype, device=pred.device)
    out = algorithm.task.metrics(pred, data.y, data.mask, scale)
    if std is not None:
        out.update(interval_metrics(pred, std, data.y, data.mask, scale, half))
    if beyond is not None:
        flagged = beyond.to(pred.dtype) * data.mask.to(pred.dtype)
        out["beyond_support"] = flagged.sum(1) / data.mask.sum(1).clamp_min(1.0).to(pred.dtype)
    return out


def interval_metrics(
    pred: Tensor,
    std: Tensor,
    y: Tensor,
    mask: Tensor,
    y_scale: Tensor,
    halfwidth: Tensor | None = None,
) -> dict[str, Tensor]:
    """Per-client calibration of predictive intervals (clients,).

    ``coverage95``: the fraction of rows whose error lies inside the method's stated 95 %
    interval, ± ``halfwidth`` (:meth:`Algorithm.interval_halfwidth`; default ±1.96 σ);
    ``pred_sd``: the mean predictive σ in the target's unit.
    A client whose σ is NaN on a row (the method states no interval, e.g. fedprior's
    declined intervals) gets NaN for both: no interval, not an empty one.
    """
    m = mask.unsqueeze(-1).to(pred.dtype)
    n = (m.sum((1, 2))).clamp_min(1.0)
    half = 1.959964 * std if halfwidth is None else halfwidth
    inside = ((pred - y).abs() <= half).to(pred.dtype)
    stated = ~(torch.isnan(std) & (m > 0)).any(2).any(1)
    nan = torch.tensor(float("nan"), dtype=pred.dtype)
    return {
        "coverage95": torch.where(stated, (inside * m).sum((1, 2)) / n, nan),
        "pred_sd": torch.where(stated, (torch.nan_to_num(std) * y_scale * m).sum((1, 2)) / n, nan),
    }
