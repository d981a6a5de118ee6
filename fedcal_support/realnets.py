"""Converters of three public co-location data sets to fedcal's file format (issue 34).

Each converter reads a *bare git mirror* of the public repository (``git show``; nothing
is downloaded) and writes one CSV with fedcal's columns: ``sensor_id``, a numeric
``time`` column (seconds since 1970 UTC, or a sample index where the data have no clock),
named feature columns, the target, and ``split`` — the last quarter of each sensor's own
time is ``test`` (:func:`fedcal.data.loader.time_split`, the loader's own rule). The data
and the files written stay out of the repository.

* :func:`purpleair` — MartineMathieu/PurpleAir-calibration, daily means of 18 PurpleAir
  sensors beside regulatory PM2.5 monitors (``conc``): features ``pm25_raw`` (the A/B
  channels' average), ``rh``, ``temp``; target ``pm25_ref``.
* :func:`antwerp` — LaurentSpi/SensEURCity_Ineris, hourly PMS5003 readings of the AirSensEUR
  boxes in Antwerp that stand at a reference station (``Location.ID`` ``ANT_REF_*``: 12
  boxes, 9 stations): features ``pm25_raw``, ``pm10_raw``; target ``pm25_ref`` (the
  station's PM2.5). The HEAD snapshot lacks ``INPUTS/LCS_df_all.Rda`` (≥ 4 MiB); commit
  ``ca03ab6`` holds it, and its ``ref_df_all.Rda`` is the Antwerp reference (HEAD's is a
  Dutch one), so both are read at ``ca03ab6``.
* :func:`gas_drift` — BrechtDewilde1/BDProject, the UCI gas sensor array drift data: one
  gas (default acetone, the gas with most rows in the snapshot: 1,779), each of the 16
  metal-oxide channels a sensor with its 8 features (``f0``…``f7``: ΔR, its normalized
  value, three rising and three decaying exponential moving averages), target the
  concentration (ppm). The batches are months of one experiment; ``time`` is the sample's
  index in batch order (batch7 and batch10 are not in the snapshot, ≥ 4 MiB: the 8 present
  batches 1–6, 8, 9 are used).

    python -m fedcal_support.realnets purpleair MIRROR_GIT_DIR out.csv   (antwerp, gas alike)
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from fedcal.data.fleet import CLIENT_COLUMN, SPLIT_COLUMN
from fedcal.data.loader import time_split

TIME = "time"
PURPLEAIR_FILE = "DAILY90_r0_5km_processeddata_PA_AQS_Jan2021_Aug2023_Final.csv"
ANTWERP_COMMIT = "ca03ab6"
GAS_BATCHES = (1, 2, 3, 4, 5, 6, 8, 9)  # batch7 and batch10 are not in the snapshot
GAS_FEATURES = tuple(f"f{k}" for k in range(8))

#: network: (features, target, raw column: the feature that reads the target itself or "")
NETWORKS = {
    "purpleair": (("pm25_raw", "rh", "temp"), "pm25_ref", "pm25_raw"),
    "antwerp": (("pm25_raw", "pm10_raw"), "pm25_ref", "pm25_raw"),
    "gas": (GAS_FEATURES, "conc_ppm", ""),
}


def _show(mirror: Path, ref: str, path: str) -> bytes:
    """A file of the bare git mirror at ``ref`` (one-line error if absent)."""
    done = subprocess.run(
        ["git", "--git-dir", str(mirror), "show", f"{ref}:{path}"], capture_output=True
    )
    if done.returncode != 0:
        raise FileNotFoundError(f"{mirror}: {ref}:{path} not in the mirror")
    return done.stdout


def _epoch(stamps: pd.Series) -> np.ndarray:
    """Timestamps (naive read as UTC) as float seconds since 1970."""
    t = pd.to_datetime(stamps, utc=True)
    return ((t - pd.Timestamp(0, tz="UTC")) / pd.Timedelta(seconds=1)).to_numpy(float)


def _finish(frame: pd.DataFrame, features: tuple[str, ...], target: str) -> pd.DataFrame:
    """Finite rows only, one row per (sensor, time), sorted, and the time split."""
    cols = [CLIENT_COLUMN, TIME, *features, target]
    frame = frame[cols].replace([np.inf, -np.inf], np.nan).dropna()
    frame = frame.drop_duplicates([CLIENT_COLUMN, TIME]).sort_values([CLIENT_COLUMN, TIME])
    frame = frame.reset_index(drop=True)
    frame[SPLIT_COLUMN] = time_split(
        frame[CLIENT_COLUMN].to_numpy(), frame[TIME].to_numpy(float), 0.25
    )
    return frame


def purpleair(mirror: Path) -> pd.DataFrame:
    """The PurpleAir network (module doc), one row per sensor-day."""
    raw = pd.read_csv(pd.io.common.BytesIO(_show(mirror, "HEAD", PURPLEAIR_FILE)))
    frame = pd.DataFrame(
        {
            CLIENT_COLUMN: "PA" + raw["sensor_index"].astype(str),
            TIME: _epoch(raw["DAILY"]),
            "pm25_raw": raw["A_B_Avg"],
            "rh": raw["humidity_a"],
            "temp": raw["temp_Celsius"],
            "pm25_ref": raw["conc"],
        }
    )
    return _finish(frame, NETWORKS["purpleair"][0], "pm25_ref")


def _read_rda(blob: bytes) -> pd.DataFrame:
    import pyreadr  # the studies extra (pyproject.toml): only the Antwerp converter needs it

    with tempfile.NamedTemporaryFile(suffix=".Rda") as f:
        f.write(blob)
        f.flush()
        (table,) = pyreadr.read_r(f.name).values()
    return table


def antwerp(mirror: Path, ref: str = ANTWERP_COMMIT) -> pd.DataFrame:
    """The Antwerp boxes at reference stations (module doc), one row per box-hour."""
    boxes = _read_rda(_show(mirror, ref, "INPUTS/LCS_df_all.Rda"))
    station = _read_rda(_show(mirror, ref, "INPUTS/ref_df_all.Rda"))
    boxes = boxes[boxes["Location.ID"].astype(str).str.startswith("ANT_REF_")]
    station = station[["Location.ID", "date", "Ref.PM2.5"]]
    station = station.groupby(["Location.ID", "date"], as_index=False).mean()
    both = boxes.merge(station, on=["Location.ID", "date"], how="inner")
    frame = pd.DataFrame(
        {
            CLIENT_COLUMN: both["ID"].astype(str).str.replace("Antwerp_", "AN", regex=False),
            TIME: _epoch(both["date"]),
            "pm25_raw": both["PMS_PM25"],
            "pm10_raw": both["PMS_PM10"],
            "pm25_ref": both["Ref.PM2.5"],
        }
    )
    return _finish(frame, NETWORKS["antwerp"][0], "pm25_ref")


def gas_drift(mirror: Path, gas: str = "Acetone") -> pd.DataFrame:
    """The gas drift array for one gas (module doc): 16 channels × the gas's samples."""
    parts = []
    for b in GAS_BATCHES:
        text = _show(mirror, "HEAD", f"data/batch{b}.dat").decode()
        rows = [line.split(",") for line in text.split() if line.startswith(gas + ",")]
        parts.append(np.array([r[1:] for r in rows], dtype=float).reshape(-1, 129))
    values = np.concatenate(parts)
    if not len(values):
        raise ValueError(f"{mirror}: no rows of gas {gas!r} in batches {GAS_BATCHES}")
    order = np.arange(len(values), dtype=float)  # the sample's index in batch order
    frames = []
    for s in range(16):
        cols = {f: values[:, 1 + 8 * s + k] for k, f in enumerate(GAS_FEATURES)}
        frames.append(
            pd.DataFrame(
                {CLIENT_COLUMN: f"CH{s:02d}", TIME: order, **cols, "conc_ppm": values[:, 0]}
            )
        )
    return _finish(pd.concat(frames, ignore_index=True), GAS_FEATURES, "conc_ppm")


