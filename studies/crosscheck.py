"""Does fedcal's stated σ hold on fleets it never saw? (issue 20, helper "crosscheck").

An independent fleet generator (nothing imported from ``fedcal.data.simulator``, none of
its formulas or coefficients) writes fleets of a resonant-diaphragm pressure sensor to a
file in fedcal's column format; the study then runs fedcal as a user would
(``fedcal run --data FILE``, then ``fedcal predict`` on the test rows) and scores the
stated 95 % intervals on random off-grid test points.

The sensor (a different textbook model from fedcal's simulator). With P the pressure and
T_r the resonator's temperature, ΔT = T_r − 25 °C:

    f(P, T_r) = f₀(T_r) · √(1 + k(T_r) · P_eff),                                   (G1)
    f₀(T) = F₀ (1 + a₁ΔT + a₂ΔT²),   k(T) = K₀ (1 + b₁ΔT + b₂ΔT²),                 (G2)
    P_eff = P − s · η (1 − u²),   u = (P − P_mid)/P_half,   s = +1 up, −1 down,    (G3)
    T_r = T_set − ΔT_step · exp(−dwell/τ),                                           (G4)

(G3) a mild pressure hysteresis (zero at the span's ends), (G4) the resonator's first-order
thermal lag behind a chamber temperature step ΔT_step (the recorded temperature is the
chamber's set point plus reading noise, the resonator is still settling). Unit-to-unit
variation comes from four manufacturing parameters (diaphragm thickness δh, residual
stress δs, thermal-expansion mismatch δα, mass loading δm), each the sum of a lot effect
and a smaller unit effect (units of one lot are correlated), mapped to the coefficients by

    F₀ = F (1 + δh) √(1 + 0.5 δs) / √(1 + δm),   K₀ = K (1 + δh)⁻³ (1 + 0.5 δs)⁻¹,   (G5)
    a₁ = A₁ + 1e-4 δα,   a₂ = A₂ (1 + 20 δα),   b₁ = B₁ (1 + 0.3 δs) − 5e-4 δα,      (G6)

η and τ are log-normal per unit. Noise: frequency jitter 0.03 Hz, temperature reading
0.01 K, chamber reference 0.01 hPa (training rows only; test references are clean).

Chamber designs of the reference units (all different from fedcal's grid):

* ``grid``: 9 pressures × 5 temperature plateaus (−10…50 °C), up and down (90 points);
* ``stagger``: 8 pressures × 5 plateaus, each unit's plateaus shifted by its own offset
  (0…12 °C inside the box), up and down (80 points);
* ``lhs``: 80 Latin-hypercube (P, T) points in time order, each one a temperature step
  (its thermal lag, G4) and a direction from the pressure step.

New units: one ascending sweep of a P × T grid, 3 × 2 (6 points), 4 × 3 (12) or 6 × 4 (24).
Test: ``--test-points`` random (P, T) per unit inside the box, at equilibrium, random
branch, clean reference.

Baselines: ``tuned``, a per-unit tensor-Legendre polynomial in (f, T) whose orders are
chosen per unit by leave-one-plateau-out cross-validation (leave-one-out where a unit has
fewer than 3 plateaus), with its ordinary-least-squares 95 % prediction interval; and
fedcal's ``polynomial`` method (in the same ``fedcal run``).

    nice python studies/crosscheck.py --fleet-seeds 0,1,2 --designs grid,stagger,lhs \\
        --new-points 6,12,24 --out /tmp/crosscheck         # mixed fleets
    nice python studies/crosscheck.py --fleet-seeds 0,1,2 --all-few 6 --out /tmp/crosscheck
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from numpy.polynomial import legendre
from scipy import stats

P_LO, P_HI = 100.0, 1300.0  # calibrated pressure box, hPa
T_LO, T_HI = -10.0, 50.0  # calibrated temperature box, °C
T_REF = 25.0


@dataclass(frozen=True)
class Nominal:
    """Nominal constants of (G1)–(G6) and the spreads of the manufacturing parameters."""

    f: float = 29_500.0  # Hz at 25 °C, zero pressure
    k: float = 2.0e-4  # 1/hPa: f rises ~12 % over the span
    a1: float = -2.5e-5  # 1/K
    a2: float = -4.0e-8  # 1/K²
    b1: float = 3.0e-4  # 1/K: the diaphragm softens when warm
    b2: float = 1.0e-6  # 1/K²
    eta: float = 0.04  # hPa, hysteresis amplitude (median)
    tau: float = 2.5  # min, resonator thermal time constant (median)
    lot_sd: tuple = (0.010, 0.05, 0.10, 0.004)  # δh, δs, δα, δm: lot effect sd
    unit_sd: tuple = (0.004, 0.02, 0.04, 0.002)  # the unit's own effect sd
    f_noise: float = 0.03  # Hz
    t_noise: float = 0.01  # K
    p_ref_noise: float = 0.01  # hPa (training references)


def make_units(seed: int, n_units: int, n_lots: int = 3, nom: Nominal = Nominal()) -> pd.DataFrame:
    """Per-unit coefficients of (G2)–(G6) from lot-correlated manufacturing parameters."""
    rng = np.random.default_rng([seed, 1])
    lot = rng.integers(0, n_lots, n_units)
    lot_eff = rng.standard_normal((n_lots, 4)) * np.array(nom.lot_sd)
    theta = lot_eff[lot] + rng.standard_normal((n_units, 4)) * np.array(nom.unit_sd)
    dh, ds, da, dm = theta.T
    return pd.DataFrame(
        {
            "lot": lot,
            "F0": nom.f * (1 + dh) * np.sqrt(1 + 0.5 * ds) / np.sqrt(1 + dm),
            "K0": nom.k * (1 + dh) ** -3 / (1 + 0.5 * ds),
            "a1": nom.a1 + 1e-4 * da,
            "a2": nom.a2 * (1 + 20 * da),
            "b1": nom.b1 * (1 + 0.3 * ds) - 5e-4 * da,
            "b2": np.full(n_units, nom.b2),
            "eta": nom.eta * np.exp(0.4 * rng.standard_normal(n_units)),
            "tau": nom.tau * (1 + dh) * np.exp(0.3 * rng.standard_normal(n_units)),
        }
    )


def frequency(u: pd.Series, p: np.ndarray, t_r: np.ndarray, sign: np.ndarray) -> np.ndarray:
    """Noise-free f of (G1)–(G3) for one unit ``u`` (a row of :func:`make_units`)."""
    dt = t_r - T_REF
    f0 = u.F0 * (1 + u.a1 * dt + u.a2 * dt * dt)
    k = u.K0 * (1 + u.b1 * dt + u.b2 * dt * dt)
    w = (p - (P_LO + P_HI) / 2) / ((P_HI - P_LO) / 2)
    p_eff = p - sign * u.eta * (1 - np.clip(w, -1, 1) ** 2)
    return f0 * np.sqrt(1 + k * p_eff)


def plateau_campaign(p_levels, t_levels, both: bool) -> pd.DataFrame:
    """A plateau campaign in time order: per plateau (cold to hot) an up sweep (and a down
    sweep); the first point of a plateau follows the temperature step, soaked 30 min."""
    rows, prev_t = [], None
    for t in t_levels:
        step = 0.0 if prev_t is None else t - prev_t
        sweeps = [(p_levels, "up")] + ([(p_levels[::-1], "down")] if both else [])
        first = True
        for levels, d in sweeps:
            for p in levels:
                rows.append((p, t, d, step if first else 0.0, 30.0))
                first = False
        prev_t = t
    return pd.DataFrame(rows, columns=["p", "t", "direction", "t_step", "dwell"])


def lhs_campaign(rng: np.random.Generator, n: int) -> pd.DataFrame:
    """n Latin-hypercube points, visited in drawn order: every point is a temperature step
    (dwell 15 min) and its direction is the sign of the pressure step."""
    p = P_LO + (P_HI - P_LO) * (rng.permutation(n) + rng.random(n)) / n
    t = T_LO + (T_HI - T_LO) * (rng.permutation(n) + rng.random(n)) / n
    step = np.diff(t, prepend=t[0])
    d = np.where(np.diff(p, prepend=0.0) >= 0, "up", "down")
    return pd.DataFrame({"p": p, "t": t, "direction": d, "t_step": step, "dwell": 15.0})


def reference_campaign(design: str, unit: int, rng: np.random.Generator) -> pd.DataFrame:
    """The rich campaign of a reference unit for ``design`` (module doc)."""
    if design == "grid":
        return plateau_campaign(np.linspace(P_LO, P_HI, 9), np.linspace(T_LO, T_HI, 5), True)
    if design == "stagger":
        shift = 12.0 * rng.random()  # the unit's own plateaus, inside the box
        t = np.linspace(T_LO + shift, T_HI - 12.0 + shift, 5)
        t[0], t[-1] = T_LO, T_HI  # end plateaus at the box's edges: the span is the box
        return plateau_campaign(np.linspace(P_LO, P_HI, 8), np.sort(t), True)
    if design == "lhs":
        return lhs_campaign(rng, 80)
    raise ValueError(f"unknown design {design!r} (grid, stagger, lhs)")


NEW_GRIDS = {6: (3, 2), 12: (4, 3), 24: (6, 4)}


def new_campaign(points: int) -> pd.DataFrame:
    """A new unit's few-point chamber run: one ascending sweep of a P × T grid."""
    if points not in NEW_GRIDS:
        raise ValueError(f"new units take 6, 12 or 24 points, not {points}")
    np_, nt = NEW_GRIDS[points]
    return plateau_campaign(np.linspace(P_LO, P_HI, np_), np.linspace(T_LO, T_HI, nt), False)


