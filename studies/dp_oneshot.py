"""The fleet prior released once under client-level DP, and the limit of that release.

Fleets of studies/dp_scale.py (``--config fewpoint``: ``--units`` reference units with the
384-point campaign + ``--new`` few-point units of each ``--designs``), fedprior's fixed (4, 3)
basis (20 terms), ``interval = "posterior"``. Per fleet:

- ``EM, no DP``: fedprior_fixed's EM, ``--rounds`` rounds, no noise (the engine's run);
- ``one-shot, no noise``: the prior from the reference units' own least-squares fits
  (fedcal.algorithms.fedprior_oneshot), no noise: what the one-shot design gives up alone;
- ``one-shot``: the same moments released under DP in ``--stages`` stages (stage 0: the mean
  and log-noise; each next stage whitened by the one before: core.privacy.release_moments),
  bounds adapted to the ``--quantile`` of the units' norms (``--count-share`` of the budget);
  with ``--coordinates grid`` (the default) the release runs on u = R ĉ, R a public
  preconditioner (fedprior_oneshot.prediction_coordinates): the basis orthonormal over a
  16 × 6 grid spanning the fleet's input box (taken as public: the campaign's range);
  ``campaign``: over the reference units' pooled design instead, a sum of every unit's own
  readings, un-clipped and un-noised, that shapes every released number: NOT covered by
  the printed ε (kept to compare; its rows say so); ``none``: ĉ's own coordinates;
  ``--scales``: stage 1 releases
  each coordinate's scale and median instead (core.privacy._scale_stage), the next stages
  are whitened by them (``--relevant τ``: and refine only the coordinates of variance
  ≥ τ σ̂², the others diagonal); its path of differences follows a keyed hash of the units'
  sensor ids (core.privacy.release_order; a noisy scaled release without ids is refused);
- ``oracle``: one stage whitened by the TRUE (non-private) mean, covariance and noise of the
  fits, the whole budget on it, declared bounds from the whitened dimension (2p): the best
  this release can do at that N and ε, whatever the preconditioning.

δ = min(1/N², 1e-5) with N all units of the fleet (reference + new), the project's default
(fedcal.build.privacy_delta); q = 1. Metric: the new units' test
RMSE (hPa) on off-grid random (P, T) points, mean and worst unit per fleet; the reference
units' mean. A release that raises or yields a non-finite sensor is printed as such and never
enters a mean. ε printed is the accountant's (Opacus RDP over the composed stages).

    python studies/dp_oneshot.py --units 2000 --designs 3x2,4x3 --epsilons 1,4,8 \\
        --fleet-seeds 0,1,2 [--stages 4] [--quantile 0.9] [--count-share 0.1] [--no-oracle]
        [--refresh-last] [--no-em] [--coordinates grid|none|campaign, a list]
        [--scales [--relevant 0.1]]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fedcal_support/ (not shipped)

from fedcal.algorithms.fedprior_oneshot import local_fits, oneshot_prior, prediction_coordinates
from fedcal.build import privacy_delta
from fedcal.config import load_config
from fedcal.core.bayes import moments
from fedcal.core.privacy import Whitening, staged_budget
from fedcal.core.tree import expand
from fedcal.engine.evaluation import evaluate_cohort
from fedcal.engine.simulation import EngineConfig, prepare, simulate
from fedcal.experiment import build_algorithm, build_task, client_inputs, load_data, one_line
from fedcal_support.scripts import seed_list


def _score(algorithm, down, tensors, new) -> dict:
    """New units' mean and worst test RMSE (hPa), reference mean; finite or not."""
    n = tensors.train.num_clients
    states = expand(algorithm.client_init(down), n)
    ev = evaluate_cohort(algorithm, down, states, tensors.train, tensors.test, tensors.scaler)
    rmse = ev.test["rmse"].to(torch.float64)
    finite = bool(torch.isfinite(rmse).all()) and bool(ev.finite.all())
    return {
        "new_mean": float(rmse[new].mean()),
        "new_worst": float(rmse[new].max()),
        "ref_mean": float(rmse[~new].mean()),
        "finite": finite,
    }


