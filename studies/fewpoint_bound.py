"""What could ANY method do with a new unit's 6 points? A Bayes bound at 3x2 (issue 10).

The oracle of ``fewpoint_oracle.py`` bounds only Gaussian priors on a polynomial
basis. This benchmark estimates E[true pressure at an off-grid test point | the
unit's chamber points] with regressors trained on a large library of units drawn
from the simulator's own generative distribution: the same family, preset, lot
settings and chamber (the fleet seed's design plateaus and their temperature
offsets) as the mixed fleets of ``studies/fewpoint.py``, but other units
(parameters from another seed, so no evaluated unit is in the library).

The library (``fedcal_support/fewpoint_library.py``, shared with its tests) holds,
per library unit: what the design measures (the simulator's physics: noise,
the ascending branch's hysteresis, ripple, the temperature reading's bias, gain
and noise) and its noise-free truth, the inverse map P = g(f, T_read) fitted on a
dense (P, T) grid in a Legendre (5, 4) basis in fixed (f, T_read) coordinates
(fit error printed). A regressor sees exactly what a unit's points carry: its
measured frequencies and temperature readings (the chamber's reference
pressures are the design's, the same for every unit of the fleet), never the
truth. It predicts the unit's coefficients; the prediction at a test point is
the basis at the unit's measured (f, T_read) there.

Estimators (all learned on the library, fitted on its first part, tuned on a
validation part):

* ``truth``: the unit's own dense-truth coefficients: the floor no method
  passes (hysteresis of unknown direction, ripple, noise at the test point).
* ``gauss``: the best Gaussian: (c, e) jointly Gaussian with e = y − Φc the
  residuals at the 6 points (mean and 6×6 covariance from the library, so the
  ascending branch's bias is known), posterior mean μ + ΣΦᵀ(ΦΣΦᵀ + S_e)⁻¹(y − Φμ − m_e)
  with the unit's own Φ. The oracle-prior ceiling with an exact prior.
* ``quad`` / ``cubic``: ``gauss`` + a ridge regression of its error c − ĉ on
  quadratic / cubic features of the unit's 12 standardized readings.
* ``abc``: ``gauss`` + the ABC local-linear regression adjustment: on the k
  nearest library units (Mahalanobis in the readings), a weighted (Epanechnikov)
  linear regression of c − ĉ on the readings, evaluated at the unit's.
* ``mlp``: ``gauss`` + a small MLP (12 → 128 → 128 → 30) on the same error.
* ``mixture``: a mixture prior with the simulator's true cluster labels (each
  unit's parent unit, 21 components): per component a Gaussian posterior, the
  components weighted by their marginal likelihood of the unit's 6 points. Uses
  structure a federation would have to learn (which units share a parent).
* ``gmm``: the same with a Gaussian mixture fitted to the library's coefficients
  without labels (sklearn ``GaussianMixture``, K by BIC among 1, 5, 10, 21, 40).
* ``kernel``: the mixture a 20 + 20 fleet could learn: one component N(c_ref, s²Σ)
  per reference unit of the fleet (its dense truth ≈ a campaign fit), equal
  weights, the bandwidth s by the evaluated units' summed evidence.

Evaluated on the 20 new units of fleet seeds 0/1/2 (the fleets of
``studies/fewpoint.py``, their 60 off-grid test points) and, for a tighter
estimate of the same quantity, on held-out library units (``--holdout``).

    python studies/fewpoint_bound.py [--library 30000] [--fleet-seeds 0,1,2]
                                        [--design 3x2] [--holdout 5000] [--knn 1000]
                                        [--only quad,cubic,abc,mlp,kernel,mixture,gmm]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fedcal_support/ (not shipped)

from fedcal.config import load_config
from fedcal.data.simulator import sensor_parameters
from fedcal_support.fewpoint_library import (
    GRID_P,
    LIBRARY_SEED_OFFSET,
    ORDERS,
    Coordinates,
    Units,
    check_library_physics,
    dense_truth,
    draw_library,
    fleet_units,
    frequency,
    function_rmse,
    gaussian_fit,
    gaussian_posterior,
)
from fedcal_support.scripts import seed_list


class Standardizer:
    def __init__(self, x: np.ndarray):
        self.m, self.s = x.mean(0), x.std(0)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return (x - self.m) / self.s


def poly_features(z: np.ndarray, degree: int) -> np.ndarray:
    from sklearn.preprocessing import PolynomialFeatures

    return PolynomialFeatures(degree, include_bias=True).fit_transform(z)


def ridge_residual(z_fit, r_fit, z_val, r_val, metric, degree):
    """Ridge of the Gaussian's error on polynomial features; λ by validation (function metric)."""
    x_fit, x_val = poly_features(z_fit, degree), poly_features(z_val, degree)
    gram, rhs = x_fit.T @ x_fit, x_fit.T @ r_fit
    best = None
    for lam in 10.0 ** np.arange(-12, 3):
        w = np.linalg.solve(gram + lam * len(x_fit) * np.eye(len(gram)), rhs)
        err = x_val @ w - r_val
        loss = np.einsum("uk,kl,ul->", err, metric, err) / len(err)
        if best is None or loss < best[0]:
            best = (loss, lam, w)
    return best[1], best[2]