def unit_rows(u: pd.Series, plan: pd.DataFrame, rng, nom: Nominal, split: str) -> pd.DataFrame:
    """Readings of one unit along a campaign (G4 lag, noise on f, T and the reference)."""
    t_r = plan.t.to_numpy() - plan.t_step.to_numpy() * np.exp(-plan.dwell.to_numpy() / u.tau)
    sign = np.where(plan.direction.to_numpy() == "up", 1.0, -1.0)
    p = plan.p.to_numpy(float)
    f = frequency(u, p, t_r, sign) + nom.f_noise * rng.standard_normal(len(p))
    t_read = plan.t.to_numpy() + nom.t_noise * rng.standard_normal(len(p))
    ref = p + (nom.p_ref_noise * rng.standard_normal(len(p)) if split == "train" else 0.0)
    return pd.DataFrame(
        {
            "frequency_hz": f,
            "temperature_c": t_read,
            "pressure_hpa": ref,
            "split": split,
            "direction": plan.direction.to_numpy(),
            "plateau": np.unique(plan.t.to_numpy(), return_inverse=True)[1],
        }
    )


def make_fleet(
    seed: int,
    design: str,
    n_ref: int,
    n_new: int,
    new_points: int,
    test_points: int = 40,
    nom: Nominal = Nominal(),
) -> pd.DataFrame:
    """A fleet in fedcal's columns: sensor_id, frequency_hz, temperature_c, pressure_hpa,
    split, direction, role (reference/new), plus lot and plateau (ignored by fedcal)."""
    units = make_units(seed, n_ref + n_new, nom=nom)
    frames = []
    for i, u in units.iterrows():
        rng = np.random.default_rng([seed, 2, i])
        ref = i < n_ref
        plan = reference_campaign(design, i, rng) if ref else new_campaign(new_points)
        train = unit_rows(u, plan, rng, nom, "train")
        test_plan = pd.DataFrame(
            {
                "p": rng.uniform(P_LO, P_HI, test_points),
                "t": rng.uniform(T_LO, T_HI, test_points),
                "direction": rng.choice(["up", "down"], test_points),
                "t_step": 0.0,
                "dwell": 30.0,
            }
        )
        test = unit_rows(u, test_plan, rng, nom, "test")
        test["plateau"] = -1
        rows = pd.concat([train, test], ignore_index=True)
        rows.insert(0, "sensor_id", f"U{i:03d}")
        rows["role"] = "reference" if ref else "new"
        rows["lot"] = int(u.lot)
        frames.append(rows)
    return pd.concat(frames, ignore_index=True)


