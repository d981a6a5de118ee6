"""How good can a fleet prior be on the few-point fleets? The oracle-prior ceiling.

Draws a mixed fleet with ``--oracle-units`` fully calibrated reference units
(campaign) plus 20 new units with a small design, learns (μ, Σ, σ²) by
fedprior's EM on the reference units only (the "oracle prior": as if hundreds
of units of the design had been calibrated), then calibrates each new unit by
its posterior under that prior. Compared with fedprior learned from the first
20 reference units + the 20 new units (the benchmark's federation). RMSE (hPa)
and coverage of the nominal 95 % interval on the new units' 60 random
off-grid test points; closed form, no engine (fedprior's own client/server steps).

If the oracle is no better than fedprior, the gap to a target is the model
class and the design (what a unit's few points can show), not the estimate of
Σ from 20 units.

    python studies/fewpoint_oracle.py [--designs 3x2,4x3] [--fleet-seeds 0,1,2]
                                         [--oracle-units 500] [--orders 4,3]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fedcal_support/ (not shipped)

from fedcal.algorithms.fedprior import FedPrior
from fedcal.config import load_config
from fedcal.core.data import ClientData
from fedcal.core.task import Task
from fedcal.core.tree import expand
from fedcal.engine.evaluation import interval_metrics
from fedcal.engine.simulation import prepare
from fedcal.experiment import load_data
from fedcal.models.mlp import MLP
from fedcal_support.rounds import run_rounds
from fedcal_support.scripts import seed_list


def subset(data: ClientData, idx: torch.Tensor) -> ClientData:
    return data.select(idx)


def fit(alg: FedPrior, data: ClientData, rounds: int):
    server, state, _, _ = run_rounds(alg, data, rounds)
    return server, state


def evaluate(alg: FedPrior, server, train: ClientData, test: ClientData, y_scale) -> tuple:
    n = train.num_clients
    down = expand(alg.broadcast(server), n)
    personal = alg.personalize(down, alg.client_init(down), train)
    pred = alg.predict(personal, test.x.double())
    std = alg.predictive_std(personal, test.x.double())
    scale = torch.as_tensor(y_scale, dtype=torch.float64)
    m = test.mask.double()
    err = ((pred - test.y.double())[..., 0] * scale) ** 2
    rmse = ((err * m).sum(1) / m.sum(1)).sqrt()
    cov = interval_metrics(pred, std, test.y.double(), test.mask, scale)["coverage95"]
    return float(rmse.mean()), float(rmse.max()), float(cov.mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--designs", default="3x2,4x3")
    ap.add_argument("--fleet-seeds", type=seed_list, default=[0, 1, 2])
    ap.add_argument("--oracle-units", type=int, default=500)
    ap.add_argument("--orders", default="4,3")
    ap.add_argument("--rounds", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config("fewpoint")
    orders = tuple(int(o) for o in args.orders.split(","))
    alg = FedPrior(Task(MLP()), orders=orders)
    print(f"orders {orders}; oracle prior from {args.oracle_units} campaign units; RMSE hPa")
    print("| design | fleet seed | fedprior (20+20): mean / worst / cov95 | oracle: the same |")
    print("|---|---:|---|---|")
    for design in args.designs.split(","):
        for fs in args.fleet_seeds:
            f = dataclasses.replace(
                cfg.fleet, seed=fs, train_design=design, num_reference=args.oracle_units
            )
            fleet = load_data(dataclasses.replace(cfg, fleet=f))
            t = prepare(fleet, cfg.data.scaling, "float64")
            k, nn = args.oracle_units, cfg.fleet.num_new
            ref = torch.arange(k)
            new = torch.arange(k, k + nn)
            fed = torch.cat([torch.arange(20), new])
            train, test = t.train, t.test
            new_train, new_test = subset(train, new), subset(test, new)
            s_fed, _ = fit(alg, subset(train, fed), args.rounds)
            r_fed = evaluate(alg, s_fed, new_train, new_test, t.scaler.y_scale)
            s_or, _ = fit(alg, subset(train, ref), args.rounds)
            r_or = evaluate(alg, s_or, new_train, new_test, t.scaler.y_scale)
            print(
                f"| {design} | {fs} | {r_fed[0]:.4f} / {r_fed[1]:.4f} / {r_fed[2]:.3f}"
                f" | {r_or[0]:.4f} / {r_or[1]:.4f} / {r_or[2]:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
