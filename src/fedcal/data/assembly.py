"""A table already read becomes a :class:`~fedcal.data.fleet.Fleet`: every check in
order, then the frame assembled (the same for a whole file and each of its row groups).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from fedcal.data.cells import (
    _infer_text_column,
    _parse_direction,
    _parse_ids,
    _parse_numbers,
    _parse_split,
    parse_times,
)
from fedcal.data.fileerrors import FleetDataError, _raise_first
from fedcal.data.fleet import (
    DIRECTION_COLUMN,
    SPLIT_COLUMN,
    Fleet,
)
from fedcal.data.reading import SOURCE_LINE, _Raw
from fedcal.data.splits import _check_counts, _seeded_split, time_split
from fedcal.data.tablechecks import (
    _check_args,
    _check_columns,
    _check_duplicates,
    _check_roles,
    _undeclared_time,
)
from fedcal.data.units import Bounds, Plausible, _check_values


@dataclass(frozen=True)
class _Assembly:
    """How a table becomes a :class:`Fleet`: :func:`load_fleet`'s arguments after
    ``_check_args``, the same for a whole file and each of its row groups."""

    features: tuple[str, ...]
    target: str
    client_column: str
    split_column: str | None
    test_fraction: float
    seed: int
    mins: dict[str, int]
    time_column: str | None
    split_by: str


def checked_assembly(
    features: Sequence[str] | None,
    target: str | None,
    client_column: str,
    split_column: str | None,
    test_fraction: float,
    seed: int,
    min_train_points: int,
    min_test_points: int,
    time_column: str | None,
    split_by: str,
) -> _Assembly:
    """:func:`~fedcal.data.loader.load_fleet`'s arguments of that name (its and
    ``load_fleet_chunks``'s, which shares them) checked by ``_check_args`` (features and
    target defaulted to the barometric schema) and bundled."""
    mins = {"train": min_train_points, "test": min_test_points}
    features, target = _check_args(
        features, target, client_column, split_column, test_fraction, seed, mins
    )
    return _Assembly(
        features, target, client_column, split_column, test_fraction, seed, mins, time_column,
        split_by,
    )  # fmt: skip


@dataclass
class _Parsed:
    """A table's cells parsed (:func:`_parsed`): ids, numeric columns, and the optional
    split, time and direction columns (None when absent)."""

    ids: list[str]
    values: dict[str, np.ndarray]
    split: np.ndarray | None
    times: np.ndarray | None
    direction: np.ndarray | None


def _fleet_of(
    raw: _Raw,
    label: str,
    bounds: dict[str, Bounds],
    plausible: Mapping[str, Plausible],
    how: _Assembly,
    whole: Mapping[str, tuple[float, float]] | None = None,
) -> Fleet:
    """:func:`load_fleet`'s checks and assembly of a table already read (``raw``); ``whole``:
    see :func:`_check_plausible`."""
    _check_how(how)
    numeric = [*how.features, how.target]
    timed = [how.time_column] if how.time_column else []
    _check_columns(raw, label, [how.client_column, *numeric, *timed], how.split_column)
    use_file_split = how.split_column is not None and how.split_column in raw.frame.columns
    parsed = _parsed(raw, label, how, use_file_split)
    _check_values(raw, label, parsed.values, bounds, plausible, whole)
    warned = _checked_rows(raw, label, how, parsed)
    split, said = _split_of(parsed, how, use_file_split)
    order = list(pd.unique(pd.Series(parsed.ids)))
    _check_counts(raw, label, how.client_column, parsed.ids, order, split, how.mins, said)
    # Assemble: everything is valid from here on.
    frame = _frame_of(raw, how, parsed, split, use_file_split)
    meta = {"source": label, "split": "file" if use_file_split else "seeded"}
    if not use_file_split:
        meta.update(test_fraction=float(how.test_fraction), split_seed=int(how.seed))
        if how.split_by == "time":
            meta.update(split="time")
    if how.time_column:
        meta["time_column"] = how.time_column
    if any(warned):  # said once by the command that loaded it (build.load_run_data)
        meta["warnings"] = [w for w in warned if w]
    return Fleet(frame, how.features, how.target, how.client_column, meta)


def _check_how(how: _Assembly) -> None:
    """The split's and the time column's settings (a ValueError: the caller's mistake)."""
    numeric = [*how.features, how.target]
    if how.split_by not in ("random", "time"):
        raise ValueError(f"split_by must be 'random' or 'time', got {how.split_by!r}")
    if how.split_by == "time" and not how.time_column:
        raise ValueError("split_by = 'time' needs a time column (--time-column)")
    reserved = (how.client_column, *numeric, SPLIT_COLUMN, SOURCE_LINE)
    if how.time_column and how.time_column in reserved:
        raise ValueError(
            f"time column {how.time_column!r} is also the sensor, a feature or reserved"
        )


def _parsed(raw: _Raw, label: str, how: _Assembly, use_file_split: bool) -> _Parsed:
    """Every column the fleet uses, parsed; one error for all the bad columns."""
    errors: list[FleetDataError] = []
    ids, err = _parse_ids(raw, how.client_column, label)
    errors += [err] if err else []
    values: dict[str, np.ndarray] = {}
    for col in [*how.features, how.target]:
        values[col], err = _parse_numbers(raw, col, label)
        errors += [err] if err else []
    split = None
    if use_file_split:
        split, err = _parse_split(raw, how.split_column, label)
        errors += [err] if err else []
    times = None
    if how.time_column:
        times, err = parse_times(raw, how.time_column, label)
        errors += [err] if err else []
    direction = None
    if DIRECTION_COLUMN in raw.frame.columns and DIRECTION_COLUMN not in (
        how.client_column,
        *values,
    ):
        direction, err = _parse_direction(raw, label)
        errors += [err] if err else []
    _raise_first(errors, label)
    return _Parsed(ids, values, split, times, direction)


def _checked_rows(raw: _Raw, label: str, how: _Assembly, parsed: _Parsed) -> list[str]:
    """Repeated rows, an undeclared time column (warnings returned) and one role per sensor."""
    ids, values, times = parsed.ids, parsed.values, parsed.times
    keyed = values if times is None else {**values, how.time_column: times}  # distinct: data
    warned = [_check_duplicates(raw, label, how.client_column, ids, keyed, times is not None)]
    if not how.time_column:
        warned.append(_undeclared_time(raw, label, [how.client_column, *values]))
    _check_roles(raw, label, how.client_column, ids)
    return warned


def _split_of(parsed: _Parsed, how: _Assembly, use_file_split: bool) -> tuple[np.ndarray, str]:
    """Each row's split (the file's, by time or seeded) and how it was made."""
    test_fraction, seed = how.test_fraction, how.seed
    if use_file_split:
        return parsed.split, f"split from column {how.split_column!r}"
    if how.split_by == "time":
        split = time_split(parsed.ids, parsed.times, float(test_fraction))
        return split, f"time split, the last {test_fraction} of each sensor's time is test"
    split = _seeded_split(parsed.ids, float(test_fraction), int(seed))
    return split, f"seeded split, test_fraction={test_fraction}, seed={seed}"


def _frame_of(
    raw: _Raw, how: _Assembly, parsed: _Parsed, split: np.ndarray, use_file_split: bool
) -> pd.DataFrame:
    """The fleet's frame: the file's columns (CSV extras typed), the parsed ones, the split
    and each row's source line."""
    client_column, split_column, numeric = how.client_column, how.split_column, parsed.values
    frame = raw.frame.copy()
    if raw.text:
        for col in frame.columns:
            if col not in (client_column, *numeric, split_column, SPLIT_COLUMN, SOURCE_LINE):
                frame[col] = _infer_text_column(frame[col].tolist())
    if parsed.times is not None:
        frame[how.time_column] = parsed.times
    if parsed.direction is not None:
        frame[DIRECTION_COLUMN] = pd.Series(parsed.direction, dtype="str", index=frame.index)
    frame[client_column] = pd.Series(parsed.ids, dtype="str")
    for col in numeric:
        frame[col] = parsed.values[col]
    split_series = pd.Series(split, dtype="str")
    if use_file_split and split_column != SPLIT_COLUMN:
        frame = frame.rename(columns={split_column: SPLIT_COLUMN})
    frame[SPLIT_COLUMN] = split_series
    frame[SOURCE_LINE] = raw.rows.astype(np.int64)
    return frame
