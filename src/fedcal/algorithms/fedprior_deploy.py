"""The prior's design-dependent error, learned from the reference units alone (issue 33).

The model and its variance are :mod:`fedcal.prior.discrepancy` (D1–D4). Here: how the
fleet's reference units learn its numbers at the end of a run, and how a unit calibrated
later from ``prior.json`` gets its σ.

E1. **Who learns.** Units with at least :data:`REFERENCE_ROWS` calibration rows (a full
    campaign: every design below is a small part of it; at most :data:`MAX_REFERENCES` of
    them, evenly in the fleet's order, so a 10,000-unit fleet's emulation costs what 64
    units' does; the leave-one-out's fleet sums are one chunked pass). Only a fleet of
    such units learns (a fleet with few-point units has I2's τ² from them, :func:`learn`);
    fewer than two: nothing is learned (prior.json has no ``discrepancy``; ``calibrate``
    keeps fedprior I2–I4's rule).
E2. **The designs each emulates** (:func:`unit_designs`), as new units are measured: P × T
    grids 3×2, 4×3, 6×4, 8×5 (6–40 points, pressure ends and temperature ends included),
    the largest grid the unit's campaign holds within
    :data:`~fedcal.algorithms.fedprior_deployed.DEPLOY_ROWS` = 64 points ("max-grid":
    T = its plateaus (≤ 8), P = min(its fewest ascending levels on a plateau − 1, ⌊64/T⌋),
    so that every plateau keeps held-out levels; kept if over 40 points: a 384-point
    fedcal campaign 10×6 = 60; a 9-level cross-check grid 8×5, not kept; a unit without
    plateaus none; the model's ``max_points`` is the largest size emulated, beyond which a
    new unit is declined) and two draws each
    of random 2- and 3-plateau designs (plateaus spread over at least half the span,
    3–4 points per plateau, pressure ends included), in positions of the unit's
    own span (:func:`~fedcal.algorithms.fedprior_interval_parts.span_positions`). The plateau input
    is the one with the fewest distinct levels (ties: the last, temperature in fedcal's
    schemas). A unit whose rows sit on plateaus (a campaign) takes, per design plateau,
    its nearest plateau and on it the rows nearest the design's pressure positions within
    that plateau's own range (an ascending-sweep row where directions are known, as new
    units are measured); a unit without plateaus (Latin hypercube) its rows nearest the
    design's points. It fits its posterior from those rows alone under its
    leave-one-out prior (:func:`_leave_one_out`: a new unit is not in the prior, and a
    reference unit is, by 1/N of it) and predicts all its other rows: errors e, the
    basis part v_c of the model's variance, the shape q of D2 (at most about
    :data:`HELD_ROWS` of them, evenly in its row order: :func:`_thin`).
E3. **β, a², ℓ** (uploaded: for each point of :data:`BETA_GRID` × :data:`AMP_GRID` ×
    :data:`LENGTH_GRID`, the summed Gaussian log density of its held-out errors under
    β v_c + σ² + a² q): the server takes the arg-max of the pooled sums.
E4. **ν₀, κ(n)** (given β, a², ℓ; uploaded per knot of design size, ν₀ of
    :data:`~fedcal.algorithms.fedprior_deploy_kappa.NU_GRID` and κ of its ``KAPPA_GRID``:
    the held-out rows inside the 95 % interval of D3–D4 and the summed Student-t log
    density, each design weighted by its nearness to the knot in log n): per knot the
    smallest κ whose coverage reaches 95 %, ν₀ the one whose log score at those κ is
    highest (∞ included: no per-unit scale): :mod:`fedcal.algorithms.fedprior_deploy_kappa`
    E4a–E4b; with them, per knot and ν₀, Σ_b w_bk s_b² and Σ_b w_bk: the mean per-unit
    scale E[s²] at each knot for the chosen ν₀ (E4c, the planner's forecast). Then (a
    second upload, sums only) each family's held-out rows inside its
    designs' κ(n) interval: the record's coverage. One length scale ℓ is fitted, shared by
    every input (the record lists it once per input).
E5. **The record** (:class:`~fedcal.prior.discrepancy.Discrepancy`): β, a², ℓ, κ (pooled),
    the knots of κ(n), ν₀, each family's coverage at κ(n) (in-sample: κ was chosen on those
    very rows, so each knot's weighted share is 95 % by construction; a family's own share
    says how even the fit is), and
    the span of designs emulated (fewest points, plateaus,
    share of each input's span) by which :func:`~fedcal.prior.design_span.design_reason`
    declines a new unit's design the references did not span.
E6. **How much the emulated designs relied on the prior** (``max_reliance``, D6):
    :mod:`fedcal.algorithms.fedprior_deploy_reliance`; a new design that leans on the
    prior beyond it by more than the 93–97 % band tolerates is declined
    (:func:`~fedcal.prior.design_span.reliance_reason`).

Only sums over a unit's own rows leave it (E3, E4, E6); the engine here is the run's end
(:meth:`~fedcal.algorithms.fedprior.FedPrior.deploy_state`), on the
final prior, once: not every round.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch
from torch import Tensor

from fedcal.algorithms.fedprior_deploy_kappa import (
    KAPPA_GRID,
    NU_GRID,
    KappaChoice,
    choose,
    knot_weights,
)
from fedcal.algorithms.fedprior_deploy_reliance import max_reliance, reliance_sums
from fedcal.algorithms.fedprior_deployed import DEPLOY_ROWS, prior_in_use
from fedcal.algorithms.fedprior_loo import _leave_one_out
from fedcal.core.bayes import F64, moments
from fedcal.core.data import ClientData
from fedcal.core.tree import Tree, gather
from fedcal.models.basis import legendre_products
from fedcal.prior.design_span import reliance_gram
from fedcal.prior.discrepancy import (
    AMP_RATIO_MAX,
    BETA_RANGE,
    Z95,
    Discrepancy,
    interval_factor,
    kappa_at,
    prior_distance,
    smoother,
    smoother_q,
    unit_scale,
)

REFERENCE_ROWS = 33  # E1: more rows than fedprior's few-point class (probe_rows = 32)
MAX_REFERENCES = 64  # E1: at most this many reference units emulate (evenly chosen)
HELD_ROWS = 128  # E2: held-out rows scored per emulated design, at most about this many
LEVEL_TOL = 0.02  # rows within 2 % of the span are one level (plateau)
# E3: a² relative to the fleet's noise σ² (0.25 decades), ℓ in scaled inputs ([-1, 1])
AMP_GRID = torch.logspace(-2, math.log10(AMP_RATIO_MAX), 49, dtype=F64)
LENGTH_GRID = (0.03, 0.05, 0.1, 0.2, 0.35, 0.6, 1.0, 2.0)
BETA_GRID = torch.logspace(
    *(math.log10(b) for b in BETA_RANGE), 11, dtype=F64
)  # β of D2 (the basis part's factor)
# E2: the fixed grids, the random plateau designs, the unit's largest grid (≤ DEPLOY_ROWS)
FAMILIES = ("3x2", "4x3", "6x4", "8x5", "2-plateau", "3-plateau", "max-grid")
GRIDS = {"3x2": (3, 2), "4x3": (4, 3), "6x4": (6, 4), "8x5": (8, 5)}
DRAWS = 2  # random designs per random family and unit


def _span_positions(x: np.ndarray) -> np.ndarray:
    lo, hi = x.min(0), x.max(0)
    return (x - lo) / np.maximum(hi - lo, 1e-12)


def _level_ids(v: np.ndarray, tol: float) -> tuple[np.ndarray, np.ndarray]:
    """Level of each value (gaps above ``tol`` split levels) and the levels' centres."""
    order = np.argsort(v, kind="stable")
    ids = np.empty(len(v), dtype=int)
    ids[order] = np.concatenate([[0], np.cumsum(np.diff(v[order]) > tol)])
    centres = np.array([v[ids == k].mean() for k in range(ids.max() + 1)])
    return ids, centres


