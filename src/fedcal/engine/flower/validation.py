"""The server checks every reply against what an honest client would send.

The expectation is derived, not declared: the server runs the algorithm's
own ``client_update`` (and ``personalize`` + the task's metrics) on a dummy
cohort of one — random inputs in the scaled range, the round's broadcast,
a fresh private state — and records the reply's flattened keys, shapes and
dtypes and the metric names. It does so twice, with two row counts, so a
dimension that follows the client's row count (``centralized`` uploads its
rows) is recognised and checked against the row count that client declared
at the handshake; any other dimension must match exactly. A reply is then
rejected, for this round only, when

* a key is missing or unexpected, a leaf has another shape or dtype,
* a floating leaf holds NaN or ±inf,
* its metric records name other metrics or hold non-numbers,
* its info names another client or an invalid train-row count.

Handshake replies are checked too (:func:`check_handshake`): a node whose
identity record or scaling sums are malformed is left out of the run.

The dummy run shares nothing with real clients and touches no server state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fedcal.engine.flower.wire import to_numpy
from fedcal.engine.schedule import INTERVAL_METRICS

if TYPE_CHECKING:
    from fedcal.core.algorithm import Algorithm
    from fedcal.core.tree import Tree
    from fedcal.data.scaling import Scaler

ROWS = -1  # a dimension equal to the client's train rows (at least 1: ClientData pads to 1)
ANY = -2  # a dimension that changes with the row count in another way: not checked
PROBE_ROWS = (7, 10)


@dataclass(frozen=True)
class ReplySpec:
    """What an honest reply holds: leaf (dtype, shape) by flattened key, metric names."""

    leaves: dict[str, tuple[np.dtype, tuple[int, ...]]]
    train_metrics: frozenset[str]
    eval_metrics: frozenset[str]


def _probe(algorithm: Algorithm, server: Tree, scaler: Scaler, features: int, dtype, rows: int):
    import torch

    from fedcal.core.data import ClientData
    from fedcal.core.tree import expand, flatten
    from fedcal.engine.evaluation import evaluate_cohort

    gen = torch.Generator().manual_seed(rows)
    x = torch.rand(1, rows, features, generator=gen, dtype=torch.float64) * 2 - 1
    if algorithm.task_kind == "classification":
        y = torch.zeros(1, rows, 1, dtype=torch.float64)  # class 0
    else:
        y = torch.rand(1, rows, 1, generator=gen, dtype=torch.float64) * 2 - 1
    data = ClientData(x.to(dtype), y.to(dtype), torch.tensor([rows]), (rows,), (0,))
    broadcast = algorithm.broadcast(server)
    down = expand(broadcast, 1)
    state = algorithm.client_init(down)
    result = algorithm.client_update(down, state, data)
    names = list(evaluate_cohort(algorithm, broadcast, result.state, data, data, scaler).test)
    leaves = {
        k: (v.detach().numpy().dtype, tuple(v.shape[1:])) for k, v in flatten(result.reply).items()
    }
    return (
        leaves,
        frozenset(result.metrics),
        frozenset(f"{p}_{n}" for p in ("test", "train") for n in names),
    )


def expected_reply(
    algorithm: Algorithm, server: Tree, scaler: Scaler, features: int, dtype
) -> ReplySpec:
    """The reply structure of one honest client this round (see the module docstring)."""
    (a, train, evals), (b, _, _) = (
        _probe(algorithm, server, scaler, features, dtype, r) for r in PROBE_ROWS
    )
    if list(a) != list(b):
        raise RuntimeError(
            f"{algorithm.name}: reply keys depend on the row count ({list(a)}, {list(b)})"
        )
    leaves = {}
    for key, (dt, shape) in a.items():
        other = b[key][1]
        if len(other) != len(shape):
            raise RuntimeError(f"{algorithm.name}: reply {key!r} changes rank with the row count")
        dims = []
        for n, m in zip(shape, other, strict=True):
            if n == m:
                dims.append(n)
            else:
                dims.append(ROWS if (n, m) == PROBE_ROWS else ANY)
        leaves[key] = (dt, tuple(dims))
    return ReplySpec(leaves, train, evals)


def _metric_problem(record: Any, names: frozenset[str], what: str) -> str | None:
    from flwr.app import MetricRecord

    if not isinstance(record, MetricRecord):
        return f"{what} is a {type(record).__name__}, not metrics"
    got = set(record.keys())
    if got != names:
        return f"{what} names {sorted(got - names)} not expected, lacks {sorted(names - got)}"
    bad = [k for k, v in record.items() if isinstance(v, bool) or not isinstance(v, int | float)]
    return f"{what} {bad} are not numbers" if bad else None


def implausible_metrics(metrics: Mapping[str, float], model_finite: bool) -> str | None:
    """Why evaluation metrics cannot be honest: a negative value (every metric is an error,
    a coverage or a σ), or a non-finite test metric from a client whose model is finite."""
    negative = sorted(k for k, v in metrics.items() if v < 0)
    if negative:
        return f"evaluation metrics {negative} are negative"
    bad = sorted(  # a declined interval's NaN coverage/σ is honest (engine.schedule)
        k
        for k, v in metrics.items()
        if k.startswith("test_") and k[5:] not in INTERVAL_METRICS and not math.isfinite(v)
    )
    if model_finite and bad:
        return f"evaluation metrics {bad} are not finite though the model is"
    return None


def check_eval(content: Any, spec: ReplySpec) -> str | None:
    """Why the evaluation record of a reply is unusable (None: it is fine)."""
    return _metric_problem(content["eval"], spec.eval_metrics, "evaluation metrics")


def check_units(record: Any, row: Mapping[str, Any]) -> tuple[dict[str, float], str | None]:
    """A site's per-unit columns of its last evaluation (``unit_columns``, e.g.
    ``recalibrate_at``; NaN: none, e.g. no drift learned), or why they are unusable: not
    metrics, not numbers, or a name of the evaluation row's own columns."""
    from flwr.app import MetricRecord

    if not isinstance(record, MetricRecord):
        return {}, "no per-unit columns (units record) in the last evaluation"
    clash = sorted(set(record.keys()) & set(row))
    if clash:
        return {}, f"per-unit columns {clash} name columns of the evaluation row"
    bad = [k for k, v in record.items() if isinstance(v, bool) or not isinstance(v, int | float)]
    if bad:
        return {}, f"per-unit columns {bad} are not numbers"
    return {k: float(v) for k, v in record.items()}, None


