"""What the released spread must hold: the fits' own moments edited, no DP (docs/safety.md,
"Sixth session").

Fleets as studies/dp_oneshot.py; in the campaign's prediction coordinates u = R ĉ
(fedprior_oneshot.prediction_coordinates on the reference units' pooled design) it prints
the spectrum of Cov(u)/σ̄² (σ̄² the fits' mean noise), κ of the covariance and of the
correlation in ĉ, grid and campaign coordinates, and the new units' mean / worst test RMSE
(hPa) under the fits' mean and a covariance edited in u: eigenvalues below τσ̄² raised to
τσ̄²; the whole × 100; only the diagonal (× 1, × 4); the correlation's eigenvalues raised
to a floor; the correlation kept only among the coordinates of variance ≥ 0.1 σ̄².

    python studies/dp_oneshot_shape.py --units 2000 --designs 3x2,4x3 --fleet-seed 0
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # dp_oneshot (its helpers)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fedcal_support/ (not shipped)

from dp_oneshot import _coordinates, _score

from fedcal.algorithms.fedprior_oneshot import local_fits
from fedcal.config import load_config
from fedcal.core.bayes import moments
from fedcal.core.privacy import psd_projection
from fedcal.engine.simulation import prepare
from fedcal.experiment import build_algorithm, build_task, client_inputs, load_data


def _corr(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = cov.diagonal().sqrt()
    return d, cov / d[:, None] / d[None, :]


def _design(design: str, args: argparse.Namespace, base) -> None:
    """One design's spectra, κ and edited-moment scores."""
    fleet_cfg = dataclasses.replace(
        base.fleet,
        seed=args.fleet_seed,
        train_design=design,
        num_reference=args.units,
        num_new=args.new,
    )
    c = replace(base, fleet=fleet_cfg)
    fleet = load_data(c)
    tensors = prepare(fleet, c.data.scaling, c.engine.dtype)
    task = build_task(c, tensors.train.x.shape[-1], {}, client_inputs(tensors))
    alg = replace(build_algorithm("fedprior_fixed", c, task), interval="posterior")
    new = torch.tensor((pd.Series(tensors.client_ids).map(fleet.roles) == "new").to_numpy())
    coef, noise, used, _ = local_fits(alg, tensors.train, 2 * alg.num_features)
    data = tensors.train
    gram = moments(alg.design(data.x[used]), data.y[used][..., 0], data.mask[used]).gram
    box = alg.support_box.fleet_box(gram.sum(0))
    s2 = noise.mean()
    for kind in ("none", "grid", "campaign"):
        r = _coordinates(kind, alg, data, used)
        cov = torch.cov((coef if r is None else coef @ r.T).T, correction=0)
        k_cov = torch.linalg.eigvalsh(cov)
        k_corr = torch.linalg.eigvalsh(_corr(cov)[1])
        print(
            f"{design} {kind}: κ covariance {float(k_cov[-1] / k_cov[0]):.3g}, "
            f"correlation {float(k_corr[-1] / k_corr[0]):.3g}"
        )
    r = _coordinates("campaign", alg, data, used)
    r_inv = torch.linalg.inv(r)
    u = coef @ r.T
    mu, cov = u.mean(0), torch.cov(u.T, correction=0)
    vals, vecs = torch.linalg.eigh(cov / s2)
    print(f"{design} Cov(u)/σ̄²:", " ".join(f"{v:.2g}" for v in vals.flip(0).tolist()))

    def score(label: str, cov_u: torch.Tensor) -> None:
        sigma = r_inv @ cov_u @ r_inv.T
        down = {
            "mu": r_inv @ mu,
            "sigma": 0.5 * (sigma + sigma.T),
            "noise_var": s2.reshape(()),
            "box": box,
        }
        out = _score(alg, down, tensors, new)
        print(f"| {design} | {label} | {out['new_mean']:.4g} | {out['new_worst']:.4g} |")

    score("the fits' moments", cov)
    for tau in (0.1, 1.0, 10.0, 100.0):
        score(f"eigenvalues ≥ {tau:g} σ̄²", vecs @ torch.diag(vals.clamp_min(tau)) @ vecs.T * s2)
    score("Σ × 100", 100 * cov)
    d, corr = _corr(cov)
    for f in (1.0, 4.0):
        score(f"diagonal × {f:g}", torch.diag(f * d * d))
    for fl in (0.1, 0.5, 2.0):
        score(
            f"correlation eigenvalues ≥ {fl:g}",
            d[:, None] * psd_projection(corr, fl) * d[None, :],
        )
    idx = torch.nonzero(cov.diagonal() >= 0.1 * s2)[:, 0]
    for fl in (0.0, 0.5, 2.0):
        block = torch.diag(cov.diagonal().clone())
        ds = d[idx]
        sub = psd_projection(corr[idx][:, idx], fl)
        block[idx.unsqueeze(1), idx.unsqueeze(0)] = ds[:, None] * sub * ds[None, :]
        score(f"correlation among the {len(idx)} ≥ 0.1 σ̄² only, eigenvalues ≥ {fl:g}", block)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--units", type=int, default=2000)
    ap.add_argument("--new", type=int, default=30)
    ap.add_argument("--designs", default="3x2,4x3")
    ap.add_argument("--fleet-seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = load_config("fewpoint")
    for design in args.designs.split(","):
        _design(design, args, base)


if __name__ == "__main__":
    main()
