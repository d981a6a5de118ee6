"""A simulated field network with hard honest units (issue 34.3): is any honest unit screened?

12 PM2.5 sensors of :func:`fedcal.data.field.field_frame` (a year, daily, drifting gains),
each sensor's last quarter of time as test; honest but hard units: S00–S02 calibrated on
the first 20 days only (few data), S03's reference zero-inflated and quantized (integer
µg/m³, the lowest 40 % at 0), S04's reference with extra noise of sd 2 × the target's sd,
S05 with 10 × the rows (each day repeated at 10 hours). Writes the CSV; run it with

    PYTHONPATH=src python studies/hard_units_net.py --seed 0 --out net0.csv
    fedcal compare --config NET.toml --out run0      # [data] path = "net0.csv",
        # time_column = "time", methods fedprior + per-sensor and pooled linear leastsq
"""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd

from fedcal.data.field import FieldSpec, field_frame, seconds
from fedcal.data.loader import time_split

FEW_DAYS = 20


def hard_network(seed: int) -> pd.DataFrame:
    """The network (module doc) as fedcal's file: sensor_id, time (s), features, target, split."""
    rng = np.random.default_rng(seed)
    frame = field_frame(FieldSpec(num_sensors=12, days=365, samples_per_day=1), seed=seed)
    frame["time"] = seconds(frame["time"])
    parts = []
    for i, (_, unit) in enumerate(frame.groupby("sensor_id", sort=True)):
        unit = unit.copy()
        ref = unit["pm25_ref"]
        if i == 3:  # zero-inflated, quantized
            unit["pm25_ref"] = np.maximum(np.round(ref - np.quantile(ref, 0.4)), 0.0)
        if i == 4:  # a noisy reference
            unit["pm25_ref"] = ref + rng.normal(0.0, 2.0 * ref.std(), len(unit))
        if i == 5:  # 10 × the rows
            unit = pd.concat([unit.assign(time=unit["time"] + k * 3600.0) for k in range(10)])
        parts.append(unit)
    out = pd.concat(parts).sort_values(["sensor_id", "time"]).reset_index(drop=True)
    out["split"] = time_split(out["sensor_id"].to_numpy(), out["time"].to_numpy(float), 0.25)
    train = out["split"] == "train"
    first = out["time"].where(train).groupby(out["sensor_id"]).transform("min")
    late = train & (out["time"] > first + FEW_DAYS * 86400.0)
    few = out["sensor_id"].isin(sorted(out["sensor_id"].unique())[:3])
    return out[~(late & few)].reset_index(drop=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    net = hard_network(args.seed)
    net.to_csv(args.out, index=False)
    print(net.groupby(["sensor_id", "split"]).size().unstack().T.to_string())


if __name__ == "__main__":
    main()