def abc_adjust(z_lib, r_lib, z_new, k: int) -> np.ndarray:
    """ABC regression adjustment: per unit, a weighted local-linear fit on k neighbours.

    Epanechnikov weights in the distance; the fit's intercept is the adjustment.
    """
    out = np.empty((len(z_new), r_lib.shape[1]))
    for i, z in enumerate(z_new):
        d = np.sqrt(((z_lib - z) ** 2).sum(1))
        nb = np.argpartition(d, k)[:k]
        h = d[nb].max()
        w = 1.0 - (d[nb] / h) ** 2
        x = np.column_stack([np.ones(k), z_lib[nb] - z])
        xw = x * w[:, None]
        beta = np.linalg.solve(xw.T @ x + 1e-8 * np.eye(x.shape[1]), xw.T @ r_lib[nb])
        out[i] = beta[0]
    return out


def mlp_residual(z_fit, r_fit, z_val, r_val, metric, seed: int, epochs: int = 60):
    """A small MLP on the Gaussian's error (loss in the function metric), early-stopped."""
    torch.manual_seed(seed)
    scale = r_fit.std(0) + 1e-12
    net = torch.nn.Sequential(
        torch.nn.Linear(z_fit.shape[1], 128),
        torch.nn.SiLU(),
        torch.nn.Linear(128, 128),
        torch.nn.SiLU(),
        torch.nn.Linear(128, r_fit.shape[1]),
    ).double()
    m = torch.as_tensor(metric * np.outer(scale, scale))
    zf, rf = torch.as_tensor(z_fit), torch.as_tensor(r_fit / scale)
    zv, rv = torch.as_tensor(z_val), torch.as_tensor(r_val / scale)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs)

    def loss_of(pred, target):
        e = pred - target
        return torch.einsum("uk,kl,ul->u", e, m, e).mean()

    best = (float("inf"), None)
    for _ in range(epochs):
        perm = torch.randperm(len(zf))
        for lo in range(0, len(zf), 256):
            b = perm[lo : lo + 256]
            opt.zero_grad()
            loss_of(net(zf[b]), rf[b]).backward()
            opt.step()
        sched.step()
        with torch.no_grad():
            val = float(loss_of(net(zv), rv))
        if val < best[0]:
            best = (val, {k: v.clone() for k, v in net.state_dict().items()})
    net.load_state_dict(best[1])

    def predict(z):
        with torch.no_grad():
            return net(torch.as_tensor(z)).numpy() * scale

    return predict


def mixture_posterior(units: Units, lib: Units, coords, m_e, s_e) -> np.ndarray:
    """Posterior mean under the parent-labelled mixture prior (one Gaussian per parent unit)."""
    means, logw = [], []
    for par in np.unique(lib.parent):
        sel = lib.parent == par
        mu_k, sig_k = lib.coef[sel].mean(0), np.cov(lib.coef[sel], rowvar=False)
        mean, loglik = gaussian_posterior(units, coords, mu_k, sig_k, m_e, s_e)
        means.append(mean)
        logw.append(loglik + np.log(sel.mean()))
    logw = np.stack(logw)
    w = np.exp(logw - logw.max(0))
    w /= w.sum(0)
    return np.einsum("ku,kuj->uj", w, np.stack(means))


