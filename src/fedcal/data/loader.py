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

import csv
import difflib
import hashlib
import json
import math
import os
import re
import stat
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from fedcal.core.atomic import write_with
from fedcal.core.paths import FILE_KINDS, byte_limit
from fedcal.data.fleet import (
    BAROMETRIC_FEATURES,
    BAROMETRIC_TARGET,
    CLIENT_COLUMN,
    DIRECTION_COLUMN,
    DIRECTION_SIGNS,
    ROLE_COLUMN,
    SPLIT_COLUMN,
    SPLITS,
    Fleet,
)

SOURCE_LINE = "source_line"
CSV_SUFFIXES: tuple[str, ...] = (".csv",)
PARQUET_SUFFIXES: tuple[str, ...] = (".parquet", ".pq")
MAX_LISTED = 5  # offending rows (or sensors) spelled out in a message
DEFAULT_MAX_BYTES = 2 * 1024**3  # a fleet file larger than this is refused unread
MAX_BYTES_ENV = "FEDCAL_MAX_FILE_BYTES"
MAX_ABS_VALUE = 1e15  # beyond any sensor reading in any unit; 1e308 overflows scaling
PARQUET_META_KEY = b"fedcal"  # key-value metadata written by save_fleet

# ASCII digits only: float() would also read "３３０００" (full-width) or Arabic-Indic digits
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?", re.ASCII)
_NON_FINITE = re.compile(r"[+-]?(?:nan|inf|infinity)", re.IGNORECASE)
_INTEGER = re.compile(r"[+-]?(?:0|[1-9]\d*)", re.ASCII)


class FleetDataError(ValueError):
    """Bad input data.

    ``str()`` names the file, the row(s) and the field. Attributes: ``path``
    (the file as given), ``rows`` (all offending line numbers for CSV — header
    is line 1, first data row line 2 — or 0-based record numbers for Parquet;
    may be empty), ``field`` (the column concerned, or ``None``) and
    ``problem`` (the message without the file and field).
    """

    def __init__(
        self, path: str, problem: str, rows: Sequence[int] = (), field: str | None = None
    ) -> None:
        self.path = str(path)
        self.problem = problem
        self.rows = [int(r) for r in rows]
        self.field = field
        head = self.path if field is None else f"{self.path}, field '{field}'"
        super().__init__(f"{head}: {problem}")

    def __reduce__(self):
        return (type(self), (self.path, self.problem, self.rows, self.field))


class SensorSplitError(FleetDataError):
    """A sensor's rows lie in two row groups of a Parquet file: :func:`load_fleet_chunks`
    cannot read it (its checks per sensor need all the rows); :func:`load_fleet` can."""


@dataclass(frozen=True)
class Bounds:
    """Physically possible range of a column; ``None`` means open on that side."""

    lo: float | None = None
    hi: float | None = None
    lo_inclusive: bool = True
    hi_inclusive: bool = True

    def outside(self, v: np.ndarray) -> np.ndarray:
        bad = np.zeros(v.shape, dtype=bool)
        if self.lo is not None:
            bad |= v < self.lo if self.lo_inclusive else v <= self.lo
        if self.hi is not None:
            bad |= v > self.hi if self.hi_inclusive else v >= self.hi
        return bad

    def describe(self) -> str:
        parts = []
        if self.lo is not None:
            parts.append(f"{'>=' if self.lo_inclusive else '>'} {self.lo:g}")
        if self.hi is not None:
            parts.append(f"{'<=' if self.hi_inclusive else '<'} {self.hi:g}")
        return "must be " + " and ".join(parts) if parts else "unbounded"


DEFAULT_PHYSICAL_BOUNDS: dict[str, Bounds] = {
    "frequency_hz": Bounds(0.0, None, lo_inclusive=False),
    "pressure_hpa": Bounds(0.0, None),
    "temperature_c": Bounds(-273.15, None, lo_inclusive=False),
}


@dataclass(frozen=True)
class Plausible:
    """Where the values of a known column lie when its unit is right.

    ``hints``: ``(lo, hi, text)`` — a value outside the range but inside
    ``[lo, hi)`` most likely means ``text`` (a unit mistake). ``reach``:
    ``(value, text)`` — the column's largest value must be at least ``value``,
    else ``text`` (every value plausible alone, the whole column in too small
    a unit).
    """

    lo: float
    hi: float
    unit: str
    hints: tuple[tuple[float, float, str], ...] = ()
    reach: tuple[float, str] | None = None
    spread: float | None = None  # no value beyond ×/÷ this of the column's median

    def hint(self, v: float) -> str:
        return next((text for lo, hi, text in self.hints if lo <= v < hi), "")


