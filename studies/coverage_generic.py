"""Coverage of fedprior's nominal 95 % intervals on a heteroscedastic generic-feature fleet
(issue 20: "a heteroscedastic generic-feature fleet").

The fleet is fedcal's humidity simulator (``fedcal.data.humidity``, the shipped
``generic`` configuration): 3 inputs (capacitance, temperature, supply voltage),
noise ε ~ N(0, σ_i²·(1 + h/30)²) growing with the humidity h (σ_i per unit,
log-uniform), 5 % outliers among the calibration points, clean test references
(40 random points per unit). Regimes:

* ``few``: the shipped fleet, 40 units of 8–15 points each;
* ``mixed``: units 0–19 of that fleet (8–15 points) + units 20–39 of the same seed
  drawn with 40–60 points (the simulator's unit i does not depend on the point
  counts' range), so that some units have at least twice the smallest design's
  points and the hold-out can learn a discrepancy τ²; coverage is reported on the
  few-point units (0–19) and on the rich ones (20–39);
* ``few-clean``, ``mixed-clean``: the same without outliers (``outlier_rate`` 0): the
  heteroscedastic noise alone.

Methods ``fedprior`` and ``fedprior_sensor`` (per-unit noise) as configured in
``generic``, ``interval = "calibrated"`` (inherited). Per regime and method: coverage
mean over units, per fleet seed, RMSE (%RH) mean and worst unit, and the decline
reason where the run states no interval.

    python studies/coverage_generic.py [--fleet-seeds 0,1,2] [--regimes few,mixed]
        [--set noise_shape=inputs,noise_tail=student]

``--set``: fedprior settings applied to every method (e.g. the noise model of
``fedcal.algorithms.fedprior_noise``); the table's method column names them.
``--terciles``: also each class's coverage by tercile of the test humidity (low / mid /
high level, terciles of all test points; pooled over the class's test points and fleet
seeds), and γ and the fleet's 2Δℓ of the noise model where it has one.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
import pandas as pd
import torch

from fedcal.build import build_algorithm, build_policy, build_task, client_inputs, engine_settings
from fedcal.config import load_config
from fedcal.data.humidity import HumiditySpec, humidity_fleet
from fedcal.engine.simulation import EngineConfig, prepare, simulate


def fleet_of(regime: str, seed: int):
    out = 0.0 if regime.endswith("clean") else HumiditySpec().outlier_rate
    few = humidity_fleet(HumiditySpec(num_units=40, outlier_rate=out), seed)
    if regime.startswith("few"):
        return few, list(dict.fromkeys(few.frame[few.client_column]))
    rich = HumiditySpec(num_units=40, min_points=40, max_points=60, outlier_rate=out)
    rich = humidity_fleet(rich, seed)
    ids = list(dict.fromkeys(few.frame[few.client_column]))
    col = few.client_column
    frame = pd.concat(
        [few.frame[few.frame[col].isin(ids[:20])], rich.frame[rich.frame[col].isin(ids[20:])]]
    ).reset_index(drop=True)
    return dataclasses.replace(few, frame=frame), ids[:20]


def run_one(cfg, method: str, regime: str, seed: int, settings: dict | None = None) -> dict:
    fleet, predicted = fleet_of(regime, seed)
    tensors = prepare(fleet, cfg.data.scaling, cfg.engine.dtype)
    task = build_task(cfg, tensors.train.x.shape[-1], fleet.meta, client_inputs(tensors))
    algorithm = build_algorithm(method, cfg, task)
    if settings:  # --set: string-valued fields (e.g. noise_shape, noise_tail)
        algorithm = dataclasses.replace(algorithm, **settings)
    policy, _ = build_policy(cfg)
    result = simulate(
        algorithm, tensors, EngineConfig(**engine_settings(cfg), seed=0, aggregation=policy)
    )
    final = pd.DataFrame(result.final)
    note = algorithm.interval_note(result.server) if hasattr(algorithm, "interval_note") else ""
    out = {"note": note or "", "interval": getattr(algorithm, "interval", "?")}
    for name, part in (
        ("few", final[final["client"].isin(predicted)]),
        ("rich", final[~final["client"].isin(predicted)]),
    ):
        cov = part["test_coverage95"].to_numpy(float) if len(part) else np.array([np.nan])
        out[f"cov_{name}"] = float(cov.mean()) if np.isfinite(cov).all() else float("nan")
        out[f"rmse_{name}"] = float(part["test_rmse"].mean()) if len(part) else float("nan")
        out[f"worst_{name}"] = float(part["test_rmse"].max()) if len(part) else float("nan")
    out.update(_by_level(algorithm, result, tensors, predicted))
    return out


def _by_level(algorithm, result, tensors, predicted) -> dict:
    """Inside/total counts of the nominal 95 % interval per class and tercile of the test
    target, and the noise model's γ and 2Δℓ (``--terciles``)."""
    test, personal = tensors.test, result.personal
    err = (algorithm.predict(personal, test.x) - test.y)[..., 0].abs().double()
    half = algorithm.interval_halfwidth(personal, test.x)[..., 0].double()
    y, real = test.y[..., 0].double(), test.mask > 0
    cuts = torch.quantile(y[real], torch.tensor([1 / 3, 2 / 3], dtype=torch.float64))
    few = torch.tensor([c in predicted for c in tensors.client_ids]).unsqueeze(1)
    out = {}
    for name, sel in (("few", few), ("rich", ~few)):
        for k, (lo, hi) in enumerate(((-np.inf, cuts[0]), (cuts[0], cuts[1]), (cuts[1], np.inf))):
            rows = real & sel & (y >= lo) & (y < hi)
            out[f"in_{name}_{k}"] = float((err[rows] <= half[rows]).sum())
            out[f"n_{name}_{k}"] = float(rows.sum())
    if "noise_gamma" in result.server:
        out["gamma"] = [round(float(g), 3) for g in result.server["noise_gamma"]]
        out["lr2"] = round(2 * float(result.server["noise_ratio"]), 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fleet-seeds", default="0,1,2")
    ap.add_argument("--regimes", default="few,mixed")
    ap.add_argument("--methods", default="fedprior,fedprior_sensor")
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--set", default="", help="fedprior settings, e.g. noise_shape=inputs")
    ap.add_argument("--terciles", action="store_true", help="coverage by level tercile")
    args = ap.parse_args()
    settings = dict(kv.split("=", 1) for kv in args.set.split(",") if kv)
    settings = {k: int(v) if v.isdigit() else v for k, v in settings.items()}  # own_folds=5
    torch.set_num_threads(1)
    base = load_config("generic")
    cfg = dataclasses.replace(
        base, engine=dataclasses.replace(base.engine, rounds=args.rounds, eval_every=args.rounds)
    )
    seeds = [int(s) for s in args.fleet_seeds.split(",")]
    t0 = time.perf_counter()
    print("| regime | method | units | cov95 mean [per fleet seed] | RMSE mean | worst | note |")
    print("|---|---|---|---:|---:|---:|---|", flush=True)
    tag = "".join(f", {v}" for v in settings.values())
    for regime in args.regimes.split(","):
        for method in args.methods.split(","):
            per = [run_one(cfg, method, regime, s, settings) for s in seeds]
            for part in ("few", "rich") if regime.startswith("mixed") else ("few",):
                c = [r[f"cov_{part}"] for r in per]
                cov = "declined" if not np.isfinite(c).any() else f"{np.nanmean(c):.3f}"
                seeds_txt = ", ".join("—" if not np.isfinite(v) else f"{v:.3f}" for v in c)
                rm = np.mean([r[f"rmse_{part}"] for r in per])
                wo = np.max([r[f"worst_{part}"] for r in per])
                notes = "; ".join(sorted({r["note"] for r in per if r["note"]}))
                label = "8–15 pts" if part == "few" else "40–60 pts"
                print(
                    f"| {regime} | {method} ({per[0]['interval']}{tag}) | {label} | {cov} "
                    f"[{seeds_txt}] "
                    f"| {rm:.3f} | {wo:.3f} | {notes} |",
                    flush=True,
                )
            if args.terciles:
                _print_terciles(regime, method, per)
    print(f"\nwall {time.perf_counter() - t0:.0f} s")


def _print_terciles(regime: str, method: str, per: list[dict]) -> None:
    for part in ("few", "rich") if regime.startswith("mixed") else ("few",):
        shares = []
        for k in range(3):
            inside = sum(r[f"in_{part}_{k}"] for r in per)
            total = sum(r[f"n_{part}_{k}"] for r in per)
            shares.append(f"{inside / total:.3f}" if total else "—")
        extra = "; ".join(f"γ {r['gamma']}, 2Δℓ {r['lr2']}" for r in per if "gamma" in r)
        print(f"  terciles {regime} {method} {part}: {' / '.join(shares)}  {extra}", flush=True)


if __name__ == "__main__":
    main()
