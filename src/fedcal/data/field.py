"""Field networks: low-cost sensors co-located with a reference, over seasons (generated).

A benchmark for calibration in the field rather than the chamber (issue 26): every
unit of a network of low-cost particulate-matter (PM2.5) monitors sits beside a
reference instrument, and the calibration learns the reference concentration from the
unit's raw reading and its environment. What makes real networks hard, and what this
generator plants (seeded; one row per sample, with its timestamp):

* **seasons** — the concentration, relative humidity (RH) and temperature follow an
  annual cycle with day-to-day AR(1) weather, so a unit calibrated in summer must
  predict winter: the test period (the last quarter of each unit's time,
  :func:`fedcal.data.loader.time_split`) lies partly outside its calibration data;
* **a nonlinear, unit-specific response** — the optical reading grows with humidity
  (hygroscopic growth, 1 + κ_i·h²/(1 − h), h = RH/100 capped at 0.97) and the unit's
  gain g_i and offset o_i differ, so raw = g_i(t)·c·growth + o_i + noise;
* **drift** — each unit's gain drifts linearly, g_i(t) = g_i·(1 + d_i·t/365),
  d_i ~ N(0, ``drift_sd``): the past calibration is biased in the future;
* **collinear features** — RH and temperature move together with the season, and
  ``extra_channels`` second optical channels read nearly the same as the first;
* **unequal data** — units start and stop at different days and miss samples;
* **short co-locations** — :func:`shorten` keeps, for a fraction of the units, only
  the first part of their calibration period.

The target (the reference, µg/m³) is the local concentration plus reference noise.
Values are rounded as instruments report them (raw 0.1, RH 1 %, temperature 0.1 °C,
reference 0.1), so identical rows at distinct times occur: they are data.
Nothing here is fitted to fedcal's models; the functional forms are the textbook
ones of low-cost PM sensing, the magnitudes typical of published co-location studies.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from fedcal.data.fleet import CLIENT_COLUMN, SPLIT_COLUMN, Fleet
from fedcal.data.loader import time_split

TIME_COLUMN = "time"
TARGET = "pm25_ref"


@dataclass(frozen=True)
class FieldSpec:
    """Settings of a generated field network (defaults: 12 units, one year, daily)."""

    num_sensors: int = 12
    days: int = 365  # the network's period
    samples_per_day: int = 1  # 24: hourly
    extra_channels: int = 0  # collinear second optical channels (features pm25_raw_b1, …)
    drift_sd: float = 0.15  # per-year relative gain drift, N(0, drift_sd) per unit
    missing: float = 0.1  # fraction of samples lost
    start: str = "2023-01-01"  # first day (timestamps are ISO 8601, UTC)

    def features(self) -> tuple[str, ...]:
        extra = tuple(f"pm25_raw_b{k + 1}" for k in range(self.extra_channels))
        return ("pm25_raw", *extra, "rh", "temp")


def _ar1(rng: np.random.Generator, n: int, phi: float, sd: float) -> np.ndarray:
    """A stationary AR(1) series of ``n`` steps with marginal standard deviation ``sd``."""
    out = np.empty(n)
    out[0] = rng.normal(0.0, sd)
    innovation = sd * np.sqrt(1.0 - phi * phi)
    for t in range(1, n):
        out[t] = phi * out[t - 1] + rng.normal(0.0, innovation)
    return out


def field_frame(spec: FieldSpec = FieldSpec(), seed: int = 0) -> pd.DataFrame:
    """The network's rows: sensor id, time (ISO), features, target (no split)."""
    rng = np.random.default_rng([seed, 26])
    steps = spec.days * spec.samples_per_day
    day = np.arange(steps) / spec.samples_per_day  # days since start
    season = 2 * np.pi * day / 365.0
    persistence = 0.7 ** (1.0 / spec.samples_per_day)  # day-to-day weather memory
    # Regional weather and concentration (shared by the network), winter-high PM.
    log_pm = np.log(10.0) + 0.5 * np.cos(season) + _ar1(rng, steps, persistence, 0.5)
    rh_region = 65.0 - 15.0 * np.sin(season - 1.7) + _ar1(rng, steps, persistence, 10.0)
    temp_region = 12.0 + 10.0 * np.sin(season - 1.7) + _ar1(rng, steps, persistence, 3.0)
    stamps = pd.Timestamp(spec.start, tz="UTC") + pd.to_timedelta(day, unit="D")
    iso = stamps.strftime("%Y-%m-%dT%H:%M:%SZ").to_numpy()
    frames = []
    for i in range(spec.num_sensors):
        gain = float(np.exp(rng.normal(np.log(1.5), 0.2)))
        kappa = float(rng.uniform(0.1, 0.35))
        offset = float(rng.normal(0.0, 1.5))
        drift = float(rng.normal(0.0, spec.drift_sd))
        first = int(rng.uniform(0.0, 0.3) * steps)
        last = steps - int(rng.uniform(0.0, 0.2) * steps)
        keep = np.arange(first, last)
        keep = keep[rng.uniform(size=len(keep)) >= spec.missing]
        n = len(keep)
        # The site: the regional concentration with a local factor and local weather.
        local = np.exp(rng.normal(0.0, 0.15) + _ar1(rng, n, persistence, 0.2))
        conc = np.exp(log_pm[keep]) * local
        rh = np.clip(rh_region[keep] + rng.normal(0.0, 3.0, n), 5.0, 100.0)
        temp = temp_region[keep] + rng.normal(0.0, 0.8, n)
        h = np.minimum(rh / 100.0, 0.97)
        growth = 1.0 + kappa * h * h / (1.0 - h)
        g_t = gain * (1.0 + drift * day[keep] / 365.0) * (1.0 + 0.004 * (temp - 20.0))
        raw = g_t * conc * growth + offset + conc * rng.normal(0.0, 0.05, n)
        raw = raw + rng.normal(0.0, 0.5, n)
        columns = {
            CLIENT_COLUMN: f"S{i:02d}",
            TIME_COLUMN: iso[keep],
            "pm25_raw": np.round(raw, 1),
        }
        for k in range(spec.extra_channels):
            factor = 1.02 + rng.normal(0.0, 0.01)
            columns[f"pm25_raw_b{k + 1}"] = np.round(raw * factor + rng.normal(0.0, 0.3, n), 1)
        columns["rh"] = np.round(rh)
        columns["temp"] = np.round(temp, 1)
        columns[TARGET] = np.round(np.maximum(conc + rng.normal(0.0, 0.5, n), 0.0), 1)
        frames.append(pd.DataFrame(columns))
    return pd.concat(frames, ignore_index=True)


