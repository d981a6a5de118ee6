"""The per-sensor polynomial at few calibration points, judged off the grid.

For each fleet seed, every sensor's 384-point campaign (quartz, nominal preset)
is cut down to a P × T chamber grid — per node the first-sweep point of the
campaign level nearest ``linspace(min, max, k)`` — or to a spread subset
(``Fleet.with_train_points``, what ``fedcal compare --train-points`` uses), and
the polynomial is tested on 60 random (P, T) points (``test_design="random"``).

Rules compared: the new order selection (criterion loo / gcv / aicc, saturated
grid interpolant allowed or never), the former rule (5-fold CV over p 1…4,
q 0…3 with fewer coefficients than a training fold's rows, the smallest within
1 % of the best; re-implemented here in numpy, folds from a seeded shuffle), and
fixed orders. Prints, per design and rule, the mean over seeds of the fleet's
mean and worst-sensor RMSE (hPa) off the grid, and the orders chosen.

    python studies/polynomial_fewpoint.py [--fleet-seeds 0,1,2] [--sensors 20]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fedcal_support/ (not shipped)

from fedcal.algorithms.polynomial import PolynomialCalibration
from fedcal.core.task import Task
from fedcal.data.fleet import SPLIT_COLUMN, Fleet
from fedcal.data.simulator import FleetSpec, simulate_fleet
from fedcal.engine.simulation import prepare
from fedcal.models.mlp import MLP
from fedcal_support.scripts import seed_list

GRIDS = {"3x2": (3, 2), "4x3": (4, 3), "6x4": (6, 4)}
SPREAD = (6, 12, 24)


def nearest_levels(levels: np.ndarray, k: int) -> np.ndarray:
    """The campaign levels nearest ``linspace(min, max, k)`` (ties: the lower level)."""
    targets = np.linspace(levels.min(), levels.max(), k)
    return np.array([levels[np.argmin(np.abs(levels - t))] for t in targets])


def grid_fleet(fleet: Fleet, spec: FleetSpec, shape: tuple[int, int]) -> Fleet:
    """Each sensor's first-sweep training points at the nodes of a P × T grid."""
    p_levels = nearest_levels(np.array(spec.pressure_levels_hpa), shape[0])
    t_levels = nearest_levels(np.array(spec.temperature_plateaus_c), shape[1])
    plateau = {t: j for j, t in enumerate(spec.temperature_plateaus_c)}
    frame = fleet.frame
    train = frame[SPLIT_COLUMN] == "train"
    # Plateau index of every training row: rows are written plateau by plateau,
    # sweeps × levels per plateau, the same schedule for every sensor.
    per_plateau = spec.train_sweeps * len(spec.pressure_levels_hpa)
    position = frame.groupby(fleet.client_column, sort=False).cumcount()
    row_plateau = position // per_plateau
    keep = (
        train
        & (frame["sweep"] == 0)
        & frame["pressure_hpa"].isin(p_levels)
        & row_plateau.isin([plateau[t] for t in t_levels])
    )
    return Fleet(frame[keep | ~train], fleet.features, fleet.target, fleet.client_column)


def old_rule_orders(x: np.ndarray, y: np.ndarray, seed: int) -> tuple[int, int]:
    """The former choice: 5-fold CV, p 1…4, q 0…3, k < the smallest training fold, 1 % rule."""
    n = len(x)
    order = np.random.default_rng(seed).permutation(n)
    fold = np.empty(n, dtype=int)
    fold[order] = np.arange(n) % 5
    grid = sorted(
        ((p, q) for p in range(1, 5) for q in range(4)),
        key=lambda o: ((o[0] + 1) * (o[1] + 1), o[0]),
    )
    fewest = min(int((fold != k).sum()) for k in range(5))
    best, scores = np.inf, []
    for p, q in grid:
        if (p + 1) * (q + 1) >= fewest:
            scores.append(np.inf)
            continue
        design = np.stack(
            [x[:, 0] ** i * x[:, 1] ** j for i in range(p + 1) for j in range(q + 1)], 1
        )
        sse = 0.0
        for k in range(5):
            tr = fold != k
            a = np.linalg.lstsq(design[tr], y[tr], rcond=None)[0]
            sse += ((design[~tr] @ a - y[~tr]) ** 2).sum()
        scores.append(np.sqrt(sse / n))
        best = min(best, scores[-1])
    return next(o for o, s in zip(grid, scores, strict=True) if s <= best * 1.01 + 1e-9)