def _coordinates(kind: str, algorithm, data, used) -> torch.Tensor | None:
    """The public preconditioner R of ``--coordinates`` (None: the coefficients' own)."""
    if kind == "none":
        return None
    design = algorithm.design(data.x[used])
    gram = moments(design, data.y[used][..., 0], data.mask[used]).gram.sum(0)
    if kind == "campaign":  # rows: Σ n_i = G[0, 0] (the constant term is 1)
        return prediction_coordinates(gram, float(gram[0, 0]))
    if kind != "grid":
        raise ValueError(f"--coordinates {kind!r}: expected none, grid or campaign")
    # public: the campaign's range (the study's premise)
    box = algorithm.support_box.fleet_box(gram)
    axes = [torch.linspace(0.0, 1.0, k, dtype=torch.float64) for k in (16, 6)]
    unit = torch.stack([g.flatten() for g in torch.meshgrid(*axes, indexing="ij")], -1)
    points = box[0] + unit * (box[1] - box[0])
    phi = algorithm.design(points.unsqueeze(0))[0]
    return prediction_coordinates(phi.T @ phi, float(phi.shape[0]))


def _kappa(cov: torch.Tensor) -> float:
    vals = torch.linalg.eigvalsh(cov)
    return float(vals[-1] / vals[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--units", default="2000", help="reference units per fleet")
    ap.add_argument("--new", type=int, default=30, help="new few-point units per fleet")
    ap.add_argument("--designs", default="3x2,4x3")
    ap.add_argument("--epsilons", default="1,4,8")
    ap.add_argument("--fleet-seeds", type=seed_list, default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=6, help="EM rounds of the non-private line")
    ap.add_argument("--seed", type=int, default=0, help="seed of the DP noise")
    ap.add_argument("--stages", default="4", help="stages of the one-shot release (list)")
    ap.add_argument("--first-share", type=float, default=0.1, help="stage 0's budget share")
    ap.add_argument("--quantile", type=float, default=0.9, help="adaptive clipping γ (0: off)")
    ap.add_argument("--count-share", type=float, default=0.1, help="the counts' budget share")
    ap.add_argument("--steps", type=int, default=12, help="quantile updates per stage")
    ap.add_argument(
        "--refresh-last", action="store_true", help="last stage: the whole covariance again"
    )
    ap.add_argument("--no-oracle", action="store_true")
    ap.add_argument(
        "--coordinates",
        default="grid",
        help="preconditioner(s): grid (public), none, campaign (data-dependent: not in ε)",
    )
    ap.add_argument(
        "--scales", action="store_true", help="stage 1: each coordinate's scale and median"
    )
    ap.add_argument(
        "--relevant", type=float, default=0.0, help="with --scales: refine var >= this × σ̂²"
    )
    ap.add_argument("--no-em", action="store_true", help="skip the EM line (slow at 10,000)")
    args = ap.parse_args()
    if args.quantile > 0 and args.count_share <= 0:  # the counts would go out without noise
        ap.error(f"--quantile {args.quantile} needs --count-share > 0 (or --quantile 0)")
    torch.set_num_threads(1)
    epsilons = [float(e) for e in args.epsilons.split(",")]
    stage_list = [int(s) for s in args.stages.split(",")]
    base = load_config("fewpoint")
    print(
        f"fedprior_fixed (4x3 basis, interval posterior); {args.new} new units; fleet seeds "
        f"{args.fleet_seeds}; noise seed {args.seed}; stages {stage_list}, stage-0 share "
        f"{args.first_share}, quantile {args.quantile}, count share {args.count_share}, "
        f"{args.steps} steps/stage; EM line: {args.rounds} rounds; scale stage path: hash of "
        "sensor ids"
    )
    if "campaign" in args.coordinates.split(","):
        print(
            "# campaign coordinates: R is built from every unit's own readings (data-"
            "dependent, un-noised); the printed ε does NOT cover those rows"
        )
    print(
        "| ref units | design | fleet seed | release | ε target | ε spent | new mean | new worst "
        "| ref mean | s |"
    )
    print("|---:|---|---:|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for units in [int(u) for u in args.units.split(",")]:
        delta, _ = privacy_delta(base, units + args.new)
        for design in args.designs.split(","):
            for fs in args.fleet_seeds:
                fleet_cfg = dataclasses.replace(
                    base.fleet, seed=fs, train_design=design, num_reference=units, num_new=args.new
                )
                c = replace(base, fleet=fleet_cfg)
                fleet = load_data(c)
                tensors = prepare(fleet, c.data.scaling, c.engine.dtype)
                task = build_task(c, tensors.train.x.shape[-1], {}, client_inputs(tensors))
                algorithm = replace(
                    build_algorithm("fedprior_fixed", c, task), interval="posterior"
                )
                ids = pd.Series(tensors.client_ids).map(fleet.roles)
                new = torch.tensor((ids == "new").to_numpy())
                coef, noise, used, _ = local_fits(
                    algorithm, tensors.train, 2 * algorithm.num_features
                )
                truth = Whitening(coef.mean(0), torch.cov(coef.T, correction=0), noise.mean())
                kinds = args.coordinates.split(",")
                coords = {k: _coordinates(k, algorithm, tensors.train, used) for k in kinds}
                for k, r in coords.items():
                    kappa = _kappa(truth.cov if r is None else r @ truth.cov @ r.T)
                    print(f"# {units} {design} fleet {fs}: κ of the fits' Cov, {k}: {kappa:.3g}")
                cells = [] if args.no_em else [("EM, no DP", None, None, "none")]
                cells.append(("one-shot, no noise", None, None, "none"))
                for eps in epsilons:
                    share = args.count_share if args.quantile > 0 else 0.0
                    for stages in stage_list:
                        budget = staged_budget(
                            eps, delta, stages, args.first_share, share, args.steps
                        )
                        for k in kinds:
                            tag = "" if k == "none" else f", {k}"
                            if k == "campaign":
                                tag += " (R not in ε)"
                            if args.scales:
                                tag += ", scales"
                            if args.relevant:
                                tag += f", relevant {args.relevant:g}"
                            cells.append((f"one-shot, {stages} stages{tag}", eps, budget, k))
                    if not args.no_oracle:
                        cells.append(("oracle", eps, staged_budget(eps, delta, 1), "none"))
                for label, eps, budget, kind in cells:
                    key = (units, design, label, "∞" if eps is None else f"{eps:g}")
                    spent = "—" if budget is None else f"{budget.spent:.3f}"
                    head = f"| {units} | {design} | {fs} | {label} | {key[3]} | {spent} |"
                    t0 = time.perf_counter()
                    gen = torch.Generator().manual_seed(args.seed)
                    try:
                        if label.startswith("EM"):
                            eng = EngineConfig(rounds=args.rounds, eval_every=args.rounds, seed=0)
                            down = simulate(algorithm, tensors, eng).server
                        elif label == "oracle":
                            down, _ = oneshot_prior(
                                algorithm, tensors.train, budget, gen, quantile=0.0, whiten=truth
                            )
                        else:
                            down, _ = oneshot_prior(
                                algorithm,
                                tensors.train,
                                budget,
                                gen,
                                quantile=args.quantile,
                                refresh_last=args.refresh_last,
                                coordinates=coords.get(kind),
                                scales=args.scales,
                                relevant=args.relevant,
                                keys=tensors.client_ids,
                            )
                        r = _score(algorithm, down, tensors, new)
                    except Exception as err:  # a failure is reported, never a number
                        print(f"{head} failed: {one_line(err, 120)} | | | |", flush=True)
                        rows.append((*key, float("nan"), float("nan")))
                        continue
                    wall = time.perf_counter() - t0
                    if not r["finite"]:
                        print(f"{head} non-finite sensor | | | {wall:.0f} |", flush=True)
                        rows.append((*key, float("nan"), float("nan")))
                        continue
                    print(
                        f"{head} {r['new_mean']:.4g} | {r['new_worst']:.4g} | "
                        f"{r['ref_mean']:.4g} | {wall:.0f} |",
                        flush=True,
                    )
                    rows.append((*key, r["new_mean"], r["new_worst"]))
    table = pd.DataFrame(rows, columns=["units", "design", "release", "eps", "mean", "worst"])
    print("\nOver fleet seeds: new units' mean RMSE (mean over seeds; the seeds') / worst unit")
    for key, g in table.groupby(["units", "design", "release", "eps"], sort=False):
        v, w = g["mean"].to_numpy(float), g["worst"].to_numpy(float)
        ok = np.isfinite(v).all() and np.isfinite(w).all()
        each = " / ".join(f"{x:.3g}" for x in v)
        text = f"{v.mean():.3g} ({each}); worst {w.max():.3g}" if ok else f"NaN ({each})"
        print(f"| {' | '.join(map(str, key))} | {text} | {len(g)} |")


if __name__ == "__main__":
    main()
