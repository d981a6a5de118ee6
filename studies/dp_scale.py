"""Client-level DP with many units (issue 25, item 3): new-unit error against the fleet size.

Mixed fleets as ``--config fewpoint`` builds them (``[fleet] num_reference`` units with the
full 384-point campaign + ``--new`` units with a few-point design), with ``--units`` reference
units each; fedprior on its fixed (4, 3) basis (``fedprior_fixed``, ``interval =
"posterior"``: the calibrated interval's hold-out uploads inputs and is refused under DP).
Per fleet: the non-private prior, then for each ε the private one with the bounds as declared
and, with ``--adaptive``, adapted by private quantile estimation (Andrew et al. 2021,
``fedcal.core.privacy.private_bounds``; quantile γ, steps per round, the counts' budget
share). δ = 1/N² with N all units of the fleet; q = 1 (every unit every round). Metric:
the new units' test RMSE (hPa) on off-grid random (P, T) points, mean over units and the
worst unit, per fleet seed; printed with the accountant's ε and σ of each run. A run that
raises or has a non-finite sensor is printed as such and never enters a mean.

With ``--select`` the basis is chosen by the fleet under DP too (fedprior ``select = "bic"``,
``select_by = "marginal"``: each unit's clipped per-candidate evidence, noised with the sums
at the budget share ``--select-share``); the table's last column is the basis in use.

    python studies/dp_scale.py --units 500,2000 --designs 3x2,4x3 --epsilons 1,4,8 \\
        --fleet-seeds 0,1,2 --rounds 6 [--new 30] [--adaptive 0.9] [--steps 12] [--share 0.1]
        [--declared] [--whiten] [--select [--select-clip 10] [--select-share 0.1]]
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

from fedcal.config import load_config
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


def _run(algorithm, tensors, roles, policy, rounds: int, seed: int) -> dict:
    """One run's new-unit mean and worst RMSE and reference mean (NaN if any is not finite)."""
    engine = EngineConfig(rounds=rounds, eval_every=rounds, seed=seed, aggregation=policy)
    t0 = time.perf_counter()
    result = simulate(algorithm, tensors, engine)
    final = pd.DataFrame(result.final)
    new = final["client"].astype(str).map(roles) == "new"
    rmse = final["test_rmse"].to_numpy(float)
    log = result.extra["aggregation"]
    bounds = {k: v for k, v in log[-1].items() if str(k).startswith("dp_bound/")}
    return {
        "new_mean": float(rmse[new].mean()),
        "new_worst": float(rmse[new].max()),
        "ref_mean": float(rmse[~new].mean()),
        "finite": bool(np.isfinite(rmse).all()),
        "wall": time.perf_counter() - t0,
        "bounds": bounds,
        "basis": _basis(algorithm, result.server),
    }


def _basis(algorithm, server) -> str:
    """The basis in use: the chosen candidate under ``--select``, else the fixed orders."""
    if getattr(algorithm, "select", "none") == "none":
        return "x".join(map(str, algorithm.orders))
    chosen = algorithm.candidates[int(server["choice"])]
    return "x".join(map(str, chosen.get("orders", [chosen.get("degree")])))


