"""Reading a fleet file's table through the guards every reader shares: a regular file
within the size limit, CSV text lines or Parquet records (page checksums, fedcal's
metadata checked), or a DataFrame given to the Python API.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from fedcal.core.paths import FILE_KINDS, byte_limit
from fedcal.data.fileerrors import MAX_LISTED, FleetDataError, _listing
from fedcal.data.units import _resolve_bounds, plausible_range

SOURCE_LINE = "source_line"


CSV_SUFFIXES: tuple[str, ...] = (".csv",)


PARQUET_SUFFIXES: tuple[str, ...] = (".parquet", ".pq")


DEFAULT_MAX_BYTES = 2 * 1024**3  # a fleet file larger than this is refused unread


MAX_BYTES_ENV = "FEDCAL_MAX_FILE_BYTES"


PARQUET_META_KEY = b"fedcal"  # key-value metadata written by save_fleet


@dataclass
class _Raw:
    frame: pd.DataFrame  # columns as read (CSV: every cell a str)
    rows: np.ndarray  # line (CSV) or record (Parquet) number of each row
    kind: str  # "line" or "record"
    text: bool  # True for CSV: cells are raw strings
    header_line: int | None = None


def _file_format(path: Path, label: str) -> str:
    suffix = path.suffix.lower()
    if suffix in CSV_SUFFIXES:
        return "csv"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    supported = ", ".join(CSV_SUFFIXES + PARQUET_SUFFIXES)
    raise FleetDataError(
        label, f"unsupported file type {path.suffix or '(no suffix)'!r}; supported: {supported}"
    )


def max_file_bytes() -> int:
    """The size limit: ``$FEDCAL_MAX_FILE_BYTES`` if set, else :data:`DEFAULT_MAX_BYTES`."""
    return byte_limit(MAX_BYTES_ENV, DEFAULT_MAX_BYTES)


def _open_regular(path: Path, label: str, max_bytes: int) -> int:
    """A read-only descriptor of ``path`` if it is a regular file within the size limit.

    Opened non-blocking and checked with ``fstat`` on the descriptor itself, so
    a FIFO is refused without waiting for a writer and a file swapped between
    check and read cannot slip through.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise FleetDataError(label, "file not found") from None
    except OSError as e:
        raise FleetDataError(label, f"cannot open file: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = FILE_KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
            raise FleetDataError(label, f"not a regular file ({kind}); give a CSV or Parquet file")
        if st.st_size > max_bytes:
            raise FleetDataError(
                label,
                f"file is {st.st_size} bytes, over the limit of {max_bytes} bytes "
                f"(set ${MAX_BYTES_ENV} to raise it)",
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_csv(path: Path, label: str, max_bytes: int) -> _Raw:
    fd = _open_regular(path, label, max_bytes)
    fh = os.fdopen(fd, newline="", encoding="utf-8-sig")
    with fh:
        reader = csv.reader(fh)
        header: list[str] | None = None
        header_line = 0
        records: list[list[str]] = []
        lines: list[int] = []
        wrong_width: list[tuple[int, str]] = []
        prev = 0
        try:
            for rec in reader:
                start, prev = prev + 1, reader.line_num
                if not "".join(rec).strip():
                    continue  # blank line or a row of empty cells
                if header is None:
                    header, header_line = [c.strip() for c in rec], start
                    continue
                if len(rec) > len(header) and not "".join(rec[len(header) :]).strip():
                    rec = rec[: len(header)]  # trailing empty cells
                if len(rec) != len(header):
                    wrong_width.append((start, f"{len(rec)} fields"))
                    continue
                records.append(rec)
                lines.append(start)
        except csv.Error as e:
            line = reader.line_num
            raise FleetDataError(label, f"malformed CSV at line {line}: {e}", [line]) from e
        except UnicodeDecodeError as e:
            raise FleetDataError(label, f"not UTF-8 text ({e.reason})") from e
    if header is None:
        raise FleetDataError(label, "file is empty (no header, no data rows)")
    where = f"header (line {header_line})"
    names = [h or f"unnamed_{i + 1}" for i, h in enumerate(header)]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise FleetDataError(
            label,
            f"duplicate column names in the {where}: {', '.join(map(repr, dupes))}",
            [header_line],
        )
    if wrong_width:
        raise FleetDataError(
            label,
            f"rows with a different number of fields than the {where} ({len(header)}): "
            + _listing(wrong_width, "line"),
            [n for n, _ in wrong_width],
        )
    if not records:
        raise FleetDataError(label, f"no data rows (only the {where})", [header_line])
    columns = list(zip(*records, strict=True))
    frame = pd.DataFrame(
        {n: pd.Series(col, dtype=object) for n, col in zip(names, columns, strict=True)}
    )
    return _Raw(frame, np.asarray(lines, dtype=np.int64), "line", True, header_line)


def _frame_digest(frame: pd.DataFrame) -> str:
    """SHA-256 of a table's column names and values (row order counts, the index does not)."""
    # Values by plain bytes, not pandas' hashing: a pandas upgrade must not reject old files.
    h = hashlib.sha256(json.dumps([str(c) for c in frame.columns]).encode())
    for col in frame.columns:
        values = frame[col]
        if pd.api.types.is_numeric_dtype(values) and not pd.api.types.is_bool_dtype(values):
            h.update(values.to_numpy(dtype="float64", na_value=np.nan).tobytes())
        else:
            h.update("\x1f".join(map(str, values.tolist())).encode("utf-8", "surrogatepass"))
        h.update(b"\x1e")
    return h.hexdigest()


def _parquet_record(frame: pd.DataFrame, client_column: str | None) -> dict:
    """What save_fleet stores beside a table, to check it when read back."""
    record: dict = {"version": 1, "rows": len(frame), "sha256": _frame_digest(frame)}
    if client_column is not None and client_column in frame.columns:
        ids = frame[client_column].astype(str)
        record["client_column"] = client_column
        record["rows_per_sensor"] = {str(k): int(v) for k, v in ids.value_counts().items()}
    return record


REDO = "the file is corrupt, or was changed by a tool that kept fedcal's metadata"


def _read_record(raw_record: bytes, label: str) -> tuple[int, str, dict | None, str | None]:
    """fedcal's metadata of a Parquet file (:func:`_parquet_record`): its rows, digest, rows
    per sensor (None: not recorded) and client column."""
    try:
        record = json.loads(raw_record)
        rows, digest = int(record["rows"]), str(record["sha256"])
        per_sensor = record.get("rows_per_sensor")
        column = record.get("client_column")
    except (ValueError, TypeError, KeyError, UnicodeDecodeError):
        raise FleetDataError(
            label, f"fedcal's metadata in the file is unreadable: {REDO}"
        ) from None
    return rows, digest, per_sensor, column


def _check_record(
    label: str,
    recorded: tuple[int, str, dict | None, str | None],
    rows: int,
    counts: dict | None,
    digest: Callable[[], str],
) -> None:
    """A table as read — its rows, rows per sensor (None: not counted) and digest (computed
    last, only if the rest agrees) — against the metadata recorded beside it."""
    want_rows, want_digest, per_sensor, column = recorded
    if rows != want_rows:
        raise FleetDataError(label, f"has {rows} rows, its metadata records {want_rows}: {REDO}")
    if per_sensor is not None and counts is not None:
        wrong = sorted(set(counts) | set(per_sensor), key=str)
        wrong = [k for k in wrong if counts.get(k, 0) != per_sensor.get(k, 0)]
        if wrong:
            listed = ", ".join(
                f"{k!r}: {counts.get(k, 0)} read, {per_sensor.get(k, 0)} recorded"
                for k in wrong[:MAX_LISTED]
            )
            raise FleetDataError(
                label, f"rows per sensor differ from its metadata ({listed}): {REDO}", [], column
            )
    if digest() != want_digest:
        raise FleetDataError(label, f"content differs from the digest in its metadata: {REDO}")


def _check_parquet_record(frame: pd.DataFrame, raw_record: bytes, label: str) -> None:
    """A Parquet table read whole against fedcal's metadata in its file."""
    recorded = _read_record(raw_record, label)
    per_sensor, column = recorded[2], recorded[3]
    counts = None
    if per_sensor is not None and column in frame.columns:
        counts = frame[column].astype(str).value_counts().to_dict()
    _check_record(label, recorded, len(frame), counts, lambda: _frame_digest(frame))


def _read_parquet(path: Path, label: str, max_bytes: int) -> _Raw:
    import pyarrow.parquet as pq

    fd = _open_regular(path, label, max_bytes)
    with os.fdopen(fd, "rb") as fh:
        try:
            pf = pq.ParquetFile(fh, page_checksum_verification=True)
            record = (pf.schema_arrow.metadata or {}).get(PARQUET_META_KEY)
            frame = pf.read().to_pandas()
        except Exception as e:  # any failure to decode untrusted bytes is the file's
            raise FleetDataError(label, _parquet_problem(e)) from None
    if record is not None:
        _check_parquet_record(frame, record, label)
    frame = _tidy_parquet_frame(frame, label)
    return _Raw(frame, np.arange(len(frame), dtype=np.int64), "record", False)


def _frame_raw(frame: pd.DataFrame) -> _Raw:
    """A DataFrame given to the Python API, read like a Parquet table (rows by position)."""
    label = "DataFrame"
    if not isinstance(frame.index, pd.RangeIndex) and any(n is not None for n in frame.index.names):
        frame = frame.reset_index()  # a named index is data (e.g. the sensor id)
    else:
        frame = frame.reset_index(drop=True)
    frame = frame.copy()
    frame.columns = [str(c) for c in frame.columns]
    if len(frame) == 0:
        raise FleetDataError(label, "no data rows (the table has 0 rows)")
    return _Raw(frame, np.arange(len(frame), dtype=np.int64), "row", False)


def _read_guarded(path, numeric: list[str], physical_bounds, max_bytes):
    """Read a fleet or readings file through the guards every reader shares (regular
    file, size limit, format, checksums); with the bounds and plausible ranges of
    ``numeric``. A user's own bounds for a column replace its plausible range as well."""
    bounds = _resolve_bounds(numeric, physical_bounds)
    plausible = {
        c: p
        for c in numeric
        if (p := plausible_range(c)) is not None and c not in (physical_bounds or {})
    }
    if isinstance(path, pd.DataFrame):  # the Python API: the same guards on a table in memory
        return _frame_raw(path), "DataFrame", bounds, plausible
    limit = max_file_bytes() if max_bytes is None else int(max_bytes)
    label = str(path)
    p = Path(path)
    fmt = _file_format(p, label)
    raw = _read_csv(p, label, limit) if fmt == "csv" else _read_parquet(p, label, limit)
    return raw, label, bounds, plausible


def _parquet_problem(e: Exception) -> str:
    detail = str(e).strip().splitlines()
    detail = f": {detail[0]}" if detail else ""
    if "verify page integrity" in detail:
        return "corrupt: a data page fails its checksum (the file was damaged)"
    return f"cannot read as Parquet ({type(e).__name__}{detail})"


def _tidy_parquet_frame(frame: pd.DataFrame, label: str, allow_empty: bool = False):
    """A Parquet table's frame as the checks read it: a named index as data, str column
    names, no column name twice, at least one row (unless ``allow_empty``)."""
    if not isinstance(frame.index, pd.RangeIndex) and any(n is not None for n in frame.index.names):
        frame = frame.reset_index()  # a named index is data (e.g. the sensor id)
    else:
        frame = frame.reset_index(drop=True)
    frame.columns = [str(c) for c in frame.columns]
    repeated = sorted({c for c in frame.columns if list(frame.columns).count(c) > 1})
    if repeated:  # a column name twice: which one is the data?
        raise FleetDataError(
            label, f"duplicate column names in the schema: {', '.join(map(repr, repeated))}"
        )
    if len(frame) == 0 and not allow_empty:
        raise FleetDataError(label, "no data rows (the table has 0 records)")
    return frame