def check_info(content: Any, client_index: int) -> tuple[int | None, str | None]:
    """The train-row count a reply claims, or why its info record is unusable."""
    from flwr.app import ConfigRecord

    info = content.get("info")
    if not isinstance(info, ConfigRecord):
        return None, "no info record"
    index, rows = info.get("client-index"), info.get("num-train")
    if index != client_index:
        return None, f"info says client {index!r}, the handshake said {client_index}"
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
        return None, f"info num-train {rows!r} is not a row count"
    return rows, None


def check_reply(
    content: Any, spec: ReplySpec, rows: int, padded: int | None = None
) -> tuple[Tree | None, str | None]:
    """The reply tree, or why it is rejected; ``rows``: the client's declared train rows.

    ``padded``: the most train rows any sensor of the client's site declared. A
    site runs its sensors as one cohort padded to that count, so a dimension
    that follows the row count may be anywhere from ``rows`` to ``padded``
    (the extra rows are padding; the server pads every reply to the longest anyway).
    """
    import torch
    from flwr.app import ArrayRecord

    from fedcal.core.tree import unflatten

    problem = _metric_problem(content["train"], spec.train_metrics, "training metrics")
    if problem:
        return None, problem
    record = content["reply"]
    if not isinstance(record, ArrayRecord):
        return None, f"reply is a {type(record).__name__}, not arrays"
    got, want = list(record.keys()), list(spec.leaves)
    if got != want:
        missing = [k for k in want if k not in got]
        extra = [k for k in got if k not in want]
        return None, f"reply keys: missing {missing}, unexpected {extra}" + (
            "" if missing or extra else " (order differs)"
        )
    flat = {}
    for key, (dtype, shape) in spec.leaves.items():
        try:
            arr = to_numpy(record[key])
        except Exception as err:  # a malformed payload must not end the run
            return None, f"reply {key!r} does not decode: {err}"
        if arr.dtype != dtype:
            return None, f"reply {key!r} has dtype {arr.dtype}, expected {dtype}"
        low, high = max(rows, 1), max(rows, padded or 0, 1)
        expect = tuple((low, high) if n == ROWS else (n, n) for n in shape)
        if len(arr.shape) != len(expect) or any(
            lo != ANY and not lo <= m <= hi for (lo, hi), m in zip(expect, arr.shape, strict=True)
        ):
            shown = tuple(
                "any" if lo == ANY else lo if lo == hi else f"{lo}..{hi}" for lo, hi in expect
            )
            return None, f"reply {key!r} has shape {arr.shape}, expected {shown}"
        if arr.dtype.kind in "fc" and not np.isfinite(arr).all():
            bad = int((~np.isfinite(arr)).sum())
            return None, f"reply {key!r} holds {bad} non-finite value(s)"
        flat[key] = torch.from_numpy(arr.copy())
    return unflatten(flat), None