# ---------------------------------------------------------------- the tuned polynomial


def _design(f, t, span, orders):
    uf = 2 * (f - span[0]) / (span[1] - span[0]) - 1
    ut = 2 * (t - span[2]) / (span[3] - span[2]) - 1
    return legendre.legvander2d(uf, ut, orders)


def tuned_polynomial(train: pd.DataFrame, test: pd.DataFrame) -> dict:
    """Per-unit polynomial, orders chosen by leave-one-plateau-out CV (leave-one-out with
    fewer than 4 plateaus), the order in T at least 1 where there are 2 plateaus; returns
    test RMSE and the coverage of its OLS 95 % prediction interval
    t_{n−k}·s·√(1 + x(XᵀX)⁻¹xᵀ) (only orders with k < n points are candidates)."""
    f, t, y = (train[c].to_numpy(float) for c in ("frequency_hz", "temperature_c", "pressure_hpa"))
    span = (f.min(), f.max(), t.min(), t.max())
    groups = train.plateau.to_numpy()
    if len(np.unique(groups)) < 4:  # leaving one of 3 plateaus out could never fit T²
        groups = np.arange(len(y))
    sizes = np.unique(train.plateau, return_counts=True)[1]
    n_t = len(sizes)
    # every input used (as an engineer would: T always enters once there are 2 plateaus);
    # the order in f below the pressure levels of a plateau (grid designs)
    max_f = min(5, int(sizes.min()) - 1) if sizes.min() > 1 else 5
    best, score = None, np.inf
    for of in range(1, max_f + 1):
        for ot in range(min(1, n_t - 1), min(4, n_t)):
            k = (of + 1) * (ot + 1)
            if k >= len(y):
                continue
            err = []
            for g in np.unique(groups):
                out = groups == g
                x_in = _design(f[~out], t[~out], span, (of, ot))
                if np.linalg.matrix_rank(x_in) < k:
                    err = None
                    break
                c = np.linalg.lstsq(x_in, y[~out], rcond=None)[0]
                err.append(y[out] - _design(f[out], t[out], span, (of, ot)) @ c)
            if err is None:
                continue
            s = float(np.sqrt(np.mean(np.concatenate(err) ** 2)))
            if s < score:
                best, score = (of, ot), s
    x = _design(f, t, span, best)
    c, *_ = np.linalg.lstsq(x, y, rcond=None)
    dof = len(y) - x.shape[1]
    s2 = float(np.sum((y - x @ c) ** 2) / dof)
    xt = _design(test.frequency_hz.to_numpy(), test.temperature_c.to_numpy(), span, best)
    pred = xt @ c
    lev = np.einsum("ij,jk,ik->i", xt, np.linalg.pinv(x.T @ x), xt)
    half = stats.t.ppf(0.975, dof) * np.sqrt(s2 * (1 + lev))
    e = test.pressure_hpa.to_numpy() - pred
    return {
        "rmse": float(np.sqrt(np.mean(e**2))),
        "coverage95": float(np.mean(np.abs(e) <= half)),
        "orders": best,
    }


