"""Each sensor's status after a run: ok, weak, rejected, unconverged, diverged or refused.

A number in a table is only worth something if the sensor's model is a calibration.
After a run each sensor gets one status (docs/statuses.md), by the first rule that
applies, in this order:

``refused``
    the method declined to calibrate it (``Algorithm.client_status`` flag
    ``"refused"``; e.g. the polynomial on points that support no surface).
``diverged``
    its personal model or its test error is not finite (the engine's row status).
``rejected``
    the server screened its reply out in one of the final rounds: the last
    ``max(1, ceil(REJECTED_WINDOW × rounds))`` rounds run (its model then rests on
    a state the federation did not accept). A down-weighting (fedprior's M-step weight,
    its reply still aggregated) is not a rejection: reported as "down-weighted".
``weak``
    its predictions lean on directions the fleet's data do not determine
    (``client_status`` flag ``"weak"``; fedprior: the weakly identified directions).
``unconverged``
    its train error was still falling at the end: between the last two evaluated
    rounds t₁ < t₂ it fell by more than ``UNCONVERGED_TOL`` (relative) per round,
    (e₁ − e₂) / max(e₁, ẽ₁) / (t₂ − t₁) > UNCONVERGED_TOL, with ẽ₁ the fleet's median
    train error at t₁: a unit that interpolates its few points (train error ≈ 0) is
    not "still improving" because 1e-5 hPa moves by 1 %. Needs two evaluated rounds.
    Also (a method trained over more than one round, a regression metric): its final
    train error is more than ``OWN_FIT_FACTOR`` (10) times its own fit's,
    e_i > OWN_FIT_FACTOR · max(f_i, f̃), with f_i the train RMSE of the unit's own
    least-squares fit on a tensor Legendre basis of total degree ≤ 3, the largest
    degree with at most half as many terms as the unit has points (:func:`own_fit_rmse`;
    no such degree: no check), and f̃ the fleet's median f: training left the unit far
    from what its own points support (e.g. an FCN stuck at 15 hPa where a polynomial
    fits 0.1). ``unconverged_tol`` = 1 turns both checks off.
``ok``
    none of the above.

A method that crashed has no sensors: its summary row says ``failed``, never
``diverged``. Fleet means and worst values are taken over the ``ok`` sensors only,
and the summary counts the others per status (:func:`counts`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

if TYPE_CHECKING:  # torch only where a status is computed (own_fit_rmse), not to read one
    import torch


class Status(StrEnum):
    """A sensor's status, declared once, least severe first: the order of precedence (module
    doc: the first rule that applies is the most severe). A member is its string (JSON, CSV:
    ``Status.WEAK == "weak"``)."""

    OK = "ok"
    UNCONVERGED = "unconverged"
    WEAK = "weak"
    REJECTED = "rejected"
    DIVERGED = "diverged"
    REFUSED = "refused"


STATUSES = tuple(Status)  # every status, least severe first
NOT_OK = tuple(reversed(STATUSES[1:]))  # the excluded ones, most severe first (run notes)
# the summary's count column of each status other than ok ("diverged" as before)
COUNT_COLUMNS = {
    Status.WEAK: "weak",
    Status.UNCONVERGED: "unconverged",
    Status.REJECTED: "rejected_sensors",
    Status.DIVERGED: "diverged",
    Status.REFUSED: "refused",
}
REJECTED_WINDOW = 0.1  # "final rounds": the last 10 % of the rounds (at least one)
HIGHER_IS_BETTER = ("accuracy",)  # metrics whose error is 1 − metric (convergence)
UNCONVERGED_TOL = 1e-3  # relative fall of the train error per round that is "still improving"
OWN_FIT_FACTOR = 10.0  # train error this many times the unit's own least-squares fit's
OWN_FIT_DEGREES = (3, 2, 1)  # own fit: the highest total degree with terms ≤ points / 2
OWN_FIT_CHUNK = 1024  # units per batched solve (memory: chunk × rows × terms)


def own_fit_rmse(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(clients,) train RMSE (scaled units) of each unit's own least-squares fit, NaN where
    no degree leaves residual information.

    x (clients, rows, inputs) scaled, y (clients, rows[, 1]), mask (clients, rows). Basis:
    φ = tensor Legendre products of total degree ≤ d (:func:`legendre_products`), d the
    first of :data:`OWN_FIT_DEGREES` with p(d) ≤ n_i / 2 (at least as many residual degrees
    of freedom as terms); RMSE = √(‖y − Φĉ‖² / n_i) with ĉ the minimum-norm solution.
    """
    import torch

    from fedcal.models.basis import legendre_exponents, legendre_products

    x, m = x.to(torch.float64), mask.to(torch.float64)
    y = y.to(torch.float64).reshape(m.shape)
    n = m.sum(1)
    out = torch.full(n.shape, math.nan, dtype=torch.float64)
    done = torch.zeros(n.shape, dtype=torch.bool)
    for d in OWN_FIT_DEGREES:
        try:
            terms = legendre_exponents(x.shape[-1], degree=d)
        except ValueError:  # more terms than any basis may hold: no unit has 2p rows
            break
        use = (~done) & (n >= 2 * len(terms))
        for idx in torch.nonzero(use).flatten().split(OWN_FIT_CHUNK):
            w = m[idx].unsqueeze(-1)
            phi = legendre_products(x[idx], terms) * w
            target = (y[idx] * m[idx]).unsqueeze(-1)
            coef = torch.linalg.lstsq(phi, target, driver="gelsd").solution
            resid = ((phi @ coef - target).squeeze(-1) ** 2).sum(1)
            out[idx] = (resid / n[idx]).sqrt()
        done |= use
    return out


