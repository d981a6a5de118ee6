"""Load real sensor fleets from CSV or Parquet files, and save fleets back.

A fleet file is one tidy table, one row per measured point: a client column
(the sensor id), feature columns (model inputs), a target column (the
reference value) and, optionally, a split column (``train``/``test``). The
barometric schema (``frequency_hz``, ``temperature_c`` → ``pressure_hpa``) is
only the default; any fleet loads by naming its columns (humidity, gas,
PM2.5, …).

Everything is validated before anything is returned, and every problem is a
:class:`FleetDataError` whose message names the file, the rows and the
field. Rows are counted as a user sees them:

* CSV: physical text lines, as in a text editor or a spreadsheet opened on
  the file — the header is line 1, the first data row line 2. Blank lines
  (and rows of empty cells) are skipped but still counted.
* Parquet: 0-based record numbers ("record 0" is the first row).

The returned frame keeps these numbers in a ``source_line`` column so that
later stages can point back into the file.

Physical bounds
---------------
``physical_bounds`` maps a column to ``(lo, hi)``: *inclusive* bounds, either
side ``None`` for open. For an exclusive side pass a :class:`Bounds`. The
defaults (:data:`DEFAULT_PHYSICAL_BOUNDS`) are applied to those of their
columns that are features or the target of the load:

* ``frequency_hz`` > 0 (exclusive: a resonator never reads zero),
* ``pressure_hpa`` >= 0 (inclusive: vacuum is possible),
* ``temperature_c`` > -273.15 (exclusive: absolute zero is unreachable).

A user entry replaces the default for that column; ``None`` as value removes
the check. User entries must name a feature or the target.

Plausible ranges
----------------
A barometric file in the wrong unit is physically possible but wrong, so the
known barometric columns also have plausible ranges (:data:`PLAUSIBLE_RANGES`)
whose messages guess the unit mistake: pressure above 2000 hPa ("is it in
Pa?") or never reaching 250 hPa ("is it in kPa or psi?"), frequency below
100 Hz ("is it in kHz?"), temperature above 250 °C ("is it in kelvin?"); a
column named with its unit (``f_hz``, ``t_c``, ``p_hpa``) is guarded like the
known column of that unit. A
``physical_bounds`` entry for a column replaces its plausible range too.
Any feature or target beyond ±1e15 (e.g. ``1e308``) is refused whatever the
column: no sensor reads that, and it overflows scaling.

Hostile files
-------------
Only regular files are read (a FIFO, a device such as ``/dev/zero``, a
directory or a symlink to one is refused without reading), and none larger
than ``max_bytes`` (default 2 GiB, or ``$FEDCAL_MAX_FILE_BYTES``). Parquet
files written by :func:`save_fleet` carry page checksums (verified on read:
a flipped bit is an error, not a silently different value) and a record of
the rows per sensor and a digest of the table in the file's key-value
metadata, checked on read when present.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fedcal.core.atomic import write_with
from fedcal.data.assembly import _fleet_of, checked_assembly
from fedcal.data.cells import _infer_text_column, _parse_ids, _parse_numbers, parse_times
from fedcal.data.fileerrors import MAX_LISTED, FleetDataError, SensorSplitError, _raise_first
from fedcal.data.fleet import (
    CLIENT_COLUMN,
    SPLIT_COLUMN,
    Fleet,
)
from fedcal.data.reading import (
    CSV_SUFFIXES,
    DEFAULT_MAX_BYTES,
    MAX_BYTES_ENV,
    PARQUET_META_KEY,
    PARQUET_SUFFIXES,
    SOURCE_LINE,
    _parquet_record,
    _read_guarded,
    max_file_bytes,
)
from fedcal.data.rowgroups import row_group_fleets, save_chunks
from fedcal.data.splits import time_split
from fedcal.data.tablechecks import TIME_NAMES, _check_columns
from fedcal.data.units import (
    DEFAULT_PHYSICAL_BOUNDS,
    MAX_ABS_VALUE,
    PLAUSIBLE_RANGES,
    Bounds,
    Plausible,
    _check_values,
    plausible_range,
)

# The loader's public names, wherever they live (tests, studies and the CLI import them from here).
__all__ = [
    "CSV_SUFFIXES",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_PHYSICAL_BOUNDS",
    "MAX_ABS_VALUE",
    "MAX_BYTES_ENV",
    "MAX_LISTED",
    "PARQUET_META_KEY",
    "PARQUET_SUFFIXES",
    "PLAUSIBLE_RANGES",
    "SOURCE_LINE",
    "TIME_NAMES",
    "Bounds",
    "FleetDataError",
    "Plausible",
    "SensorSplitError",
    "load_fleet",
    "load_fleet_chunks",
    "load_readings",
    "max_file_bytes",
    "parse_times",
    "plausible_range",
    "save_chunks",
    "save_fleet",
    "time_split",
]


def load_fleet(
    path: str | Path | pd.DataFrame,
    features: Sequence[str] | None = None,
    target: str | None = None,
    client_column: str = CLIENT_COLUMN,
    split_column: str | None = SPLIT_COLUMN,
    test_fraction: float = 0.135,
    seed: int = 0,
    min_train_points: int = 3,
    min_test_points: int = 1,
    physical_bounds: Mapping[str, tuple[float | None, float | None] | Bounds | None] | None = None,
    max_bytes: int | None = None,
    time_column: str | None = None,
    split_by: str = "random",
) -> Fleet:
    """Read and validate a fleet file (``.csv``, ``.parquet`` or ``.pq``), or a DataFrame.

    A DataFrame (the Python API, :mod:`fedcal.api`) goes through the same checks as a
    Parquet table; messages then name ``DataFrame`` and rows by position (0-based).

    ``time_column`` (optional) names each row's time, a number or a date
    (:func:`parse_times`; kept in the frame as float seconds or the file's number):
    rows of one sensor identical in inputs and target but at distinct times are data,
    not duplicates. ``split_by = "time"`` (needs ``time_column``; a file without a
    split column) tests each sensor on the last ``test_fraction`` of its time span
    (:func:`time_split`), ``"random"`` on a seeded random subset.

    ``features``/``target`` default to the barometric schema. If the file has
    no ``split_column`` (or ``split_column`` is ``None``), each sensor's points
    are split at random (seeded by ``seed`` and the sensor id) with
    ``round(n * test_fraction)`` test points, at least one test and one train
    point per sensor with two or more points; ``meta["split"]`` says
    ``"seeded"`` or ``"file"``. Split values in the file may be any case and
    padded with spaces.

    Validation (each failure a :class:`FleetDataError` naming file, rows and
    field, in this order): readable file of a supported type with data rows;
    required columns present; sensor ids non-empty; features and target
    finite numbers; split values known; values inside the physical bounds
    (see the module docstring); no duplicate records (same sensor, time, features and
    target, with a time column; without one, repeated rows are kept and counted in
    ``meta["warnings"]``, as is an undeclared time-like column); every sensor has
    at least ``min_train_points`` train and ``min_test_points`` test points.
    Before any of it, the file must be a regular file of at most ``max_bytes``
    (default :func:`max_file_bytes`), and values must be of sane magnitude and
    plausible for known columns (see the module docstring).

    Returns a :class:`Fleet` whose frame keeps the file's row order and
    extra columns (CSV extras are typed: int, float, bool or str), with the
    client column as str, features/target float64, a lowercase ``split``
    column and an int ``source_line`` column (CSV line number or Parquet
    record number; a column of that name in the file is replaced).
    """
    how = checked_assembly(
        features, target, client_column, split_column, test_fraction, seed, min_train_points,
        min_test_points, time_column, split_by,
    )  # fmt: skip
    numeric = [*how.features, how.target]
    raw, label, bounds, plausible = _read_guarded(path, numeric, physical_bounds, max_bytes)
    return _fleet_of(raw, label, bounds, plausible, how)


_LOAD_FLEET = inspect.signature(load_fleet)
_ASSEMBLY_ARGUMENTS = tuple(inspect.signature(checked_assembly).parameters)


def load_fleet_chunks(path: str | Path, **options: Any) -> Iterator[Fleet]:
    """:func:`load_fleet` of a Parquet file, one row group at a time
    (:func:`fedcal.data.rowgroups.row_group_fleets` says how). ``options``: load_fleet's, by
    name, with its defaults (its signature is their one declaration; an unknown one is a
    TypeError at the call). Lazy as a generator: nothing is checked or read before the
    first row group is asked for."""
    given = _LOAD_FLEET.bind(path, **options)
    given.apply_defaults()
    return _row_groups(given.arguments)


def _row_groups(given: Mapping[str, Any]) -> Iterator[Fleet]:
    how = checked_assembly(**{name: given[name] for name in _ASSEMBLY_ARGUMENTS})
    yield from row_group_fleets(given["path"], how, given["physical_bounds"], given["max_bytes"])


def load_readings(
    path: str | Path | pd.DataFrame,
    features: Sequence[str],
    client_column: str = CLIENT_COLUMN,
    physical_bounds: Mapping[str, tuple[float | None, float | None] | Bounds | None] | None = None,
    max_bytes: int | None = None,
) -> pd.DataFrame:
    """Read and validate raw readings to calibrate (``fedcal predict``): no target needed.

    The same guards as :func:`load_fleet`, each failure a :class:`FleetDataError`
    naming the file, the rows and the field: a regular file within the size limit,
    a supported type (fedcal's Parquet checked against its page checksums and
    metadata), the sensor column and ``features`` present, sensor ids non-empty,
    features finite numbers of sane magnitude, inside their physical bounds and
    plausible ranges. Duplicate rows and per-sensor counts are not checked: a
    reading may repeat, and one reading is enough to calibrate.

    Returns the file's rows in order, every column kept (CSV extras typed as in
    :func:`load_fleet`), the sensor column as str and the features as float64.
    """
    features = tuple(features)
    if not features:
        raise ValueError("features must name at least one column")
    raw, label, bounds, plausible = _read_guarded(path, list(features), physical_bounds, max_bytes)
    _check_columns(raw, label, [client_column, *features], None)
    errors: list[FleetDataError] = []
    ids, err = _parse_ids(raw, client_column, label)
    errors += [err] if err else []
    values: dict[str, np.ndarray] = {}
    for col in features:
        values[col], err = _parse_numbers(raw, col, label)
        errors += [err] if err else []
    _raise_first(errors, label)
    _check_values(raw, label, values, bounds, plausible)
    frame = raw.frame.copy()
    if raw.text:
        for col in frame.columns:
            if col not in (client_column, *features):
                frame[col] = _infer_text_column(frame[col].tolist())
    frame[client_column] = pd.Series(ids, dtype="str")
    for col in features:
        frame[col] = values[col]
    return frame.drop(columns=[SOURCE_LINE], errors="ignore").reset_index(drop=True)


def save_fleet(fleet: Fleet, path: str | Path) -> None:
    """Write ``fleet.frame`` as ``.csv`` or ``.parquet``/``.pq`` (by suffix), atomically.

    The table goes to a temporary file in the same directory, fsync'd, which
    then replaces ``path`` (:mod:`fedcal.core.atomic`), so a failed write never
    leaves a half file and never touches an existing one. The ``source_line``
    column is not written (it is regenerated on load). Features, target and
    client column are not stored: pass them to :func:`load_fleet` again.

    Parquet is written with page checksums (CRC32 of every data page, verified
    by :func:`load_fleet`) and, in the key-value metadata under ``fedcal``, the
    row count, the rows of each sensor and a digest of the table.
    """
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in CSV_SUFFIXES + PARQUET_SUFFIXES:
        supported = ", ".join(CSV_SUFFIXES + PARQUET_SUFFIXES)
        raise ValueError(f"{p}: unsupported file type {p.suffix!r}; supported: {supported}")
    frame = fleet.frame.drop(columns=[SOURCE_LINE], errors="ignore").reset_index(drop=True)

    if suffix in CSV_SUFFIXES:

        def write(tmp: Path) -> None:
            with open(tmp, "x", newline="", encoding="utf-8") as fh:
                frame.to_csv(fh, index=False, lineterminator="\n")

    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pandas(frame, preserve_index=False)
        # The digest of the table as load_fleet reads it back (a missing text cell is
        # None in memory, NaN read back): the frame itself would not match its own file.
        record = json.dumps(_parquet_record(table.to_pandas(), fleet.client_column)).encode()
        table = table.replace_schema_metadata(
            {**(table.schema.metadata or {}), PARQUET_META_KEY: record}
        )

        def write(tmp: Path) -> None:
            with open(tmp, "xb") as fh:
                pq.write_table(table, fh, write_page_checksum=True)

    write_with(p, write)