def plateau_input(x: np.ndarray) -> int:
    """The input with the fewest levels (E2; ties: the last)."""
    u = _span_positions(x)
    count = [len(_level_ids(u[:, j], LEVEL_TOL)[1]) for j in range(x.shape[1])]
    return int(len(count) - 1 - np.argmin(count[::-1]))


def _draw(
    rng: np.random.Generator, family: str, largest: tuple[int, int] | None = None
) -> list[tuple[float, list[float]]]:
    """A design as (plateau position, pressure positions) in the unit's span (E2);
    ``largest`` the unit's own max-grid (P, T)."""
    if family in GRIDS or family == "max-grid":
        p, t = GRIDS.get(family, largest)
        return [(tk, list(np.linspace(0, 1, p))) for tk in np.linspace(0, 1, t)]
    if family == "2-plateau":
        t1 = rng.uniform(0, 0.5)
        ts, r = [t1, rng.uniform(t1 + 0.5, 1.0)], int(rng.choice([3, 4]))
    else:
        t1, t3 = rng.uniform(0, 0.25), rng.uniform(0.75, 1.0)
        ts, r = [t1, rng.uniform(t1 + 0.2, t3 - 0.2), t3], int(rng.choice([3, 4]))
    return [(tk, [0.0, *sorted(rng.uniform(0, 1, r - 2)), 1.0]) for tk in ts]