def seconds(iso: pd.Series) -> np.ndarray:
    """ISO timestamps as float seconds since 1970 (what the loader keeps)."""
    stamps = pd.to_datetime(iso, utc=True)
    return ((stamps - pd.Timestamp(0, tz="UTC")) / pd.Timedelta(seconds=1)).to_numpy(float)


def field_fleet(spec: FieldSpec = FieldSpec(), seed: int = 0, test_fraction: float = 0.25) -> Fleet:
    """The network as a :class:`Fleet`, each unit tested on the last ``test_fraction`` of
    its time (the loader's time split); the time column as float seconds."""
    frame = field_frame(spec, seed)
    frame[TIME_COLUMN] = seconds(frame[TIME_COLUMN])
    frame[SPLIT_COLUMN] = time_split(
        frame[CLIENT_COLUMN].to_numpy(), frame[TIME_COLUMN].to_numpy(), test_fraction
    )
    meta = {"source": "fedcal.data.field", "seed": seed, "split": "time"}
    return Fleet(frame, spec.features(), TARGET, CLIENT_COLUMN, meta)


def shorten(
    frame: pd.DataFrame, fraction: float = 0.5, keep: float = 0.1, seed: int = 0
) -> pd.DataFrame:
    """Short co-locations: for ``fraction`` of the units (seeded), only the first ``keep`` of
    their calibration (train) period's time stays; their test rows are untouched.

    ``frame`` needs the split and a numeric time column (e.g. :func:`field_fleet`'s frame).
    """
    rng = np.random.default_rng([seed, 27])
    ids = list(pd.unique(frame[CLIENT_COLUMN]))
    chosen = set(rng.choice(ids, size=round(fraction * len(ids)), replace=False).tolist())
    drop = np.zeros(len(frame), dtype=bool)
    for sid, rows in frame.groupby(CLIENT_COLUMN, sort=False):
        if sid not in chosen:
            continue
        train = rows[rows[SPLIT_COLUMN] == "train"]
        t = train[TIME_COLUMN].to_numpy(float)
        cut = t.min() + keep * (t.max() - t.min())
        late = train.index[t > cut]
        if len(train) - len(late) < 3:  # at least 3 calibration points remain
            late = train.index[3:]
        drop[frame.index.get_indexer(late)] = True
    return frame[~drop].reset_index(drop=True)


def hard_units(
    frame: pd.DataFrame, few: int = 3, zero: int = 3, keep: float = 0.08, seed: int = 0
) -> pd.DataFrame:
    """A network's hard units (issue 34): ``few`` units keep only the first ``keep`` of their
    calibration period (few data), and ``zero`` others report at a clean site: every row
    whose reference is below the unit's median reads 0 in the reference and in the raw
    channel(s) (below detection; zero-inflated targets, identical rows at distinct times).

    ``frame`` needs the split and a numeric time column (:func:`field_fleet`'s frame); test
    rows of the few-data units are untouched. Seeded; the units are disjoint.
    """
    rng = np.random.default_rng([seed, 34])
    ids = list(pd.unique(frame[CLIENT_COLUMN]))
    chosen = rng.choice(ids, size=min(few + zero, len(ids)), replace=False).tolist()
    short, clean = set(chosen[:few]), set(chosen[few:])
    out = frame.copy()
    raw = [c for c in out.columns if c.startswith("pm25_raw")]
    for sid in clean:
        rows = out[CLIENT_COLUMN] == sid
        low = rows & (out[TARGET] < out.loc[rows, TARGET].median())
        out.loc[low, [TARGET, *raw]] = 0.0
    drop = np.zeros(len(out), dtype=bool)
    for sid in short:
        train = out[(out[CLIENT_COLUMN] == sid) & (out[SPLIT_COLUMN] == "train")]
        t = train[TIME_COLUMN].to_numpy(float)
        late = train.index[t > t.min() + keep * (t.max() - t.min())]
        if len(train) - len(late) < 3:
            late = train.index[3:]
        drop[out.index.get_indexer(late)] = True
    return out[~drop].reset_index(drop=True)
