"""Parsing a table's cells: numbers (each bad cell named), sensor ids, split and direction
labels, times, and the typing of a CSV's extra columns.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd

from fedcal.data.fileerrors import FleetDataError, _fmt, _listing
from fedcal.data.fleet import (
    DIRECTION_COLUMN,
    DIRECTION_SIGNS,
    SPLITS,
)
from fedcal.data.reading import _Raw

# ASCII digits only: float() would also read "３３０００" (full-width) or Arabic-Indic digits
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?", re.ASCII)


_NON_FINITE = re.compile(r"[+-]?(?:nan|inf|infinity)", re.IGNORECASE)


_INTEGER = re.compile(r"[+-]?(?:0|[1-9]\d*)", re.ASCII)


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
            problem = _read_cell(v, out, i)
            if problem:
                bad.append((int(raw.rows[i]), problem))
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


def _read_cell(v, out: np.ndarray, i: int) -> str:
    """One cell of a text or object column: its value into ``out[i]`` (a finite number given
    as a number is stored even when it is refused), or what is wrong with it ("": nothing)."""
    if _is_missing(v):
        return "missing (null)"
    if isinstance(v, int | float | np.number) and not isinstance(v, bool | np.bool_):
        x = float(v)
        out[i] = x
        return "" if math.isfinite(x) else f"{_fmt(x)}: not finite"
    t = str(v).strip()
    if not t:
        return "empty cell"
    if _NUMBER.fullmatch(t):
        x = float(t)
        if math.isfinite(x):
            out[i] = x
            return ""
        return f"{t!r}: out of range"
    if _NON_FINITE.fullmatch(t):
        return f"{t!r}: not finite"
    return f"{t!r}: not a number"


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
