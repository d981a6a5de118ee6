"""Physical bounds and plausible ranges of a fleet's columns (the unit guesses: Pa, kHz,
kelvin), and the checks of parsed values against them (:mod:`fedcal.data.loader`'s module
docstring says which bounds apply).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fedcal.data.fileerrors import FleetDataError, _fmt, _listing

MAX_ABS_VALUE = 1e15  # beyond any sensor reading in any unit; 1e308 overflows scaling


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


def _check_values(
    raw, label: str, values: dict[str, np.ndarray], bounds, plausible, whole=None
) -> None:
    """Magnitudes, physical bounds and plausible ranges of parsed numeric columns."""
    _check_magnitudes(raw, label, values)
    _check_bounds(raw, label, values, bounds)
    _check_plausible(raw, label, values, plausible, whole)
