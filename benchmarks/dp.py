"""Client-level DP on the default fleet: accuracy at ε = 1, 4, 8 and without DP.

DP-FedAvg (McMahan et al. 2018) through ``fedcal.core.aggregation``: each
client's update is clipped to L2 norm C (``--clip``, scaled units), the sum gets
N(0, σ²C²) noise, σ chosen by Opacus's RDP accountant so that the whole run
spends at most ε at δ = 1e-5 (all 20 sensors every round: q = 1, exact
accounting). The private parts of a personalized model (FedGMI's head state)
never leave the sensor and get no noise; only what is uploaded is protected.

Printed: σ and the ε actually spent, the fleet's mean and worst test RMSE (hPa)
over training seeds, diverged sensors; and, without DP, the median update norm
of round 1 and the last round (to choose C).

    python benchmarks/dp.py [--methods fedgmi] [--seeds 3] [--rounds 20] [--clip 0.5]
        [--epsilons 1,4,8]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import pandas as pd
import torch

from fedcal.config import default_config
from fedcal.engine.simulation import EngineConfig, prepare, simulate
from fedcal.experiment import (
    build_algorithm,
    build_policy,
    build_task,
    client_inputs,
    load_data,
    one_line,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default="fedgmi")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--clip", type=float, default=0.5)
    ap.add_argument("--epsilons", default="1,4,8")
    ap.add_argument("--delta", type=float, default=1e-5)
    args = ap.parse_args()
    torch.set_num_threads(1)

    cfg = default_config()
    cfg = replace(cfg, engine=replace(cfg.engine, rounds=args.rounds, eval_every=args.rounds))
    tensors = prepare(load_data(cfg), cfg.data.scaling, cfg.engine.dtype)
    task = build_task(cfg, tensors.train.x.shape[-1], {}, client_inputs(tensors))
    settings = [("no DP", 0.0)] + [(f"ε = {e}", float(e)) for e in args.epsilons.split(",")]
    print(
        f"recipe: lr {cfg.train.lr}, batch {cfg.train.batch_size}, grad_clip {cfg.train.grad_clip}"
        f", {args.rounds} rounds, {args.seeds} seeds, C = {args.clip}, δ = {args.delta}"
    )
    print("| method | privacy | σ | ε spent | RMSE mean (hPa) | RMSE worst (hPa) | diverged |")
    print("|---|---|---:|---:|---:|---:|---:|")
    t0 = time.perf_counter()
    for method in args.methods.split(","):
        for label, eps in settings:
            privacy = replace(cfg.privacy, epsilon=eps, clip=args.clip, delta=args.delta)
            policy, spent = build_policy(replace(cfg, privacy=privacy))
            algorithm = build_algorithm(method, cfg, task)
            means, worsts, diverged, norms, failed = [], [], 0, [], []
            for seed in range(args.seeds):
                engine = EngineConfig(
                    rounds=args.rounds, eval_every=args.rounds, seed=seed, aggregation=policy
                )
                try:
                    result = simulate(algorithm, tensors, engine)
                except Exception as err:  # reported as a failure, never as a number
                    failed.append(one_line(err, 150))
                    continue
                final = pd.DataFrame(result.final)
                means.append(final["test_rmse"].mean(skipna=False))
                worsts.append(final["test_rmse"].max(skipna=False))
                diverged += int((final["status"] == "diverged").sum())
                log = result.extra["aggregation"]
                norms.append((log[0]["median_update_norm"], log[-1]["median_update_norm"]))
            if failed:
                print(
                    f"| {method} | {label} | | | failed in {len(failed)}/{args.seeds} seeds: "
                    f"{failed[0]} | | |",
                    flush=True,
                )
                continue
            m, w = pd.Series(means), pd.Series(worsts)
            sigma = f"{spent['noise_multiplier']:.3g}" if spent else "—"
            eps_spent = f"{spent['epsilon']:.3f}" if spent else "∞"
            print(
                f"| {method} | {label} | {sigma} | {eps_spent} | {m.mean():.3g} ± "
                f"{m.std(ddof=0):.2g} | {w.mean():.3g} ± {w.std(ddof=0):.2g} | {diverged} |",
                flush=True,
            )
            if not spent:
                first = sum(n[0] for n in norms) / len(norms)
                last = sum(n[1] for n in norms) / len(norms)
                print(f"|  | median update norm, round 1 / last: {first:.3g} / {last:.3g} |")
    print(f"wall {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