PLAUSIBLE_RANGES: dict[str, Plausible] = {
    "pressure_hpa": Plausible(
        0.0,
        2000.0,
        "hPa",
        ((2000.0, 2.0e5, "is it in Pa? (1 hPa = 100 Pa)"),),
        # kPa (<= 200 for a 2000 hPa range), psi (<= 29), inHg (<= 59) never reach 250.
        (250.0, "is it in kPa or psi? a barometric calibration reaches ambient (~1013 hPa)"),
    ),
    # A resonator is pulled by a few % over its range (quartz 32.8–37.6 kHz): one row ten
    # times the fleet's median (33 MHz among 33 kHz) is a unit mistake or a corrupt cell.
    "frequency_hz": Plausible(
        100.0, 1e9, "Hz", ((0.0, 100.0, "is it in kHz? (1 kHz = 1000 Hz)"),), spread=10.0
    ),
    "temperature_c": Plausible(
        -100.0, 250.0, "°C", ((250.0, 800.0, "is it in kelvin? (°C = K − 273.15)"),)
    ),
}


# a column's own name for its unit (``f_hz``, ``t_c``, ``p_hpa``): the known column of that unit
UNIT_SUFFIXES = {"hpa": "pressure_hpa", "hz": "frequency_hz", "c": "temperature_c"}


def plausible_range(column: str) -> Plausible | None:
    """The plausible range of a known column, or of one named with its unit (``t_c``: °C).

    So the unit guesses (kHz, kelvin, Pa) also guard a user's own names for the columns.
    """
    if column in PLAUSIBLE_RANGES:
        return PLAUSIBLE_RANGES[column]
    unit = column.rsplit("_", 1)[-1].lower() if "_" in column else ""
    return PLAUSIBLE_RANGES.get(UNIT_SUFFIXES.get(unit, ""))


# --------------------------------------------------------------------------- messages


def _listing(items: Sequence[tuple[int, str | None]], kind: str) -> str:
    """``line 5 ('abc'), line 9 (empty cell) and 3 more``."""
    shown = [f"{kind} {n}" + (f" ({d})" if d else "") for n, d in items[:MAX_LISTED]]
    text = ", ".join(shown)
    if len(items) > MAX_LISTED:
        text += f" and {len(items) - MAX_LISTED} more"
    return text


def _fmt(v: float) -> str:
    return repr(float(v))


# --------------------------------------------------------------------------- reading


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


def _check_parquet_record(frame: pd.DataFrame, raw_record: bytes, label: str) -> None:
    redo = "the file is corrupt, or was changed by a tool that kept fedcal's metadata"
    try:
        record = json.loads(raw_record)
        rows, digest = int(record["rows"]), str(record["sha256"])
        per_sensor = record.get("rows_per_sensor")
        column = record.get("client_column")
    except (ValueError, TypeError, KeyError, UnicodeDecodeError):
        raise FleetDataError(
            label, f"fedcal's metadata in the file is unreadable: {redo}"
        ) from None
    if len(frame) != rows:
        raise FleetDataError(label, f"has {len(frame)} rows, its metadata records {rows}: {redo}")
    if per_sensor is not None and column in frame.columns:
        have = frame[column].astype(str).value_counts().to_dict()
        wrong = sorted(set(have) | set(per_sensor), key=str)
        wrong = [k for k in wrong if have.get(k, 0) != per_sensor.get(k, 0)]
        if wrong:
            listed = ", ".join(
                f"{k!r}: {have.get(k, 0)} read, {per_sensor.get(k, 0)} recorded"
                for k in wrong[:MAX_LISTED]
            )
            raise FleetDataError(
                label, f"rows per sensor differ from its metadata ({listed}): {redo}", [], column
            )
    if _frame_digest(frame) != digest:
        raise FleetDataError(label, f"content differs from the digest in its metadata: {redo}")


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


# --------------------------------------------------------------------------- parsing cells


def _is_missing(v) -> bool:
    return v is None or v is pd.NA or v is pd.NaT or (isinstance(v, float) and math.isnan(v))


def _fast_floats(cells: list) -> np.ndarray | None:
    """All cells plain ASCII decimal numbers, all finite: their values; else None.

    ``float()`` (which numpy uses) also takes ``nan``, ``inf``, ``1_000`` and
    non-ASCII digits; those, and anything it rejects, go to the slow path that
    names each bad cell.
    """
    if not all(isinstance(c, str) for c in cells):
        return None
    joined = "\x00".join(cells)
    if "_" in joined or not joined.isascii():
        return None
    try:
        out = np.array(cells, dtype=np.float64)
    except ValueError:
        return None
    return out if np.isfinite(out).all() else None


