"""The in-memory fleet: one tidy table of measurements, one row per point.

Everything that produces data (the simulator, the file loaders) returns a
:class:`Fleet`; everything that trains reads one. A fleet knows which column
names the client (sensor), which columns are model inputs and which is the
target, and which rows are calibration (``train``) and which are held out
(``test``) points.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

BAROMETRIC_FEATURES: tuple[str, ...] = ("frequency_hz", "temperature_c")
BAROMETRIC_TARGET: str = "pressure_hpa"
CLIENT_COLUMN: str = "sensor_id"
SPLIT_COLUMN: str = "split"
SPLITS: tuple[str, ...] = ("train", "test")
ROLE_COLUMN: str = "role"  # optional: a unit's role, e.g. "reference" / "new" (mixed fleets)
# Optional: the chamber's sweep direction of each point, "up" (ascending) or "down".
DIRECTION_COLUMN: str = "direction"
DIRECTION_SIGNS: dict[str, float] = {"up": 1.0, "down": -1.0}


@dataclass(frozen=True)
class Fleet:
    """A fleet of sensors as one table.

    ``frame`` has at least the client column, the feature columns, the target
    column and a ``split`` column whose values are ``"train"`` or ``"test"``.
    Rows of one client keep their order (the simulator writes them in the
    order they were measured). ``meta`` carries provenance (source file,
    simulator settings, latent family of each sensor, units) and is copied
    into run directories.
    """

    frame: pd.DataFrame
    features: tuple[str, ...] = BAROMETRIC_FEATURES
    target: str = BAROMETRIC_TARGET
    client_column: str = CLIENT_COLUMN
    meta: dict = field(default_factory=dict)

    @property
    def client_ids(self) -> list:
        """Sensor ids in order of first appearance."""
        return list(pd.unique(self.frame[self.client_column]))

    @property
    def num_clients(self) -> int:
        return len(self.client_ids)

    @property
    def roles(self) -> dict[str, str] | None:
        """Each sensor's role (from the optional ``role`` column), or None without one.

        A sensor whose rows disagree on its role is refused: results per role
        would be meaningless.
        """
        if ROLE_COLUMN not in self.frame.columns:
            return None
        per = self.frame.groupby(self.client_column, sort=False)[ROLE_COLUMN]
        counts = per.nunique(dropna=False)
        if (counts > 1).any():
            bad = ", ".join(map(str, counts.index[counts > 1][:5]))
            raise ValueError(f"column {ROLE_COLUMN!r}: sensor(s) {bad} have more than one role")
        return {str(cid): str(role) for cid, role in per.first().items()}

    def content_digest(self) -> str:
        """SHA-256 of what training reads: every row's client, features, target and split.

        Row order counts (it fixes each client's point order); extra columns do
        not. Used to refuse resuming a run whose data file has changed.
        """
        columns = [self.client_column, *self.features, self.target, SPLIT_COLUMN]
        h = hashlib.sha256(json.dumps(columns).encode())
        for col in columns:
            values = self.frame[col]
            if col in (*self.features, self.target):
                h.update(values.to_numpy(dtype="float64").tobytes())
            else:
                h.update("\x1f".join(map(str, values.tolist())).encode("utf-8", "surrogatepass"))
            h.update(b"\x1e")
        return h.hexdigest()

    def _split_rows(self, split: str) -> tuple[pd.DataFrame, list[np.ndarray | None]]:
        """The rows of ``split``, and per client (``client_ids`` order) its positions in them.

        None for a client without rows there. One grouping, then each client's rows
        by position (in frame order): a DataFrame per client took ~1 ms each (14 s for
        10,000 sensors), a mask per client O(clients × rows) (356 s).
        """
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        rows = self.frame[self.frame[SPLIT_COLUMN] == split]
        # Grouped on integer codes (a stable sort, then one split): the positions
        # groupby(...).indices gives, in a tenth of its time at 10,000 sensors.
        codes, uniques = pd.factorize(rows[self.client_column], use_na_sentinel=True)
        kept = np.flatnonzero(codes >= 0)  # a missing id belongs to no sensor
        order = kept[np.argsort(codes[kept], kind="stable")]
        counts = np.bincount(codes[kept], minlength=len(uniques))
        groups = np.split(order, np.cumsum(counts)[:-1]) if len(uniques) else []
        positions = dict(zip(uniques, groups, strict=True))
        return rows, [positions.get(cid) for cid in self.client_ids]

    def arrays(self, split: str) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per client (in ``client_ids`` order): ``(x (n, F), y (n, 1))`` float64."""
        rows, where = self._split_rows(split)
        x_all = rows[list(self.features)].to_numpy(dtype=np.float64)
        y_all = rows[[self.target]].to_numpy(dtype=np.float64)
        empty = (np.zeros((0, len(self.features))), np.zeros((0, 1)))
        return [empty if at is None else (x_all[at], y_all[at]) for at in where]

    def row_times(self, split: str) -> list[np.ndarray] | None:
        """Per client (``arrays`` order): each row's time, float64; None without a time
        column (``meta["time_column"]``, kept by the loader as seconds since 1970 for
        dates, else the file's number)."""
        col = self.meta.get("time_column")
        if not col or col not in self.frame.columns:
            return None
        rows, where = self._split_rows(split)
        t = rows[col].to_numpy(dtype=np.float64)
        bad = ~np.isfinite(t)
        if bad.any():  # the loader refuses these in files; a frame built in memory is unchecked
            self._refuse_row(rows, bad, col, "a finite time")
        empty = np.zeros(0, dtype=np.float64)
        return [empty if at is None else t[at] for at in where]

    def _refuse_row(self, rows: pd.DataFrame, bad: np.ndarray, col: str, expected: str) -> None:
        """Raise the one-line error for the first ``bad`` row: source, line (or row), sensor,
        column, what it must be and the value found."""
        at = bad.nonzero()[0][0]
        line = rows["source_line"].iloc[at] if "source_line" in rows.columns else None
        place = f"line {line}" if line is not None else f"row {rows.index[at]}"
        raise ValueError(
            f"{self.meta.get('source', 'fleet')}: {place} (sensor "
            f"{rows[self.client_column].iloc[at]}): column {col!r} must be {expected}, "
            f"got {rows[col].iloc[at]!r}"
        )

    def branch_signs(self, split: str) -> list[np.ndarray] | None:
        """Per client (``arrays`` order): each row's sweep sign, +1 "up", −1 "down".

        None without a ``direction`` column. Any other value is refused, naming
        its sensor, row and the column: the loader checked its files' values, but a
        fleet built in memory (the simulator's, a user's frame) reaches here unchecked.
        """
        if DIRECTION_COLUMN not in self.frame.columns:
            return None
        rows, where = self._split_rows(split)
        # Each distinct value read once (a column of millions of rows holds a few).
        codes, values = pd.factorize(rows[DIRECTION_COLUMN], use_na_sentinel=True)
        text = pd.Index(values).astype(str).str.strip().str.lower()
        by_value = np.array([DIRECTION_SIGNS.get(v, np.nan) for v in text], dtype=np.float64)
        per_row = np.append(by_value, np.nan)[codes]  # code −1 (a missing value): NaN
        bad = np.isnan(per_row)
        if bad.any():
            self._refuse_row(rows, bad, DIRECTION_COLUMN, "'up' or 'down'")
        signs = per_row
        empty = np.zeros(0, dtype=np.float64)
        return [empty if at is None else signs[at] for at in where]

    def with_train_points(self, n: int | None, seed: int = 0) -> Fleet:
        """Keep at most ``n`` calibration points per sensor (test rows untouched).

        The subset is spread over the operating range (see
        :func:`spread_subset`), not drawn at random, because a calibration
        engineer chooses chamber points as a design.
        """
        if n is None:
            return self
        keep = []
        for _, g in self.frame.groupby(self.client_column, sort=False):
            train = g[g[SPLIT_COLUMN] == "train"]
            chosen = spread_subset(train[list(self.features)].to_numpy(float), n, seed)
            keep.append(train.index[chosen])
            keep.append(g.index[g[SPLIT_COLUMN] == "test"])
        idx = np.concatenate([np.asarray(k) for k in keep])
        frame = self.frame.loc[np.sort(idx)]
        meta = {**self.meta, "train_points": n}
        return Fleet(frame, self.features, self.target, self.client_column, meta)


def spread_subset(x: np.ndarray, n: int, seed: int = 0) -> np.ndarray:
    """Indices of ``min(n, len(x))`` rows of ``x`` spread over its range.

    Greedy farthest-point selection on min-max scaled features, starting from
    the row nearest the lower corner; ties broken by a seeded jitter. For a
    grid this picks the corners first, then fills in — what a chamber
    calibration with few points does.
    """
    m = len(x)
    if n >= m:
        return np.arange(m)
    lo, hi = x.min(0), x.max(0)
    z = (x - lo) / np.where(hi > lo, hi - lo, 1.0)
    z = z + np.random.default_rng(seed).uniform(0, 1e-9, z.shape)
    chosen = [int(np.argmin(z.sum(1)))]
    dist = np.linalg.norm(z - z[chosen[0]], axis=1)
    for _ in range(n - 1):
        nxt = int(np.argmax(dist))
        chosen.append(nxt)
        dist = np.minimum(dist, np.linalg.norm(z - z[nxt], axis=1))
    return np.sort(np.array(chosen))
