"""The worst unit on the deployment path (issue 33): how far can any per-unit scale lift it?

The σ that ``calibrate`` states for a new unit (docs/uncertainty.md, "Deployment") covers
93–97 % of off-grid test points on average over units, but the worst unit of a design is
covered far less (0.23–0.85). This study measures the limit, per design row (20 new units
× 3 fleet seeds = 60 units, as ``deployment_sigma.py`` builds them): the largest worst-unit
coverage L that a per-unit factor f_u on the stated σ can reach while the mean coverage
over units stays ≤ 0.97, where f_u may depend only on

* ``one``: nothing (one factor for every unit of the design: what any σ shared by the
  design's units can do, an oracle κ);
* ``d2``: the unit's d_i²/n_i (D4: its readings about the prior mean, whitened by their
  model covariance: what ``calibrate`` sees of the unit), in 3 tertile bins;
* ``resid``: the unit's own fit residual at its design points over its stated σ there,
  in 3 tertile bins;
* ``hard``: the unit's true difficulty (its own needed factor, from its test points: an
  oracle ranking), in 3 tertile bins: the best any 3-bin statistic could do.

Each bin's factor is the oracle's (chosen on the test points: f_b = the smallest factor
lifting every unit of the bin to L), so every figure is an upper bound of what that
statistic can give. Also: Spearman's correlation of each statistic with the unit's needed
factor r_u (the factor at which the unit's own coverage is 95 %).

    python studies/deployment_worst.py --sim fedcal --fleet-seeds 0,1,2
    python studies/deployment_worst.py --sim crosscheck --ref-designs grid,lhs --fleet-seeds 0,1,2
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import deployment_sigma as ds

from fedcal.api import FleetPrior
from fedcal.prior.discrepancy import Discrepancy, interval_factor, kappa_at

Z95 = 1.959964
MEAN_CAP = 0.97  # the band's top: a worst unit bought by over-covering the rest is not kept
BINS = 3


def unit_rows(prior: FleetPrior, frame: pd.DataFrame) -> pd.DataFrame:
    """Per test row of the new units: error, stated σ, and the unit's d²/n and residual."""
    new = frame[frame["role"] == "new"]
    per = ds.score(prior, frame)
    keep = set(per.loc[~per["refused"].astype(bool), "sensor_id"])
    new = new[new["sensor_id"].isin(keep)]
    train = new[new["split"] == "train"][ds.COLUMNS].reset_index(drop=True)
    test = new[new["split"] == "test"].reset_index(drop=True)
    units = prior.calibrate(train)
    mean, std = units.predict(test[ds.COLUMNS[:3]], return_std=True)
    rows = pd.DataFrame(
        {
            "sensor_id": test["sensor_id"],
            "err": test["pressure_hpa"].to_numpy() - np.asarray(mean).ravel(),
            "sd": np.asarray(std).ravel(),
        }
    )
    fit, fit_sd = units.predict(train[ds.COLUMNS[:3]], return_std=True)
    own = pd.DataFrame(
        {
            "sensor_id": train["sensor_id"],
            "r2": (train["pressure_hpa"].to_numpy() - np.asarray(fit).ravel()) ** 2,
            "s2": np.asarray(fit_sd).ravel() ** 2,
        }
    ).groupby("sensor_id")
    resid = np.sqrt(own["r2"].mean() / own["s2"].mean())
    d2n = _d2_per_point(prior, train)
    return rows.assign(resid=rows["sensor_id"].map(resid), d2=rows["sensor_id"].map(d2n)).dropna()


def _d2_per_point(prior: FleetPrior, train: pd.DataFrame) -> pd.Series:
    """d_i²/n_i of D4, read back from a calibration under ν₀ = 1: there
    s_i² = (1 + d_i²)/(1 + n_i) and the stored factor is κ(n)² s_i² (t/1.96)²."""
    raw = dict(prior.model_.discrepancy)
    raw["nu0"] = 1.0
    probe = copy.copy(prior)
    probe.model_ = dataclasses.replace(prior.model_, discrepancy=raw)
    units = probe.calibrate(train)
    n = torch.tensor(train.groupby("sensor_id").size().reindex(units.sensor_ids).to_numpy())
    n = n.to(torch.float64)
    model = Discrepancy.from_dict(raw)
    factor = kappa_at(model, n).square() * interval_factor(1.0, n)
    s2 = torch.as_tensor(units.params["gp_scale"], dtype=torch.float64) / factor
    return pd.Series(((s2 * (1 + n) - 1) / n).numpy(), index=units.sensor_ids)


def needed(ratio: np.ndarray, level: float) -> float:
    """The smallest factor f on σ at which a unit's share of |e| ≤ 1.96 f σ reaches
    ``level``: the ⌈level·m⌉-th smallest of its m ratios |e|/(1.96 σ)."""
    k = max(int(np.ceil(level * len(ratio) - 1e-9)), 1)
    return float(np.sort(ratio)[k - 1])