# ---------------------------------------------------------------- running fedcal


def fedcal(args: list[str], log) -> str:
    """Run the fedcal CLI as a user would (a subprocess); return its stdout."""
    code = "import sys; from fedcal.cli import main; sys.argv[0]='fedcal'; main()"
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, check=False
    )
    log.write(f"$ fedcal {' '.join(args)}\n{done.stdout}{done.stderr}\n")
    log.flush()
    if done.returncode != 0:
        raise RuntimeError(f"fedcal {args[0]} exited {done.returncode}: {done.stderr[-500:]}")
    return done.stdout


def score_run(
    fleet: pd.DataFrame, run: Path, methods: list[str], predicted: str, log
) -> list[dict]:
    """Per predicted unit and method: fedcal's per_sensor coverage95/RMSE/status and the
    coverage recomputed here from ``fedcal predict``'s ``_std`` column (±1.96 σ)."""
    out = []
    test = fleet[fleet.split == "test"]
    test_file = run / "test_rows.csv"
    test.drop(columns=["pressure_hpa"]).to_csv(test_file, index=False)
    summary = pd.read_csv(run / "summary.csv")
    notes = {}
    if "coverage_note" in summary:
        notes = {r.method: str(r.coverage_note) for r in summary.itertuples()
                 if pd.notna(r.coverage_note)}  # fmt: skip
    for m in methods:
        per = pd.read_csv(run / "runs" / f"{m}_tp0_seed0" / "per_sensor.csv")
        pred_file = run / f"pred_{m}.csv"
        fedcal(["predict", str(run), "--method", m, "--data", str(test_file),
                "--out", str(pred_file)], log)  # fmt: skip
        pred = pd.read_csv(pred_file)
        pred["truth"] = test.pressure_hpa.to_numpy()
        for sid, rows in pred.groupby("sensor_id"):
            role = fleet.loc[fleet.sensor_id == sid, "role"].iloc[0]
            if predicted != "all" and role != predicted:
                continue
            e = rows.pressure_hpa_calibrated - rows.truth
            sd = rows.get("pressure_hpa_std", np.nan)
            inside = np.abs(e) <= 1.959964 * sd
            mine = float(inside.mean()) if np.isfinite(sd).all() else np.nan
            ps = per[per.client.astype(str) == sid].iloc[0]
            out.append(
                {
                    "method": m,
                    "sensor": sid,
                    "rmse_predict": float(np.sqrt(np.mean(e**2))),
                    "cov_predict": mine,
                    "rmse": float(ps.get("test_rmse", np.nan)),
                    "coverage95": float(ps.get("test_coverage95", np.nan)),
                    "status": str(ps.get("status", "")),
                    "reason": _text(ps.get("status_reason")),
                    "note": notes.get(m, ""),
                    "in_range": float(rows["in_range"].mean()) if "in_range" in rows else np.nan,
                }
            )
    return out