def _parse_numbers(raw: _Raw, col: str, label: str) -> tuple[np.ndarray, FleetDataError | None]:
    """float64 values of one feature/target column, or the error naming its bad cells."""
    s = raw.frame[col]
    n = len(s)
    out = np.full(n, np.nan)
    bad: list[tuple[int, str]] = []
    dtype = s.dtype
    if not raw.text and pd.api.types.is_bool_dtype(dtype):
        return out, FleetDataError(label, "has boolean values; expected numbers", [], col)
    if not raw.text and dtype == np.float16:  # 11 bits: 33 kHz is stored to ±16 Hz
        return out, FleetDataError(
            label, "is stored as float16 (3 significant digits); store float32 or float64", [], col
        )
    if not raw.text and pd.api.types.is_numeric_dtype(dtype):
        out = s.to_numpy(dtype=np.float64, na_value=np.nan)
        for i in np.flatnonzero(~np.isfinite(out)):
            d = "missing (null/NaN)" if np.isnan(out[i]) else f"{_fmt(out[i])}: not finite"
            bad.append((int(raw.rows[i]), d))
    elif raw.text or dtype.kind == "O" or isinstance(dtype, pd.StringDtype | pd.CategoricalDtype):
        cells = s.tolist()
        fast = _fast_floats(cells)
        if fast is not None:
            return fast, None
        for i, v in enumerate(cells):
            if _is_missing(v):
                bad.append((int(raw.rows[i]), "missing (null)"))
                continue
            if isinstance(v, int | float | np.number) and not isinstance(v, bool | np.bool_):
                x = float(v)
                if not math.isfinite(x):
                    bad.append((int(raw.rows[i]), f"{_fmt(x)}: not finite"))
                out[i] = x
                continue
            t = str(v).strip()
            if not t:
                bad.append((int(raw.rows[i]), "empty cell"))
            elif _NUMBER.fullmatch(t):
                x = float(t)
                if math.isfinite(x):
                    out[i] = x
                else:
                    bad.append((int(raw.rows[i]), f"{t!r}: out of range"))
            elif _NON_FINITE.fullmatch(t):
                bad.append((int(raw.rows[i]), f"{t!r}: not finite"))
            else:
                bad.append((int(raw.rows[i]), f"{t!r}: not a number"))
    else:
        return out, FleetDataError(label, f"has type {dtype}; expected numbers", [], col)
    if bad:
        return out, FleetDataError(
            label,
            "needs finite numbers; bad values at " + _listing(bad, raw.kind),
            [r for r, _ in bad],
            col,
        )
    return out, None


def _strings(raw: _Raw, col: str) -> tuple[np.ndarray, np.ndarray]:
    """Stripped str of each cell (``""`` where missing) and the missing mask."""
    series = raw.frame[col]
    missing = series.isna().to_numpy()
    if series.dtype != object:  # typed (e.g. Arrow strings): each distinct value once
        codes, uniques = pd.factorize(series, use_na_sentinel=True)  # missing: code −1
        text = np.array([str(u).strip() for u in uniques] + [""], dtype=object)
        return text[codes], missing
    text = series.astype(object).where(~missing, "").map(str).str.strip()
    return text.to_numpy(dtype=object), missing


def _lower(text: np.ndarray) -> np.ndarray:
    """``text`` (str cells) lowercased, each distinct value once (a column holds a few)."""
    codes, uniques = pd.factorize(text)
    return np.array([u.lower() for u in uniques] + [""], dtype=object)[codes]


def _parse_ids(raw: _Raw, col: str, label: str) -> tuple[list[str], FleetDataError | None]:
    ids, missing = _strings(raw, col)
    empty = np.flatnonzero(ids == "")
    if len(empty):
        what = "missing" if not raw.text else "empty cell"
        bad = [(int(raw.rows[i]), "missing" if missing[i] else what) for i in empty]
        err = FleetDataError(
            label, "sensor id missing at " + _listing(bad, raw.kind), [r for r, _ in bad], col
        )
        return ids.tolist(), err
    return ids.tolist(), None


def parse_times(raw: _Raw, col: str, label: str) -> tuple[np.ndarray, FleetDataError | None]:
    """The time column as float64 seconds: numbers as given (any unit, e.g. hours or
    Unix seconds), or dates/timestamps (ISO 8601 and what pandas reads) as seconds since
    1970-01-01 UTC. Missing or unreadable cells are refused, naming their rows."""
    series = raw.frame[col]
    numbers = pd.to_numeric(series, errors="coerce")
    if numbers.notna().all():
        return numbers.to_numpy(dtype=np.float64), None
    text, missing = _strings(raw, col)
    stamps = pd.to_datetime(pd.Series(text), errors="coerce", utc=True, format="mixed")
    bad = np.flatnonzero(stamps.isna().to_numpy() | missing)
    if len(bad):
        items = [(int(raw.rows[i]), "missing" if missing[i] else repr(text[i])) for i in bad]
        msg = "unreadable time (a number or a date such as 2024-05-01T13:00) at "
        return np.zeros(len(text)), FleetDataError(
            label, msg + _listing(items, raw.kind), [r for r, _ in items], col
        )
    seconds = (stamps - pd.Timestamp(0, tz="UTC")) / pd.Timedelta(seconds=1)
    return seconds.to_numpy(dtype=np.float64), None


