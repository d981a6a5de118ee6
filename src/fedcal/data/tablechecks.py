"""Checks of a fleet table as a whole: the arguments naming its columns, the columns
present, repeated rows, an undeclared time column, one role per sensor.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

import numpy as np
import pandas as pd

from fedcal.data.fileerrors import MAX_LISTED, FleetDataError
from fedcal.data.fleet import (
    BAROMETRIC_FEATURES,
    BAROMETRIC_TARGET,
    ROLE_COLUMN,
    SPLIT_COLUMN,
)
from fedcal.data.reading import SOURCE_LINE, _Raw


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
