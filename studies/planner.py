"""Study: chamber points planned from the fleet prior vs fixed grids (issue 24, item 5).

Per fleet seed (default 0, 1, 2) of the shipped ``fewpoint`` fleet:

1. the fleet prior is learned by the federation on the 20 reference units
   (full campaign) and, with ``--probe 3x2`` (the default), 20 units calibrated at
   that few-point grid, exactly as ``fedcal run`` does (``run_experiment``, its
   prior.json), for each prior method (default fedprior and fedprior_branch). The
   few-point units are the probe class of the interval's hold-out (fedprior
   "Intervals"): without them (``--probe none``) the prior learns no discrepancy τ²
   and states no interval for a few-point unit (coverage NaN, declined);
2. a design of K plateaus and N points is planned from that prior.json only
   (:func:`fedcal.planning.plan_design`; never from the simulator's truth);
3. 20 further new units of the same fleet seed (sensors 40–59, also with
   ``--probe none``: never in the federation) are simulated measured at the planned design
   (the simulator's ``train_design = "points"``) and at the fixed
   PxT grid of the same N and K, calibrated against the prior
   (:func:`fedcal.calibration.calibrate`, as ``fedcal calibrate``), and scored
   on the same 60 off-grid points (P ~ U(50, 1550) hPa, T ~ U(−40, 60) °C,
   random sweep direction).

Prints per (prior method, N/K, design): RMSE mean over the new units and the
worst unit (each averaged over fleet seeds, with the range over seeds),
coverage of the 95 % interval, chamber time, and the planner's own forecast
(expected mean and 95th-percentile unit RMSE). A unit with a non-finite error
makes its fleet's figures NaN (never dropped).

    python studies/planner.py [--out runs/planner] [--fleet-seeds 0,1,2]
                              [--methods fedprior,fedprior_branch] [--budgets 2x6,3x12]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from fedcal import calibration, planning
from fedcal.build import load_data
from fedcal.config import load_config
from fedcal.data.fleet import Fleet
from fedcal.data.simulator import POINTS, simulate_fleet
from fedcal.engine.evaluation import errors
from fedcal.experiment import run_experiment
from fedcal.prior.model import PriorModel

GRIDS = {(2, 6): "3x2", (3, 12): "4x3"}  # the fixed grid of the same K plateaus, N points
PROBE_UNITS = 20  # few-point units in the prior's federation (the hold-out's probe class)


def learn_prior(
    cfg, seed: int, methods: tuple[str, ...], out: Path, probe: str = "none"
) -> dict[str, PriorModel]:
    """The fleet priors of the reference units (+ 20 units at the ``probe`` grid) as
    ``fedcal run`` learns them; a prior already in ``out`` (an earlier call) is read back."""
    try:
        return {m: calibration.load_prior(calibration.find_prior(out, m, 0, 0)) for m in methods}
    except FileNotFoundError:
        pass
    few = 0 if probe == "none" else PROBE_UNITS
    fleet_cfg = replace(cfg.fleet, num_new=few, seed=seed)
    if few:
        fleet_cfg = replace(fleet_cfg, train_design=probe)
    run_cfg = replace(cfg, fleet=fleet_cfg, methods=methods, designs=(), fleet_seeds=(), seeds=1)
    run_experiment(run_cfg, load_data(run_cfg), out, methods)
    return {m: calibration.load_prior(calibration.find_prior(out, m, 0, 0)) for m in methods}


def new_units(cfg, seed: int, design: str, points: tuple = (), skip: int = 0) -> Fleet:
    """20 new units measured at ``design`` (a PxT grid or explicit points): the fleet's
    sensors after the reference units and the ``skip`` units that are in the prior's
    federation (the simulator's sensor i does not depend on how many follow it)."""
    spec = replace(cfg.fleet, seed=seed, num_new=cfg.fleet.num_new + skip).spec()
    spec = replace(spec, train_design=design, design_points=points)
    fleet = simulate_fleet(spec, seed)
    new = fleet.frame[fleet.frame["role"] == "new"]
    ids = list(dict.fromkeys(new[fleet.client_column]))[skip:]
    frame = new[new[fleet.client_column].isin(ids)].reset_index(drop=True)
    return replace(fleet, frame=frame)


def score(prior: PriorModel, fleet: Fleet) -> dict[str, float]:
    """Calibrate the units against the prior; RMSE mean/worst and coverage off-grid."""
    result = calibration.calibrate(prior, fleet, "study")
    t = result.tensors
    e = errors(result.algorithm, result.personal, t.test, t.scaler)
    rmse = e["rmse"].numpy()
    finite = np.isfinite(rmse).all()
    return {
        "rmse_mean": float(rmse.mean()) if finite else float("nan"),
        "rmse_worst": float(rmse.max()) if finite else float("nan"),
        "coverage95": float(e["coverage95"].numpy().mean()) if finite else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/planner"))
    parser.add_argument("--fleet-seeds", default="0,1,2")
    parser.add_argument("--methods", default="fedprior,fedprior_branch")
    parser.add_argument("--budgets", default="2x6,3x12", help="KxN: plateaus x points")
    parser.add_argument(
        "--probe",
        default="3x2",
        help="PxT grid of the 20 few-point units in the prior's federation, or 'none'",
    )
    parser.add_argument(
        "--scan-step",
        type=float,
        default=0.0,
        help="diagnostic: every pair of set points on this °C grid, 6 points (planner's "
        "pressures), scored on the new units (the best 2-plateau placement in hindsight)",
    )
    parser.add_argument(
        "--figure", type=Path, default=None, help="PNG: predictive σ over (P, T), planned vs 3x2"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = load_config("fewpoint")
    if args.scan_step:
        scan(cfg, args)
        return
    if args.figure:
        figure(cfg, args)
        return
    methods = tuple(args.methods.split(","))
    budgets = [tuple(int(v) for v in b.split("x")) for b in args.budgets.split(",")]
    rows = []
    t0 = time.perf_counter()
    for seed in (int(s) for s in args.fleet_seeds.split(",")):
        priors = learn_prior(cfg, seed, methods, _prior_dir(args, seed), args.probe)
        for method, prior in priors.items():
            plan = planning.planner(prior)
            for k, n in budgets:
                result = planning.optimize(plan, k, n)
                frame = result.design.frame()
                frame.to_csv(args.out / f"design_{method}_{k}x{n}_seed{seed}.csv", index=False)
                pts = tuple((float(p), float(t), str(d)) for p, t, d in frame.to_numpy())
                designs = {"planned": (POINTS, pts, result.expected)}
                grid = GRIDS.get((k, n))
                if grid:
                    g = planning.grid_design(plan.chamber, n // k, k)
                    designs[f"grid {grid}"] = (grid, (), planning.evaluate(plan, g))
                for name, (design, points, expected) in designs.items():
                    got = score(prior, new_units(cfg, seed, design, points, _skip(args)))
                    rows.append(
                        {
                            "method": method,
                            "budget": f"{n} pts / {k} plateaus",
                            "design": name,
                            "fleet_seed": seed,
                            **got,
                            "forecast_mean": expected.mean_rmse,
                            "forecast_q95": expected.quantile_rmse,
                            "minutes": expected.minutes,
                            "points": json.dumps([list(p) for p in points]) if points else grid,
                        }
                    )
                    print(rows[-1], flush=True)
    table = pd.DataFrame(rows)
    table.to_csv(args.out / "planner.csv", index=False)
    wall = time.perf_counter() - t0
    strict = {"rmse_mean": _strict, "rmse_worst": _strict, "coverage95": _strict}
    agg = (
        table.groupby(["method", "budget", "design"], sort=False)
        .agg(
            {
                **strict,
                "forecast_mean": "mean",
                "forecast_q95": "mean",
                "minutes": "first",
            }
        )
        .reset_index()
    )
    spread = table.groupby(["method", "budget", "design"], sort=False)["rmse_mean"].agg(
        ["min", "max"]
    )
    print(f"\nfleet seeds {args.fleet_seeds}; wall {wall:.0f} s; hPa, mean over fleet seeds\n")
    print(
        "| prior | budget | design | RMSE mean [seed range] | worst | coverage95 | "
        "forecast mean / q95 | chamber min |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for _, r in agg.iterrows():
        lo, hi = spread.loc[(r["method"], r["budget"], r["design"])]
        print(
            f"| {r['method']} | {r['budget']} | {r['design']} | {r['rmse_mean']:.3f} "
            f"[{lo:.3f}–{hi:.3f}] | {r['rmse_worst']:.3f} | {100 * r['coverage95']:.1f} % | "
            f"{r['forecast_mean']:.3f} / {r['forecast_q95']:.3f} | {r['minutes']:.0f} |"
        )


def scan(cfg, args) -> None:
    """Every pair of plateau set points (grid ``--scan-step``): the planner's 6 points at
    that pair, the units' actual off-grid RMSE, beside the planner's forecast. Picking the
    best pair by the units' test error uses the simulator's truth: a diagnostic of how far
    the prior-only plan is from the best 2-plateau placement, never a design rule."""
    rows = []
    for seed in (int(s) for s in args.fleet_seeds.split(",")):
        priors = learn_prior(
            cfg, seed, tuple(args.methods.split(",")), _prior_dir(args, seed), args.probe
        )
        for method, prior in priors.items():
            full = planning.default_chamber(prior)
            temps = np.arange(full.temperatures[0], full.temperatures[-1] + 1e-9, args.scan_step)
            for pair in itertools.combinations(temps.tolist(), 2):
                chamber = replace(full, temperatures=pair)
                result = planning.optimize(planning.planner(prior, chamber), 2, 6)
                frame = result.design.frame()
                pts = tuple((float(p), float(t), str(d)) for p, t, d in frame.to_numpy())
                got = score(prior, new_units(cfg, seed, POINTS, pts, _skip(args)))
                rows.append(
                    {
                        "method": method,
                        "fleet_seed": seed,
                        "t_low": pair[0],
                        "t_high": pair[1],
                        **got,
                        "forecast_mean": result.expected.mean_rmse,
                        "forecast_q95": result.expected.quantile_rmse,
                    }
                )
                print(rows[-1], flush=True)
    table = pd.DataFrame(rows)
    table.to_csv(args.out / "scan.csv", index=False)
    for (method, seed), part in table.groupby(["method", "fleet_seed"]):
        best = part.loc[part["rmse_mean"].idxmin()]
        chosen = part.loc[part["forecast_mean"].idxmin()]
        rho = part["rmse_mean"].corr(part["forecast_mean"], method="spearman")
        print(
            f"{method} seed {seed}: best pair in hindsight {best.t_low:g}/{best.t_high:g} °C "
            f"{best.rmse_mean:.3f} mean {best.rmse_worst:.3f} worst; forecast's pick "
            f"{chosen.t_low:g}/{chosen.t_high:g} °C {chosen.rmse_mean:.3f} / "
            f"{chosen.rmse_worst:.3f}; Spearman(forecast, actual) {rho:.2f} over {len(part)} pairs"
        )


def figure(cfg, args) -> None:
    """Expected predictive σ over the (P, T) plane: the planned 6-point design vs 3×2
    (first fleet seed, first method), with the chamber points marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seed = int(args.fleet_seeds.split(",")[0])
    method = args.methods.split(",")[0]
    prior = learn_prior(cfg, seed, (method,), _prior_dir(args, seed), args.probe)[method]
    plan = planning.planner(prior)
    designs = {
        "planned (6 points, 2 plateaus)": planning.optimize(plan, 2, 6).design,
        "grid 3x2": planning.grid_design(plan.chamber, 3, 2),
    }
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True, constrained_layout=True)
    maps = {name: planning.sigma_map(plan, d) for name, d in designs.items()}
    levels = np.linspace(0.0, max(float(m["sigma"].max()) for m in maps.values()), 13)
    for ax, (name, d) in zip(axes, designs.items(), strict=True):
        grid = maps[name].pivot(index="temperature_c", columns="pressure_hpa", values="sigma")
        im = ax.contourf(grid.columns, grid.index, grid.to_numpy(), levels=levels)
        pts = d.frame()
        ax.scatter(pts["pressure_hpa"], pts["temperature_c"], c="w", edgecolors="k")
        e = planning.evaluate(plan, d)
        ax.set_title(f"{name}\nRMS σ {e.rms:.3f}, worst {e.worst:.3f} hPa", fontsize=10)
        ax.set_xlabel("pressure (hPa)")
    axes[0].set_ylabel("temperature (°C)")
    fig.colorbar(im, ax=axes, label="expected predictive σ (hPa)")
    fig.savefig(args.figure, dpi=110)
    print(f"wrote {args.figure} ({method}, fleet seed {seed})")


def _prior_dir(args, seed: int) -> Path:
    return args.out / (f"prior_seed{seed}" + ("" if args.probe == "none" else f"_{args.probe}"))


def _skip(args) -> int:
    """New units skipped before the scored ones: the probe units of the prior's federation
    (also without a probe, so that both priors are scored on the same units)."""
    return PROBE_UNITS


def _strict(values: pd.Series) -> float:
    v = values.to_numpy(float)
    return float(v.mean()) if np.isfinite(v).all() else float("nan")


if __name__ == "__main__":
    main()
