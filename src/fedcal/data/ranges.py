"""Each sensor's calibrated span (valid_range.json), torch-free: ``fedcal run`` and
``fedcal calibrate`` (with or without torch) write it, the exports and ``predict`` read it."""

from __future__ import annotations

from typing import Any

from fedcal.data.fleet import SPLIT_COLUMN, Fleet


def valid_ranges(fleet: Fleet) -> dict[str, Any]:
    """Per sensor, the span of its calibration points: {sensor: {column: [min, max]}}.

    Inputs and target; a model is only validated inside this range, so exports carry it.
    """
    train = fleet.frame[fleet.frame[SPLIT_COLUMN] == "train"]
    columns = [*fleet.features, fleet.target]
    groups = train.groupby(fleet.client_column, sort=False)[columns]
    # Column-wise (two arrays), not a row lookup per sensor: 100,000 sensors take a second.
    low, high = groups.min(), groups.max()
    names = [str(s) for s in low.index]
    low, high = low.to_numpy(float).tolist(), high.to_numpy(float).tolist()
    return {
        sensor: {c: [lo[j], hi[j]] for j, c in enumerate(columns)}
        for sensor, lo, hi in zip(names, low, high, strict=True)
    }
