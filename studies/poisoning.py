"""One poisoned sensor of 20: how far does it move the other sensors, under each server rule?

The default fleet (fleet seed 0, 20 quartz sensors, 384 calibration points);
sensor 0's *training* targets are poisoned — ×2, ×20, ×1000, random labels
(uniform over 0–1600 hPa), or flipped (1600 − p) — and every method trains with
the shipped default recipe. Reported: the other 19 sensors' mean test RMSE
(hPa), as a ratio to the same method and rule on the clean fleet (1.00 = no
harm), mean over training seeds; and, on the clean fleet, what each rule costs
against the plain mean (the fleet is honestly heterogeneous: sensors differ by
hundreds of hPa-equivalents, which a robust rule may mistake for an attack).

Rules: ``plain`` (the algorithm's own mean; only non-finite replies rejected —
the behaviour before screening existed), ``default`` (the shipped
[aggregation]: norm screening at 10× and adaptive clipping at 3× the cohort
median update norm), ``median``, ``trimmed_mean`` (10 % each end) and ``krum``
(Multi-Krum, f = 1), the last three on top of the default screening/clipping.

    python studies/poisoning.py [--methods fedgmi,fedper] [--seeds 0,1,2] [--rounds 30]
        [--rules plain,default,median,trimmed_mean,krum]
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

from fedcal.config import default_config
from fedcal.core.aggregation import PLAIN
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

POISONS = {
    "clean": None,
    "x2": lambda p, rng: 2.0 * p,
    "x20": lambda p, rng: 20.0 * p,
    "x1000": lambda p, rng: 1000.0 * p,
    "random": lambda p, rng: rng.uniform(0.0, 1600.0, p.shape),
    "1600-p": lambda p, rng: 1600.0 - p,
}
VICTIM = 0


def poison(fleet, name: str):
    """The fleet with sensor VICTIM's training targets replaced (test rows untouched)."""
    if POISONS[name] is None:
        return fleet
    frame = fleet.frame.copy()
    victim = fleet.client_ids[VICTIM]
    rows = (frame[fleet.client_column] == victim) & (frame["split"] == "train")
    rng = np.random.default_rng(123)
    frame.loc[rows, fleet.target] = POISONS[name](frame.loc[rows, fleet.target].to_numpy(), rng)
    return replace(fleet, frame=frame)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default="fedgmi,fedper")
    ap.add_argument("--seeds", type=seed_list, default=[0, 1, 2], help="training seeds")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--rules", default="plain,default,median,trimmed_mean,krum")
    ap.add_argument(
        "--poisoned-rules", default=None, help="rules run on poisoned fleets (default: --rules)"
    )
    ap.add_argument("--poisons", default=",".join(POISONS))
    args = ap.parse_args()
    torch.set_num_threads(1)

    cfg = default_config()
    cfg = replace(cfg, engine=replace(cfg.engine, rounds=args.rounds, eval_every=args.rounds))
    base_fleet = load_data(cfg)
    policies = {}
    for rule in args.rules.split(","):
        if rule == "plain":
            policies[rule] = PLAIN
        elif rule == "default":
            policies[rule] = build_policy(cfg)[0]
        else:
            policies[rule] = build_policy(
                replace(cfg, aggregation=replace(cfg.aggregation, rule=rule))
            )[0]
    poisoned_rules = (args.poisoned_rules or args.rules).split(",")
    print(
        f"recipe: lr {cfg.train.lr}, batch {cfg.train.batch_size}, grad_clip "
        f"{cfg.train.grad_clip}, {args.rounds} rounds, training seeds {args.seeds}; "
        f"sensor {VICTIM} poisoned"
    )
    records = []
    failures: set[str] = set()
    t0 = time.perf_counter()
    for pname in args.poisons.split(","):
        tensors = prepare(poison(base_fleet, pname), cfg.data.scaling, cfg.engine.dtype)
        task = build_task(cfg, tensors.train.x.shape[-1], {}, client_inputs(tensors))
        for method in args.methods.split(","):
            algorithm = build_algorithm(method, cfg, task)
            for rule, policy in policies.items():
                if pname != "clean" and rule not in poisoned_rules:
                    continue
                for seed in args.seeds:
                    engine = EngineConfig(
                        rounds=args.rounds, eval_every=args.rounds, seed=seed, aggregation=policy
                    )
                    record = {"poison": pname, "method": method, "rule": rule, "seed": seed}
                    try:
                        result = simulate(algorithm, tensors, engine)
                    except Exception as err:  # reported as a failure, never as a number
                        failures.add(f"{method} {rule} {pname}: {one_line(err, 120)}")
                        records.append({**record, "others_rmse": np.nan, "failed": 1})
                        continue
                    final = pd.DataFrame(result.final)
                    others = final[final["client_index"] != VICTIM]
                    records.append(
                        {
                            **record,
                            # NaN-propagating: a diverged sensor shows as NaN, not dropped.
                            "others_rmse": float(others["test_rmse"].mean(skipna=False)),
                            "diverged": int((final["status"] == "diverged").sum()),
                            "rejected": int(final["rejected_rounds"].sum()),
                            "failed": 0,
                        }
                    )
        print(f"  {pname} done at {time.perf_counter() - t0:.0f} s", flush=True)
    frame = pd.DataFrame(records)
    clean = frame[frame["poison"] == "clean"].set_index(["method", "rule", "seed"])["others_rmse"]
    frame["ratio"] = [
        r.others_rmse / clean.get((r.method, r.rule, r.seed), np.nan)
        for r in frame.itertuples(index=False)
    ]
    for method in args.methods.split(","):
        part = frame[frame["method"] == method]
        print(f"\n{method}: other sensors' RMSE / clean RMSE (same rule), mean over seeds")
        rules = list(policies)
        print("| poison | " + " | ".join(rules) + " |")
        print("|---|" + "---:|" * len(rules))
        for pname in args.poisons.split(","):
            cells = []
            for rule in rules:
                cell = part[(part["poison"] == pname) & (part["rule"] == rule)]
                if cell.empty:
                    cells.append("")
                    continue
                ratio = cell["ratio"].mean(skipna=False)
                div = int(cell["diverged"].fillna(0).sum())
                if cell["failed"].sum():
                    cells.append(f"failed ({int(cell['failed'].sum())}/{len(cell)})")
                    continue
                text = "diverged" if not np.isfinite(ratio) else f"{ratio:.2f}"
                text += f" ({int(cell['rejected'].sum())} rej)"
                cells.append(text + (f" [{div} div]" if div else ""))
            print(f"| {pname} | " + " | ".join(cells) + " |")
        base = part[(part["poison"] == "clean") & (part["rule"] == "plain")]["others_rmse"]
        cost = []
        for rule in rules:
            c = part[(part["poison"] == "clean") & (part["rule"] == rule)]["others_rmse"]
            cost.append(f"{c.mean():.3g} hPa ({c.mean() / base.mean():.2f}×)")
        print("| clean RMSE (vs plain) | " + " | ".join(cost) + " |")
    for line in sorted(failures):
        print("failed:", line)
    print(f"\nwall {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
