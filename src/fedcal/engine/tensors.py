"""A fleet as the engine's tensors: scaled (:mod:`fedcal.data.scaling`) and padded, from
one frame or from parts of the fleet a few sensors at a time (issue 25.1).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fedcal.core.data import ClientData
from fedcal.data.fleet import Fleet
from fedcal.data.scaling import (
    Scaler,
    client_moments,
    fit_scaler,
    needs_moments,
    scaler_from_moments,
)

DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True)
class FleetTensors:
    """A fleet as padded tensors (scaled), with the scaler to undo the target scale."""

    train: ClientData
    test: ClientData
    scaler: Scaler
    client_ids: tuple[str, ...]
    target_unit: str = ""

    @property
    def num_clients(self) -> int:
        return len(self.client_ids)


def prepare(fleet: Fleet, scaling: str = "auto", dtype: str = "float32") -> FleetTensors:
    """Scale a fleet (see :mod:`fedcal.data.scaling`) and pad it into tensors."""
    train = fleet.arrays("train")
    test = fleet.arrays("test")
    # Class labels (meta "task" = "classification") are indices, not quantities.
    classification = fleet.meta.get("task") == "classification"
    scaler = fit_scaler(fleet.features, fleet.target, train, scaling, not classification)
    torch_dtype = DTYPES[dtype]

    def scaled(arrays: list[tuple[np.ndarray, np.ndarray]], split: str) -> ClientData:
        return ClientData.from_arrays(
            [(scaler.x(x), scaler.y(y)) for x, y in arrays],
            dtype=torch_dtype,
            branch=fleet.branch_signs(split),  # None without a direction column
            time=fleet.row_times(split),  # None without a time column
        )

    unit = fleet.target.rsplit("_", 1)[-1] if "_" in fleet.target else ""
    return FleetTensors(
        scaled(train, "train"),
        scaled(test, "test"),
        scaler,
        tuple(map(str, fleet.client_ids)),
        unit,
    )


def prepare_chunks(
    parts: Callable[[], Iterable[Fleet]], scaling: str = "auto", dtype: str = "float32"
) -> FleetTensors:
    """:func:`prepare` of the fleet whose sensors ``parts()`` yields a few at a time (disjoint
    sensor sets, in order: ``simulate_chunks``' frames, a Parquet file's row groups), without
    the whole fleet's frame (issue 25.1: 100,000 units). The same tensors as :func:`prepare`
    of their concatenation (tested to the bit). ``parts`` is called twice when the scaler
    needs federated statistics (a first pass sums each client's, :func:`client_moments`),
    once when every column has a physical range (the barometer)."""
    chunks_ = iter(parts())
    first = next(chunks_, None)
    if first is None:
        raise ValueError("prepare_chunks: the fleet has no sensors")
    classification = first.meta.get("task") == "classification"
    moments: list[dict[str, np.ndarray]] = []
    if needs_moments(first.features, first.target, scaling, not classification):
        for part in parts():  # a first pass: each client's sums only
            moments += [client_moments(x, y) for x, y in part.arrays("train")]
    scaler = scaler_from_moments(first.features, first.target, moments, scaling, not classification)
    torch_dtype = DTYPES[dtype]
    train: list[ClientData] = []
    test: list[ClientData] = []
    ids: list[str] = []
    seen: set[str] = set()
    for part in itertools.chain([first], chunks_):
        for split, out in (("train", train), ("test", test)):
            out.append(
                ClientData.from_arrays(
                    [(scaler.x(x), scaler.y(y)) for x, y in part.arrays(split)],
                    dtype=torch_dtype,
                    branch=part.branch_signs(split),
                    time=part.row_times(split),
                )
            )
        new = list(map(str, part.client_ids))
        again = next((i for i in new if i in seen), None)
        if again is not None:  # two units with one id: a sensor's rows split over two parts
            raise ValueError(f"prepare_chunks: sensor {again!r} is in two parts of the fleet")
        seen.update(new)
        ids += new
    unit = first.target.rsplit("_", 1)[-1] if "_" in first.target else ""
    return FleetTensors(_stacked(train), _stacked(test), scaler, tuple(ids), unit)


def _stacked(parts: list[ClientData]) -> ClientData:
    """Chunks' padded data as one cohort, padded to the longest client (zeros, as
    :meth:`ClientData.from_arrays` pads); each chunk freed once copied."""
    rows = max(p.x.shape[1] for p in parts)
    n = sum(p.num_clients for p in parts)

    def joined(get: Callable[[ClientData], Tensor | None]) -> Tensor | None:
        if get(parts[0]) is None:
            return None
        sample = get(parts[0])
        out = sample.new_zeros((n, rows, *sample.shape[2:]))
        at = 0
        for p in parts:
            t = get(p)
            out[at : at + t.shape[0], : t.shape[1]] = t
            at += t.shape[0]
        return out

    x, y = joined(lambda p: p.x), joined(lambda p: p.y)
    branch, time_ = joined(lambda p: p.branch), joined(lambda p: p.time)
    count = torch.cat([p.count for p in parts])
    return ClientData(x, y, count, (0,) * n, tuple(range(n)), branch, time_)
