"""Does a sweep-direction term in the fleet prior close the one-direction-design gap? (issue 10)

A measurement of a candidate model, not a shipped feature. The simulator's
units have direction-dependent hysteresis; the mixed fleets' reference units
are calibrated up AND down, the new units (PxT designs) on one ascending sweep
per plateau, and the test points are off-grid with a random direction. The
candidate model of each unit's calibration is

    y = φ(x)ᵀc_i + d·ψ(x)ᵀh_i + ε,   d = +1 ascending, −1 descending,
    (c_i, h_i) ~ N(μ, Σ) jointly,

i.e. fedprior's hierarchical model on the features [φ(x), d·ψ(x)]: the reference
units teach the fleet's hysteresis (mean and covariance of h, and its
correlation with c); a new unit whose points are all ascending sees only
c + h along ψ, and the joint prior splits the two. In the field the direction
is unknown (taken as ±1 with equal odds), so a prediction is the branch
average φ(x)ᵀm_c, and the hysteresis enters the predictive variance:

    Var = φᵀV_cc φ + σ² + ψᵀ(m_h m_hᵀ + V_hh)ψ        (E[d] = 0, E[d²] = 1).

φ is fedprior's Legendre (3, 3) basis (the one its BIC picks on these fleets),
ψ the Legendre products up to ``--psi`` orders in (P, T) ((0,0): one constant
offset per branch; (1,0), (2,0): growing in pressure); "none" is fedprior
itself (no direction term: its EM, defaults and prediction). The EM is
fedprior's, one round after another with core/bayes.py's functions (E-step
:func:`posterior`, ECME :func:`m_step`, :func:`regularize` with ν0 pseudo-units
of shrinkage in the fleet's design metric, weakly informed directions reset),
closed form, no engine (``fedcal_support/direction_reference.py``, shared with the
tests). The fleet BIC Σ_i log p(y_i) − ½ d log N (d = p +
p(p+1)/2 + 1, p the number of features) of each model is printed: the choice
between ψ bases that uses no test data.

Also printed ("dir known"): the same posterior predicting with the test
point's true direction, φᵀm_c + d ψᵀm_h — the ceiling if the field knew the
branch it is on.

    python studies/fewpoint_direction.py [--designs 3x2,4x3,6x4] [--fleet-seeds 0,1,2]
                                            [--psi none,0-0,1-0,2-0] [--rounds 50]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fedcal_support/ (not shipped)

from fedcal.config import load_config
from fedcal.core.bayes import F64
from fedcal.data.fleet import SPLIT_COLUMN
from fedcal.engine.evaluation import interval_metrics
from fedcal.engine.simulation import prepare
from fedcal.experiment import load_data
from fedcal_support.direction_reference import (
    PHI_ORDERS,
    bases,
    features,
    fit_prior,
    predict,
)
from fedcal_support.scripts import seed_list


def branch_signs(fleet, split: str, rows: int) -> Tensor:
    """d per row (+1 "up", −1 "down", 0 padding): (clients, rows), aligned with ``fleet.arrays``."""
    frame = fleet.frame[fleet.frame[SPLIT_COLUMN] == split]
    groups = dict(tuple(frame.groupby(fleet.client_column, sort=False)))
    out = np.zeros((len(fleet.client_ids), rows))
    for i, cid in enumerate(fleet.client_ids):
        direction = groups[cid]["direction"].to_numpy()
        bad = ~np.isin(direction, ("up", "down"))
        if bad.any():
            got = direction[bad][0]
            raise ValueError(f"unit {cid}: direction must be 'up' or 'down', got {got!r}")
        out[i, : len(direction)] = np.where(direction == "up", 1.0, -1.0)
    return torch.as_tensor(out, dtype=F64)


def scores(pred: Tensor, var: Tensor, y: Tensor, mask: Tensor, y_scale: Tensor):
    """Per-unit RMSE (target unit) and coverage of the nominal 95 % interval."""
    m = mask.to(F64)
    err = ((pred - y) * y_scale) ** 2
    rmse = ((err * m).sum(1) / m.sum(1)).sqrt()
    cov = interval_metrics(
        pred.unsqueeze(-1), var.sqrt().unsqueeze(-1), y.unsqueeze(-1), mask, y_scale
    )["coverage95"]
    return rmse, cov


def run_fleet(cfg, design: str, fleet_seed: int, psis: list, rounds: int) -> dict:
    f = dataclasses.replace(cfg.fleet, seed=fleet_seed, train_design=design)
    fleet = load_data(dataclasses.replace(cfg, fleet=f))
    t = prepare(fleet, cfg.data.scaling, "float64")
    d_train = branch_signs(fleet, "train", t.train.x.shape[1])
    d_test = branch_signs(fleet, "test", t.test.x.shape[1])
    role = fleet.frame.groupby(fleet.client_column, sort=False)["role"].first()
    is_new = torch.tensor([role[cid] == "new" for cid in fleet.client_ids])
    y_scale = torch.as_tensor(t.scaler.y_scale, dtype=F64).reshape(())
    ytr, mtr = t.train.y[..., 0].to(F64), t.train.mask
    yte, mte = t.test.y[..., 0].to(F64), t.test.mask
    out = {}
    for psi in psis:
        phi_tr, psi_tr = bases(t.train.x, psi)
        phi_te, psi_te = bases(t.test.x, psi)
        ftr = features(phi_tr, psi_tr, d_train)
        mu, sigma, noise, bic = fit_prior(ftr, ytr, mtr, rounds)
        if not torch.isfinite(sigma).all() or not torch.isfinite(noise):
            out[psi] = None  # diverged: reported as such
            continue
        pred, var, known = predict(mu, sigma, noise, (ftr, ytr, mtr), phi_te, psi_te, d_test)
        rmse, cov = scores(pred, var, yte, mte, y_scale)
        rmse_known, _ = scores(known, var, yte, mte, y_scale)
        out[psi] = {
            "bic": bic,
            "sigma": float(noise.sqrt() * y_scale),
            "new": (rmse[is_new].mean(), rmse[is_new].max(), cov[is_new].mean()),
            "ref": (rmse[~is_new].mean(), cov[~is_new].mean()),
            "known": rmse_known[is_new].mean(),
            "ref_known": rmse_known[~is_new].mean(),
        }
    return out


def parse_psi(s: str) -> tuple | None:
    return None if s == "none" else tuple(int(o) for o in s.split("-"))


def label(psi) -> str:
    return "none (fedprior)" if psi is None else f"ψ {psi}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--designs", default="3x2,4x3,6x4")
    ap.add_argument("--fleet-seeds", type=seed_list, default=[0, 1, 2])
    ap.add_argument("--psi", default="none,0-0,1-0,2-0")
    ap.add_argument("--rounds", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config("fewpoint")
    psis = [parse_psi(s) for s in args.psi.split(",")]
    seeds = args.fleet_seeds
    print(
        f"φ Legendre {PHI_ORDERS}; {args.rounds} EM rounds; σ = fleet noise, RMSE in hPa;"
        " per fleet seed, then the mean over seeds (BIC: the model the fleet BIC picks)"
    )
    print(
        "| design | seed | direction term | fleet BIC | σ | new: RMSE mean / worst / cov95"
        " | new: dir known | reference: RMSE / cov95 | ref.: dir known |"
    )
    print("|---|---|---|---:|---:|---|---:|---|---:|")
    for design in args.designs.split(","):
        per_seed = [run_fleet(cfg, design, fs, psis, args.rounds) for fs in seeds]
        for fs, res in zip(seeds, per_seed, strict=True):
            best = max((p for p in psis if res[p] is not None), key=lambda p: res[p]["bic"])
            for psi in psis:
                r = res[psi]
                if r is None:
                    dashes = " — |" * 5
                    print(f"| {design} | {fs} | {label(psi)} | diverged |{dashes}")
                    continue
                mark = " (BIC)" if psi == best else ""
                n, ref = r["new"], r["ref"]
                print(
                    f"| {design} | {fs} | {label(psi)}{mark} | {r['bic']:.1f} | {r['sigma']:.4f}"
                    f" | {n[0]:.4f} / {n[1]:.4f} / {n[2]:.3f} | {r['known']:.4f}"
                    f" | {ref[0]:.4f} / {ref[1]:.3f} | {r['ref_known']:.4f} |",
                    flush=True,
                )
        for psi in psis:
            rows = [res[psi] for res in per_seed]
            if any(r is None for r in rows):
                dashes = " — |" * 5
                print(f"| {design} | mean | {label(psi)} | diverged on a seed |{dashes}")
                continue

            def avg(key, k=None, rows=rows):
                return float(np.mean([float(r[key] if k is None else r[key][k]) for r in rows]))

            print(
                f"| **{design}** | mean | {label(psi)} | — | {avg('sigma'):.4f}"
                f" | {avg('new', 0):.4f} / {avg('new', 1):.4f} / {avg('new', 2):.3f}"
                f" | {avg('known'):.4f} | {avg('ref', 0):.4f} / {avg('ref', 1):.3f}"
                f" | {avg('ref_known'):.4f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
