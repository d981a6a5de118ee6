"""A run folder's CSV table through the guarded reader (regular file, size limit, one width).

Torch-free (pandas and the path guards of :mod:`fedcal.core.paths`): what reads a run's or a
calibrate output's tables without loading its models (``fedcal report`` of a calibrate
output, the certificate's tables). :func:`fedcal.report.rundir.read_table` is this function.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pandas as pd

from fedcal.core.atomic import write_with
from fedcal.core.paths import read_text
from fedcal.core.runfiles import RunFileError


def read_table(
    path: Path, required: tuple[str, ...] = (), dtype: dict | None = None
) -> pd.DataFrame:
    """A CSV of a run folder through the guarded reader (regular file, size limit).

    ``required`` columns must be there; anything else is a RunFileError naming the file.
    """
    text = read_text(path)
    try:
        widths = [(i, len(r)) for i, r in enumerate(csv.reader(io.StringIO(text)), 1) if r]
    except csv.Error as e:  # e.g. a field over the csv module's limit (131,072 characters)
        raise RunFileError(f"{path}: not a readable CSV table ({e})") from None
    for line, width in widths[1:]:
        if width != widths[0][1]:  # pandas would fill a cut row with NaN: a "diverged" run
            raise RunFileError(
                f"{path}: line {line} has {width} fields, the header {widths[0][1]}: "
                "truncated or edited"
            )
    try:
        frame = pd.read_csv(io.StringIO(text), dtype=dtype)
    except (ValueError, pd.errors.ParserError) as e:  # EmptyDataError is a ValueError
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise RunFileError(f"{path}: not a readable CSV table ({first})") from None
    missing = [c for c in required if c not in frame.columns]
    if missing:
        raise RunFileError(f"{path}: missing column(s) {', '.join(missing)}")
    if required and len(frame) == 0:
        raise RunFileError(f"{path}: no rows")
    return frame


def write_table(path: str | Path, frame: pd.DataFrame) -> None:
    """``frame`` as CSV, atomically, written 10,000 rows at a time into the temporary file
    (pandas' ``chunksize``): a 100,000-sensor table is never held as one string too."""

    def write(tmp: Path) -> None:
        # exclusive, as every writer (core.atomic); UTF-8 whatever the locale
        with open(tmp, "x", newline="", encoding="utf-8") as fh:
            frame.to_csv(fh, index=False, chunksize=10_000)

    write_with(Path(path), write)