def tuned_rows(fleet: pd.DataFrame, predicted: str) -> list[dict]:
    """The tuned polynomial's rows of :func:`run_regime` (the predicted units)."""
    rows = []
    for sid, unit in fleet.groupby("sensor_id"):
        if predicted != "all" and unit.role.iloc[0] != predicted:
            continue
        r = tuned_polynomial(unit[unit.split == "train"], unit[unit.split == "test"])
        rows.append({"method": "tuned", "sensor": sid, "rmse": r["rmse"], "rmse_predict": r["rmse"],
                     "coverage95": r["coverage95"], "cov_predict": r["coverage95"],
                     "status": f"orders {r['orders']}"})  # fmt: skip
    return rows


def rescore_tuned(out: Path) -> None:
    """Recompute the tuned polynomial's rows of a finished study from its fleet files (the
    baseline needs no fedcal run) and rewrite per_unit.csv and summary.csv."""
    per = pd.read_csv(out / "per_unit.csv")
    fresh = []
    for (regime, seed), _ in per.groupby(["regime", "seed"]):
        fleet = pd.read_csv(out / f"{regime}-seed{seed}" / "fleet.csv")
        rows = pd.DataFrame(tuned_rows(fleet, "all" if regime.startswith("all") else "new"))
        rows["regime"], rows["seed"] = regime, seed
        fresh.append(rows)
    per = pd.concat([per[per.method != "tuned"], *fresh], ignore_index=True)
    per.to_csv(out / "per_unit.csv", index=False)
    summarize(per).to_csv(out / "summary.csv", index=False)


