"""Field study (issue 26): fedprior against per-sensor and pooled linear fits on generated
field networks (fedcal.data.field), tested on the last quarter of each sensor's time.

For each network (features), co-location (full; short: half the sensors keep the first
10 % of their calibration period) and fleet seed, the network is written to a CSV with
ISO timestamps and run through the CLI exactly as a user would:

    fedcal compare --config <dir>/run.toml --out <dir>/run -q

with ``[data] time_column = "time"``, ``split_by = "time"``, ``test_fraction = 0.25``.
Per method: the mean and worst sensor's RMSE (µg/m³) and, where the method states
intervals, the mean and worst sensor's coverage of its nominal 95 % intervals; a method
that failed or has a non-finite sensor is reported as such. Markdown table on stdout,
every number in ``<out>/field.csv``.

    PYTHONPATH=src python studies/field.py --out /tmp/field-study [--seeds 0,1,2]
    PYTHONPATH=src python studies/field.py --out /tmp/fq --methods persensor_quad,pooled_quad
    PYTHONPATH=src python studies/field.py --out /tmp/f0 --features 2 --drift-sd 0  # no drift
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from fedcal.data.field import TARGET, TIME_COLUMN, FieldSpec, field_frame, seconds, shorten
from fedcal.data.fleet import CLIENT_COLUMN, SPLIT_COLUMN
from fedcal.data.loader import time_split
from fedcal_support.scripts import compare_in

NETWORKS = {  # name: (spec, features)
    "2 features (raw, RH)": (FieldSpec(), ("pm25_raw", "rh")),
    "3 features (raw, RH, T)": (FieldSpec(), ("pm25_raw", "rh", "temp")),
    "8 features (6 collinear raw channels, RH, T)": (
        FieldSpec(extra_channels=5),
        FieldSpec(extra_channels=5).features(),
    ),
}
METHODS = ("fedprior_drift", "fedprior", "persensor_lin", "pooled_lin")
BASELINES = ("persensor_lin", "pooled_lin")

CONFIG = """\
[run]
methods = {methods}
seeds = 1

[data]
path = "{path}"
features = {features}
target = "{target}"
time_column = "{time}"
split_by = "time"
test_fraction = 0.25

[engine]
eval_every = 50

[methods.persensor_lin]        # each sensor's own least-squares line in every feature
base = "leastsq"
degree = 1

[methods.pooled_lin]           # one fleet-wide least-squares line (not personalized)
base = "leastsq"
degree = 1
pooled = true

[methods.fedprior_noise]       # σ²(x) in the inputs, Student-t rows (fedprior_noise)
base = "fedprior"
noise_shape = "inputs"
noise_tail = "student"

[methods.fedprior_sigmax]      # σ²(x) in the inputs only
base = "fedprior"
noise_shape = "inputs"

[methods.fedprior_t]           # Student-t rows only
base = "fedprior"
noise_tail = "student"

[methods.fedprior_auto]        # Student-t rows only where the fleet's evidence says so (N6)
base = "fedprior"
noise_tail = "auto"

[methods.fedprior_trim]        # Gaussian rows without the gross outliers of the t fit (N7)
base = "fedprior"
noise_tail = "trim"

[methods.persensor_quad]       # each sensor's own least-squares quadratic (a stronger reference)
base = "leastsq"
degree = 2

[methods.fedprior_drift_static] # q in use only: prior, basis and σ² fitted as fedprior's
base = "fedprior_drift"
drift_prior = "static"

[methods.fedprior_drift_walk]  # the prior fitted under the walk (ECM), q by the future check
base = "fedprior_drift"
drift_prior = "walk"

[methods.fedprior_drift_evidence]  # the prior under the walk, q by in-sample evidence
base = "fedprior_drift"
drift_prior = "walk"
drift_fit = "evidence"

[methods.fedprior_drift_noshort] # without the short co-location step (fedprior_short S1–S4)
base = "fedprior_drift"
short_colocation = "off"

[methods.fedprior_drift_span]  # the short step's emulation over each long unit's whole span
base = "fedprior_drift"
short_emulation = "span"

[methods.fedprior_drift_far]   # the short step's emulation from the first window only
base = "fedprior_drift"
short_emulation = "far"

