"""Client-level DP: accuracy at ε = 1, 4, 8 and without DP, per method and fleet.

DP-FedAvg (McMahan et al. 2018) through ``fedcal.core.aggregation``: each
client's update is clipped to L2 norm C (``--clip``, scaled units), the sum gets
N(0, σ²C²) noise, σ chosen by Opacus's RDP accountant so that the whole run
spends at most ε at δ = 1e-5 (all sensors every round: q = 1, exact
accounting). The private parts of a personalized model (FedGMI's head state)
never leave the sensor and get no noise; only what is uploaded is protected.
A method that declares its summed statistics (fedprior: ``dp_statistics``) is
clipped statistic by statistic to its declared bounds, which ``--clip`` then
multiplies (1 = as declared), noised at the joint sensitivity and projected to
valid sums (``fedcal.core.privacy.private_sums``). A method with the calibrated
interval (whose hold-out uploads inputs, refused under DP) runs with
``interval = "posterior"`` in every cell, with and without DP.

``--config fewpoint`` runs the mixed fleet (20 reference units with 384 points
+ 20 new units with a few-point design, ``--designs``) over ``--fleet-seeds``
and reports the new and the reference units apart (off-grid test points).

Printed: σ and the ε actually spent, the mean and worst test RMSE (hPa) over
fleet seeds × training seeds, diverged sensors, failures with their reason;
and, without DP, the median update norm of round 1 and the last round.

    python studies/dp.py [--methods fedgmi] [--seeds 0,1,2] [--rounds 20] [--clip 0.5]
        [--epsilons 1,4,8] [--config fewpoint --designs 3x2,4x3 --fleet-seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fedcal_support/ (not shipped)

from fedcal.config import default_config, load_config
from fedcal.engine.simulation import EngineConfig, prepare, simulate
from fedcal.experiment import (
    build_algorithm,
    build_policy,
    build_task,
    client_inputs,
    load_data,
    one_line,
)
from fedcal_support.scripts import seed_list


def _cell(values: list[float]) -> str:
    """mean ± std over runs; NaN as soon as one run is not finite (never skipped)."""
    v = np.asarray(values, float)
    if not len(v) or not np.isfinite(v).all():
        return "NaN"
    return f"{v.mean():.3g} ± {v.std():.2g}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default="fedgmi")
    ap.add_argument("--seeds", type=seed_list, default=[0, 1, 2], help="training seeds")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--clip", type=float, default=0.5)
    ap.add_argument("--epsilons", default="1,4,8")
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--config", default=None, help="a shipped name (fewpoint) or a TOML file")
    ap.add_argument("--designs", default=None, help="[fleet] train_design values (mixed fleets)")
    ap.add_argument("--fleet-seeds", type=seed_list, default=None, help="[fleet] seeds")
    ap.add_argument("--per-run", action="store_true", help="print every run's RMSE mean too")
    args = ap.parse_args()
    torch.set_num_threads(1)

    cfg = load_config(args.config) if args.config else default_config()
    cfg = replace(cfg, engine=replace(cfg.engine, rounds=args.rounds, eval_every=args.rounds))
    designs = args.designs.split(",") if args.designs else [cfg.fleet.train_design]
    fleet_seeds = args.fleet_seeds if args.fleet_seeds else [cfg.fleet.seed]
    fleets = {}
    for design in designs:
        for fs in fleet_seeds:
            c = replace(cfg, fleet=dataclasses.replace(cfg.fleet, seed=fs, train_design=design))
            fleet = load_data(c)
            tensors = prepare(fleet, cfg.data.scaling, cfg.engine.dtype)
            task = build_task(c, tensors.train.x.shape[-1], {}, client_inputs(tensors))
            fleets[design, fs] = (c, fleet, tensors, task)
    settings = [("no DP", 0.0)] + [(f"ε = {e}", float(e)) for e in args.epsilons.split(",")]
    print(
        f"config {args.config or 'default'}, designs {designs}, fleet seeds {fleet_seeds}; "
        f"recipe: lr {cfg.train.lr}, batch {cfg.train.batch_size}, grad_clip "
        f"{cfg.train.grad_clip}, {args.rounds} rounds, training seeds {args.seeds}, "
        f"C = {args.clip}, "
        f"δ = {args.delta}"
    )
    print(
        "| method | design | privacy | σ | ε spent | RMSE mean (hPa) | RMSE worst (hPa) "
        "| new units: mean | new units: worst | reference units: mean | diverged |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    t0 = time.perf_counter()
    for method in args.methods.split(","):
        for design in designs:
            for label, eps in settings:
                privacy = replace(
                    cfg.privacy, epsilon=eps, clip=args.clip, delta=args.delta, noise="seeded"
                )
                policy, spent = build_policy(replace(cfg, privacy=privacy))
                means, worsts, new_means, new_worsts, ref_means = [], [], [], [], []
                diverged, norms, failed = 0, [], []
                for fs in fleet_seeds:
                    c, fleet, tensors, task = fleets[design, fs]
                    algorithm = build_algorithm(method, c, task)
                    if getattr(algorithm, "interval", None) == "calibrated":
                        # the calibrated interval's hold-out uploads inputs: refused under DP;
                        # every cell (DP or not) uses the posterior interval, so they compare
                        algorithm = replace(algorithm, interval="posterior")
                    roles = fleet.roles
                    for seed in args.seeds:
                        engine = EngineConfig(
                            rounds=args.rounds,
                            eval_every=args.rounds,
                            seed=seed,
                            aggregation=policy,
                        )
                        try:
                            result = simulate(algorithm, tensors, engine)
                        except Exception as err:  # reported as a failure, never as a number
                            failed.append(one_line(err, 150))
                            continue
                        final = pd.DataFrame(result.final)
                        means.append(final["test_rmse"].mean(skipna=False))
                        if args.per_run:
                            print(f"  run: fleet seed {fs}, seed {seed}, {label}: {means[-1]:.4g}")
                        worsts.append(final["test_rmse"].max(skipna=False))
                        if roles is not None:
                            new = final["client"].astype(str).map(roles) == "new"
                            new_means.append(final.loc[new, "test_rmse"].mean(skipna=False))
                            new_worsts.append(final.loc[new, "test_rmse"].max(skipna=False))
                            ref_means.append(final.loc[~new, "test_rmse"].mean(skipna=False))
                        diverged += int((final["status"] == "diverged").sum())
                        log = result.extra["aggregation"]
                        norms.append((log[0]["median_update_norm"], log[-1]["median_update_norm"]))
                runs = len(fleet_seeds) * len(args.seeds)
                head = f"| {method} | {design} | {label} |"
                if failed:
                    print(
                        f"{head} | | failed in {len(failed)}/{runs} runs: {failed[0]} | | | | | |",
                        flush=True,
                    )
                    continue
                sigma = f"{spent['noise_multiplier']:.3g}" if spent else "—"
                eps_spent = f"{spent['epsilon']:.3f}" if spent else "∞"
                new_cells = (
                    f"{_cell(new_means)} | {_cell(new_worsts)} | {_cell(ref_means)}"
                    if new_means
                    else "— | — | —"
                )
                print(
                    f"{head} {sigma} | {eps_spent} | {_cell(means)} | {_cell(worsts)} | "
                    f"{new_cells} | {diverged} |",
                    flush=True,
                )
                if not spent:
                    first = sum(n[0] for n in norms) / len(norms)
                    last = sum(n[1] for n in norms) / len(norms)
                    print(f"|  |  | median update norm, round 1 / last: {first:.3g} / {last:.3g} |")
    print(f"wall {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