def time_split(ids: Sequence[str], times: np.ndarray, test_fraction: float) -> np.ndarray:
    """Per sensor: the rows in the last ``test_fraction`` of its own time span are test.

    A sensor observed from t0 to t1 is tested on t > t1 − f·(t1 − t0) (f =
    ``test_fraction``; 0.25: the last quarter of its time) and calibrated on what
    came before — the future is predicted from the past, as in the field. At
    least one test row (its latest) and one train row (its earliest) for a sensor
    with two or more distinct times.
    """
    ids = np.asarray(ids, dtype=object)
    times = np.asarray(times, dtype=np.float64)
    split = np.full(len(ids), "train", dtype=object)
    if test_fraction <= 0:
        return split
    codes, _ = pd.factorize(ids)
    for code in range(codes.max() + 1 if len(codes) else 0):
        idx = np.flatnonzero(codes == code)
        t = times[idx]
        t0, t1 = t.min(), t.max()
        test = t > t1 - test_fraction * (t1 - t0)
        if t1 > t0:
            test |= t == t1  # at least the latest row
            test &= t > t0  # never the earliest
        split[idx[test]] = "test"
    return split


def _parse_split(raw: _Raw, col: str, label: str) -> tuple[np.ndarray, FleetDataError | None]:
    text, _ = _strings(raw, col)
    out = _lower(text)
    wrong = np.flatnonzero(~np.isin(out, SPLITS))
    if len(wrong):
        cells = raw.frame[col]
        bad = [
            (int(raw.rows[i]), "empty cell" if not text[i] else repr(str(cells.iloc[i])))
            for i in wrong
        ]
        err = FleetDataError(
            label,
            f"split must be one of {', '.join(SPLITS)} (any case); bad values at "
            + _listing(bad, raw.kind),
            [r for r, _ in bad],
            col,
        )
        return out, err
    return out, None


def _parse_direction(raw: _Raw, label: str) -> tuple[np.ndarray, FleetDataError | None]:
    """The optional sweep-direction column: "up" or "down" (any case), lowercased."""
    text, _ = _strings(raw, DIRECTION_COLUMN)
    out = _lower(text)
    wrong = np.flatnonzero(~np.isin(out, list(DIRECTION_SIGNS)))
    if len(wrong):
        cells = raw.frame[DIRECTION_COLUMN]
        bad = [
            (int(raw.rows[i]), "empty cell" if not text[i] else repr(str(cells.iloc[i])))
            for i in wrong
        ]
        problem = "direction must be up or down (any case); bad values at "
        err = FleetDataError(
            label, problem + _listing(bad, raw.kind), [r for r, _ in bad], DIRECTION_COLUMN
        )
        return out, err
    return out, None


def _infer_text_column(values: list[str]) -> pd.Series:
    """Type an extra CSV column like a spreadsheet would: int, float, bool or str."""
    stripped = [v.strip() for v in values]
    filled = [v for v in stripped if v]
    if filled:
        if all(v in ("True", "False") for v in stripped):
            return pd.Series([v == "True" for v in stripped], dtype=bool)
        # Leading zeros ("0042") mark an identifier, not a number.
        no_id = not any(re.fullmatch(r"[+-]?0\d+", v) for v in filled)
        if no_id and len(filled) == len(stripped) and all(_INTEGER.fullmatch(v) for v in filled):
            try:
                return pd.Series(np.array([int(v) for v in filled], dtype=np.int64))
            except OverflowError:
                pass
        if no_id and all(_NUMBER.fullmatch(v) or _NON_FINITE.fullmatch(v) for v in filled):
            return pd.Series([float(v) if v else np.nan for v in stripped], dtype=np.float64)
    return pd.Series(values, dtype="str")


# --------------------------------------------------------------------------- checks


def _check_args(features, target, client_column, split_column, test_fraction, seed, mins):
    if isinstance(features, str):
        features = (features,)
    features = tuple(BAROMETRIC_FEATURES if features is None else features)
    target = BAROMETRIC_TARGET if target is None else target
    if not features:
        raise ValueError("features must name at least one column")
    named = [client_column, *features, target]
    if len(set(named)) != len(named):
        raise ValueError(f"client, feature and target columns must be distinct, got {named}")
    reserved = {SPLIT_COLUMN, SOURCE_LINE} | ({split_column} if split_column else set())
    clash = [c for c in named if c in reserved]
    if clash:
        raise ValueError(f"column names {clash} are reserved for the split / source line")
    if not 0.0 <= float(test_fraction) < 1.0:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    if int(seed) < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    for name, v in mins.items():
        if int(v) < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    return features, target