[methods.pooled_quad]          # one fleet-wide least-squares quadratic
base = "leastsq"
degree = 2
pooled = true
"""


def network_csv(spec: FieldSpec, seed: int, short: bool, path: Path) -> None:
    """The network's CSV as a user would have it; short: half its sensors cut to the first
    10 % of their calibration period (the cut is made on the time split, then the split
    column is dropped so that the loader splits by time again, as a user's file)."""
    frame = field_frame(spec, seed)
    if short:
        work = frame.copy()
        work[TIME_COLUMN] = seconds(work[TIME_COLUMN])
        work[SPLIT_COLUMN] = time_split(
            work[CLIENT_COLUMN].to_numpy(), work[TIME_COLUMN].to_numpy(), 0.25
        )
        kept = shorten(work, fraction=0.5, keep=0.1, seed=seed)
        keys = set(zip(kept[CLIENT_COLUMN], kept[TIME_COLUMN], strict=True))
        t = seconds(frame[TIME_COLUMN])
        frame = frame[[(c, s) in keys for c, s in zip(frame[CLIENT_COLUMN], t, strict=True)]]
    frame.to_csv(path, index=False)


def per_sensor(run: Path, method: str) -> pd.DataFrame | None:
    found = sorted((run / "runs").glob(f"{method}*/per_sensor.csv"))
    found = [f for f in found if pd.read_csv(f, nrows=1)["method"].iloc[0] == method]
    return pd.read_csv(found[0]) if found else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--methods", default=",".join(METHODS), help="e.g. persensor_quad")
    parser.add_argument("--features", default="2,3,8", help="networks by feature count")
    parser.add_argument("--colocations", default="full,short")
    parser.add_argument(
        "--drift-sd", type=float, default=None, help="override the planted gain drift (0: none)"
    )
    args = parser.parse_args()
    wanted = {int(f) for f in args.features.split(",")}
    colocations = [c == "short" for c in args.colocations.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    methods = args.methods.split(",")
    rows = []
    for net, (spec, features) in NETWORKS.items():
        if len(features) not in wanted:
            continue
        if args.drift_sd is not None:
            spec = replace(spec, drift_sd=args.drift_sd)
        for short in colocations:
            for seed in seeds:
                where = args.out / f"{len(features)}f-{'short' if short else 'full'}-{seed}"
                where.mkdir(parents=True, exist_ok=True)
                network_csv(spec, seed, short, where / "network.csv")
                config = CONFIG.format(
                    methods=methods,
                    path=where / "network.csv",
                    features=list(features),
                    target=TARGET,
                    time=TIME_COLUMN,
                ).replace("'", '"')
                compare_in(where, config)
                for method in methods:
                    table = per_sensor(where / "run", method)
                    row = {"network": net, "colocation": "short" if short else "full"}
                    row.update(seed=seed, method=method, status="ok")
                    if table is None:
                        row["status"] = "failed"
                    else:
                        rmse = table["test_rmse"].to_numpy(float)
                        row["status"] = "ok" if np.isfinite(rmse).all() else "non-finite"
                        row.update(rmse_mean=rmse.mean(), rmse_worst=rmse.max())
                        if "test_coverage95" in table:
                            cov = table["test_coverage95"].to_numpy(float)
                            row.update(coverage_mean=cov.mean(), coverage_worst=cov.min())
                        if "test_beyond_support" in table:
                            row["beyond_support"] = table["test_beyond_support"].mean()
                    rows.append(row)
                    print(row, flush=True)
    results = pd.DataFrame(rows)
    results.to_csv(args.out / "field.csv", index=False)
    print(markdown(results))


def markdown(results: pd.DataFrame) -> str:
    """Mean over fleet seeds of each figure; the goal's check per seed."""
    lines = [
        "| network | co-location | method | RMSE mean | RMSE worst | coverage mean "
        "| coverage worst | ≤ best linear (mean, worst), seeds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (net, col), group in results.groupby(["network", "colocation"], sort=False):
        base = group[group["method"].isin(BASELINES)]
        best_mean = base.groupby("seed")["rmse_mean"].min()
        best_worst = base.groupby("seed")["rmse_worst"].min()
        for method, g in group.groupby("method", sort=False):
            if (g["status"] != "ok").any():
                lines.append(f"| {net} | {col} | {method} | {', '.join(g['status'])} | | | | |")
                continue
            g = g.set_index("seed")
            wins = ""
            if method not in BASELINES and not base.empty:  # (a references-only run: none)
                ok_mean = (g["rmse_mean"] <= best_mean[g.index]).sum()
                ok_worst = (g["rmse_worst"] <= best_worst[g.index]).sum()
                wins = f"{ok_mean}/{len(g)}, {ok_worst}/{len(g)}"
            cov = (
                f"{g['coverage_mean'].mean():.3f} | {g['coverage_worst'].mean():.3f}"
                if "coverage_mean" in g and g["coverage_mean"].notna().all()
                else "– | –"
            )
            lines.append(
                f"| {net} | {col} | {method} | {g['rmse_mean'].mean():.2f} | "
                f"{g['rmse_worst'].mean():.2f} | {cov} | {wins} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