def unit_designs(x: np.ndarray, up: np.ndarray, seed: int) -> list[tuple[int, np.ndarray]]:
    """E2: (family index, the unit's row indices) of every design a reference unit emulates.

    ``x`` its calibration inputs (rows, d), ``up`` whether each row is of an ascending sweep
    (all True without directions), ``seed`` its own draw of the random designs."""
    rng = np.random.default_rng([seed, 33])
    u = _span_positions(x)
    d = x.shape[1]
    j = plateau_input(x)
    ids, centres = _level_ids(u[:, j], LEVEL_TOL)
    # plateaus: at least two levels, each a few rows held within 5 % of the span (a Latin
    # hypercube's levels chain into wide clusters: no plateaus)
    width = np.array([np.ptp(u[ids == k, j]) for k in range(len(centres))])
    plateaus = d == 2 and len(centres) >= 2 and len(x) >= 3 * len(centres) and width.max() <= 0.05
    largest = _largest_grid(u, up, ids, len(centres), j) if plateaus else None
    out = []
    for f, family in enumerate(FAMILIES):
        if family == "max-grid" and largest is None:
            continue
        for _ in range(1 if family in GRIDS or family == "max-grid" else DRAWS):
            design, rows, used = _draw(rng, family, largest), [], set()
            for tk, ps in design:
                if plateaus:
                    free = [k for k in range(len(centres)) if k not in used]
                    if not free:  # more design plateaus than the unit has: fewer
                        break
                    k = free[int(np.argmin(np.abs(centres[free] - tk)))]
                    used.add(k)
                    pool = np.flatnonzero((ids == k) & up)
                    pool = pool if len(pool) else np.flatnonzero(ids == k)
                    w = _span_positions(u[pool][:, [1 - j]])[:, 0]
                    targets = [(pool, w, p) for p in ps]
                else:
                    pool = np.flatnonzero(up) if up.any() else np.arange(len(x))
                    other = np.delete(u[pool], j, axis=1)
                    targets = []
                    for p in ps:
                        dist = np.sqrt(((other - p) ** 2).sum(1) + (u[pool, j] - tk) ** 2)
                        targets.append((pool, dist, None))
                for pool, w, p in targets:
                    dist = np.abs(w - p) if p is not None else w.copy()
                    dist[np.isin(pool, rows)] = np.inf
                    if np.isfinite(dist).any():
                        rows.append(int(pool[int(np.argmin(dist))]))
            out.append((f, np.array(sorted(rows))))
    return out