def _resolve_bounds(columns: Sequence[str], user) -> dict[str, Bounds]:
    out = {c: DEFAULT_PHYSICAL_BOUNDS[c] for c in columns if c in DEFAULT_PHYSICAL_BOUNDS}
    for col, b in (user or {}).items():
        if col not in columns:
            raise ValueError(
                f"physical_bounds names {col!r}, which is not a feature or the target "
                f"({', '.join(columns)})"
            )
        if b is None:
            out.pop(col, None)
            continue
        if not isinstance(b, Bounds):
            lo, hi = b
            b = Bounds(None if lo is None else float(lo), None if hi is None else float(hi))
        if b.lo is not None and b.hi is not None and b.lo > b.hi:
            raise ValueError(f"physical_bounds[{col!r}]: lower bound above upper bound")
        out[col] = b
    return out


def _check_columns(raw: _Raw, label: str, required: list[str], split_column: str | None):
    present = list(raw.frame.columns)
    missing = [c for c in required if c not in present]
    where = [raw.header_line] if raw.header_line else []
    if missing:
        hints = []
        lower = {p.lower(): p for p in present}
        for m in missing:
            close = difflib.get_close_matches(m.lower(), list(lower), n=1, cutoff=0.75)
            if close:
                hints.append(f"{m!r} → did you mean {lower[close[0]]!r}?")
        text = (
            f"missing column{'s' if len(missing) > 1 else ''} "
            f"{', '.join(map(repr, missing))}; the file has columns "
            f"{', '.join(map(repr, present))}"
        )
        if hints:
            text += " (" + "; ".join(hints) + ")"
        if raw.text and len(present) == 1 and any(d in present[0] for d in ";\t|"):
            text += " — is the file separated by something else than ','? only ',' is supported"
        if raw.header_line:
            text = f"header (line {raw.header_line}): {text}"
        raise FleetDataError(label, text, where, ", ".join(missing))
    if split_column is not None and split_column != SPLIT_COLUMN and SPLIT_COLUMN in present:
        raise FleetDataError(
            label,
            f"the file has a {SPLIT_COLUMN!r} column but split_column={split_column!r}; "
            f"rename one of them, or pass split_column={SPLIT_COLUMN!r} (or None to ignore it)",
            where,
            SPLIT_COLUMN,
        )


def _check_magnitudes(raw, label, values) -> None:
    for col, v in values.items():
        bad = np.flatnonzero(np.abs(v) > MAX_ABS_VALUE)
        if len(bad):
            items = [(int(raw.rows[i]), _fmt(v[i])) for i in bad]
            raise FleetDataError(
                label,
                f"absurd magnitude (beyond ±{MAX_ABS_VALUE:g}; no sensor reads that — a wrong "
                "unit or a corrupt value?) at " + _listing(items, raw.kind),
                [r for r, _ in items],
                col,
            )


def _check_plausible(raw, label, values, ranges: Mapping[str, Plausible], whole=None) -> None:
    """``whole``: per column, the (median, max) of the whole file when ``values`` is one
    row group of it (:func:`load_fleet_chunks`): the spread and reach checks are the file's."""
    for col, r in ranges.items():
        v = values[col]
        median, top = (whole or {}).get(col, (None, None))
        bad = np.flatnonzero((v < r.lo) | (v > r.hi))
        if len(bad):
            items = [(int(raw.rows[i]), _fmt(v[i])) for i in bad]
            hint = r.hint(float(v[bad[0]]))
            text = (
                f"implausible values for this column (expected {r.lo:g} to {r.hi:g} {r.unit}) at "
                + _listing(items, raw.kind)
                + (f" — {hint}" if hint else "")
                + "; if they are right, pass physical_bounds for this column"
            )
            raise FleetDataError(label, text, [r for r, _ in items], col)
        if median is None:
            median = float(np.median(v)) if len(v) else 0.0
        if r.spread is not None and median > 0:
            far = np.flatnonzero((v > median * r.spread) | (v < median / r.spread))
            if len(far):
                items = [(int(raw.rows[i]), _fmt(v[i])) for i in far]
                raise FleetDataError(
                    label,
                    f"values more than {r.spread:g}× away from the column's median "
                    f"{_fmt(median)} {r.unit} at " + _listing(items, raw.kind) + " — a unit "
                    "mistake or a corrupt value? if they are right, pass physical_bounds "
                    "for this column",
                    [r for r, _ in items],
                    col,
                )
        if top is None and len(v):
            top = float(v.max())
        if r.reach is not None and top is not None and top < r.reach[0]:
            raise FleetDataError(
                label,
                f"implausible for this column: its largest value is {_fmt(top)} {r.unit}, "
                f"below {r.reach[0]:g} — {r.reach[1]}; if it is right, pass physical_bounds "
                "for this column",
                [],
                col,
            )


def _check_bounds(raw, label, values, bounds) -> None:
    for col, b in bounds.items():
        v = values[col]
        bad = np.flatnonzero(b.outside(v))
        if len(bad):
            items = [(int(raw.rows[i]), _fmt(v[i])) for i in bad]
            raise FleetDataError(
                label,
                f"physically impossible values ({b.describe()}) at " + _listing(items, raw.kind),
                [r for r, _ in items],
                col,
            )


