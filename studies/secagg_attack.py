"""A hostile Flower site under secure aggregation (issue 36.2): how far does it move the
honest units, with today's SecAgg+ (one sum, ``robust = "off"``) and with grouped SecAgg+
(``secagg-groups``: one secure sum per fixed group of sites, each checked and judged by the
robust M-step, :mod:`fedcal.engine.flower.secagg_groups`)?

The ServerApp's round loop and the sites' real handlers in one process
(``fedcal_support.flower_hostile``), one sensor per site, fedprior on the simulated fleet
(``--sensors`` sites, ``[fleet]`` defaults), ``--method`` with ``interval = "posterior"``
(SecAgg+ refuses the calibrated interval). Cases:

* ``xF``: site ``--attacker`` scales every statistic of its upload but its row count and
  Gram by F (``fedcal_support.prior_attack.scale_arrays``) *before* it masks its vector;
* ``flip``: its unit's training targets are p → 1600 − p (an honest upload of wrong data).

Modes: ``plain`` (no SecAgg+, ``robust = "full"``: the per-unit defence, for reference),
``secure`` (SecAgg+, ``robust = "off"``: today), ``grouped`` (SecAgg+ with ``--groups``,
``robust = "full"``). Reported per mode and case: the honest units' test RMSE as a ratio to
the clean run of the same mode (mean over fleet seeds of the mean; largest over seeds of the
worst unit's ratio), and the sites the server left out in the last round; the clean rows
give the absolute mean, and the grouped clean run's largest difference from the secure one.

    python studies/secagg_attack.py --sensors 20 --groups 5 [--fleet-seeds 0,1,2]
    python studies/secagg_attack.py --sensors 5 --groups 2
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedcal.apps.flower_server import federation
from fedcal.config import default_config
from fedcal.data.simulator import FleetSpec, simulate_fleet
from fedcal.engine.flower.secagg import SecureAggregation
from fedcal_support.flower_hostile import node_cfgs, run_in_process
from fedcal_support.prior_attack import flipped, scaling_site


def run(config, method, fleet, tamper, secure, root: Path) -> tuple[pd.DataFrame, list, str]:
    """One in-process Flower run: (final rows, sites left out per round, failure or "")."""
    fed = federation(config, method, seed=0, secure=secure)
    try:
        run_in_process(fed, node_cfgs(fleet, root), run_id=7, tamper=tamper)
    except RuntimeError as err:
        return pd.DataFrame(), [], str(err).split(";")[0]
    left = [sorted({r["client"] for r in e.get("screening", [])}) for e in fed.log if "asked" in e]
    return pd.DataFrame(fed.final_rows()), left, ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sensors", type=int, default=20)
    ap.add_argument("--groups", type=int, default=5)
    ap.add_argument("--attacker", type=int, default=3)
    ap.add_argument("--method", default="fedprior_fixed")
    ap.add_argument("--orders", default="", help="e.g. 1,1 (default: the method's basis)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fleet-seeds", default="0")
    ap.add_argument("--cases", default="clean,x1.5,x10,flip")
    ap.add_argument("--modes", default="plain,secure,grouped")
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = default_config()
    params = {"interval": "posterior"}
    if args.orders:
        params["orders"] = [int(o) for o in args.orders.split(",")]
    method_params = {**base.method_params}
    method_params[args.method] = {**method_params.get(args.method, {}), **params}
    base = replace(base, method_params=method_params)
    modes = {
        "plain": ("full", None),
        "secure": ("off", SecureAggregation()),
        "grouped": ("full", SecureAggregation(groups=args.groups)),
    }
    modes = {m: modes[m] for m in args.modes.split(",")}
    cases = ["clean", *[c for c in args.cases.split(",") if c != "clean"]]
    seeds = [int(s) for s in args.fleet_seeds.split(",")]
    t0 = time.perf_counter()
    rows = []
    for seed in seeds:
        fleet = simulate_fleet(FleetSpec(num_sensors=args.sensors), seed=seed)
        clean_secure = None
        for mode, (robust, secure) in modes.items():
            mp = {**base.method_params}
            mp[args.method] = {**mp[args.method], "robust": robust}
            config = replace(
                base, method_params=mp, engine=replace(base.engine, rounds=args.rounds)
            )
            clean = None
            for case in cases:
                data, tamper = fleet, None
                if case == "flip":
                    data = flipped(fleet, fleet.client_ids[args.attacker])
                elif case != "clean":
                    tamper = scaling_site(args.attacker, float(case[1:]))
                with tempfile.TemporaryDirectory() as tmp:
                    final, left, failed = run(config, args.method, data, tamper, secure, Path(tmp))
                row = {"seed": seed, "mode": mode, "case": case, "failed": failed}
                row["left_last"] = left[-1] if left else []
                if failed:
                    rows.append(row)
                    print(row, flush=True)
                    continue
                err = final.set_index("client_index")["test_rmse"]
                if case == "clean":
                    clean = err
                    row["clean_mean_hpa"] = float(err.drop(args.attacker).mean())
                    if mode == "secure":
                        clean_secure = err
                    elif mode == "grouped" and clean_secure is not None:
                        row["vs_secure"] = float((err - clean_secure).abs().max())
                honest = err.drop(args.attacker)
                ref = clean.drop(args.attacker)
                row["mean"] = float(honest.mean() / ref.mean())
                row["worst"] = float((honest / ref).max())
                rows.append(row)
                print(row, flush=True)
    table = pd.DataFrame(rows)
    print(
        f"\n{args.sensors} sites, {args.method}, {args.rounds} rounds, fleet seeds {seeds}, "
        f"groups {args.groups}, attacker {args.attacker}; wall {time.perf_counter() - t0:.0f} s"
    )
    print("| mode | case | honest mean / clean | honest worst / clean | left out (last round) |")
    print("|---|---|---:|---:|---|")
    for (mode, case), part in table.groupby(["mode", "case"], sort=False):
        bad = part[part["failed"] != ""]
        if len(bad):
            print(f"| {mode} | {case} | stopped: {bad['failed'].iloc[0]} | | |")
            continue
        left = "; ".join(str(x) for x in part["left_last"])
        print(
            f"| {mode} | {case} | {part['mean'].mean():.4f} | {part['worst'].max():.4f} | {left} |"
        )


if __name__ == "__main__":
    main()