def _fmt(values: list[float]) -> str:
    v = np.asarray(values, float)
    return "NaN" if not len(v) or not np.isfinite(v).all() else f"{v.mean():.4g}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--units", default="500,2000", help="reference units per fleet")
    ap.add_argument("--new", type=int, default=30, help="new few-point units per fleet")
    ap.add_argument("--designs", default="3x2,4x3")
    ap.add_argument("--epsilons", default="1,4,8")
    ap.add_argument("--fleet-seeds", type=seed_list, default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="training seed (draws the DP noise)")
    ap.add_argument("--adaptive", type=float, default=0.0, help="target quantile γ (0: off)")
    ap.add_argument("--steps", type=int, default=12, help="quantile updates per round")
    ap.add_argument("--rate", type=float, default=2.0, help="initial geometric rate η")
    ap.add_argument("--share", type=float, default=0.1, help="the counts' budget share")
    ap.add_argument("--declared", action="store_true", help="also run the declared bounds")
    ap.add_argument("--whiten", action="store_true", help="fedprior dp_whiten = true")
    ap.add_argument("--second-weight", type=float, default=1.0, help="fedprior dp_second_weight")
    ap.add_argument(
        "--select",
        action="store_true",
        help="fedprior with select = bic, select_by = marginal (the basis chosen under DP)",
    )
    ap.add_argument("--select-clip", type=float, default=10.0, help="fedprior select_clip")
    ap.add_argument("--select-share", type=float, default=0.1, help="fedprior dp_select_share")
    args = ap.parse_args()
    torch.set_num_threads(1)

    base = load_config("fewpoint")
    base = replace(base, engine=replace(base.engine, rounds=args.rounds, eval_every=args.rounds))
    epsilons = [float(e) for e in args.epsilons.split(",")]
    modes = ["declared"] if (args.declared or not args.adaptive) else []
    modes += ["adaptive"] if args.adaptive else []
    method = "fedprior (select bic, marginal)" if args.select else "fedprior_fixed"
    print(
        f"{method} (interval posterior), {args.rounds} rounds, {args.new} new units, "
        f"fleet seeds {args.fleet_seeds}, noise seed {args.seed}; adaptive: γ {args.adaptive}, "
        f"{args.steps} steps/round, η {args.rate}, count share {args.share}; "
        f"dp_whiten {args.whiten}, second-moment weight {args.second_weight}"
        + (f"; select_clip {args.select_clip}, share {args.select_share}" if args.select else "")
    )
    print(
        "| ref units | design | fleet seed | privacy | bounds | ε spent | σ sums | z counts "
        "| new mean | new worst | ref mean | s | basis |"
    )
    print("|---:|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    rows = []
    for units in [int(u) for u in args.units.split(",")]:
        n_all = units + args.new
        for design in args.designs.split(","):
            for fs in args.fleet_seeds:
                fleet_cfg = dataclasses.replace(
                    base.fleet, seed=fs, train_design=design, num_reference=units, num_new=args.new
                )
                c = replace(base, fleet=fleet_cfg)
                fleet = load_data(c)
                tensors = prepare(fleet, c.data.scaling, c.engine.dtype)
                task = build_task(c, tensors.train.x.shape[-1], {}, client_inputs(tensors))
                algorithm = replace(
                    build_algorithm("fedprior_fixed", c, task),
                    interval="posterior",
                    dp_whiten=args.whiten,
                    dp_second_weight=args.second_weight,
                )
                if args.select:  # the basis chosen by the fleet, under DP too (issue 25.3)
                    algorithm = replace(
                        algorithm,
                        select="bic",
                        select_by="marginal",
                        select_clip=args.select_clip,
                        dp_select_share=args.select_share,
                    )
                cells = [("no DP", 0.0, "—")]
                cells += [(f"ε = {e:g}", e, m) for e in epsilons for m in modes]
                for label, eps, mode in cells:
                    privacy = replace(
                        c.privacy,
                        epsilon=eps,
                        delta=1.0 / n_all**2,
                        clip=1.0,
                        quantile=args.adaptive if mode == "adaptive" else 0.0,
                        quantile_steps=args.steps,
                        quantile_rate=args.rate,
                        quantile_share=args.share,
                        noise="seeded",  # the training seed draws the noise (reproducible)
                    )
                    policy, spent = build_policy(replace(c, privacy=privacy))
                    head = f"| {units} | {design} | {fs} | {label} | {mode} |"
                    acct = (
                        f"{spent['epsilon']:.3f} | {spent['noise_multiplier']:.3g} | "
                        f"{spent['count_multiplier']:.3g}"
                        if spent
                        else "∞ | — | —"
                    )
                    try:
                        r = _run(algorithm, tensors, fleet.roles, policy, args.rounds, args.seed)
                    except Exception as err:  # a failure is reported, never a number
                        print(f"{head} {acct} | failed: {one_line(err, 120)} | | | |", flush=True)
                        rows.append((units, design, label, mode, float("nan"), float("nan")))
                        continue
                    if not r["finite"]:
                        print(f"{head} {acct} | non-finite sensor | | | {r['wall']:.0f} |")
                        rows.append((units, design, label, mode, float("nan"), float("nan")))
                        continue
                    print(
                        f"{head} {acct} | {r['new_mean']:.4g} | {r['new_worst']:.4g} | "
                        f"{r['ref_mean']:.4g} | {r['wall']:.0f} | {r['basis']} |",
                        flush=True,
                    )
                    if r["bounds"]:
                        text = ", ".join(f"{k[9:]} {v:.3g}" for k, v in r["bounds"].items())
                        print(f"|  |  |  | last round's adapted bounds: {text} |", flush=True)
                    rows.append((units, design, label, mode, r["new_mean"], r["new_worst"]))
    table = pd.DataFrame(rows, columns=["units", "design", "privacy", "bounds", "mean", "worst"])
    print("\nOver fleet seeds: new units' mean RMSE (mean over seeds) / worst unit (max)")
    for key, g in table.groupby(["units", "design", "privacy", "bounds"], sort=False):
        worst = g["worst"].to_numpy(float)
        w = "NaN" if not np.isfinite(worst).all() else f"{worst.max():.4g}"
        print(f"| {' | '.join(map(str, key))} | {_fmt(list(g['mean']))} | {w} | {len(g)} |")


if __name__ == "__main__":
    main()