def severity(status: str) -> float:
    """A status's rank, least severe first (:data:`STATUSES`); a name no member spells
    (another fedcal's file) is not ok: ranked just above ok."""
    return STATUSES.index(status) if status in STATUSES else 0.5


def most_severe(statuses: Sequence[str]) -> str:
    """The most severe of ``statuses`` (ties between unknown names broken by name)."""
    return max(statuses, key=lambda s: (severity(s), s))


def final_window(rounds: int) -> int:
    """How many of the last rounds count as "final" for a rejection."""
    return max(1, math.ceil(REJECTED_WINDOW * rounds))


def still_improving(history: pd.DataFrame, column: str) -> dict[int, float]:
    """Per client index, the fall per round of ``column`` between its last two evaluated
    rounds, relative to max(its value, the fleet's median value) at the first of them
    (only clients with two finite values and a positive scale).

    Array by array, not client by client (at 100,000 units a loop over the clients' rows
    took minutes, issue 36.1): the rows sorted by client and round, each client's last two.
    """
    if history.empty or column not in history.columns or "round" not in history.columns:
        return {}
    client = history["client_index"].to_numpy(np.int64)
    t, e = history["round"].to_numpy(float), history[column].to_numpy(float)
    order = np.lexsort((t, client))  # by client, then round (stable: ties keep row order)
    c, t, e = client[order], t[order], e[order]
    last = np.flatnonzero(np.r_[c[1:] != c[:-1], True])  # each client's last row
    last = last[(last > 0) & (c[last - 1] == c[last])]  # ... with a row before it
    t1, e1, t2, e2 = t[last - 1], e[last - 1], t[last], e[last]
    keep = np.isfinite(e1) & np.isfinite(e2) & (t2 > t1)
    if not keep.any():
        return {}
    who, t1, e1, t2, e2 = c[last][keep], t1[keep], e1[keep], t2[keep], e2[keep]
    fleet = float(np.median(e1))
    scale = np.maximum(e1, fleet)
    ok = scale > 0
    rate = (e1[ok] - e2[ok]) / scale[ok] / (t2[ok] - t1[ok])
    # in the order the clients first appear in ``history`` (as the loop over groups gave)
    first = pd.unique(client)
    values = dict(zip(who[ok].tolist(), rate.tolist(), strict=True))
    return {int(i): values[i] for i in first.tolist() if i in values}


