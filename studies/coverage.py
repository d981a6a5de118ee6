"""Coverage of fedprior's nominal 95 % intervals in every few-point regime (issue 20, item 1).

Each regime is a fleet of the simulator (fleet seeds as given), tested on 60
random (P, T) points per unit inside the calibrated range (off the chamber
grid):

* ``all-<d>``: 40 units, every one calibrated on the chamber design ``d``
  (3x2 = 6 points, 4x3 = 12, 6x4 = 24);
* ``mixed-<d>``: 20 reference units with the full campaign (384 points, both
  sweep directions) + 20 new units on design ``d`` (one upward sweep);
* ``mixed-nodir-<d>``: the same fleet without its ``direction`` column (a chamber
  that does not record the sweep direction).

Methods: ``fedprior`` (ignores the sweep direction) and ``fedprior_branch`` (reads
the direction column as a branch term), as configured in the shipped ``fewpoint``
configuration. Reported per (method, regime): coverage95 of the predicted units
(the new ones in a mixed fleet; every unit otherwise), mean over units and
averaged over fleet seeds, with each fleet seed's value; the RMSE (hPa) mean over
units and fleet seeds, and the worst unit over fleet seeds; and, where the method
declines to state an interval, "declined" with its reason. Prints a Markdown table.

    python studies/coverage.py [--fleet-seeds 0,1,2] [--designs 3x2,4x3,6x4]
                               [--regimes all,mixed,mixed-nodir]
                               [--methods fedprior,fedprior_branch]
                               [--rounds 50] [--set noise_shape=inputs,noise_tail=student]

``--set``: fedprior settings applied to every method (e.g. the noise model of
``fedcal.algorithms.fedprior_noise``); digits are read as integers (``own_folds=5``).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
import pandas as pd
import torch

from fedcal.build import (
    build_algorithm,
    build_policy,
    build_task,
    client_inputs,
    engine_settings,
    load_data,
)
from fedcal.config import load_config
from fedcal.data.fleet import DIRECTION_COLUMN
from fedcal.engine.simulation import EngineConfig, prepare, simulate


def run_one(cfg, method: str, directions: bool = True, settings: dict | None = None) -> dict:
    """One fleet, one method: coverage and RMSE of the predicted units, and any decline.

    ``directions=False``: the fleet's ``direction`` column is dropped (a chamber that
    does not record its sweep direction)."""
    fleet = load_data(cfg)
    if not directions:
        fleet = dataclasses.replace(fleet, frame=fleet.frame.drop(columns=[DIRECTION_COLUMN]))
    tensors = prepare(fleet, cfg.data.scaling, cfg.engine.dtype)
    task = build_task(cfg, tensors.train.x.shape[-1], fleet.meta, client_inputs(tensors))
    algorithm = build_algorithm(method, cfg, task)
    if settings:  # --set: string-valued fields (e.g. noise_shape, noise_tail)
        algorithm = dataclasses.replace(algorithm, **settings)
    policy, _ = build_policy(cfg)
    engine = EngineConfig(**engine_settings(cfg), seed=0, aggregation=policy)
    result = simulate(algorithm, tensors, engine)
    final = pd.DataFrame(result.final)
    roles = fleet.roles
    if roles is not None:
        final = final[final["client"].astype(str).map(roles) == "new"]
    note = ""
    if hasattr(algorithm, "interval_note"):
        note = algorithm.interval_note(result.server) or ""
    cov = final["test_coverage95"].to_numpy(float) if "test_coverage95" in final else []
    return {
        "coverage": float(np.mean(cov)) if len(cov) and np.isfinite(cov).all() else float("nan"),
        "rmse_mean": float(final["test_rmse"].mean()),
        "rmse_worst": float(final["test_rmse"].max()),
        "note": note,
    }


def regime_config(base, regime: str, design: str, fleet_seed: int, rounds: int):
    f = base.fleet
    if regime.startswith("all"):
        fleet = dataclasses.replace(
            f, num_reference=0, num_new=0, num_sensors=40, train_design=design
        )
    else:
        fleet = dataclasses.replace(f, num_reference=20, num_new=20, train_design=design)
    fleet = dataclasses.replace(fleet, seed=fleet_seed, test_design="random")
    return dataclasses.replace(
        base,
        fleet=fleet,
        designs=(),
        fleet_seeds=(),
        engine=dataclasses.replace(base.engine, rounds=rounds, eval_every=rounds),
    )


def _fmt(x: float, digits: int = 3) -> str:
    return "—" if not np.isfinite(x) else f"{x:.{digits}g}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fleet-seeds", default="0,1,2")
    ap.add_argument("--designs", default="3x2,4x3,6x4")
    ap.add_argument("--regimes", default="all,mixed,mixed-nodir")
    ap.add_argument("--methods", default="fedprior,fedprior_branch")
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--set", default="", help="fedprior settings, e.g. noise_tail=student")
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = load_config("fewpoint")
    seeds = [int(s) for s in args.fleet_seeds.split(",")]
    print(f"fleet seeds {seeds}, {args.rounds} rounds\n")
    print("| regime | method | cov95 mean [per fleet seed] | RMSE mean | RMSE worst | note |")
    print("|---|---|---:|---:|---:|---|", flush=True)
    t0 = time.perf_counter()
    for regime in args.regimes.split(","):
        for design in args.designs.split(","):
            for method in args.methods.split(","):
                cfgs = [regime_config(base, regime, design, s, args.rounds) for s in seeds]
                settings = dict(kv.split("=", 1) for kv in args.set.split(",") if kv)
                settings = {k: int(v) if v.isdigit() else v for k, v in settings.items()}
                per = [run_one(c, method, not regime.endswith("nodir"), settings) for c in cfgs]
                print(row(f"{regime}-{design}", method, per), flush=True)
    print(f"\nwall {time.perf_counter() - t0:.0f} s")


def row(regime: str, method: str, per: list[dict]) -> str:
    """One Markdown row: coverage (or "declined") over fleet seeds, RMSE mean and worst."""
    c = np.array([r["coverage"] for r in per])
    declined = int((~np.isfinite(c)).sum())
    cov = "declined" if declined == len(c) else _fmt(float(np.nanmean(c)))
    if 0 < declined < len(c):
        cov += f" ({declined} of {len(c)} seeds declined)"
    cov += " [" + ", ".join(_fmt(v) for v in c) + "]"
    notes = "; ".join(sorted({r["note"] for r in per if r["note"]}))
    rmse = float(np.mean([r["rmse_mean"] for r in per]))
    worst = float(np.max([r["rmse_worst"] for r in per]))
    return f"| {regime} | {method} | {cov} | {_fmt(rmse, 4)} | {_fmt(worst, 4)} | {notes} |"


if __name__ == "__main__":
    main()