def run_regime(fleet: pd.DataFrame, where: Path, methods: list[str], rounds: int, predicted: str):
    """Write the fleet, ``fedcal run`` it, score fedcal's methods and the tuned polynomial."""
    where.mkdir(parents=True, exist_ok=True)
    data = where / "fleet.csv"
    fleet.to_csv(data, index=False)
    with open(where / "log.txt", "a") as log:
        printed = fedcal(["run", "--data", str(data), "--methods", ",".join(methods),
                          "--seeds", "1", "--rounds", str(rounds), "--out", str(where / "run")],
                         log)  # fmt: skip
        rows = score_run(fleet, where / "run", methods, predicted, log)
    rows += tuned_rows(fleet, predicted)
    return pd.DataFrame(rows), printed


def _text(v) -> str:
    return str(v) if v is not None and pd.notna(v) else ""


def _mean_or_nan(c: pd.Series) -> float:
    """A seed's coverage over its units; NaN (declined) if any unit states no interval."""
    return float(c.mean()) if c.notna().all() else float("nan")


def summarize(per: pd.DataFrame) -> pd.DataFrame:
    """Per (regime, method): coverage mean over units per seed, worst unit, RMSE mean/worst."""
    rows = []
    for (regime, method), g in per.groupby(["regime", "method"], sort=False):
        seeds = g.groupby("seed")["cov_predict"].agg(_mean_or_nan)
        fed = g.groupby("seed")["coverage95"].agg(_mean_or_nan)
        rows.append(
            {
                "regime": regime,
                "method": method,
                "cov_mean": float(seeds.mean()),
                "cov_seeds": [round(float(v), 3) for v in seeds],
                "cov_fedcal_seeds": [round(float(v), 3) for v in fed],
                "cov_worst_unit": float(g.cov_predict.min()),
                "rmse_mean": float(g.rmse_predict.mean()),
                "rmse_worst": float(g.rmse_predict.max()),
                "statuses": json.dumps(g.status.value_counts().to_dict()),
                "notes": "; ".join(sorted({n for n in g.get("note", pd.Series()).dropna() if n})),
            }
        )
    return pd.DataFrame(rows)