def _largest_grid(
    u: np.ndarray, up: np.ndarray, ids: np.ndarray, plateaus: int, j: int
) -> tuple[int, int] | None:
    """E2's max-grid (P, T) of a campaign unit: T = its plateaus (≤ 8), P = its fewest
    ascending levels of the other input on a plateau, less one, within DEPLOY_ROWS / T;
    None unless larger than the largest fixed grid (40 points)."""
    t = min(plateaus, 8)
    fewest = min(
        len(
            _level_ids(
                u[(ids == k) & up if ((ids == k) & up).any() else ids == k, 1 - j], LEVEL_TOL
            )[1]
        )
        for k in range(plateaus)
    )
    p = min(fewest - 1, DEPLOY_ROWS // t)
    fixed = max(a * b for a, b in GRIDS.values())
    return (p, t) if p >= 2 and p * t > fixed else None


def _emulation(alg, down: Tree, data: ClientData, refs: Tensor) -> dict[str, Tensor]:
    """E2 for every reference unit at once: one pseudo-unit per (unit, design)."""
    # the references' rows alone in float64 (not the fleet's: 1.4 GB at 100,000 units)
    x, y, mask = (t[refs].to(F64) for t in (data.x, data.y[..., 0], data.mask))
    branch = data.branch
    fam, unit, keeps = [], [], []
    for j, i in enumerate(refs.tolist()):
        n = int(data.count[i])
        xi = x[j, :n].numpy()
        up = np.ones(n, bool) if branch is None else branch[i, :n].numpy() >= 0
        for f, rows in unit_designs(xi, up, i):
            keep = torch.zeros(x.shape[1], dtype=F64)
            keep[torch.as_tensor(rows)] = 1.0
            fam.append(f)
            unit.append(i)
            keeps.append(keep)
    idx = torch.tensor(unit)
    at = torch.searchsorted(refs, idx)  # refs ascending: each pseudo-unit's reference row
    keep = torch.stack(keeps)
    xb, yb, mb = x[at], y[at], mask[at]
    bb = None if branch is None else branch[idx]
    sub = {k: v for k, v in down.items() if k != "cand"}
    loo = _leave_one_out(alg, sub, data, refs)  # rows in refs' order
    down_b = {**gather(sub, idx), **gather(loo, at)}
    z = alg.design(xb, bb).to(F64)
    state = {"noise_var": down_b["noise_var"]}  # the fleet's σ² (a new unit has no own yet)
    coef, cov, noise = alg.calibrated._fit(down_b, state, moments(z, yb, keep))
    mean, v0 = alg.calibrated._mean_var(coef, cov, noise, xb, down_b)
    nmax = int(keep.sum(1).max())
    order = torch.argsort(keep, dim=1, descending=True, stable=True)[:, :nmax]
    km = keep.gather(1, order)
    zd = z.gather(1, order.unsqueeze(-1).expand(-1, -1, z.shape[-1])) * km.unsqueeze(-1)
    xd = xb.gather(1, order.unsqueeze(-1).expand(-1, -1, xb.shape[-1]))
    yd = yb.gather(1, order)
    p = len(alg.terms)
    sigma, mu = prior_in_use(down_b)
    resid = (yd - (zd * mu.unsqueeze(1)).sum(-1)) * km  # y_D − Z_Dμ (D4)
    held = _thin(mb * (1 - keep))  # the scored rows, gathered to the front (E3–E4 cost)
    width = int(held.sum(1).max())
    rows = torch.argsort(held, dim=1, descending=True, stable=True)[:, :width]
    xh = xb.gather(1, rows.unsqueeze(-1).expand(-1, -1, xb.shape[-1]))
    return {
        "family": torch.tensor(fam),
        "unit": at,  # each design's reference unit, by its place in refs
        "held": held.gather(1, rows),
        "err2": (yb - mean).square().gather(1, rows),
        "vc": (v0 - noise.reshape(-1, 1)).clamp_min(0.0).gather(1, rows),  # φᵀVφ (D2)
        "sn": noise.reshape(-1, 1).expand(-1, width),
        "x": xh,
        "phi": legendre_products(xh, alg.terms),
        "xd": xd,
        "km": km,
        "zd": zd,
        "a": smoother(zd, cov[..., :, :p], noise, km),
        "cov": cov,
        "sigma": sigma,
        "noise": noise.reshape(-1),
        "resid": resid,
        "dof": km.sum(1),
    }


def _thin(held: Tensor, cap: int = HELD_ROWS) -> Tensor:
    """At most about ``cap`` held-out rows per emulated design: every k-th in the unit's row
    order, k = ⌈held/cap⌉ (a campaign's 378 → 126; the cost of E3–E4 is per held row)."""
    rank = held.cumsum(1) - 1
    step = torch.ceil(held.sum(1, keepdim=True) / cap).clamp_min(1.0)
    return held * (torch.remainder(rank, step) == 0).to(F64)


def _per_unit(values: Tensor, unit: Tensor, units: int) -> Tensor:
    """Sum the pseudo-units' (designs') values into their units': what each unit uploads."""
    out = torch.zeros(units, *values.shape[1:], dtype=F64)
    return out.index_add_(0, unit, values)


def hyper_sums(em: dict[str, Tensor], noise: float, units: int) -> Tensor:
    """E3's uploads: per unit, the held-out Gaussian log density of its errors under
    β v_c + σ² + a² q per (β, a², ℓ) of the grids: (units, β, a², ℓ)."""
    amps = AMP_GRID * noise
    out = []
    for ell in LENGTH_GRID:
        lengths = torch.full((em["x"].shape[-1],), ell, dtype=F64)
        q = smoother_q(em["x"], em["phi"], em["xd"], em["km"], em["a"], lengths)
        per_beta = []
        for beta in BETA_GRID:
            v = (beta * em["vc"] + em["sn"]).unsqueeze(0) + amps.reshape(-1, 1, 1) * q.unsqueeze(0)
            dens = -0.5 * (torch.log(2 * math.pi * v) + em["err2"].unsqueeze(0) / v)
            per_beta.append((dens * em["held"].unsqueeze(0)).sum(-1).T)  # (B, A)
        out.append(torch.stack(per_beta, 1))  # (B, β, A)
    return _per_unit(torch.stack(out, -1), em["unit"], units)


def _t_logpdf(e2: Tensor, scale2: Tensor, nu: Tensor | float) -> Tensor:
    if isinstance(nu, float) and math.isinf(nu):
        return -0.5 * (torch.log(2 * math.pi * scale2) + e2 / scale2)
    nu = torch.as_tensor(nu, dtype=F64)
    return (
        torch.lgamma((nu + 1) / 2)
        - torch.lgamma(nu / 2)
        - 0.5 * torch.log(nu * math.pi * scale2)
        - (nu + 1) / 2 * torch.log1p(e2 / (nu * scale2))
    )


def _standardised(
    em: dict[str, Tensor], beta: float, amplitude: float, lengths: Tensor
) -> tuple[Tensor, Tensor]:
    """v = β v_c + σ² + a² q on the held-out rows (D2) and d_i²/n_i of each design (D4)."""
    q = smoother_q(em["x"], em["phi"], em["xd"], em["km"], em["a"], lengths)
    v = beta * em["vc"] + em["sn"] + amplitude * q
    d2 = prior_distance(
        em["zd"],
        beta * em["sigma"],
        em["noise"],
        em["xd"],
        em["km"],
        amplitude,
        lengths,
        em["resid"],
    )
    return v, d2 / em["dof"]


def _scaled(em: dict[str, Tensor], v: Tensor, ratio: Tensor, nu0: float) -> Tensor:
    """s_i² (t/1.96)² v (D3–D4 without κ²) per held-out row."""
    s2 = unit_scale(nu0, em["dof"], ratio).unsqueeze(-1)
    return interval_factor(nu0, em["dof"]).unsqueeze(-1) * s2 * v


def scale_sums(
    em: dict[str, Tensor], beta: float, amplitude: float, lengths: Tensor, units: int
) -> dict[str, Tensor]:
    """E4's uploads per unit (E4a of :mod:`~fedcal.algorithms.fedprior_deploy_kappa`):
    ``inside`` (units, knots, ν₀, κ) weighted held-out rows within the 95 % interval,
    ``held`` (units, knots) weighted held-out rows, ``logn`` (units, knots) their weighted
    log design size, ``score`` (units, knots, ν₀, κ) the weighted t log density;
    ``designs`` (units, knots) Σ_b w_bk and ``s2`` (units, knots, ν₀) Σ_b w_bk s_b² (E4c)."""
    v, ratio = _standardised(em, beta, amplitude, lengths)
    inside, score = [], []
    k2 = KAPPA_GRID.square().reshape(-1, 1, 1)
    s2 = torch.stack([unit_scale(nu0, em["dof"], ratio) for nu0 in NU_GRID], -1)  # (B, ν₀)
    for nu0 in NU_GRID:
        scaled = _scaled(em, v, ratio, nu0)
        need = em["err2"] / (Z95**2 * scaled).clamp_min(1e-300)  # κ² at which e is inside
        within = (need.unsqueeze(0) <= k2).to(F64) * em["held"].unsqueeze(0)  # (G, B, rows)
        inside.append(within.sum(-1).T)  # (B, G)
        nu = nu0 if math.isinf(nu0) else (nu0 + em["dof"]).unsqueeze(-1)
        dens = _t_logpdf(em["err2"].unsqueeze(0), k2 * scaled, nu)
        score.append((dens * em["held"].unsqueeze(0)).sum(-1).T)  # (B, G)
    w = knot_weights(em["dof"])  # (B, knots)
    rows = em["held"].sum(-1, keepdim=True)  # (B, 1)
    spread = w.reshape(*w.shape, 1, 1)
    return {
        "inside": _per_unit(spread * torch.stack(inside, 1).unsqueeze(1), em["unit"], units),
        "held": _per_unit(w * rows, em["unit"], units),
        "logn": _per_unit(w * rows * em["dof"].log().unsqueeze(-1), em["unit"], units),
        "score": _per_unit(spread * torch.stack(score, 1).unsqueeze(1), em["unit"], units),
        "designs": _per_unit(w, em["unit"], units),  # E4c: Σ_b w_bk
        "s2": _per_unit(w.unsqueeze(-1) * s2.unsqueeze(1), em["unit"], units),  # Σ_b w_bk s_b²
    }


def family_sums(em: dict[str, Tensor], model: Discrepancy, units: int) -> tuple[Tensor, Tensor]:
    """E4's second upload (E5's record): per unit and design family, the held-out rows
    inside the 95 % interval of its designs' κ(n) (D3), and the held-out rows: (units, F)."""
    lengths = torch.tensor(model.lengths, dtype=F64)
    v, ratio = _standardised(em, model.beta, model.amplitude, lengths)
    k2 = kappa_at(model, em["dof"]).square().unsqueeze(-1)
    inside = (em["err2"] <= Z95**2 * k2 * _scaled(em, v, ratio, model.nu0)).to(F64)
    onehot = torch.zeros(len(em["family"]), len(FAMILIES), dtype=F64)
    onehot[torch.arange(len(em["family"])), em["family"]] = 1.0
    per = (inside * em["held"]).sum(-1, keepdim=True) * onehot
    return _per_unit(per, em["unit"], units), _per_unit(
        em["held"].sum(-1, keepdim=True) * onehot, em["unit"], units
    )


def deploy_state(alg, server: Tree, data: ClientData) -> dict | None:
    """The prior's design-dependent error model learned by the reference units at the run's
    end (E1–E5), as prior.json's ``"discrepancy"`` (``FedPrior.deploy_state``); None when not
    learned (``deploy = "off"``, the model's own interval, the noise model's weighted rows or
    drift: not emulated; ``noise = "sensor"``: the emulation fits with the fleet's σ² while
    ``calibrate`` states a unit's σ with its own σ_i², so κ would be learned for another noise
    rule; fewer than two reference units)."""
    if alg.deploy != "learn" or alg.interval != "calibrated" or alg.noise_model.weighted:
        return None
    if alg.noise == "sensor" or hasattr(alg, "drift_fit"):  # fedprior_drift: not emulated
        return None
    model = learn(alg, server, data)
    return None if model is None else model.to_dict()


def learn(alg, server: Tree, data: ClientData) -> Discrepancy | None:
    """E1–E5 on the final prior: the model, or None (fewer than two reference units, a
    fleet with few-point units, or no κ of the grid covers).

    A fleet with units of fewer than :data:`REFERENCE_ROWS` rows learns nothing here: its
    few-point units give I2 its τ² directly, and removing one of its few references there
    changes which directions the prior determines and Σ itself (measured on 3 campaign
    units among 24 six-point units: the exact refit without one moved the prior mean on its
    rows by 79 hPa and its σ from 116 to 179 hPa, which no one-step removal reproduces)."""
    refs = torch.nonzero(data.count >= REFERENCE_ROWS)[:, 0]
    if refs.numel() < 2 or refs.numel() < data.num_clients:
        return None
    if refs.numel() > MAX_REFERENCES:  # evenly over the fleet's order: bounded memory and time
        refs = refs[torch.linspace(0, refs.numel() - 1, MAX_REFERENCES).round().long()]
    down = {
        k: v.unsqueeze(0).expand(data.num_clients, *v.shape)
        for k, v in alg.broadcast(server).items()
        if k != "cand"
    }
    noise = float(server["noise_var"])
    with torch.no_grad():
        em = _emulation(alg, down, data, refs)
        # only the references emulate: only their uploads are summed (every unit's, zeros
        # for the others, were 13.5 GB at 100,000 units)
        units = refs.numel()
        hyper = hyper_sums(em, noise, units).sum(0)  # the server's pooled sums
        b, a, ell = np.unravel_index(int(torch.argmax(hyper)), tuple(hyper.shape))
        beta, amplitude = float(BETA_GRID[b]), float(AMP_GRID[a]) * noise
        lengths = torch.full((data.x.shape[-1],), LENGTH_GRID[ell], dtype=F64)
        pick: KappaChoice = choose(scale_sums(em, beta, amplitude, lengths, units))
        if pick.nu < 0:
            return None
        model = Discrepancy(
            beta=beta,
            amplitude=amplitude,
            lengths=tuple(lengths.tolist()),
            kappa=pick.kappa,
            nu0=NU_GRID[pick.nu],
            **_span_record(em, data, refs),
            level_tol=LEVEL_TOL,
            units=int(refs.numel()),
            kappa_points=pick.knots,
            mean_scale2=pick.scales,
        )
        inside, held = (t.sum(0) for t in family_sums(em, model, units))
        gram = torch.as_tensor(reliance_gram(model.box_lo, model.box_hi, alg.terms))
        u_ref = max_reliance(reliance_sums(em, gram, units))  # E6
    return replace(
        model,
        max_reliance=u_ref,
        coverage=tuple(
            (f, float(h), round(float(i / h), 4))
            for f, h, i in zip(FAMILIES, held.tolist(), inside.tolist(), strict=True)
            if h > 0
        ),
    )


def _span_record(em: dict[str, Tensor], data: ClientData, refs: Tensor) -> dict:
    """E5: the references' input box and the span of the designs they emulated."""
    x, mask = data.x[refs].to(F64), data.mask[refs] > 0
    lo = torch.where(mask.unsqueeze(-1), x, math.inf).amin((0, 1))
    hi = torch.where(mask.unsqueeze(-1), x, -math.inf).amax((0, 1))
    km = em["km"] > 0
    wide = torch.where(km.unsqueeze(-1), em["xd"], -math.inf).amax(1)
    narrow = torch.where(km.unsqueeze(-1), em["xd"], math.inf).amin(1)
    share = ((wide - narrow) / (hi - lo)).amin(0) - 0.05  # slack: a design's own readings
    j = plateau_input(x[0, : int(data.count[refs[0]])].numpy())
    # the response inputs' span also varies unit to unit (each its own frequencies): only
    # half of the narrowest emulated is asked of a new design there; the plateaus' in full
    share = torch.where(torch.arange(share.shape[0]) == j, share, 0.5 * share)
    fewest = [2] * x.shape[-1]  # E2: two plateaus, and pressure ends on each
    return {
        "box_lo": tuple(lo.tolist()),
        "box_hi": tuple(hi.tolist()),
        "min_points": int(em["km"].sum(1).min()),
        "max_points": int(em["km"].sum(1).max()),  # the largest emulated (D3: κ(n) learned)
        "min_levels": tuple(fewest),
        "min_span": tuple(share.clamp(0.0, 1.0).tolist()),
    }
