"""A fleet in which every unit has few points: can the fleet prior still be learned?

The default fleet (20 quartz units) cut to ``--points`` spread calibration
points per unit (no reference units), tested on 60 random (P, T) points per
unit inside the calibrated range, over fleet seeds. Prints per method and
fleet seed the mean and worst unit's RMSE (hPa), coverage of the nominal 95 %
interval, and for fedprior the basis it used (with ``select = "bic"``: the
one the fleet's evidence chose). Runs go into a run directory like ``fedcal
compare`` (resumable).

    python studies/fewpoint_all_few.py [--methods fedprior,fedprior_fixed] [--points 12]
                                          [--fleet-seeds 0,1,2] [--out runs/all-few]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fedcal_support/ (not shipped)

from fedcal.config import load_config
from fedcal.experiment import load_data, run_experiment
from fedcal_support.scripts import seed_list


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default="fedprior,fedprior_fixed")
    ap.add_argument("--points", type=int, default=12)
    ap.add_argument("--fleet-seeds", type=seed_list, default=[0, 1, 2])
    ap.add_argument("--out", type=Path, default=Path("runs/all-few"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    methods = args.methods.split(",")
    cfg = load_config(None)
    cfg = dataclasses.replace(
        cfg,
        methods=tuple(methods),
        seeds=1,
        fleet_seeds=tuple(args.fleet_seeds),
        fleet=dataclasses.replace(cfg.fleet, test_design="random"),
    )
    summary = run_experiment(cfg, load_data(cfg), args.out, methods, train_points=(args.points,))
    print(f"{args.points} spread points per unit, no reference units; RMSE hPa on random points")
    print("| method | fleet seed | mean | worst | cov95 | basis |")
    print("|---|---:|---:|---:|---:|---|")
    for (method, fs), rows in summary.groupby(["method", "fleet_seed"], sort=False):
        prior = args.out / "runs" / f"{method}_fs{fs}_tp{args.points}_seed0" / "prior.json"
        basis = "—"
        if prior.exists():
            doc = json.loads(prior.read_text())
            chosen = doc.get("selection", {}).get("chosen")
            basis = str(chosen or doc["method_params"].get("orders"))
        print(
            f"| {method} | {fs} | {rows['rmse_mean'].mean():.4g} | {rows['rmse_worst'].mean():.4g}"
            f" | {rows['coverage95_mean'].mean():.3f} | {basis} |"
        )


if __name__ == "__main__":
    main()