def evaluate(fleet: Fleet, rule: str | tuple, seed: int) -> tuple[np.ndarray, list, float]:
    """Per-sensor off-grid RMSE (hPa), the orders chosen, the share of saturated fits."""
    tensors = prepare(fleet, dtype="float64")
    task = Task(MLP(in_features=2, hidden=(1,)))
    train, test = tensors.train, tensors.test
    if rule == "old":
        orders = []
        for c in range(train.num_clients):
            n = int(train.count[c])
            orders.append(
                old_rule_orders(train.x[c, :n].numpy(), train.y[c, :n, 0].numpy(), seed * 100 + c)
            )
        coef_rmse = []
        for c, (p, q) in enumerate(orders):
            alg = PolynomialCalibration(task, max_orders=(4, 3), orders=(p, max(q, 1)))
            if q == 0:  # the former rule may drop temperature; fit that surface directly
                coef_rmse.append(fixed_f_only(train, test, c, p))
                continue
            coef_rmse.append(rmse_of(alg, train.select(torch.tensor([c])), test, c, tensors)[0])
        return np.array(coef_rmse) * tensors.scaler.y_scale[0], orders, 0.0
    if isinstance(rule, tuple):
        alg = PolynomialCalibration(task, max_orders=(4, 3), orders=rule)
    else:
        criterion, saturate = rule.split("+")
        alg = PolynomialCalibration(task, max_orders=(4, 3), criterion=criterion, saturate=saturate)
    fit = alg.fit(train)
    params = {k: fit[k] for k in ("coef", "orders", "lo", "hi")}
    err = (alg.predict(params, test.x) - test.y)[..., 0] * test.mask
    rmse = (err.pow(2).sum(1) / test.mask.sum(1)).sqrt().numpy() * tensors.scaler.y_scale[0]
    chosen = [tuple(int(v) for v in o) for o in fit["orders"].tolist()]
    chosen = [
        o if r < 0.5 else "refused" for o, r in zip(chosen, fit["refused"].tolist(), strict=True)
    ]
    return rmse, chosen, float(fit["saturated"].mean())


def rmse_of(alg, one, test, c, tensors):
    fit = alg.fit(one)
    params = {k: fit[k] for k in ("coef", "orders", "lo", "hi")}
    t = test.select(torch.tensor([c]))
    err = (alg.predict(params, t.x) - t.y)[..., 0] * t.mask
    return (err.pow(2).sum(1) / t.mask.sum(1)).sqrt().numpy()


def fixed_f_only(train, test, c, p):
    """Least squares on 1, f, …, f^p (temperature dropped), RMSE on the test points (scaled)."""
    n, m = int(train.count[c]), int(test.count[c])
    f, y = train.x[c, :n, 0].numpy(), train.y[c, :n, 0].numpy()
    a = np.linalg.lstsq(np.vander(f, p + 1), y, rcond=None)[0]
    ft, yt = test.x[c, :m, 0].numpy(), test.y[c, :m, 0].numpy()
    return float(np.sqrt(np.mean((np.vander(ft, p + 1) @ a - yt) ** 2)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleet-seeds", type=seed_list, default=[0, 1, 2])
    parser.add_argument("--sensors", type=int, default=20)
    parser.add_argument("--preset", default="nominal")
    args = parser.parse_args()
    torch.set_num_threads(1)
    seeds = args.fleet_seeds
    rules: list = ["loo+auto", "gcv+auto", "aicc+auto", "loo+grid", "loo+last_resort"]
    rules += ["loo+never"]
    rules += ["old", (2, 1), (3, 2), (3, 3)]
    designs = list(GRIDS) + [f"spread{n}" for n in SPREAD] + ["all384"]
    results: dict = {}
    for seed in seeds:
        spec = FleetSpec(num_sensors=args.sensors, test_design="random", preset=args.preset)
        fleet = simulate_fleet(spec, seed=seed)
        for design in designs:
            if design in GRIDS:
                sub = grid_fleet(fleet, spec, GRIDS[design])
            elif design.startswith("spread"):
                sub = fleet.with_train_points(int(design[6:]))
            else:
                sub = fleet
            for rule in rules:
                results[design, str(rule), seed] = evaluate(sub, rule, seed)
    print(f"off-grid RMSE (hPa), {len(seeds)} fleet seeds × {args.sensors} sensors, {args.preset}")
    print("mean over seeds of the fleet mean [worst sensor]; most chosen orders; saturated share")
    for design in designs:
        print(f"\n## {design}")
        for rule in rules:
            runs = [results[design, str(rule), s] for s in seeds]
            mean = np.mean([r[0].mean() for r in runs])
            worst = np.mean([r[0].max() for r in runs])
            top = Counter(o for r in runs for o in r[1]).most_common(3)
            sat = np.mean([r[2] for r in runs])
            label = rule if isinstance(rule, str) else f"fixed {rule}"
            print(f"{label:12s} {mean:9.4g} [{worst:8.4g}]  sat {sat:4.2f}  {top}")


if __name__ == "__main__":
    main()
