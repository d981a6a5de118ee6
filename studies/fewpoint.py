"""The few-point benchmark: new units calibrated with 6 / 12 / 24 chamber points.

Runs the shipped ``fewpoint`` configuration (the same runs as ``fedcal compare
--config fewpoint``, into the same kind of run directory, so an interrupted
benchmark resumes): 20 reference units with the full campaign (384 points) +
20 new units with a small chamber design (3x2, 4x3, 6x4), tested on 60 random
(P, T) points inside the calibrated range, over 3 fleet seeds. Prints, per
method and design, the new units' RMSE — the mean over sensors and the worst
sensor, each averaged over fleet seeds (and training seeds), with the range
over fleet seeds — the reference units' mean RMSE, and coverage95 of the new
units where a method reports predictive standard deviations.

A run whose sensors are not all finite counts as NaN (never skipped), and so
does the mean over fleet seeds it enters. Methods the configuration lists
but this tree does not register (e.g. ``fedprior`` before it is merged) are
named and skipped.

    python studies/fewpoint.py [--out runs/fewpoint-bench] [--methods a,b]
                                  [--designs 3x2,4x3,6x4] [--fleet-seeds 0,1,2] [--rounds 50]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fedcal_support/ (not shipped)

from fedcal.config import load_config
from fedcal.experiment import check_methods, load_data, run_experiment
from fedcal_support.scripts import seed_list


def _strict_mean(values: pd.Series) -> float:
    """Mean that is NaN as soon as one value is not finite (pandas would skip NaN)."""
    v = values.to_numpy(float)
    return float(v.mean()) if len(v) and np.isfinite(v).all() else float("nan")


def _fmt(x: float) -> str:
    return "NaN" if not np.isfinite(x) else f"{x:.3g}"


def table(summary: pd.DataFrame, methods: list[str], designs: list[str]) -> str:
    """Markdown: per method, per design "mean (worst) [fleet-seed range]" of the new units."""
    has_cov = "coverage95_mean_new" in summary.columns
    header = ["method"]
    for d in designs:
        header += [f"{d} new mean", f"{d} new worst"] + ([f"{d} cov95 new"] if has_cov else [])
    header += ["ref mean (all designs)"]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for m in methods:
        rows = summary[summary["method"] == m]
        cells = [m]
        for d in designs:
            part = rows[rows["design"] == d]
            per_fleet = part.groupby("fleet_seed")["rmse_mean_new"].apply(_strict_mean)
            spread = (
                f" [{_fmt(per_fleet.min())}–{_fmt(per_fleet.max())}]"
                if np.isfinite(per_fleet.to_numpy()).all() and len(per_fleet) > 1
                else ""
            )
            cells.append(_fmt(_strict_mean(part["rmse_mean_new"])) + spread)
            cells.append(_fmt(_strict_mean(part["rmse_worst_new"])))
            if has_cov:
                cov = part.get("coverage95_mean_new")
                cells.append("—" if cov is None or cov.isna().all() else _fmt(_strict_mean(cov)))
        cells.append(_fmt(_strict_mean(rows["rmse_mean_reference"])))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/fewpoint-bench"))
    parser.add_argument("--config", default="fewpoint")
    parser.add_argument("--methods", default=None, help="comma separated (default: the config's)")
    parser.add_argument("--designs", default=None)
    parser.add_argument("--fleet-seeds", type=seed_list, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)

    cfg = load_config(args.config)
    if args.methods:
        cfg = replace(cfg, methods=tuple(args.methods.split(",")))
    if args.designs:
        cfg = replace(cfg, designs=tuple(args.designs.split(",")))
    if args.fleet_seeds:
        cfg = replace(cfg, fleet_seeds=tuple(args.fleet_seeds))
    if args.rounds:
        cfg = replace(cfg, engine=replace(cfg.engine, rounds=args.rounds))
    runnable = []
    for m in cfg.methods:
        try:
            check_methods([m], cfg)
            runnable.append(m)
        except ValueError as err:
            print(f"skipped {m}: {err}")
    cfg = replace(cfg, methods=tuple(runnable))
    t0 = time.perf_counter()
    summary = run_experiment(cfg, load_data(cfg), args.out, runnable)
    wall = time.perf_counter() - t0
    f = cfg.fleet
    print(
        f"fleet: {f.num_reference} reference units ({f.reference_design}) + {f.num_new} new units"
        f" (design below), test_design={f.test_design}, fleet seeds {list(cfg.fleet_seeds)},"
        f" training seeds {cfg.seeds}, rounds {cfg.engine.rounds}; wall {wall:.0f} s"
    )
    print("RMSE (hPa) of the new units: mean over sensors (range over fleet seeds), worst sensor;")
    print("each averaged over fleet seeds and training seeds\n")
    print(table(summary, runnable, list(cfg.designs)))
    print(f"\nrun directory: {args.out} (summary.csv, runs/*/per_sensor.csv)")


if __name__ == "__main__":
    main()