def _check_duplicates(raw, label, client_column, ids, values, timed: bool) -> str:
    """Rows of one sensor identical in inputs and target (and time, ``timed``).

    With a time column such rows are one record written twice: refused, naming the rows.
    Without one they are legitimate in zero-inflated or quantized data (dry days of a rain
    gauge, a sensor's integer counts; issue 34.5): returned as a one-line warning with
    their share and the first of them ("" when none)."""
    cols = [client_column, *values]
    key = pd.DataFrame({"_id": ids, **{f"_{k}": v for k, v in enumerate(values.values())}})
    dup = key.duplicated(keep="first").to_numpy()
    if not dup.any():
        return ""
    gid = key.groupby(list(key.columns), sort=False).ngroup().to_numpy()
    first = pd.Series(np.arange(len(gid))).groupby(gid).transform("min").to_numpy()
    items = [(int(raw.rows[i]), int(raw.rows[first[i]])) for i in np.flatnonzero(dup)]
    shown = ", ".join(f"{raw.kind} {a} duplicates {raw.kind} {b}" for a, b in items[:MAX_LISTED])
    if len(items) > MAX_LISTED:
        shown += f" and {len(items) - MAX_LISTED} more"
    names = ", ".join(map(repr, cols))
    if timed:
        raise FleetDataError(
            label,
            f"duplicate rows (same sensor, time, inputs and target; columns {names}): {shown}",
            sorted({r for pair in items for r in pair}),
        )
    share = len(items) / len(dup)
    first_pair = f"{raw.kind} {items[0][0]} repeats {raw.kind} {items[0][1]}"
    return (
        f"{label}: {len(items)} repeated rows ({100 * share:.3g} % of the rows: same sensor, "
        f"inputs and target; e.g. {first_pair}) kept as data (legitimate in zero-inflated or "
        "quantized readings; a record written twice would count twice)"
    )


#: Column names that hold a row's time (lowercase; also any name containing one of them).
TIME_NAMES = ("time", "date", "timestamp", "datetime")


def _undeclared_time(raw, label, used: Sequence[str]) -> str:
    """A one-line recommendation when the table has a time-like column not declared as the
    time column (issue 34.5): "" when none. A time column lets the split and the model
    choice respect time (the future is not in the training rows) and drift be learned."""
    names = [
        c
        for c in raw.frame.columns
        if c not in (*used, SPLIT_COLUMN, SOURCE_LINE)
        and any(t in str(c).lower() for t in TIME_NAMES)
    ]
    if not names:
        return ""
    return (
        f"{label}: column {names[0]!r} looks like each row's time; declare it (--time-column "
        f"{names[0]}, and --split-by time for field data) so that tests lie in each sensor's "
        "future and drift can be learned"
    )


def _check_roles(raw, label, client_column, ids) -> None:
    """A sensor's rows must agree on its ``role`` (results per role would be meaningless):
    refused at load, naming the sensor and the rows that disagree, before a run writes
    anything (:meth:`fedcal.data.fleet.Fleet.roles` reads the column later)."""
    if ROLE_COLUMN not in raw.frame.columns or client_column == ROLE_COLUMN:
        return
    role = raw.frame[ROLE_COLUMN].to_numpy(object)
    codes, _ = pd.factorize(role, use_na_sentinel=False)  # as Fleet.roles: NaN is a value
    key = pd.DataFrame({"id": ids, "code": codes})
    first = key.groupby("id", sort=False)["code"].transform("first").to_numpy()
    bad = np.flatnonzero(codes != first)
    if not len(bad):
        return
    sensor = ids[bad[0]]
    start = int(np.flatnonzero(np.asarray(ids, dtype=object) == sensor)[0])
    raise FleetDataError(
        label,
        f"sensor {sensor!r} has more than one role ({role[start]!r} at {raw.kind} "
        f"{int(raw.rows[start])}, {role[bad[0]]!r} at {raw.kind} {int(raw.rows[bad[0]])})",
        [int(raw.rows[i]) for i in bad[:MAX_LISTED]],
        field=ROLE_COLUMN,
    )


def _seeded_split(ids: list[str], test_fraction: float, seed: int):
    """Per sensor: ``round(n * test_fraction)`` random test points, at least one
    test and one train point when the sensor has two or more points.

    A sensor's split depends only on (seed, its id, its points), not on the
    other sensors of the file.
    """
    split = np.full(len(ids), "train", dtype=object)
    codes, uniques = pd.factorize(np.asarray(ids, dtype=object))
    by_code = np.argsort(codes, kind="stable")
    groups = np.split(by_code, np.cumsum(np.bincount(codes))[:-1])
    for cid, idx in zip(uniques, groups, strict=True):
        m = len(idx)
        k = math.floor(m * test_fraction + 0.5)
        # test_fraction 0: every point calibrates (e.g. new units for `fedcal calibrate`)
        k = min(max(k, 1), m - 1) if m >= 2 and test_fraction > 0 else 0
        rng = np.random.default_rng([int(seed), zlib.crc32(cid.encode("utf-8"))])
        split[idx[rng.choice(m, size=k, replace=False)]] = "test"
    return split


