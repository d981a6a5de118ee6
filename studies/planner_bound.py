"""The limit at 6 points on 2 plateaus: the exact-Gaussian bound for the planned design (issue 24).

``studies/planner.py`` plans a new unit's chamber points from the fleet prior learned
by the federation (20 reference units + 20 units at 3×2, fedprior_branch) and scores
new units 40–59 at that design. This study asks what the BEST Gaussian prior could do
with the same design: the ``gauss`` estimator of ``studies/fewpoint_bound.py`` (its
library of simulator units through the fleet seed's own chamber, now at the planned
points with their sweep directions; (c, e = y − Φc) jointly Gaussian with the library's
exact moments; posterior mean with the unit's own Φ), and ``truth`` (the unit's own
dense-truth coefficients: the floor of hysteresis, ripple and noise at the test points).

Per fleet seed: the prior is ``studies/planner.py``'s (``learn_prior``, read back from
``--out`` if already there); the designs are the planner's (``planning.optimize``) for
each ``--budgets`` KxN, plus the fixed 3×2 grid; for each design a library of
``--library`` units (fit) + ``--holdout`` held-out units is drawn through it (parameters
from seed 1000 + fleet seed: no evaluated unit is in it), and scored on the 60 off-grid
test points of the fleet. Prints per design: the study's new units 40–59 (mean / worst),
the held-out units (mean, 95th percentile, worst of all), and the worst unit of 20-unit
sets of held-out units (median and 90th percentile over the sets: comparable to the
worst of a 20-unit study).

With ``--oracle-search FIT,SEARCH`` each planned design is also improved under the exact
Gaussian itself (:func:`oracle_search`, a coordinate exchange by simulation) and scored
the same way: is the planner's design, chosen from the 20 + 20 prior, where the oracle
prior would put it? Results and commands: docs/planner.md, "The limit at 6 points on 2
plateaus".

    python studies/planner_bound.py [--out runs/planner] [--fleet-seeds 0,1,2]
                                    [--budgets 2x6,3x6,2x12] [--library 16000] [--holdout 2000]
                                    [--oracle-search 1000,500]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fedcal_support/, studies/

from fedcal import planning
from fedcal.config import load_config
from fedcal.data.simulator import POINTS, measurement_plan
from fedcal_support.fewpoint_library import (
    GRID_P,
    Coordinates,
    check_library_physics,
    dense_truth,
    draw_library,
    frame_units,
    frequency,
    function_rmse,
    gaussian_fit,
    gaussian_posterior,
    observe,
)
from fedcal_support.scripts import seed_list
from studies.planner import PROBE_UNITS, learn_prior, new_units, score

METHOD = "fedprior_branch"
SET = 20  # units per set: the study's new units per fleet seed


def designs(prior: dict, budgets: list[tuple[int, int]]) -> dict[str, tuple[str, tuple, str]]:
    """name -> (simulator design, explicit points, description): the planner's designs under
    the learned prior, and the fixed 3×2 grid."""
    plan = planning.planner(prior)
    out = {"grid 3x2 (6 pts / 2 plateaus)": ("3x2", (), "50/800/1550 hPa at −40, 60 °C, up")}
    for k, n in budgets:
        frame = planning.optimize(plan, k, n).design.frame()
        pts = tuple((float(p), float(t), str(d)) for p, t, d in frame.to_numpy())
        desc = ", ".join(f"{p:g}{'↑' if d == 'up' else '↓'}@{t:g}" for p, t, d in pts)
        out[f"planned {n} pts / {k} plateaus"] = (POINTS, pts, desc)
    return out


def set_worsts(rmse: np.ndarray) -> np.ndarray:
    """The worst unit of each consecutive set of ``SET`` units."""
    m = len(rmse) // SET * SET
    return rmse[:m].reshape(-1, SET).max(1)


def run_seed(cfg, seed: int, args, budgets) -> list[dict]:
    prior = learn_prior(cfg, seed, (METHOD,), args.out / f"prior_seed{seed}_3x2", "3x2")[METHOD]
    rows, coords, lib_coef = [], None, None
    todo = list(designs(prior, budgets).items())
    while todo:
        name, (design, points, desc) = todo.pop(0)
        t0 = time.perf_counter()
        fleet = new_units(cfg, seed, design, points, PROBE_UNITS)
        new, new_prm, spec = frame_units(fleet, seed)
        first = spec.num_reference + PROBE_UNITS
        check = check_library_physics(spec, new_prm, new, seed, design, first)
        lib, lib_prm = draw_library(spec, seed, design, args.library + args.holdout)
        if coords is None:  # one basis for every design of the seed (its dense truth is shared)
            edges = frequency(spec, lib_prm, np.array([[GRID_P[0], GRID_P[-1]]]), np.zeros((1, 1)))
            f_lo = min(float(lib.f.min()), float(lib.test_f.min()), float(edges.min())) - 200.0
            f_hi = max(float(lib.f.max()), float(lib.test_f.max()), float(edges.max())) + 200.0
            coords = Coordinates(f_lo, f_hi)
            lib_coef, fit_err = dense_truth(spec, lib_prm, coords)
        lib.coef = lib_coef
        if args.oracle_search and name.startswith("planned"):
            # (b): the design chosen under the exact Gaussian itself, from the planned one.
            crit = OracleCriterion(spec, seed, lib, lib_prm, coords, *args.oracle_search)
            found, _ = oracle_search(crit, points, planning.default_chamber(prior))
            found_desc = ", ".join(f"{p:g}{'↑' if d == 'up' else '↓'}@{t:g}" for p, t, d in found)
            todo.append((name.replace("planned", "oracle-searched"), (POINTS, found, found_desc)))
        new.coef, fit_err_new = dense_truth(spec, new_prm, coords)
        fit = lib.take(slice(0, args.library))
        hold = lib.take(slice(args.library, args.library + args.holdout))
        mu, sigma, m_e, s_e = gaussian_fit(fit, coords)
        for est in ("truth", "gauss"):
            if est == "truth":
                c_new, c_hold = new.coef, hold.coef
            else:
                c_new = gaussian_posterior(new, coords, mu, sigma, m_e, s_e)[0]
                c_hold = gaussian_posterior(hold, coords, mu, sigma, m_e, s_e)[0]
            r_new = function_rmse(c_new, new, coords)
            r_hold = function_rmse(c_hold, hold, coords)
            worsts = set_worsts(r_hold)
            rows.append(
                {
                    "fleet_seed": seed,
                    "design": name,
                    "estimator": est,
                    "new_mean": r_new.mean(),
                    "new_worst": r_new.max(),
                    "hold_mean": r_hold.mean(),
                    "hold_q95": np.quantile(r_hold, 0.95),
                    "hold_max": r_hold.max(),
                    "set_worst_median": np.median(worsts),
                    "set_worst_q90": np.quantile(worsts, 0.9),
                    "sets_mean_le_007": float(
                        np.mean(r_hold[: len(worsts) * SET].reshape(-1, SET).mean(1) <= 0.07)
                    ),
                    "sets_worst_le_012": float(np.mean(worsts <= 0.12)),
                }
            )
            r = rows[-1]
            print(
                f"| {seed} | {name} | {est} | {r['new_mean']:.4f} / {r['new_worst']:.4f} | "
                f"{r['hold_mean']:.4f} / {r['hold_q95']:.4f} / {r['hold_max']:.4f} | "
                f"{r['set_worst_median']:.4f} / {r['set_worst_q90']:.4f} | "
                f"{100 * r['sets_worst_le_012']:.0f} % |",
                flush=True,
            )
        got = score(prior, fleet)  # the study's own figure: fedprior_branch, 20 + 20 units
        rows.append(
            {
                "fleet_seed": seed,
                "design": name,
                "estimator": f"{METHOD} (20 + 20 units)",
                "new_mean": got["rmse_mean"],
                "new_worst": got["rmse_worst"],
            }
        )
        print(
            f"| {seed} | {name} | {rows[-1]['estimator']} | {got['rmse_mean']:.4f} / "
            f"{got['rmse_worst']:.4f} | | | |"
        )
        print(
            f"|   | {name}: {desc} | (checks) | physics max |Δf| {check:.2e} Hz | fit error ≤ "
            f"{max(fit_err, fit_err_new):.2e} hPa | wall {time.perf_counter() - t0:.0f} s | |",
            flush=True,
        )
    return rows


class OracleCriterion:
    """The exact-Gaussian criterion of a design, by simulation: the mean off-grid RMSE of
    ``search`` library units under the Gaussian fitted to ``fit`` library units measured at
    the design (common random numbers: the same units and noise draws for every design)."""

    def __init__(self, spec, seed: int, lib, prm, coords, n_fit: int, n_search: int):
        self.spec, self.seed, self.coords = spec, seed, coords
        self.lib = lib.take(slice(0, n_fit + n_search))
        self.prm = prm.iloc[: n_fit + n_search]
        self.n_fit = n_fit
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 78])))
        self.z = rng.standard_normal((2, n_fit + n_search, 64))  # per unit and point (≤ 64)
        search = self.lib.take(slice(n_fit, None))
        self.phi_test = coords.basis(search.test_f, search.test_t)  # design-independent
        self.test_p = search.test_p

    def units(self, points: tuple):
        """The library units measured at ``points`` ((P, set point, direction), …)."""
        spec = dataclasses.replace(self.spec, design_points=points)
        rows = measurement_plan(spec, self.seed, POINTS)
        tr = rows[rows["split"] == "train"]
        n = len(tr)
        p = tr["pressure_hpa"].to_numpy(float)[None, :]
        t = tr["temperature_true_c"].to_numpy(float)[None, :]
        sign = np.where(tr["direction"].to_numpy() == "down", 1.0, -1.0)[None, :]
        f, t_read = observe(spec, self.prm, p, t, sign, self.z[0, :, :n], self.z[1, :, :n])
        return dataclasses.replace(self.lib, f=f, t=t_read, y=p[0].copy())

    def __call__(self, points: tuple) -> float:
        u = self.units(points)
        fit, search = u.take(slice(0, self.n_fit)), u.take(slice(self.n_fit, None))
        mu, sigma, m_e, s_e = gaussian_fit(fit, self.coords)
        c = gaussian_posterior(search, self.coords, mu, sigma, m_e, s_e)[0]
        pred = np.einsum("urk,uk->ur", self.phi_test, c)
        return float(np.sqrt(((pred - self.test_p[None, :]) ** 2).mean(1)).mean())


def oracle_search(crit: OracleCriterion, start: tuple, chamber, passes: int = 2) -> tuple:
    """Coordinate exchange under the oracle criterion: each point in turn moves to its best
    (plateau, pressure, direction), each plateau to its best feasible set point, keeping a
    move only if the criterion falls; until a pass changes nothing. Same plateau count."""
    best, value = tuple(start), crit(tuple(start))
    print(f"  oracle search start: criterion {value:.4f} hPa", flush=True)
    for _ in range(passes):
        improved = False
        temps = sorted({t for _, t, _ in best})
        for i in range(len(best)):
            cands = [
                (*best[:i], (p, t, d), *best[i + 1 :])
                for t in temps
                for p in chamber.pressures
                for d in chamber.directions
            ]
            cands = [c for c in cands if len({t for _, t, _ in c}) == len(temps)]
            vals = [crit(c) for c in cands]
            j = int(np.argmin(vals))
            if vals[j] < value - 1e-6:
                best, value, improved = cands[j], vals[j], True
        for t_old in sorted({t for _, t, _ in best}):
            others = {t for _, t, _ in best} - {t_old}
            cands = [
                tuple((p, t_new if t == t_old else t, d) for p, t, d in best)
                for t_new in chamber.temperatures
                if t_new not in others
            ]
            vals = [crit(c) for c in cands]
            j = int(np.argmin(vals))
            if vals[j] < value - 1e-6:
                best, value, improved = cands[j], vals[j], True
        print(f"  oracle search pass: criterion {value:.4f} hPa, {best}", flush=True)
        if not improved:
            break
    return best, value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/planner"))
    ap.add_argument("--fleet-seeds", type=seed_list, default=[0, 1, 2])
    ap.add_argument("--budgets", default="2x6,3x6,2x12", help="KxN: plateaus x points")
    ap.add_argument("--library", type=int, default=16000, help="library units the prior is fit on")
    ap.add_argument("--holdout", type=int, default=2000, help="held-out library units")
    ap.add_argument(
        "--oracle-search",
        type=lambda v: tuple(int(x) for x in v.split(",")),
        default=None,
        help="FIT,SEARCH: also search each planned design's points under the exact Gaussian "
        "(fit on the first FIT library units, criterion on the next SEARCH; not held out)",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    budgets = [tuple(int(v) for v in b.split("x")) for b in args.budgets.split(",")]
    cfg = load_config("fewpoint")
    print(
        f"library {args.library} fit + {args.holdout} held out (seed 1000 + fleet seed); "
        f"designs planned by {METHOD} (prior of 20 reference + 20 units at 3x2); RMSE hPa, "
        "60 off-grid test points"
    )
    print(
        "| fleet seed | design | estimator | new units 40–59: mean / worst | held out: mean / "
        "q95 / worst | worst of 20: median / q90 over sets | sets with worst ≤ 0.12 |"
    )
    print("|---|---|---|---|---|---|---|")
    rows = []
    for seed in args.fleet_seeds:
        rows += run_seed(cfg, seed, args, budgets)
    import pandas as pd

    table = pd.DataFrame(rows)
    table.to_csv(args.out / f"planner_bound_{args.budgets.replace(',', '_')}.csv", index=False)
    agg = table.groupby(["design", "estimator"], sort=False).agg(
        new_mean=("new_mean", "mean"),
        new_worst=("new_worst", "max"),
        hold_mean=("hold_mean", "mean"),
        hold_q95=("hold_q95", "mean"),
        hold_max=("hold_max", "max"),
        set_worst_median=("set_worst_median", "mean"),
        sets_worst_le_012=("sets_worst_le_012", "mean"),
    )
    print("\nover fleet seeds (means; worst = max over seeds)\n")
    print(agg.to_string(float_format=lambda v: f"{v:.4f}"))


if __name__ == "__main__":
    main()