def markdown(summary: pd.DataFrame) -> str:
    """The docs' table: coverage mean [per seed] (fedcal's own coverage95 where it differs
    from ±1.96 σ of ``predict``), worst unit, RMSE mean/worst, statuses, the run's note."""
    lines = [
        "| regime | method | cov95 mean [per seed] | worst unit | RMSE mean | RMSE worst "
        "| statuses | note |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for r in summary.itertuples():
        seeds = json.loads(str(r.cov_seeds).replace("nan", "NaN"))
        fed = json.loads(str(r.cov_fedcal_seeds).replace("nan", "NaN"))
        if all(np.isnan(seeds)):
            cov = "declined" if r.method.startswith("fedprior") else "no σ"
        else:
            cov = f"{r.cov_mean:.3f} [{', '.join(f'{v:.3f}' for v in seeds)}]"
            if not np.allclose(seeds, fed, equal_nan=True):
                cov += f" (coverage95: {', '.join(f'{v:.3f}' for v in fed)})"
        worst = "—" if np.isnan(r.cov_worst_unit) else f"{r.cov_worst_unit:.3f}"
        note = "" if pd.isna(r.notes) else str(r.notes).split("; ")[0]
        lines.append(
            f"| {r.regime} | {r.method} | {cov} | {worst} | {r.rmse_mean:.4g} "
            f"| {r.rmse_worst:.4g} | {r.statuses} | {note} |"
        )
    return "\n".join(lines)


def reference_table(outs: list[Path]) -> str:
    """The reference units' coverage95 and RMSE as the runs under ``outs`` wrote them
    (per_sensor.csv, role reference): mean over units per seed, the worst unit."""
    rows = []
    files = [f for o in outs for f in o.glob("*-seed*/run/runs/*_tp0_seed0/per_sensor.csv")]
    for per_file in sorted(files, key=lambda f: (f.parts[-5], f.parts[-2])):
        regime, seed = per_file.parts[-5].rsplit("-seed", 1)
        if not (per_file.parents[3] / "printed.txt").exists():
            continue  # a fleet whose runs are not all finished
        per = pd.read_csv(per_file)
        if "test_coverage95" not in per or "role" not in per:
            continue
        ref = per[per.role == "reference"]
        rows.append({"regime": regime, "method": per.method.iloc[0], "seed": int(seed),
                     "cover": ref.test_coverage95.mean(), "worst": ref.test_coverage95.min(),
                     "rmse": ref.test_rmse.mean(), "rmse_worst": ref.test_rmse.max(),
                     "not_ok": int((ref.status != "ok").sum())})  # fmt: skip
    lines = [
        "| regime | method | ref. cov95 mean [per seed] | worst unit | RMSE mean | worst | "
        "not ok |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for (regime, method), g in pd.DataFrame(rows).groupby(["regime", "method"], sort=False):
        seeds = ", ".join(f"{v:.3f}" for v in g.cover)
        lines.append(
            f"| {regime} | {method} | {g.cover.mean():.3f} [{seeds}] | {g.worst.min():.3f} "
            f"| {g.rmse.mean():.4g} | {g.rmse_worst.max():.4g} | {g.not_ok.sum()} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fleet-seeds", default="0,1,2")
    ap.add_argument("--designs", default="grid,stagger,lhs")
    ap.add_argument("--new-points", default="6,12,24")
    ap.add_argument("--all-few", type=int, default=0, help="every unit N points (no mixed)")
    ap.add_argument("--methods", default="fedprior,fedprior_branch,polynomial")
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--units", type=int, default=20, help="reference and new units each")
    ap.add_argument("--test-points", type=int, default=40)
    ap.add_argument("--out", default="/tmp/crosscheck")
    ap.add_argument("--table", nargs="*", help="print the Markdown table of these per_unit.csv")
    ap.add_argument("--reference", nargs="*", help="print the reference units' table of these")
    ap.add_argument("--rescore-tuned", nargs="*", help="recompute the tuned rows of these")
    args = ap.parse_args()
    if args.rescore_tuned:
        for d in args.rescore_tuned:
            rescore_tuned(Path(d))
        return
    if args.table:  # per_unit.csv of one or more study directories, summarized together
        print(markdown(summarize(pd.concat([pd.read_csv(f) for f in args.table]))))
        return
    if args.reference:
        print(reference_table([Path(d) for d in args.reference]))
        return
    seeds = [int(s) for s in args.fleet_seeds.split(",")]
    methods = args.methods.split(",")
    out = Path(args.out)
    regimes = (
        [("all", "grid", args.all_few)]
        if args.all_few
        else [(d, d, int(n)) for d in args.designs.split(",") for n in args.new_points.split(",")]
    )
    per, t0 = [], time.perf_counter()
    for name, design, n in regimes:
        for s in seeds:
            if name == "all":
                fleet = make_fleet(s, design, 0, 2 * args.units, n, args.test_points)
                label, predicted = f"all-{n}", "all"
            else:
                fleet = make_fleet(s, design, args.units, args.units, n, args.test_points)
                label, predicted = f"{design}-new{n}", "new"
            where = out / f"{label}-seed{s}"
            try:
                rows, printed = run_regime(fleet, where, methods, args.rounds, predicted)
            except RuntimeError as err:  # a failed run is reported, never dropped
                print(f"{label} seed {s}: FAILED {err}", flush=True)
                continue
            (where / "printed.txt").write_text(printed)
            rows["regime"], rows["seed"] = label, s
            per.append(rows)
            print(f"{label} seed {s} done ({time.perf_counter() - t0:.0f} s)", flush=True)
            all_rows = pd.concat(per, ignore_index=True)
            all_rows.to_csv(out / "per_unit.csv", index=False)
            summarize(all_rows).to_csv(out / "summary.csv", index=False)
    print(markdown(summarize(pd.concat(per, ignore_index=True))))


if __name__ == "__main__":
    main()
