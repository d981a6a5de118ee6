"""Each sensor's status after a run (:mod:`fedcal.status`): the algorithm's own flags, the
fleet's medians, its own least-squares fit, taken chunk by chunk; and the run's
rejections as a table.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import torch

from fedcal.core.algorithm import Algorithm, fleet_medians
from fedcal.core.hooks import StatusValues
from fedcal.core.tree import gather
from fedcal.engine.chunks import spans
from fedcal.engine.evaluation import errors
from fedcal.engine.simulation import (
    FleetTensors,
    RunResult,
)
from fedcal.status import own_fit_rmse, sensor_statuses

REJECTION_COLUMNS = ["round", "client_index", "client", "reason", "ratio", "threshold"]


def _status_server(
    algorithm: Algorithm, result: RunResult, tensors: FleetTensors, chunk_size: int
) -> Any:
    """The server ``client_status`` reads: with the fleet's medians of the algorithm's
    :class:`~fedcal.core.hooks.StatusValues` over every unit (taken chunk by
    chunk), so that ``chunk_size`` changes no status."""
    if not isinstance(algorithm, StatusValues):
        return result.server
    n, found = tensors.num_clients, {}
    for rows in spans(n, chunk_size):
        with torch.no_grad():
            got = algorithm.status_values(
                _clients(result.personal, rows, n),
                _clients(tensors.test.x, rows, n).to(torch.float64),
                _clients(tensors.test.mask, rows, n),
            )
        for key, v in got.items():
            found.setdefault(key, []).append(v)
    if not found:
        return result.server
    medians = fleet_medians({k: torch.cat(v) for k, v in found.items()})
    return {**result.server, "status_medians": medians}


def judge_sensors(
    algorithm: Algorithm,
    result: RunResult,
    tensors: FleetTensors,
    history: pd.DataFrame,
    metric: str,
    tolerance: float | None = None,
    chunk_size: int = 0,
) -> tuple[list[str], list[str], pd.DataFrame]:
    """Each final row's (status, reason) (:func:`fedcal.status.sensor_statuses`) and the
    run's rejections as a table (round, client, reason, measured ratio, threshold).

    The algorithm's own flags (``client_status``: weak, refused) are taken at each
    sensor's test inputs, where its errors are measured. Every client's flags and fits
    are its own, so they are computed ``chunk_size`` clients at a time (0 = all at once):
    at once, the rows' designs and predictive variances of a 10,000-unit fleet were the
    run's peak memory (issue 25.1).
    """
    parts: list[dict[str, np.ndarray]] = []
    server = _status_server(algorithm, result, tensors, chunk_size)
    for rows in spans(tensors.num_clients, chunk_size):
        with torch.no_grad():
            got = algorithm.client_status(
                server,
                _clients(result.personal, rows, tensors.num_clients),
                _clients(tensors.test.x, rows, tensors.num_clients).to(torch.float64),
                _clients(tensors.test.mask, rows, tensors.num_clients),
            )
        parts.append({k: v.cpu().numpy() for k, v in got.items()})
    flags = {}  # a flag one chunk did not return is False for its clients (client_status)
    for key in sorted({k for part in parts for k in part}):
        flags[key] = np.concatenate(
            [
                part[key] if key in part else np.zeros(len(rows), dtype=bool)
                for part, rows in zip(parts, spans(tensors.num_clients, chunk_size), strict=True)
            ]
        )
    rejections = pd.DataFrame(result.extra.get("rejections", []))
    if rejections.empty:
        rejections = pd.DataFrame(columns=REJECTION_COLUMNS)
    else:
        ids = list(tensors.client_ids)
        rejections.insert(2, "client", [ids[int(i)] for i in rejections["client_index"]])
    statuses, reasons = sensor_statuses(
        pd.DataFrame(result.final),
        history,
        result.extra.get("rejections", []),
        flags,
        result.rounds_done,
        metric,
        tolerance,
        _own_fit(algorithm, result, tensors, metric, chunk_size),
    )
    return statuses, reasons, rejections


def _clients(tree, rows: torch.Tensor, n: int):
    """Clients ``rows`` of a tree or tensor with a leading clients axis (itself when all)."""
    if len(rows) == n:
        return tree
    if isinstance(tree, torch.Tensor):
        return tree.index_select(0, rows)
    return gather(tree, rows)


def _own_fit(
    algorithm: Algorithm,
    result: RunResult,
    tensors: FleetTensors,
    metric: str,
    chunk_size: int = 0,
) -> dict[int, tuple[float, float]] | None:
    """Per client (final train RMSE, its own least-squares fit's), target units, for the
    status's factor rule (:func:`fedcal.status.own_fit_rmse`); None for a one-round
    method or a metric other than RMSE. ``chunk_size`` clients at a time (0 = all)."""
    if metric != "rmse" or result.rounds_done <= 1:
        return None
    n = tensors.num_clients
    scale = float(np.asarray(tensors.scaler.y_scale, dtype=float).ravel()[0])
    got, own = [], []
    for rows in spans(n, chunk_size):
        train = tensors.train if len(rows) == n else tensors.train.select(rows)
        with torch.no_grad():
            personal = _clients(result.personal, rows, n)
            got.append(errors(algorithm, personal, train, tensors.scaler)["rmse"].double())
        own.append(own_fit_rmse(train.x, train.y[..., :1], train.mask) * scale)
    fit, mine = torch.cat(got), torch.cat(own)
    return {i: (float(fit[i]), float(mine[i])) for i in range(n)}