def kernel_mixture(units: Units, ref_coef, sigma, coords, m_e, s_e) -> tuple[np.ndarray, float]:
    """A mixture prior with one component per reference unit: N(c_ref, s²Σ), equal weights.

    A kernel density over the fleet's calibrated units; the bandwidth s maximizes the new
    units' summed log marginal likelihood (their evidence, no test data). Returns
    (posterior means, s).
    """
    best = None
    for s in (0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.7, 1.0):
        means, logw = [], []
        for c in ref_coef:
            mean, loglik = gaussian_posterior(units, coords, c, s * s * sigma, m_e, s_e)
            means.append(mean)
            logw.append(loglik)
        logw = np.stack(logw)
        top = logw.max(0)
        evidence = float((top + np.log(np.exp(logw - top).mean(0))).sum())
        if best is None or evidence > best[0]:
            w = np.exp(logw - top)
            w /= w.sum(0)
            best = (evidence, s, np.einsum("ku,kuj->uj", w, np.stack(means)))
    return best[2], best[1]


def learned_mixture(coef: np.ndarray, seed: int) -> tuple[int, np.ndarray]:
    """A Gaussian mixture fitted to the coefficients without labels (sklearn, K by BIC).

    Returns (K, each unit's component): components are then used like parents.
    """
    from sklearn.mixture import GaussianMixture

    z = (coef - coef.mean(0)) / coef.std(0)
    best = None
    for k in (1, 5, 10, 21, 40):
        gm = GaussianMixture(k, covariance_type="full", reg_covar=1e-6, random_state=seed).fit(z)
        bic = gm.bic(z)
        if best is None or bic < best[0]:
            best = (bic, k, gm.predict(z))
    return best[1], best[2]


# ---------------------------------------------------------------------------


def run_seed(
    cfg, design: str, fleet_seed: int, n_lib: int, n_hold: int, knn: int, only: set | None = None
) -> dict:
    """One fleet seed: every estimator (or those in ``only``, plus truth and gauss)."""

    def wanted(name: str) -> bool:
        return only is None or name in only

    t0 = time.perf_counter()
    new, new_prm, spec = fleet_units(cfg, design, fleet_seed)
    check = check_library_physics(spec, new_prm, new, fleet_seed, design)
    lib_all, lib_prm = draw_library(spec, fleet_seed, design, n_lib + n_hold)
    f_edges = frequency(spec, lib_prm, np.array([[GRID_P[0], GRID_P[-1]]]), np.array([[0.0]]))
    f_lo = min(float(lib_all.f.min()), float(f_edges.min())) - 200.0
    f_hi = max(float(lib_all.f.max()), float(f_edges.max())) + 200.0
    coords = Coordinates(f_lo, f_hi)
    lib_all.coef, fit_err = dense_truth(spec, lib_prm, coords)
    new.coef, fit_err_new = dense_truth(spec, new_prm, coords)
    n_fit = int(0.8 * n_lib)
    fit, val = lib_all.take(slice(0, n_fit)), lib_all.take(slice(n_fit, n_lib))
    hold = lib_all.take(slice(n_lib, n_lib + n_hold))
    mu, sigma, m_e, s_e = gaussian_fit(fit, coords)
    # The function metric: E over test inputs of φφᵀ (coefficient error -> squared pressure error).
    phi_val = coords.basis(val.test_f, val.test_t)
    metric = np.einsum("urk,url->kl", phi_val, phi_val) / phi_val.shape[0] / phi_val.shape[1]

    std = Standardizer(fit.readings())
    gauss = {
        name: gaussian_posterior(u, coords, mu, sigma, m_e, s_e)[0]
        for name, u in (("fit", fit), ("val", val), ("hold", hold), ("new", new))
    }
    resid = {name: u.coef - gauss[name] for name, u in (("fit", fit), ("val", val))}
    z = {
        name: std(u.readings())
        for name, u in (("fit", fit), ("val", val), ("hold", hold), ("new", new))
    }
    preds = {"truth": {"hold": hold.coef, "new": new.coef}, "gauss": gauss}
    chosen = {}
    for degree, name in ((2, "quad"), (3, "cubic")):
        if not wanted(name):
            continue
        lam, w = ridge_residual(z["fit"], resid["fit"], z["val"], resid["val"], metric, degree)
        chosen[name] = f"λ={lam:g}"
        preds[name] = {k: gauss[k] + poly_features(z[k], degree) @ w for k in ("hold", "new")}
    if wanted("abc"):
        # ABC: whiten the readings by the library's covariance (Mahalanobis neighbours).
        vals, vecs = np.linalg.eigh(np.cov(z["fit"], rowvar=False))
        white = vecs / np.sqrt(np.maximum(vals, 1e-12 * vals.max()))
        zl = z["fit"] @ white
        preds["abc"] = {
            k: gauss[k][:2000] + abc_adjust(zl, resid["fit"], z[k][:2000] @ white, knn)
            for k in ("hold", "new")
        }
    if wanted("mlp"):
        mlp = mlp_residual(z["fit"], resid["fit"], z["val"], resid["val"], metric, fleet_seed)
        preds["mlp"] = {k: gauss[k] + mlp(z[k]) for k in ("hold", "new")}
    if wanted("kernel"):
        ref_prm = sensor_parameters(spec, fleet_seed).iloc[: spec.num_reference]
        ref_coef, _ = dense_truth(spec, ref_prm, coords)
        preds["kernel"] = {}
        for k, u in (("hold", hold), ("new", new)):
            preds["kernel"][k], bandwidth = kernel_mixture(u, ref_coef, sigma, coords, m_e, s_e)
            if k == "new":
                chosen["kernel"] = f"s={bandwidth:g} on the new units"
    if wanted("mixture"):
        preds["mixture"] = {
            k: mixture_posterior(u, fit, coords, m_e, s_e)
            for k, u in (("hold", hold), ("new", new))
        }
    if wanted("gmm"):
        comps, labels = learned_mixture(fit.coef, fleet_seed)
        chosen["gmm"] = f"K={comps}"
        unlabelled = dataclasses.replace(fit, parent=labels)
        preds["gmm"] = {
            k: mixture_posterior(u, unlabelled, coords, m_e, s_e)
            for k, u in (("hold", hold), ("new", new))
        }
    out = {"check": check, "fit_err": max(fit_err, fit_err_new), "chosen": chosen}
    for name, p in preds.items():
        hold_part = hold if name != "abc" else hold.take(slice(0, 2000))
        r_new = function_rmse(p["new"], new, coords)
        r_hold = function_rmse(p["hold"], hold_part, coords)
        out[name] = (r_new.mean(), r_new.max(), r_hold.mean(), np.quantile(r_hold, 0.95))
    out["wall"] = time.perf_counter() - t0
    return out