def _check_counts(raw, label, client_column, ids, order, split, mins, how) -> None:
    # Points per sensor and split, counted on integer codes (a crosstab took 1.4 s at 10,000).
    codes, uniques = pd.factorize(np.asarray(ids, dtype=object))
    at = pd.Index(uniques).get_indexer(list(order))
    split = np.asarray(split, dtype=object)
    table = {}
    for name in SPLITS:
        counts = np.bincount(codes[split == name], minlength=len(uniques))
        table[name] = pd.Series(np.where(at >= 0, counts[at], 0), index=list(order))
    problems: list[str] = []
    short_ids: set[str] = set()
    for name, need in mins.items():
        have = table[name]
        short = have[have < need]
        if len(short):
            short_ids.update(short.index)
            text = ", ".join(f"{cid!r} has {int(k)}" for cid, k in short.iloc[:MAX_LISTED].items())
            if len(short) > MAX_LISTED:
                text += f" and {len(short) - MAX_LISTED} more"
            problems.append(f"sensors with fewer than {need} {name} points: {text}")
    if problems:
        rows = raw.rows[np.isin(np.asarray(ids, dtype=object), list(short_ids))]
        raise FleetDataError(label, "; ".join(problems) + f" ({how})", rows.tolist(), client_column)


# --------------------------------------------------------------------------- API


def _raise_first(errors: list[FleetDataError], label: str) -> None:
    """One error for all the bad columns: the first in full, the others named."""
    if not errors:
        return
    first = errors[0]
    if len(errors) > 1:
        others = ", ".join(repr(e.field) for e in errors[1:])
        raise FleetDataError(
            label, f"{first.problem} (also bad values in {others})", first.rows, first.field
        )
    raise first


def _check_values(
    raw, label: str, values: dict[str, np.ndarray], bounds, plausible, whole=None
) -> None:
    """Magnitudes, physical bounds and plausible ranges of parsed numeric columns."""
    _check_magnitudes(raw, label, values)
    _check_bounds(raw, label, values, bounds)
    _check_plausible(raw, label, values, plausible, whole)


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
    mins = {"train": min_train_points, "test": min_test_points}
    features, target = _check_args(
        features, target, client_column, split_column, test_fraction, seed, mins
    )
    numeric = [*features, target]
    raw, label, bounds, plausible = _read_guarded(path, numeric, physical_bounds, max_bytes)
    how = _Assembly(
        features, target, client_column, split_column, test_fraction, seed, mins, time_column,
        split_by,
    )  # fmt: skip
    return _fleet_of(raw, label, bounds, plausible, how)


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
    features, target, mins = how.features, how.target, how.mins
    client_column, split_column, time_column = how.client_column, how.split_column, how.time_column
    test_fraction, seed, split_by = how.test_fraction, how.seed, how.split_by
    numeric = [*features, target]
    if split_by not in ("random", "time"):
        raise ValueError(f"split_by must be 'random' or 'time', got {split_by!r}")
    if split_by == "time" and not time_column:
        raise ValueError("split_by = 'time' needs a time column (--time-column)")
    if time_column and time_column in (client_column, *numeric, SPLIT_COLUMN, SOURCE_LINE):
        raise ValueError(f"time column {time_column!r} is also the sensor, a feature or reserved")
    timed = [time_column] if time_column else []
    _check_columns(raw, label, [client_column, *numeric, *timed], split_column)
    use_file_split = split_column is not None and split_column in raw.frame.columns

    errors: list[FleetDataError] = []
    ids, err = _parse_ids(raw, client_column, label)
    errors += [err] if err else []
    values: dict[str, np.ndarray] = {}
    for col in numeric:
        values[col], err = _parse_numbers(raw, col, label)
        errors += [err] if err else []
    split = None
    if use_file_split:
        split, err = _parse_split(raw, split_column, label)
        errors += [err] if err else []
    times = None
    if time_column:
        times, err = parse_times(raw, time_column, label)
        errors += [err] if err else []
    direction = None
    if DIRECTION_COLUMN in raw.frame.columns and DIRECTION_COLUMN not in (
        client_column,
        *numeric,
    ):
        direction, err = _parse_direction(raw, label)
        errors += [err] if err else []
    _raise_first(errors, label)

    _check_values(raw, label, values, bounds, plausible, whole)
    keyed = values if times is None else {**values, time_column: times}  # distinct times: data
    warned = [_check_duplicates(raw, label, client_column, ids, keyed, times is not None)]
    if not time_column:
        warned.append(_undeclared_time(raw, label, [client_column, *numeric]))
    _check_roles(raw, label, client_column, ids)

    order = list(pd.unique(pd.Series(ids)))
    if use_file_split:
        how = f"split from column {split_column!r}"
    elif split_by == "time":
        split = time_split(ids, times, float(test_fraction))
        how = f"time split, the last {test_fraction} of each sensor's time is test"
    else:
        split = _seeded_split(ids, float(test_fraction), int(seed))
        how = f"seeded split, test_fraction={test_fraction}, seed={seed}"
    _check_counts(raw, label, client_column, ids, order, split, mins, how)

    # Assemble: everything is valid from here on.
    frame = raw.frame.copy()
    if raw.text:
        for col in frame.columns:
            if col not in (client_column, *numeric, split_column, SPLIT_COLUMN, SOURCE_LINE):
                frame[col] = _infer_text_column(frame[col].tolist())
    if times is not None:
        frame[time_column] = times
    if direction is not None:
        frame[DIRECTION_COLUMN] = pd.Series(direction, dtype="str", index=frame.index)
    frame[client_column] = pd.Series(ids, dtype="str")
    for col in numeric:
        frame[col] = values[col]
    split_series = pd.Series(split, dtype="str")
    if use_file_split and split_column != SPLIT_COLUMN:
        frame = frame.rename(columns={split_column: SPLIT_COLUMN})
    frame[SPLIT_COLUMN] = split_series
    frame[SOURCE_LINE] = raw.rows.astype(np.int64)
    meta = {"source": label, "split": "file" if use_file_split else "seeded"}
    if not use_file_split:
        meta.update(test_fraction=float(test_fraction), split_seed=int(seed))
        if split_by == "time":
            meta.update(split="time")
    if time_column:
        meta["time_column"] = time_column
    if any(warned):  # said once by the command that loaded it (build.load_run_data)
        meta["warnings"] = [w for w in warned if w]
    return Fleet(frame, features, target, client_column, meta)


