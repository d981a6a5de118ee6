"""Bayesian heads for the FCN (issue 10, item 3): FedGMI's posterior head vs the seed's rule.

    python studies/bayesian_heads.py [--fleet-seeds 0,1,2] [--out runs/bayesian_heads]

For each fleet seed, the default configuration (seed protocol, FCN 2-64-64-1,
3 training seeds, evaluated every 10 rounds) runs fedgmi (alg. 3.3),
fedgmi_posterior (head posterior, body trained with it: FedRep-style),
fedgmi_posterior_frozen (head posterior, body never trained), local, fedper and
the per-sensor polynomial with all calibration points and with 12 and 24.
Runs resume from ``--out``.

Then, to locate the FCN's error (body features or head), each trained
method's final bodies are frozen and every sensor gets the least-squares head
on its body's features (all points; a 1e-10 ridge, closed form): if that head
is much better than the method's own, the body's features were fine and the
head's optimization is what failed. The same is done for the untrained
initial body of each training seed.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fedcal_support/ (not shipped)

from fedcal.algorithms.fedgmi import head_design
from fedcal.config import default_config
from fedcal.core.bayes import F64, moments, posterior
from fedcal.core.tree import stack
from fedcal.engine.simulation import prepare
from fedcal.experiment import build_task, client_inputs, load_data, run_experiment
from fedcal_support.scripts import seed_list

METHODS = [
    "polynomial",
    "local",
    "fedper",
    "fedgmi",
    "fedgmi_posterior",
    "fedgmi_posterior_frozen",
]
NEURAL = ["local", "fedper", "fedgmi", "fedgmi_posterior"]
POINTS = [0, 12, 24]


def own_ls_rmse(task, params, tensors) -> float:
    """Fleet-mean test RMSE (hPa) of each sensor's least-squares head on its frozen body."""
    train, test = tensors.train, tensors.test
    stats = moments(head_design(task, params, train.x), train.y[..., 0], train.mask)
    c, p = stats.rhs.shape
    # Σ = I, σ² = 1e-10: a ridge of 1e-10 on the head, i.e. least squares.
    post = posterior(
        stats, torch.zeros(p, dtype=F64), torch.eye(p, dtype=F64), torch.full((c,), 1e-10)
    )
    pred = (head_design(task, params, test.x).to(F64) @ post.mean.unsqueeze(-1)).to(test.x.dtype)
    scale = torch.as_tensor(tensors.scaler.y_scale, dtype=pred.dtype)
    return float(task.metrics(pred, test.y, test.mask, scale)["rmse"].mean())


def fmt(values: list[float]) -> str:
    if not values or any(not math.isfinite(v) for v in values):
        return "diverged"
    return f"{np.mean(values):.3g} ± {np.std(values):.2g}"


def main() -> None:
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser()
    ap.add_argument("--fleet-seeds", type=seed_list, default=[0])
    ap.add_argument("--out", default="runs/bayesian_heads")
    args = ap.parse_args()
    base = default_config()
    for fleet_seed in args.fleet_seeds:
        cfg = replace(
            base,
            fleet=replace(base.fleet, seed=fleet_seed),
            engine=replace(base.engine, eval_every=10),
        )
        out = Path(args.out) / f"fleet{fleet_seed}"
        fleet = load_data(cfg)
        summary = run_experiment(cfg, fleet, out, METHODS, POINTS)
        print(f"\n## fleet seed {fleet_seed}: test RMSE mean (hPa), mean ± std over 3 seeds")
        print("| method | " + " | ".join(f"{tp or 'all'} points" for tp in POINTS) + " |")
        print("|---" * (len(POINTS) + 1) + "|")
        for method in METHODS:
            cells = []
            for tp in POINTS:
                rows = summary[(summary.method == method) & (summary.train_points == tp)]
                cells.append(fmt(rows.rmse_mean.tolist()))
            print(f"| {method} | " + " | ".join(cells) + " |")
        cover = summary[(summary.method == "fedgmi_posterior_frozen")]
        if "coverage95_mean" in cover:
            print(
                "fedgmi_posterior_frozen 95 % interval coverage by points: "
                + ", ".join(
                    f"{tp or 'all'}: {cover[cover.train_points == tp].coverage95_mean.mean():.3f}"
                    for tp in POINTS
                )
            )

        # Where the error comes from: least-squares heads on frozen bodies (all points).
        tensors = prepare(fleet, cfg.data.scaling, cfg.engine.dtype)
        task = build_task(cfg, tensors.train.x.shape[-1], fleet.meta, client_inputs(tensors))
        print(f"\n## fleet seed {fleet_seed}: own least-squares head on each frozen body (hPa)")
        print("| body | method's own head | least-squares head |")
        print("|---|---:|---:|")
        for method in NEURAL:
            own, ls = [], []
            for seed in range(cfg.seeds):
                run = out / "runs" / f"{method}_tp0_seed{seed}"
                saved = torch.load(run / "model.pt", weights_only=False)
                params = stack([saved["params"][c] for c in tensors.client_ids])
                params = {k: v for k, v in params.items() if k in set(task.head + task.body)}
                ls.append(own_ls_rmse(task, params, tensors))
                rows = summary[
                    (summary.method == method)
                    & (summary.train_points == 0)
                    & (summary.seed == seed)
                ]
                own.append(float(rows.rmse_mean.iloc[0]))
            print(f"| {method} (trained) | {fmt(own)} | {fmt(ls)} |")
        init = []
        for seed in range(cfg.seeds):
            params = task.model.init(torch.Generator().manual_seed(seed), torch.float32)
            params = {k: v.expand(tensors.num_clients, *v.shape) for k, v in params.items()}
            init.append(own_ls_rmse(task, params, tensors))
        print(f"| initial (untrained) body | — | {fmt(init)} |")


if __name__ == "__main__":
    main()