def sensor_statuses(
    final: pd.DataFrame,
    history: pd.DataFrame,
    rejections: Sequence[Mapping],
    flags: Mapping[str, np.ndarray],
    rounds: int,
    metric: str,
    tolerance: float | None = None,
    own_fit: Mapping[int, tuple[float, float]] | None = None,
) -> tuple[list[str], list[str]]:
    """(status, reason) of each row of ``final`` (the engine's final rows, in order).

    ``history`` are the per-round rows (``metrics.csv``), ``rejections`` the engine's
    record (round, client_index, reason, ratio, threshold), ``flags`` the algorithm's
    ``client_status`` (clients,) bool arrays in client-index order, ``rounds`` the rounds
    run, ``metric`` the task's primary metric (its train error judges convergence),
    ``tolerance`` the relative fall per round that is "still improving" (default
    :data:`UNCONVERGED_TOL`; ``[run] unconverged_tol``; 1 never flags), ``own_fit`` per
    client index (its final train error, its own fit's train error) in the metric's
    unit, for the factor rule (module doc; None: not applied).
    """
    tol = UNCONVERGED_TOL if tolerance is None else float(tolerance)
    first_final = rounds - final_window(rounds) + 1
    late, lowered = _final_records(rejections, first_final)
    column = f"train_{metric}"
    if metric in HIGHER_IS_BETTER and column in history.columns:  # judge its error rate
        history = history.assign(**{column: 1.0 - history[column]})
    falling = still_improving(history, column)
    far = {}
    if own_fit and tol < 1.0:  # e_i > OWN_FIT_FACTOR · max(f_i, median f)
        fits = [f for _, f in own_fit.values() if np.isfinite(f)]
        floor = float(np.median(fits)) if fits else math.nan
        for i, (e, f) in own_fit.items():
            scale = max(f, floor) if np.isfinite(f) else math.nan
            if np.isfinite(e) and scale > 0 and e > OWN_FIT_FACTOR * scale:
                far[i] = (e, f)
    statuses, reasons = [], []
    for _, row in final.iterrows():
        i = int(row["client_index"])
        flag = {name: bool(np.asarray(v)[i]) for name, v in flags.items()}
        if flag.get(Status.REFUSED):
            status, why = Status.REFUSED, "the method declined to calibrate this sensor"
        elif row.get("status", Status.OK) != Status.OK:
            status, why = Status.DIVERGED, "non-finite model or test error"
        elif i in late:
            r = late[i]
            ratio = float(r.get("ratio", float("nan")))
            what = (
                f"size {ratio:.3g} > threshold {float(r['threshold']):g}"
                if r["reason"] == "size" and ratio == ratio
                else str(r["reason"])
            )
            status, why = Status.REJECTED, f"reply screened out in round {int(r['round'])}: {what}"
        elif flag.get(Status.WEAK):
            status, why = Status.WEAK, "leans on directions the fleet's data do not determine"
        elif falling.get(i, 0.0) > tol:
            status = Status.UNCONVERGED
            why = (
                f"train {metric} still falling {100 * falling[i]:.2g} %/round at the end "
                f"(tolerance {100 * tol:g} %)"
            )
        elif i in far:
            e, f = far[i]
            status = Status.UNCONVERGED
            why = (
                f"train {metric} {e:.3g} is {e / f:.3g}× its own least-squares fit's {f:.3g} "
                f"(factor {OWN_FIT_FACTOR:g})"
            )
        elif i in lowered:
            r = lowered[i]
            status = Status.OK
            why = f"down-weighted in round {int(r['round'])} (still aggregated): {r['reason']}"
        else:
            status, why = Status.OK, ""
        statuses.append(str(status))
        reasons.append(why)
    return statuses, reasons


def _final_records(
    rejections: Sequence[Mapping], first_final: int
) -> tuple[dict[int, Mapping], dict[int, Mapping]]:
    """Per client index, its last rejection and its last down-weighting in the final rounds
    (a down-weighting is no rejection: its reply was aggregated; ok, said in its reason)."""
    from fedcal.core.aggregation import is_downweighting

    late: dict[int, Mapping] = {}
    lowered: dict[int, Mapping] = {}
    for r in rejections:
        if int(r["round"]) >= first_final:
            (lowered if is_downweighting(r["reason"]) else late)[int(r["client_index"])] = r
    return late, lowered


def counts(statuses: pd.Series) -> dict[str, int]:
    """The summary's counts: sensors, excluded (not ok) and one column per other status."""
    values = statuses.astype(str)
    out = {"sensors": len(values), "excluded": int((values != Status.OK).sum())}
    for status, column in COUNT_COLUMNS.items():
        out[column] = int((values == status).sum())
    return out