NAMES = ("truth", "gauss", "quad", "cubic", "abc", "mlp", "kernel", "mixture", "gmm")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--design", default="3x2")
    ap.add_argument("--fleet-seeds", type=seed_list, default=[0, 1, 2])
    ap.add_argument("--library", type=int, default=30000, help="library units (fit + validation)")
    ap.add_argument("--holdout", type=int, default=5000, help="held-out library units")
    ap.add_argument("--knn", type=int, default=1000)
    ap.add_argument("--only", default=None, help="estimators to run (truth, gauss: always)")
    args = ap.parse_args()
    only = None if args.only is None else set(args.only.split(","))
    torch.set_num_threads(1)
    cfg = load_config("fewpoint")
    seeds = args.fleet_seeds
    print(
        f"design {args.design}; library {args.library} units (80 % fit, 20 % validation) +"
        f" {args.holdout} held out, parameters from seed {LIBRARY_SEED_OFFSET} + fleet seed;"
        f" truth on Legendre {ORDERS} in (f, T_read); RMSE in hPa over 60 off-grid test points"
    )
    print(
        "| fleet seed | estimator | fleet's 20 new units: mean / worst"
        " | held-out library units: mean / 95th percentile |"
    )
    print("|---|---|---|---|")
    results = []
    for fs in seeds:
        res = run_seed(cfg, args.design, fs, args.library, args.holdout, args.knn, only)
        results.append(res)
        for name in (n for n in NAMES if n in res):
            a = res[name]
            extra = f" ({res['chosen'][name]})" if name in res["chosen"] else ""
            print(f"| {fs} | {name}{extra} | {a[0]:.4f} / {a[1]:.4f} | {a[2]:.4f} / {a[3]:.4f} |")
        print(
            f"| {fs} | (checks) | physics vs the fleet's frame: max |Δf| {res['check']:.2e} Hz;"
            f" dense-truth fit error ≤ {res['fit_err']:.2e} hPa | wall {res['wall']:.0f} s |",
            flush=True,
        )
    for name in (n for n in NAMES if n in results[0]):
        a = np.mean([r[name] for r in results], axis=0)
        print(f"| **mean** | {name} | {a[0]:.4f} / {a[1]:.4f} | {a[2]:.4f} / {a[3]:.4f} |")


if __name__ == "__main__":
    main()