def load_fleet_chunks(
    path: str | Path,
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
) -> Iterator[Fleet]:
    """:func:`load_fleet` of a Parquet file, one row group at a time (issue 25.1: a fleet
    of 100,000 units without its whole frame; ``fedcal simulate`` and :func:`save_chunks`
    write a row group per 1,000 sensors). Each row group is checked as :func:`load_fleet`
    checks a file (its messages name the file and the record numbers of the whole file)
    and yielded as a :class:`Fleet`; their frames concatenated are :func:`load_fleet`'s
    (tested). Before the first, fedcal's metadata (rows, rows per sensor, digest) is
    checked against the file column by column, row group by row group. A sensor's rows
    must lie in one row group (the checks per sensor need all of them): a sensor met again
    in a later row group is refused, naming it."""
    import pyarrow.parquet as pq

    mins = {"train": min_train_points, "test": min_test_points}
    features, target = _check_args(
        features, target, client_column, split_column, test_fraction, seed, mins
    )
    how = _Assembly(
        features, target, client_column, split_column, test_fraction, seed, mins, time_column,
        split_by,
    )  # fmt: skip
    numeric = [*features, target]
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
            _check_sensor_groups(pf, client_column, label)
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


def _check_streamed_record(source, raw_record: bytes, label: str) -> None:
    """:func:`_check_parquet_record` of a Parquet file read a column of a row group at a
    time (:func:`_streamed_record`)."""
    redo = "the file is corrupt, or was changed by a tool that kept fedcal's metadata"
    try:
        record = json.loads(raw_record)
        rows, digest = int(record["rows"]), str(record["sha256"])
        per_sensor = record.get("rows_per_sensor")
        column = record.get("client_column")
    except (ValueError, TypeError, KeyError, UnicodeDecodeError):
        raise FleetDataError(
            label, f"fedcal's metadata in the file is unreadable: {redo}"
        ) from None
    have = _streamed_record(source, column if per_sensor is not None else None)
    if have["rows"] != rows:
        raise FleetDataError(label, f"has {have['rows']} rows, its metadata records {rows}: {redo}")
    if per_sensor is not None and "rows_per_sensor" in have:
        counts = have["rows_per_sensor"]
        wrong = sorted(set(counts) | set(per_sensor), key=str)
        wrong = [k for k in wrong if counts.get(k, 0) != per_sensor.get(k, 0)]
        if wrong:
            listed = ", ".join(
                f"{k!r}: {counts.get(k, 0)} read, {per_sensor.get(k, 0)} recorded"
                for k in wrong[:MAX_LISTED]
            )
            raise FleetDataError(
                label, f"rows per sensor differ from its metadata ({listed}): {redo}", [], column
            )
    if have["sha256"] != digest:
        raise FleetDataError(label, f"content differs from the digest in its metadata: {redo}")


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
        import pyarrow as pa
        import pyarrow.parquet as pq

        def write(tmp: Path) -> None:
            scratch = tmp.with_name(tmp.name + ".rows")
            try:
                writer = None
                for k, frame in enumerate(parts()):
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

    write_with(p, write)
    return sizes["rows"], len(sensors)


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