CONVERTERS = {"purpleair": purpleair, "antwerp": antwerp, "gas": gas_drift}


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] not in CONVERTERS:
        raise SystemExit(f"usage: realnets {{{','.join(CONVERTERS)}}} MIRROR_GIT_DIR OUT.csv")
    frame = CONVERTERS[args[0]](Path(args[1]))
    frame.to_csv(args[2], index=False)
    print(f"{args[2]}: {frame[CLIENT_COLUMN].nunique()} sensors, {len(frame)} rows")


if __name__ == "__main__":
    main()


# The study's scoring (studies/realnets.py): the simple fits it compares against and the
# per-method summary over every sensor (tests/test_realnets_summary.py).
def baselines(frame: pd.DataFrame, features: tuple[str, ...], target: str) -> pd.DataFrame:
    """Per sensor: test RMSE of its own linear least squares and of the pooled one."""
    train = frame[frame[SPLIT_COLUMN] == "train"]

    def design(part: pd.DataFrame) -> np.ndarray:
        return np.column_stack([np.ones(len(part)), part[list(features)].to_numpy(float)])

    pooled = np.linalg.lstsq(design(train), train[target].to_numpy(float), rcond=None)[0]
    rows = []
    for sid, part in frame.groupby(CLIENT_COLUMN, sort=True):
        tr, te = part[part[SPLIT_COLUMN] == "train"], part[part[SPLIT_COLUMN] == "test"]
        own = np.linalg.lstsq(design(tr), tr[target].to_numpy(float), rcond=None)[0]
        y = te[target].to_numpy(float)
        rows.append(
            {
                CLIENT_COLUMN: str(sid),
                "own_linear": float(np.sqrt(np.mean((design(te) @ own - y) ** 2))),
                "pooled_linear": float(np.sqrt(np.mean((design(te) @ pooled - y) ** 2))),
            }
        )
    return pd.DataFrame(rows)