def capped_weight(declared: int, claimed: int) -> float:
    """A client's aggregation weight: what it claims now, never more than at the handshake."""
    return float(min(declared, claimed))


HANDSHAKE_INFO = {
    "sensor-id": str,
    "client-index": int,
    "num-clients": int,
    "num-train": int,
    "features": str,
    "target": str,
    "classification": bool,
    "num-classes": int,
}


def check_handshake(content: Any, moments: bool) -> str | None:
    """Why a handshake reply is unusable (None: fine); ``moments``: scaling sums expected."""
    import json

    from flwr.app import ConfigRecord

    info = content.get("info")
    if not isinstance(info, ConfigRecord):
        return "handshake without an info record"
    for key, kind in HANDSHAKE_INFO.items():
        value = info.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            return f"handshake info {key}={value!r} is not a {kind.__name__}"
    if not 0 <= info["client-index"] < info["num-clients"] or info["num-train"] < 0:
        return (
            f"handshake info client-index={info['client-index']} num-clients="
            f"{info['num-clients']} num-train={info['num-train']} is inconsistent"
        )
    if (
        not 0 <= info["num-classes"] <= 10_000
        or (info["num-classes"] > 0) != info["classification"]
    ):
        return (  # a class count sizes the model the server builds: bounded
            f"handshake info num-classes={info['num-classes']} does not fit "
            f"classification={info['classification']}"
        )
    try:
        features = json.loads(info["features"])
    except ValueError:
        features = None
    if not isinstance(features, list) or not all(isinstance(f, str) for f in features):
        return f"handshake info features={info['features']!r} is not a JSON list of names"
    if not moments:
        return None
    return _check_moments(content.get("moments"), len(features), info["num-train"])


def _check_moments(record: Any, num_features: int, num_train: int) -> str | None:
    """Why a handshake's scaling sums are unusable (None: fine): the five sums, finite, of
    their dtypes and widths, the counts and squares non-negative, ``n`` the declared rows."""
    from flwr.app import ArrayRecord

    if not isinstance(record, ArrayRecord):
        return "handshake without its scaling sums"
    width = {"n": 1, "sx": num_features, "sxx": num_features, "sy": 1, "syy": 1}
    if set(record.keys()) != set(width):
        return f"scaling sums {sorted(record.keys())}, expected {sorted(width)}"
    for key, n in width.items():
        try:
            arr = to_numpy(record[key])
        except Exception as err:  # a malformed payload must not end the run
            return f"scaling sum {key!r} does not decode: {err}"
        dtype = np.int64 if key == "n" else np.float64
        if arr.dtype != dtype or arr.shape != (n,) or not np.isfinite(arr).all():
            want = f"finite {dtype.__name__} ({n},)"
            return f"scaling sum {key!r}: {arr.dtype} {arr.shape}, expected {want}"
        if key in ("n", "sxx", "syy") and (arr < 0).any():
            return f"scaling sum {key!r} is negative"
    if int(to_numpy(record["n"])[0]) != num_train:
        return f"scaling sums count {int(to_numpy(record['n'])[0])} rows, info says {num_train}"
    return None
