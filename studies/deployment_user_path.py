"""The deployment path as a user runs it, through the command line (issue 33's check).

Per simulator, reference design and fleet seed: the 20 reference units' file →
``fedcal run --methods fedprior`` with every default (50 rounds, the chamber preset) → for
each new design, the 20 new units' calibration points → ``fedcal calibrate --prior`` →
their 60 random off-grid test readings → ``fedcal predict`` → coverage of ±1.96 × the
``pressure_hpa_std`` column, per unit. The planner's designs come from ``fedcal plan
--plateaus K --points N`` (its "planned" row's ``rms_sd`` is the forecast, compared with the
RMS of the σ ``predict`` then states). Units that ``calibrate`` refuses (read outside the
prior fleet's range: ``units.csv`` status "refused") are counted, not scored.

The fleets are :mod:`deployment_sigma`'s (the same units, designs and test points), so this
checks that the commands give what the study's Python API path gives
(``studies/deployment_sigma.py`` runs ``FleetPrior`` with 20 rounds).

    OMP_NUM_THREADS=1 PYTHONPATH=src:studies python studies/deployment_user_path.py \
        --sims fedcal:campaign,crosscheck:grid,crosscheck:stagger,crosscheck:lhs \
        --fleet-seeds 0,1,2 --designs 3x2,4x3,6x4,plan2,plan3 --out /tmp/user_path
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))

import deployment_sigma as ds

CROSSCHECK_CHAMBER = ["--pressures", ",".join(str(p) for p in range(100, 1301, 100))]
CROSSCHECK_CHAMBER += ["--t-min", "-10", "--t-max", "50"]


def fedcal(*args: str) -> str:
    """One fedcal command (the console script beside this Python); its stdout, or exit."""
    exe = Path(sys.executable).with_name("fedcal")
    cmd = [str(exe) if exe.exists() else shutil.which("fedcal") or "fedcal", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"fedcal {args[0]} failed: {tail}")
    return proc.stdout


def fleet(sim: str, ref: str, seed: int, design) -> pd.DataFrame:
    """deployment_sigma's fleet: 20 references + 20 new units of ``design``."""
    if sim == "fedcal":
        if isinstance(design, str):
            return ds.fedcal_fleet(seed, design)
        return ds.fedcal_fleet(seed, "points", design)
    return ds.cc_rows(seed, ref, design)


def planned(prior: Path, sim: str, design: str, out: Path) -> tuple[tuple, float]:
    """``fedcal plan``'s design (P, T, direction) rows and its forecast RMS σ."""
    plateaus, points = ds.PLANS[design]
    chamber = CROSSCHECK_CHAMBER if sim == "crosscheck" else []
    text = fedcal(
        "plan", "--prior", str(prior), "--plateaus", str(plateaus), "--points", str(points),
        "--out", str(out), *chamber,
    )  # fmt: skip
    row = next(line.split() for line in text.splitlines() if line.strip().startswith("planned"))
    frame = pd.read_csv(out)
    rows = tuple((float(p), float(t), str(d)) for p, t, d in frame.itertuples(index=False))
    return rows, float(row[4])


def score(run: Path, frame: pd.DataFrame, tag: str) -> pd.DataFrame:
    """calibrate → predict of ``frame``'s new units; per unit RMSE, coverage, σ RMS."""
    new = frame[frame["role"] == "new"]
    train = new[new["split"] == "train"][ds.COLUMNS[:4]]
    test = new[new["split"] == "test"]
    train.to_csv(run / f"new_{tag}.csv", index=False)
    test[ds.COLUMNS[:3]].to_csv(run / f"test_{tag}.csv", index=False)
    cal = run / f"calibrated_{tag}"
    fedcal("calibrate", "--prior", str(run / "prior"), "--data", str(run / f"new_{tag}.csv"),
           "--out", str(cal))  # fmt: skip
    pred_csv = run / f"predicted_{tag}.csv"
    fedcal("predict", str(cal), "--data", str(run / f"test_{tag}.csv"), "--out", str(pred_csv))
    pred = pd.read_csv(pred_csv)
    err = test["pressure_hpa"].to_numpy() - pred["pressure_hpa_calibrated"].to_numpy()
    sd = pred["pressure_hpa_std"].to_numpy()
    rows = pd.DataFrame({"sensor_id": test["sensor_id"].to_numpy(), "err": err, "sd": sd})
    units = pd.read_csv(cal / "units.csv", dtype={"sensor_id": str})
    refused = set(units.loc[units["status"] == "refused", "sensor_id"])
    out = []
    for unit, g in rows.groupby("sensor_id"):
        stated = bool(np.isfinite(g["sd"]).all())
        inside = np.abs(g["err"]) <= 1.959964 * g["sd"]
        out.append({
            "sensor_id": unit, "refused": unit in refused,
            "rmse": float(np.sqrt(np.mean(g["err"] ** 2))) if unit not in refused else np.nan,
            "coverage": float(np.mean(inside)) if stated else np.nan,
            "sd_rms": float(np.sqrt(np.mean(g["sd"] ** 2))) if stated else np.nan,
        })  # fmt: skip
    return pd.DataFrame(out)


