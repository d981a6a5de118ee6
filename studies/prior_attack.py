"""Hostile sites against the fleet prior (issue 21): how far do they move the honest units?

fedprior on two fleets — the quickstart mixed fleet (``--config quickstart``: 20 reference
units with the full campaign + 20 new units with 3×2 points) and the default fleet (20
quartz units, full campaign) — over fleet seeds, with

* ``xF``: the first reference unit's site scales every statistic of its upload (posterior
  mean, second moments, GLS terms, RSS, every candidate's, the interval's sums) by F, but
  not its row count and Gram (a count check alone would catch those;
  fedcal_support/prior_attack.py);
* ``5xF``: the first five reference units do so, all by F;
* ``flip``: the first reference unit's training targets are p → 1600 − p (honest uploads
  of wrong data; its test rows untouched).

Each case runs with ``robust = "off"`` (the plain sums: the M-step before issue 21) and
``"full"`` (core/robust.py: consistency check + leave-one-out outlier weights). Reported:
the honest units' (every unit but the attackers) mean and worst test RMSE as a ratio to the
clean run of the same mode and seed, for new and reference units separately, and who the
server rejected or down-weighted in the last round. Clean rows give the absolute figures and
the new units' 95 % coverage, and the cost of ``full`` against ``off``.

    python studies/prior_attack.py [--configs quickstart,default] [--fleet-seeds 0,1,2]
        [--cases clean,x1.5,x3,x10,x1000,5x1.5,5x3,5x10,5x1000,flip] [--modes off,full]
        [--off-cases x1.5,flip]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedcal.build import (
    build_algorithm,
    build_policy,
    build_task,
    client_inputs,
    engine_settings,
    load_data,
)
from fedcal.config import load_config
from fedcal.engine.simulation import EngineConfig, prepare, simulate
from fedcal_support.prior_attack import attacking, flipped


def configure(name: str, fleet_seed: int):
    cfg = load_config(name)
    return dataclasses.replace(
        cfg,
        fleet=dataclasses.replace(cfg.fleet, seed=fleet_seed),
        designs=(),
        fleet_seeds=(),
    )


def run_case(cfg, case: str, mode: str) -> dict:
    fleet = load_data(cfg)
    roles = fleet.roles or {}
    refs = [i for i, c in enumerate(fleet.client_ids) if roles.get(str(c), "reference") != "new"]
    attackers: tuple[int, ...] = ()
    factor = 1.0
    if case == "flip":
        attackers = (refs[0],)
        fleet = flipped(fleet, fleet.client_ids[refs[0]])
    elif case != "clean":
        many, _, f = case.partition("x")
        attackers, factor = tuple(refs[: int(many or 1)]), float(f)
    tensors = prepare(fleet, cfg.data.scaling, cfg.engine.dtype)
    task = build_task(cfg, tensors.train.x.shape[-1], fleet.meta, client_inputs(tensors))
    base = build_algorithm("fedprior", cfg, task)
    algorithm = attacking(base, attackers, factor, robust=mode)
    policy, _ = build_policy(cfg)
    settings = {**engine_settings(cfg), "chunk_size": 0}
    result = simulate(algorithm, tensors, EngineConfig(**settings, seed=0, aggregation=policy))
    final = pd.DataFrame(result.final)
    final["role"] = final["client"].astype(str).map(lambda c: roles.get(c, "reference"))
    honest = final[~final["client_index"].isin(attackers)]
    last = result.rounds_done
    judged = sorted(
        {int(r["client_index"]) for r in result.extra["rejections"] if r["round"] == last}
    )
    out = {"attackers": list(attackers), "judged": judged, "failed": 0}
    for role in ("new", "reference"):
        part = honest[honest["role"] == role]
        if part.empty:
            continue
        rmse = part["test_rmse"].to_numpy(float)  # NaN propagates: a diverged unit shows
        out[f"{role}_mean"] = float(rmse.mean())
        out[f"{role}_worst"] = float(rmse.max())
        if role == "new" and "test_coverage95" in part:
            out["new_cov"] = float(part["test_coverage95"].mean())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="quickstart,default")
    ap.add_argument("--fleet-seeds", default="0,1,2")
    ap.add_argument("--cases", default="clean,x1.5,x3,x10,x1000,5x1.5,5x3,5x10,5x1000,flip")
    ap.add_argument("--modes", default="off,full")
    ap.add_argument(
        "--off-cases", default=None, help="cases run with robust = off (default: --cases)"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    seeds = [int(s) for s in args.fleet_seeds.split(",")]
    cases = args.cases.split(",")
    if "clean" not in cases:
        cases = ["clean", *cases]
    off_cases = set(args.off_cases.split(",")) | {"clean"} if args.off_cases else set(cases)
    t0 = time.perf_counter()
    records = []
    for name in args.configs.split(","):
        for seed in seeds:
            cfg = configure(name, seed)
            for mode in args.modes.split(","):
                for case in cases:
                    if mode == "off" and case not in off_cases:
                        continue
                    rec = {"config": name, "seed": seed, "mode": mode, "case": case}
                    try:
                        rec.update(run_case(cfg, case, mode))
                    except Exception as err:  # a failure is reported as such, never a number
                        rec.update(failed=1, error=f"{type(err).__name__}: {err}"[:160])
                    records.append(rec)
                    print(
                        f"  {name} seed {seed} {mode} {case}: "
                        + ", ".join(
                            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                            for k, v in rec.items()
                            if k not in ("config", "seed", "mode", "case")
                        ),
                        flush=True,
                    )
    frame = pd.DataFrame(records)
    report(frame, cases)
    print(f"\nwall {time.perf_counter() - t0:.0f} s")


def report(frame: pd.DataFrame, cases: list[str]) -> None:
    """Markdown tables: per config and mode, each case's honest ratios to clean."""
    key = ["config", "seed", "mode"]
    clean = frame[frame["case"] == "clean"].set_index(key)
    for (name, mode), part in frame.groupby(["config", "mode"], sort=False):
        roles = [r for r in ("new", "reference") if f"{r}_mean" in part]
        print(
            f"\n{name}, robust = {mode}: honest units' RMSE / clean (mean over fleet seeds; "
            "worst: max over seeds of the worst unit's ratio)"
        )
        head = " | ".join(f"{r} mean | {r} worst" for r in roles)
        print(f"| case | {head} | rejected or down-weighted (last round, per seed) |")
        print("|---|" + "---:|" * (2 * len(roles)) + "---|")
        for case in cases:
            rows = part[part["case"] == case]
            if rows.empty:
                continue
            if rows["failed"].sum():
                print(f"| {case} | failed: {rows['error'].dropna().iloc[0]} |")
                continue
            cells = []
            for r in roles:
                base = clean.loc[[(name, s, mode) for s in rows["seed"]]]
                mean = rows[f"{r}_mean"].to_numpy() / base[f"{r}_mean"].to_numpy()
                worst = rows[f"{r}_worst"].to_numpy() / base[f"{r}_worst"].to_numpy()
                cells += [f"{np.mean(mean):.3f}", f"{np.max(worst):.3f}"]
            who = "; ".join(
                f"{j} (attackers {a})"
                for j, a in zip(rows["judged"], rows["attackers"], strict=True)
            )
            print(f"| {case} | " + " | ".join(cells) + f" | {who} |")
    print("\nclean runs: honest RMSE (hPa), mean over fleet seeds [worst unit over seeds]")
    for (name, mode), part in frame[frame["case"] == "clean"].groupby(["config", "mode"]):
        cells = [
            f"{r} {part[f'{r}_mean'].mean():.4g} [{part[f'{r}_worst'].max():.4g}]"
            for r in ("new", "reference")
            if f"{r}_mean" in part
        ]
        if "new_cov" in part:
            cells.append(f"new coverage {part['new_cov'].mean():.3f}")
        print(f"  {name} {mode}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