def per_sensor(run: Path, method: str) -> pd.DataFrame | None:
    for f in sorted((run / "runs").glob(f"{method}*/per_sensor.csv")):
        table = pd.read_csv(f)
        if table["method"].iloc[0] == method:
            return table
    return None


def future_interval(run: Path, method: str) -> str:
    """The run's interval after calibration (prior.json ``selection.forward.interval``): its
    factor κ and growth, or "declined: why"; "" when the method has none."""
    for f in sorted((run / "runs").glob(f"{method}*/prior.json")):
        state = json.loads(f.read_text())
        record = (state.get("selection") or {}).get("forward", {}).get("interval")
        if f.parent.name.split("_tp")[0] != method or record is None:
            continue
        if "declined" in record:
            return f"declined: {record['declined']}"
        rho = record["rate_per_time"] * record["time_scale"]  # per fleet time scale T
        return f"κ {record['kappa']:.3f}, ρ {rho:.3g}"
    return ""


def summarize(net: str, base: pd.DataFrame, run: Path, methods: list[str]) -> list[dict]:
    best = min(base["own_linear"].mean(), base["pooled_linear"].mean())
    rows = [
        {"network": net, "method": m, "rmse_mean": base[m].mean(), "rmse_worst": base[m].max()}
        for m in ("own_linear", "pooled_linear")
    ]
    for method in methods:
        table = per_sensor(run, method)
        row: dict = {"network": net, "method": method}
        if table is None:
            rows.append({**row, "statuses": "failed"})
            continue
        table = table.assign(**{CLIENT_COLUMN: table["client"].astype(str)})
        run_ids, base_ids = set(table[CLIENT_COLUMN]), set(base[CLIENT_COLUMN].astype(str))
        missing = sorted(base_ids ^ run_ids)  # a mean over fewer sensors is not "all sensors"
        if missing:
            shown = ", ".join(missing[:5]) + (" …" if len(missing) > 5 else "")
            rows.append(
                {
                    **row,
                    "statuses": f"failed: {len(missing)} sensor(s) not in both "
                    f"the run and the simple fits ({shown})",
                }
            )
            continue
        both = table.merge(base.astype({CLIENT_COLUMN: str}), on=CLIENT_COLUMN)
        assert len(both) == len(base), f"{net} {method}: sensors repeated in the merge"
        rmse = both["test_rmse"].to_numpy(float)
        status = both["status"].astype(str)
        far = (rmse > 3 * both["own_linear"].to_numpy()) & (status == "ok").to_numpy()
        row.update(rmse_mean=rmse.mean(), rmse_worst=rmse.max(), ratio=rmse.mean() / best)
        row["statuses"] = ", ".join(f"{k} {v}" for k, v in status.value_counts().items())
        row["ok_far"] = int(far.sum())
        if "test_coverage95" in both:
            cov = both["test_coverage95"].to_numpy(float)
            row["coverage_mean"] = float(np.nanmean(cov)) if np.isfinite(cov).any() else np.nan
            row["coverage_worst"] = float(np.nanmin(cov)) if np.isfinite(cov).any() else np.nan
            row["declined"] = int((~np.isfinite(cov)).sum())
        row["future_interval"] = future_interval(run, method)
        for col in ("choice", "fallback"):
            if col in both:
                row[col] = ", ".join(f"{k} {v}" for k, v in both[col].value_counts().items())
        rows.append(row)
    return rows