def one_fleet(sim: str, ref: str, seed: int, designs: list[str], out: Path) -> list[dict]:
    run = out / f"{sim}_{ref}_{seed}"
    run.mkdir(parents=True, exist_ok=True)
    base = fleet(sim, ref, seed, "3x2")
    base[base["role"] == "reference"][ds.COLUMNS].to_csv(run / "references.csv", index=False)
    if not (run / "prior" / "summary.csv").exists():
        fedcal("run", "--data", str(run / "references.csv"), "--methods", "fedprior",
               "--seeds", "1", "--out", str(run / "prior"))  # fmt: skip
    rows = []
    for design in designs:
        forecast = np.nan
        if design in ds.PLANS:
            points, forecast = planned(run / "prior", sim, design, run / f"design_{design}.csv")
            frame = fleet(sim, ref, seed, points)
        else:
            frame = fleet(sim, ref, seed, design)
        per = score(run, frame, design)
        per = per.assign(sim=sim, ref=ref, seed=seed, design=design, forecast_rms=forecast)
        rows += per.to_dict("records")
    return rows


def table(per: pd.DataFrame) -> str:
    lines = [
        "| simulator / references | new design | cov95 mean [per seed] | worst unit | declined "
        "| refused | RMSE mean / worst | plan's σ / stated σ (RMS) |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for (sim, ref, design), g in per.groupby(["sim", "ref", "design"], sort=False):
        kept = g[~g["refused"]]
        seeds = kept.groupby("seed")["coverage"].mean()
        ratio = ", ".join(
            f"{s['forecast_rms'].iloc[0] / np.sqrt(np.nanmean(s['sd_rms'] ** 2)):.2f}"
            for _, s in kept.groupby("seed")
            if np.isfinite(s["forecast_rms"].iloc[0])
        )
        cov = (
            f"{kept['coverage'].mean():.3f} [" + ", ".join(f"{v:.3f}" for v in seeds) + "]"
            if kept["coverage"].notna().any()
            else "declined"
        )
        lines.append(
            f"| {sim} / {ref} | {design} | {cov} | {kept['coverage'].min():.3f} | "
            f"{int(kept['coverage'].isna().sum())} of {len(kept)} | {int(g['refused'].sum())} | "
            f"{kept['rmse'].mean():.4g} / {kept['rmse'].max():.4g} | {ratio} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sims", default="fedcal:campaign,crosscheck:grid")
    ap.add_argument("--fleet-seeds", default="0,1,2")
    ap.add_argument("--designs", default="3x2,4x3,6x4,plan2,plan3")
    ap.add_argument("--out", default="/tmp/deployment_user_path")
    args = ap.parse_args()
    out = Path(args.out)
    rows: list[dict] = []
    for item in args.sims.split(","):
        sim, ref = item.split(":")
        for seed in (int(s) for s in args.fleet_seeds.split(",")):
            rows += one_fleet(sim, ref, seed, args.designs.split(","), out)
            pd.DataFrame(rows).to_csv(out / "per_unit.csv", index=False)
    print(table(pd.DataFrame(rows)))


if __name__ == "__main__":
    main()
