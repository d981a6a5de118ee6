"""Does the default recipe hold on generic real-world-like sensor data? Every method, defaults.

A generic low-cost sensor fleet of our own (no physical ranges known, so inputs
and target are scaled by federated statistics): ``--sensors`` optical PM2.5
sensors co-located with a reference, ``--train`` points each (few), test points
drawn off the training days. Per sensor: gain 0.6–1.6, offset, a humidity
growth factor 1 + k·RH²/(100−RH) (hygroscopic growth, k per sensor), a
temperature drift; heteroscedastic noise (std ∝ concentration, 8–25 %);
outliers in 4 % of the training rows (×3–×10 spikes of the raw reading, or a
reference logged as 0); reference PM2.5 log-normal (median 15 µg/m³, tail to
~300). Columns: ``raw_ugm3, temp_c, rh_pct`` → ``pm25_ugm3``.

Every registered regression method runs with the shipped default configuration
(optionally overridden on the command line), and the script prints per method
RMSE mean/worst, diverged sensors, rejected replies and failures — a
divergence or a failure is printed as such, never as a number.

    python studies/recipes.py [--seeds 0,1,2] [--rounds 50] [--grad-clip 1.0] [--lr 0.1]
        [--methods all] [--aggregation mean] [--clip-factor 3] [--fleet-seed 0]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fedcal_support/ (not shipped)

from fedcal.config import default_config
from fedcal.data.fleet import Fleet
from fedcal.experiment import run_experiment
from fedcal_support.scripts import seed_list

FEATURES = ("raw_ugm3", "temp_c", "rh_pct")
TARGET = "pm25_ugm3"


def generic_fleet(
    sensors: int = 30, train: int = 24, test: int = 40, seed: int = 0, outliers: float = 0.04
) -> Fleet:
    """A heteroscedastic, outlier-ridden low-cost PM2.5 fleet (see the module docstring)."""
    rng = np.random.default_rng(seed)
    rows = []
    for s in range(sensors):
        gain, offset = rng.uniform(0.6, 1.6), rng.normal(2.0, 2.0)
        k_rh, drift = rng.uniform(0.05, 0.4), rng.normal(0.0, 0.08)
        noise = rng.uniform(0.08, 0.25)
        for split, n in (("train", train), ("test", test)):
            ref = np.exp(rng.normal(np.log(15.0), 0.9, n)).clip(1.0, 400.0)
            rh = rng.uniform(20.0, 95.0, n)
            temp = rng.normal(15.0, 9.0, n)
            growth = 1.0 + k_rh * rh**2 / (100.0 - rh) / 100.0
            raw = gain * ref * growth + offset + drift * (temp - 15.0)
            raw = raw * (1.0 + noise * rng.standard_normal(n))  # heteroscedastic
            y = ref.copy()
            if split == "train":
                bad = rng.random(n) < outliers
                spike = rng.random(n) < 0.5
                raw = np.where(bad & spike, raw * rng.uniform(3.0, 10.0, n), raw)
                y = np.where(bad & ~spike, 0.0, y)
            for i in range(n):
                rows.append((f"P{s:03d}", raw[i], temp[i], rh[i], y[i], split))
    frame = pd.DataFrame(rows, columns=["sensor_id", *FEATURES, TARGET, "split"])
    return Fleet(
        frame,
        features=FEATURES,
        target=TARGET,
        meta={"source": f"studies/recipes.py generic_fleet(seed={seed})"},
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--seeds", type=seed_list, default=[0, 1, 2], help="training seeds 0..n-1 (the run's)"
    )
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--sensors", type=int, default=30)
    ap.add_argument("--train", type=int, default=24)
    ap.add_argument("--fleet-seed", type=int, default=0)
    ap.add_argument("--methods", default="all")
    ap.add_argument("--grad-clip", type=float, default=None, help="[train] grad_clip override")
    ap.add_argument("--lr", type=float, default=None, help="[train] lr override")
    ap.add_argument("--aggregation", default=None)
    ap.add_argument("--clip-factor", type=float, default=None)
    ap.add_argument("--screen-factor", type=float, default=None)
    ap.add_argument("--eval-every", type=int, default=10)
    args = ap.parse_args()
    if args.seeds != list(range(len(args.seeds))):
        ap.error(f"--seeds {args.seeds}: an experiment runs training seeds 0..n-1, e.g. 0,1,2")
    torch.set_num_threads(1)

    cfg = default_config()
    train = cfg.train
    if args.grad_clip is not None:
        train = replace(train, grad_clip=args.grad_clip)
    if args.lr is not None:
        train = replace(train, lr=args.lr)
    agg = cfg.aggregation
    if args.aggregation:
        agg = replace(agg, rule=args.aggregation)
    if args.clip_factor is not None:
        agg = replace(agg, clip_factor=args.clip_factor)
    if args.screen_factor is not None:
        agg = replace(agg, screen_factor=args.screen_factor)
    cfg = replace(
        cfg,
        seeds=len(args.seeds),
        train=train,
        aggregation=agg,
        data=replace(cfg.data, features=FEATURES, target=TARGET),
        engine=replace(cfg.engine, rounds=args.rounds, eval_every=args.eval_every),
    )
    fleet = generic_fleet(args.sensors, args.train, seed=args.fleet_seed)
    print(
        f"recipe: lr {cfg.train.lr}, batch {cfg.train.batch_size}, grad_clip "
        f"{cfg.train.grad_clip}, aggregation {cfg.aggregation.rule} (clip ×"
        f"{cfg.aggregation.clip_factor}, screen ×{cfg.aggregation.screen_factor}), "
        f"{args.rounds} rounds, training seeds {args.seeds}, "
        f"{args.sensors} sensors × {args.train} points"
    )
    failures: list[str] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        summary = run_experiment(
            cfg,
            fleet,
            Path(tmp),
            args.methods.split(","),
            on_skip=lambda m, why: print(f"skipped {m}: {why}"),
            on_fail=lambda label, why: failures.append(f"{label}: {why}"),
        )
    print(f"wall {time.perf_counter() - t0:.0f} s")
    print("| method | RMSE mean (µg/m³) | RMSE worst | diverged (runs) | rejected | state |")
    print("|---|---:|---:|---:|---:|---|")
    bad_methods = 0
    for method, part in summary.groupby("method", sort=False):
        failed = int(part.get("failed", pd.Series(0)).fillna(0).sum())
        ok = part[part.get("failed", 0).fillna(0) == 0] if "failed" in part else part
        div = int(ok["diverged"].sum()) if len(ok) else 0
        runs_div = int((ok["diverged"] > 0).sum()) if len(ok) else 0
        finite = len(ok) and np.isfinite(ok["rmse_mean"]).all()
        state = "failed" if failed else ("finite" if finite and not div else "DIVERGED")
        bad_methods += state != "finite"
        rmse = ok["rmse_mean"]
        mean = f"{rmse.mean():.3g} ± {rmse.std(ddof=0):.2g}" if finite else "—"
        worst = f"{ok['rmse_worst'].mean():.3g}" if finite else "—"
        rej = int(ok["rejected"].sum()) if len(ok) else 0
        print(f"| {method} | {mean} | {worst} | {div} ({runs_div}) | {rej} | {state} |")
    for line in failures:
        print("failed", line)
    print(f"methods not finite: {bad_methods} of {summary['method'].nunique()}")


if __name__ == "__main__":
    main()
