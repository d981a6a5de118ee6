"""A Parquet fleet file read and written one row group at a time (issue 25.1): a fleet of
100,000 units without its whole frame; fedcal's metadata checked and written column by
column.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np
import pandas as pd

from fedcal.core.atomic import write_with
from fedcal.data.assembly import _Assembly, _fleet_of
from fedcal.data.fileerrors import FleetDataError, SensorSplitError
from fedcal.data.fleet import (
    CLIENT_COLUMN,
    Fleet,
)
from fedcal.data.reading import (
    CSV_SUFFIXES,
    PARQUET_META_KEY,
    PARQUET_SUFFIXES,
    SOURCE_LINE,
    _check_record,
    _file_format,
    _open_regular,
    _parquet_problem,
    _Raw,
    _read_record,
    _tidy_parquet_frame,
    max_file_bytes,
)
from fedcal.data.units import Bounds, Plausible, _resolve_bounds, plausible_range


def row_group_fleets(
    path: str | Path,
    how: _Assembly,
    physical_bounds: Mapping[str, tuple[float | None, float | None] | Bounds | None] | None,
    max_bytes: int | None,
) -> Iterator[Fleet]:
    """:func:`~fedcal.data.loader.load_fleet_chunks`' work (its options checked into ``how``,
    :func:`~fedcal.data.assembly.checked_assembly`): :func:`load_fleet` of a Parquet file, one
    row group at a time (issue 25.1: a fleet
    of 100,000 units without its whole frame; ``fedcal simulate`` and :func:`save_chunks`
    write a row group per 1,000 sensors). Each row group is checked as :func:`load_fleet`
    checks a file (its messages name the file and the record numbers of the whole file)
    and yielded as a :class:`Fleet`; their frames concatenated are :func:`load_fleet`'s
    (tested). Before the first, fedcal's metadata (rows, rows per sensor, digest) is
    checked against the file column by column, row group by row group. A sensor's rows
    must lie in one row group (the checks per sensor need all of them): a sensor met again
    in a later row group is refused, naming it."""
    import pyarrow.parquet as pq

    numeric = [*how.features, how.target]
    bounds = _resolve_bounds(numeric, physical_bounds)
    plausible = {
        c: p
        for c in numeric
        if (p := plausible_range(c)) is not None and c not in (physical_bounds or {})
    }
    label = str(path)
    if _file_format(Path(path), label) != "parquet":
        raise FleetDataError(label, "read by row groups: give a Parquet file (.parquet, .pq)")
    limit = max_file_bytes() if max_bytes is None else int(max_bytes)
    fd = _open_regular(Path(path), label, limit)
    with os.fdopen(fd, "rb") as fh:
        try:
            pf = pq.ParquetFile(fh, page_checksum_verification=True)
            record = (pf.schema_arrow.metadata or {}).get(PARQUET_META_KEY)
            if record is not None:
                _check_streamed_record(pf, record, label)
            _check_sensor_groups(pf, how.client_column, label)
            whole = _whole_file_stats(pf, plausible)
        except FleetDataError:
            raise
        except Exception as e:  # any failure to decode untrusted bytes is the file's
            raise FleetDataError(label, _parquet_problem(e)) from None
        start = 0
        for g in range(pf.num_row_groups):
            try:
                frame = pf.read_row_group(g).to_pandas()
            except Exception as e:
                raise FleetDataError(label, _parquet_problem(e)) from None
            raw = _Raw(
                _tidy_parquet_frame(frame, label, allow_empty=True),
                np.arange(start, start + len(frame), dtype=np.int64),
                "record",
                False,
            )
            start += len(frame)
            if not len(frame):
                continue
            fleet = _fleet_of(raw, label, bounds, plausible, how, whole)
            yield fleet
        if not start:
            raise FleetDataError(label, "no data rows (the table has 0 records)")


def _check_sensor_groups(source, client_column: str, label: str) -> None:
    """Refuse a file whose sensor has rows in two row groups (read by row groups, each
    sensor's checks need all its rows), naming the first: one column of one row group at
    a time, its distinct ids."""
    import pyarrow.compute as pc

    if client_column not in source.schema_arrow.names:
        return  # the first row group's column check names it
    seen: set[str] = set()
    for g in range(source.num_row_groups):
        column = source.read_row_group(g, columns=[client_column]).column(0)
        # stripped, as _parse_ids reads them: "S000" and "S000 " are one sensor
        ids = {str(v).strip() for v in pc.unique(column).to_pylist() if v is not None}
        again = sorted(ids & seen)
        if again:
            raise SensorSplitError(
                label,
                f"sensor {again[0]!r} has rows in row group {g + 1} and an earlier one: "
                "read by row groups, a sensor's rows must lie in one (load the whole file)",
            )
        seen |= ids


def _whole_file_stats(source, plausible: Mapping[str, Plausible]) -> dict[str, tuple[float, float]]:
    """Per plausible-range column with a spread or reach check, the (median, max) of its
    finite values over the whole file, one column at a time (a row group alone would let a
    unit mistake confined to it pass). A column that is not numbers is left out: its row
    group's parse names the bad cells."""
    import pyarrow as pa
    import pyarrow.compute as pc

    out = {}
    names = source.schema_arrow.names
    for col, r in plausible.items():
        if (r.spread is None and r.reach is None) or col not in names:
            continue
        parts = []
        try:
            for g in range(source.num_row_groups):
                column = pc.cast(source.read_row_group(g, columns=[col]).column(0), pa.float64())
                parts.append(column.to_numpy(zero_copy_only=False))
        except pa.ArrowException:
            continue
        v = np.concatenate(parts) if parts else np.empty(0)
        v = v[np.isfinite(v)]
        if len(v):
            out[col] = (float(np.median(v)), float(v.max()))
    return out


def _check_streamed_record(source, raw_record: bytes, label: str) -> None:
    """:func:`_check_parquet_record` of a Parquet file read a column of a row group at a
    time (:func:`_streamed_record`)."""
    recorded = _read_record(raw_record, label)
    per_sensor, column = recorded[2], recorded[3]
    have = _streamed_record(source, column if per_sensor is not None else None)
    counts = have.get("rows_per_sensor") if per_sensor is not None else None
    _check_record(label, recorded, have["rows"], counts, lambda: have["sha256"])


def save_chunks(
    frames: Iterable[pd.DataFrame], path: str | Path, client_column: str = CLIENT_COLUMN
) -> tuple[int, int]:
    """Write a fleet table given as consecutive parts (e.g. sensors 0–999, 1000–1999, …),
    atomically, holding one part at a time: what :func:`save_fleet` writes for their
    concatenation. Returns (rows, sensors). Parts must have the first part's columns, in
    its order, in types it can hold (a ValueError naming the file and the part).

    CSV: each part appended (the header once). Parquet: one row group per part
    (``pyarrow.parquet.ParquetWriter``); the metadata :func:`save_fleet` stores (rows,
    rows per sensor, the digest of :func:`_frame_digest`) needs the whole table, column
    after column, so the row groups go to a scratch file first, are digested column by
    column and row group by row group (:func:`_streamed_record`: the digest's bytes in
    the same order), then copied with that metadata into the file (page checksums on).
    """
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in CSV_SUFFIXES + PARQUET_SUFFIXES:
        supported = ", ".join(CSV_SUFFIXES + PARQUET_SUFFIXES)
        raise ValueError(f"{p}: unsupported file type {p.suffix!r}; supported: {supported}")
    sizes = {"rows": 0}
    sensors: set[str] = set()

    def parts() -> Iterable[pd.DataFrame]:
        columns = None
        for k, frame in enumerate(frames):
            frame = frame.drop(columns=[SOURCE_LINE], errors="ignore").reset_index(drop=True)
            names = [str(c) for c in frame.columns]
            columns = names if columns is None else columns
            if names != columns:  # CSV would write the values under the first part's header
                raise ValueError(
                    f"{p}: part {k + 1} has the columns {names}, the first part {columns}"
                )
            sizes["rows"] += len(frame)
            if client_column in frame.columns:
                sensors.update(frame[client_column].astype(str).unique())
            yield frame

    if suffix in CSV_SUFFIXES:

        def write(tmp: Path) -> None:
            with open(tmp, "x", newline="", encoding="utf-8") as fh:
                for k, frame in enumerate(parts()):
                    frame.to_csv(fh, index=False, header=k == 0, lineterminator="\n")

    else:

        def write(tmp: Path) -> None:
            _write_row_groups(parts(), tmp, p, client_column)

    write_with(p, write)
    return sizes["rows"], len(sensors)


def _write_row_groups(parts: Iterable[pd.DataFrame], tmp: Path, p: Path, client_column: str):
    """:func:`save_chunks`' Parquet: the parts as row groups into a scratch file, then
    copied into ``tmp`` with fedcal's metadata (:func:`_streamed_record`), page checksums on."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    scratch = tmp.with_name(tmp.name + ".rows")
    try:
        writer = None
        for k, frame in enumerate(parts):
            table = pa.Table.from_pandas(frame, preserve_index=False)
            if writer is None:
                writer = pq.ParquetWriter(scratch, table.schema)
            try:
                table = table.cast(writer.schema)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                wrong = [
                    f"{f.name} ({g.type}, first part {f.type})"
                    for f, g in zip(writer.schema, table.schema, strict=True)
                    if f.type != g.type
                ]
                raise ValueError(
                    f"{p}: part {k + 1}: column types the first part's cannot hold: "
                    + ", ".join(wrong)
                ) from None
            writer.write_table(table)
        if writer is None:
            raise ValueError(f"{p}: no rows to write")
        writer.close()
        source = pq.ParquetFile(scratch)
        record = json.dumps(_streamed_record(source, client_column)).encode()
        schema = source.schema_arrow
        schema = schema.with_metadata({**(schema.metadata or {}), PARQUET_META_KEY: record})
        with (
            open(tmp, "xb") as fh,
            pq.ParquetWriter(fh, schema, write_page_checksum=True) as out,
        ):
            for g in range(source.num_row_groups):
                out.write_table(source.read_row_group(g).cast(schema))
    finally:
        scratch.unlink(missing_ok=True)


def _streamed_record(source, client_column: str | None) -> dict:
    """:func:`_parquet_record` of a Parquet file's table, read one column of one row group
    at a time: the digest hashes the same bytes in the same order (each column in full,
    its text cells joined by ``\\x1f`` across row groups too), rows per sensor summed."""
    names = source.schema_arrow.names
    h = hashlib.sha256(json.dumps([str(c) for c in names]).encode())
    counts: dict[str, int] = {}
    rows = 0
    for col in names:
        joined = False  # a text cell written before: the next one is preceded by \x1f
        for g in range(source.num_row_groups):
            values = source.read_row_group(g, columns=[col]).to_pandas()[col]
            if col == names[0]:
                rows += len(values)
            if pd.api.types.is_numeric_dtype(values) and not pd.api.types.is_bool_dtype(values):
                h.update(values.to_numpy(dtype="float64", na_value=np.nan).tobytes())
            elif len(values):
                text = "\x1f".join(map(str, values.tolist()))
                h.update((("\x1f" if joined else "") + text).encode("utf-8", "surrogatepass"))
                joined = True
            if col == client_column:
                for k, v in values.astype(str).value_counts().items():
                    counts[str(k)] = counts.get(str(k), 0) + int(v)
        h.update(b"\x1e")
    record: dict = {"version": 1, "rows": rows, "sha256": h.hexdigest()}
    if client_column is not None and client_column in names:
        record["client_column"] = client_column
        record["rows_per_sensor"] = counts
    return record