def coverage_at(ratios: list[np.ndarray], factors: np.ndarray) -> np.ndarray:
    return np.array([np.mean(r <= f) for r, f in zip(ratios, factors, strict=True)])


def best_worst(ratios: list[np.ndarray], groups: np.ndarray) -> tuple[float, float]:
    """The largest worst-unit coverage L reachable with one oracle factor per group while
    the mean coverage stays ≤ MEAN_CAP (and the mean at it); a group's factor is the
    smallest lifting each of its units to L."""
    best = (np.nan, np.nan)
    for level in np.arange(0.30, 0.9751, 0.005):
        need = np.array([needed(r, level) for r in ratios])
        factors = np.zeros(len(ratios))
        for g in np.unique(groups):
            factors[groups == g] = need[groups == g].max()
        cov = coverage_at(ratios, factors)
        if cov.mean() > MEAN_CAP:
            break
        best = (float(cov.min()), float(cov.mean()))
    return best


def tertiles(v: np.ndarray) -> np.ndarray:
    return np.searchsorted(np.quantile(v, [1 / 3, 2 / 3]), v, side="right")


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(pd.Series(a).rank(), pd.Series(b).rank())[0, 1])


def limits(rows: pd.DataFrame) -> dict:
    """The row of the table for one design (all its units, every seed)."""
    units = rows.groupby(["seed", "sensor_id"])
    ratios = [np.abs(g["err"].to_numpy()) / (Z95 * g["sd"].to_numpy()) for _, g in units]
    first = units.first()
    d2, resid = first["d2"].to_numpy(), first["resid"].to_numpy()
    hard = np.array([needed(r, 0.95) for r in ratios])
    stated = coverage_at(ratios, np.ones(len(ratios)))
    out = {"units": len(ratios), "stated": (stated.min(), stated.mean())}
    for name, groups in (
        ("one", np.zeros(len(ratios), int)),
        ("d2", tertiles(d2)),
        ("resid", tertiles(resid)),
        ("hard", tertiles(hard)),
    ):
        out[name] = best_worst(ratios, groups)
    out["rho_d2"], out["rho_resid"] = spearman(d2, hard), spearman(resid, hard)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sim", default="fedcal", choices=["fedcal", "crosscheck"])
    ap.add_argument("--ref-designs", default="grid,stagger,lhs", help="crosscheck only")
    ap.add_argument("--fleet-seeds", default="0,1,2")
    ap.add_argument("--designs", default="3x2,4x3,6x4,plan2,plan3")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", default="/tmp/deployment_worst")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    refs = ["campaign"] if args.sim == "fedcal" else args.ref_designs.split(",")
    frames = []
    for ref in refs:
        for seed in (int(s) for s in args.fleet_seeds.split(",")):
            frames += fleet_rows(args, ref, seed)
            pd.concat(frames).to_csv(out / "rows.csv", index=False)
    print(table(pd.concat(frames, ignore_index=True)))


def fleet_rows(args, ref: str, seed: int) -> list[pd.DataFrame]:
    sim = args.sim
    base = ds.fedcal_fleet(seed, "3x2") if sim == "fedcal" else ds.cc_rows(seed, ref, "3x2")
    prior = FleetPrior(rounds=args.rounds).fit(base[base["role"] == "reference"][ds.COLUMNS])
    frames = []
    for design in args.designs.split(","):
        if design in ds.PLANS:
            kw = {}
            if sim == "crosscheck":
                kw = {"pressures": tuple(np.arange(100.0, 1301.0, 100.0)), "temps": (-10.0, 50.0)}
            pts, _ = ds.plan_points(prior, *ds.PLANS[design], **kw)
            frame = (
                ds.fedcal_fleet(seed, design, pts)
                if sim == "fedcal"
                else ds.cc_rows(seed, ref, pts)
            )
        else:
            frame = (
                ds.fedcal_fleet(seed, design) if sim == "fedcal" else ds.cc_rows(seed, ref, design)
            )
        frames.append(unit_rows(prior, frame).assign(sim=sim, ref=ref, seed=seed, design=design))
    return frames


def table(rows: pd.DataFrame) -> str:
    out = [
        "| simulator / references | design | units | stated σ: worst / mean | one factor | "
        "d²/n (3 bins) | own residual (3 bins) | true hardness (3 bins) | ρ(d²/n) | ρ(resid) |",
        "|---|---|---:|---|---|---|---|---|---:|---:|",
    ]
    for (sim, ref, design), g in rows.groupby(["sim", "ref", "design"], sort=False):
        r = limits(g)
        cell = [
            f"{a:.3f} / {b:.3f}"
            for a, b in (r[k] for k in ("stated", "one", "d2", "resid", "hard"))
        ]
        out.append(
            f"| {sim} / {ref} | {design} | {r['units']} | "
            + " | ".join(cell)
            + f" | {r['rho_d2']:.2f} | {r['rho_resid']:.2f} |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    main()
