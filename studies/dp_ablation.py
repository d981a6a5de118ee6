"""Which statistic's DP noise costs fedprior's new units: noise on one statistic at a time.

The fleet of studies/dp_scale.py (``--units`` reference units + 30 new few-point units),
fedprior_fixed with ``interval = "posterior"`` and ``dp_whiten``, bounds adapted by
private quantile estimation (γ 0.9), σ from the accountant for ``--epsilon`` over
``--rounds`` at δ = 1/N². Each line keeps the full noise on the statistic named and
scales every other statistic's noise by 1e-6 (a diagnosis, not a private run: only the
"all noisy" line is ε-DP). Prints the new units' mean and worst test RMSE (hPa) and the
reference units' mean.

    python studies/dp_ablation.py --units 500 --epsilon 1 --design 3x2 --fleet-seed 0
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import replace

import pandas as pd
import torch

import fedcal.core.privacy as privacy
from fedcal.config import load_config
from fedcal.engine.simulation import EngineConfig, prepare, simulate
from fedcal.experiment import (
    build_algorithm,
    build_policy,
    build_task,
    client_inputs,
    load_data,
)

KEYS = ("mean", "second", "gls_gram", "gls_rhs", "rss", "n", "gram", "support")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--units", type=int, default=500)
    ap.add_argument("--new", type=int, default=30)
    ap.add_argument("--epsilon", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--design", default="3x2")
    ap.add_argument("--fleet-seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)

    noisy: set[str] | None = None
    plain_std = privacy.noise_std

    def ablated(declared, multiplier, scale=1.0):  # private_sums looks noise_std up at call
        out = plain_std(declared, multiplier, scale)
        return {k: v if noisy is None or k in noisy else 1e-6 * v for k, v in out.items()}

    privacy.noise_std = ablated
    cfg = load_config("fewpoint")
    n_all = args.units + args.new
    fleet_cfg = dataclasses.replace(
        cfg.fleet,
        seed=args.fleet_seed,
        train_design=args.design,
        num_reference=args.units,
        num_new=args.new,
    )
    dp = replace(cfg.privacy, epsilon=args.epsilon, delta=1.0 / n_all**2, clip=1.0, quantile=0.9)
    dp = replace(dp, noise="seeded")  # the training seed draws the noise: reproducible figures
    c = replace(cfg, fleet=fleet_cfg, privacy=dp, engine=replace(cfg.engine, rounds=args.rounds))
    fleet = load_data(c)
    tensors = prepare(fleet, c.data.scaling, c.engine.dtype)
    task = build_task(c, tensors.train.x.shape[-1], {}, client_inputs(tensors))
    base = build_algorithm("fedprior_fixed", c, task)
    algorithm = replace(base, interval="posterior", dp_whiten=True)
    policy, spent = build_policy(c)
    print(
        f"{args.units} reference + {args.new} new units ({args.design}), fleet seed "
        f"{args.fleet_seed}, ε {spent['epsilon']:.3f} (δ {spent['delta']:.2g}), "
        f"σ {spent['noise_multiplier']:.3g}, {args.rounds} rounds"
    )
    print("| noise on | new mean | new worst | reference mean |\n|---|---:|---:|---:|")
    for only in [None, (), *((k,) for k in KEYS)]:
        noisy = None if only is None else set(only)
        engine = EngineConfig(
            rounds=args.rounds, eval_every=args.rounds, seed=0, aggregation=policy
        )
        final = pd.DataFrame(simulate(algorithm, tensors, engine).final)
        new = final["client"].astype(str).map(fleet.roles) == "new"
        rmse = final["test_rmse"]
        label = "all (ε-DP)" if only is None else (", ".join(only) or "none")
        print(
            f"| {label} | {rmse[new].mean():.4g} | {rmse[new].max():.4g} | "
            f"{rmse[~new].mean():.4g} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
