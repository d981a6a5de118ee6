"""The few-point Bayes bound's library: the simulator's physics, vectorized over units.

What ``studies/fewpoint_bound.py`` learns from and is scored against (its
docstring has the study): units drawn from the simulator's own generative
distribution, what a chamber design measures of them
(:func:`fedcal.data.simulator.noise_draws`, :func:`~fedcal.data.simulator.frequency`:
the simulator's public physics, so :func:`check_library_physics` can compare
with a simulated fleet draw for draw), each unit's dense noise-free truth in
fixed (f, T_read) Legendre coordinates, and the best Gaussian posterior. Shared
with tests/test_fewpoint_bound.py (it checks the physics and the Gaussian).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from numpy.polynomial.legendre import legvander2d

from fedcal.build import load_data
from fedcal.data.simulator import (
    FleetSpec,
    measurement_plan,
    noise_draws,
    param_names,
    sensor_parameters,
)
from fedcal.data.simulator import frequency as family_frequency

ORDERS = (5, 4)  # Legendre orders in (f, T_read) of the dense truth
LIBRARY_SEED_OFFSET = 1000  # library units: parameters from seed 1000 + fleet seed
T_BOX = (-42.0, 62.0)  # temperature-reading coordinates (°C) -> [-1, 1]
GRID_P = np.linspace(40.0, 1560.0, 39)  # dense truth grid, a little beyond the range
GRID_T = np.linspace(-41.0, 61.0, 35)


# ---------------------------------------------------------------------------
# The library: the simulator's physics, vectorized over units


def ripple(p: np.ndarray, t: np.ndarray, prm) -> np.ndarray:
    """The simulator's ripple term for many units: (units, rows)."""
    nu = np.stack(prm["ripple_nu"].to_numpy())[:, None, :]
    mu = np.stack(prm["ripple_mu"].to_numpy())[:, None, :]
    ph = np.stack(prm["ripple_phase"].to_numpy())[:, None, :]
    w = np.stack(prm["ripple_weight"].to_numpy())[:, None, :]
    arg = 2.0 * np.pi * (nu * p[..., None] / 1600.0 + mu * (t[..., None] + 40.0) / 100.0) + ph
    total = (w * np.sin(arg)).sum(-1)
    return prm["ripple_amp_hpa"].to_numpy()[:, None] * total / w.sum(-1)


def observe(spec: FleetSpec, prm, p_true, t_true, sign, z_p, z_t) -> tuple[np.ndarray, ...]:
    """What units read at chamber points (P, T_true, branch sign): (frequency, T_read).

    ``sign``: +1 descending, −1 ascending (simulator convention); ``z_p``, ``z_t``:
    standard normal draws (units, rows). Same formulas as simulator.simulate_fleet.
    """
    levels = np.asarray(spec.pressure_levels_hpa, dtype=float)
    p_min, p_max = levels.min(), levels.max()
    shape_h = np.sin(np.pi * np.clip((p_true - p_min) / (p_max - p_min), 0.0, 1.0))
    hyst = sign * prm["hysteresis_hpa"].to_numpy()[:, None] * shape_h
    p_eff = p_true + hyst + ripple(p_true, t_true, prm) + spec.noise_hpa * z_p
    freq = frequency(spec, prm, p_eff, np.broadcast_to(t_true, p_eff.shape))
    t_read = (
        t_true * (1.0 + prm["temperature_gain"].to_numpy()[:, None])
        + prm["temperature_bias_c"].to_numpy()[:, None]
        + spec.temperature_noise_c * z_t
    )
    return freq, t_read


def frequency(spec: FleetSpec, prm, p, t) -> np.ndarray:
    coeffs = {k: prm[k].to_numpy(float)[:, None] for k in param_names(spec.family)}
    return family_frequency(spec.family, p, t, coeffs)


class Coordinates:
    """Fixed affine map of (f, T_read) to [-1, 1]² (frequency box from the library)."""

    def __init__(self, f_lo: float, f_hi: float):
        self.f0, self.fs = 0.5 * (f_lo + f_hi), 0.5 * (f_hi - f_lo)
        self.t0, self.ts = 0.5 * (T_BOX[0] + T_BOX[1]), 0.5 * (T_BOX[1] - T_BOX[0])

    def basis(self, f: np.ndarray, t: np.ndarray) -> np.ndarray:
        return legvander2d((f - self.f0) / self.fs, (t - self.t0) / self.ts, ORDERS)


def dense_truth(spec: FleetSpec, prm, coords: Coordinates) -> tuple[np.ndarray, float]:
    """Each unit's noise-free inverse map P = g(f, T_read) on the basis: (coefficients, max error).

    Branch average: no hysteresis, no ripple, no noise; the reading's bias and gain kept.
    """
    pp, tt = np.meshgrid(GRID_P, GRID_T, indexing="ij")
    pp, tt = pp.ravel(), tt.ravel()
    out, worst = [], 0.0
    for lo in range(0, len(prm), 400):
        part = prm.iloc[lo : lo + 400]
        f = frequency(spec, part, pp[None, :], tt[None, :])
        t_read = (
            tt[None, :] * (1.0 + part["temperature_gain"].to_numpy()[:, None])
            + part["temperature_bias_c"].to_numpy()[:, None]
        )
        phi = torch.as_tensor(coords.basis(f, t_read))
        target = torch.as_tensor(np.broadcast_to(pp, f.shape).copy()).unsqueeze(-1)
        c = torch.linalg.lstsq(phi, target, driver="gelsd").solution[..., 0]
        worst = max(worst, float((phi @ c.unsqueeze(-1) - target).abs().max()))
        out.append(c.numpy())
    return np.concatenate(out), worst


@dataclasses.dataclass
class Units:
    """Units as a method sees them (readings) and as the benchmark judges them."""

    f: np.ndarray  # (units, 6) measured frequencies at the design's points
    t: np.ndarray  # (units, 6) measured temperatures there
    y: np.ndarray  # (6,) the chamber's reference pressures (the same for every unit)
    test_f: np.ndarray  # (units, 60) measured frequency at the test points
    test_t: np.ndarray  # (units, 60)
    test_p: np.ndarray  # (60,) true pressures of the test points
    coef: np.ndarray | None = None  # (units, 30) dense truth (None for the fleet's units
    parent: np.ndarray | None = None  # until computed from their true parameters)

    def readings(self) -> np.ndarray:
        return np.concatenate([self.f, self.t], axis=1)

    def take(self, idx) -> Units:
        return Units(
            self.f[idx],
            self.t[idx],
            self.y,
            self.test_f[idx],
            self.test_t[idx],
            self.test_p,
            None if self.coef is None else self.coef[idx],
            None if self.parent is None else self.parent[idx],
        )


def draw_library(spec: FleetSpec, fleet_seed: int, design: str, n: int) -> tuple[Units, object]:
    """``n`` units of the spec's distribution through the fleet seed's chamber (design + tests)."""
    lib_spec = dataclasses.replace(spec, num_sensors=n, num_reference=0, num_new=0)
    prm = sensor_parameters(lib_spec, LIBRARY_SEED_OFFSET + fleet_seed)
    plan = measurement_plan(spec, fleet_seed, design)
    tr, te = plan[plan["split"] == "train"], plan[plan["split"] == "test"]
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([fleet_seed, 77])))
    out = []
    for rows in (tr, te):
        p = rows["pressure_hpa"].to_numpy(float)[None, :]
        t = rows["temperature_true_c"].to_numpy(float)[None, :]
        sign = np.where(rows["direction"].to_numpy() == "down", 1.0, -1.0)[None, :]
        z_p = rng.standard_normal((n, p.shape[1]))
        z_t = rng.standard_normal((n, p.shape[1]))
        out.append(observe(spec, prm, p, t, sign, z_p, z_t))
    (f, t_read), (tf, tt) = out
    units = Units(
        f, t_read, tr["pressure_hpa"].to_numpy(float), tf, tt, te["pressure_hpa"].to_numpy(float)
    )
    units.parent = prm["parent"].to_numpy()
    return units, prm


def fleet_units(cfg, design: str, fleet_seed: int) -> tuple[Units, object, FleetSpec]:
    """The new units of one fleet of ``studies/fewpoint.py`` (the frame's own rows)."""
    f = dataclasses.replace(cfg.fleet, seed=fleet_seed, train_design=design)
    return frame_units(load_data(dataclasses.replace(cfg, fleet=f)), fleet_seed)


def frame_units(fleet, fleet_seed: int) -> tuple[Units, object, FleetSpec]:
    """The new units of a simulated fleet (its frame's rows, e.g. a subset of them) as Units."""
    spec = FleetSpec(**fleet.meta["spec"])
    frame = fleet.frame[fleet.frame["role"] == "new"]
    ids = list(dict.fromkeys(frame[fleet.client_column]))
    tr = frame[frame["split"] == "train"]
    te = frame[frame["split"] == "test"]

    def grid(rows, col):
        return np.stack([rows.loc[rows[fleet.client_column] == i, col].to_numpy() for i in ids])

    y = grid(tr, "pressure_hpa")
    p_test = grid(te, "pressure_hpa")
    assert (y == y[0]).all() and (p_test == p_test[0]).all()  # one chamber, the same points
    units = Units(
        grid(tr, "frequency_hz"),
        grid(tr, "temperature_c"),
        y[0],
        grid(te, "frequency_hz"),
        grid(te, "temperature_c"),
        p_test[0],
    )
    prm = sensor_parameters(spec, fleet_seed).loc[ids]
    units.parent = prm["parent"].to_numpy()
    return units, prm, spec


def check_library_physics(
    spec, prm, units: Units, fleet_seed: int, design: str, first: int | None = None
) -> float:
    """Max |Δf| (Hz) of the vectorized physics against the fleet's own frame, same noise draws.

    ``first``: the sensor index of ``units``' first unit (default the first new unit)."""
    plan = measurement_plan(spec, fleet_seed, design)
    is_test = (plan["split"] == "test").to_numpy()
    tr = plan[~is_test]
    first = spec.num_reference if first is None else first  # units' first sensor index
    z = [noise_draws(fleet_seed, first + k, is_test) for k in range(len(prm))]
    z_p = np.stack([zp[~is_test] for zp, _ in z])  # the train rows' draws
    z_t = np.stack([zt[~is_test] for _, zt in z])
    p = tr["pressure_hpa"].to_numpy(float)[None, :]
    t = tr["temperature_true_c"].to_numpy(float)[None, :]
    sign = np.where(tr["direction"].to_numpy() == "down", 1.0, -1.0)[None, :]
    f, t_read = observe(spec, prm, p, t, sign, z_p, z_t)
    return float(max(np.abs(f - units.f).max(), 1e3 * np.abs(t_read - units.t).max()))


# ---------------------------------------------------------------------------
# Estimators of a unit's coefficients from its readings


def gaussian_fit(lib: Units, coords: Coordinates):
    """(μ, Σ) of the coefficients and (m_e, S_e) of the 6 residuals y − Φc, from the library."""
    phi = coords.basis(lib.f, lib.t)  # (units, 6, 30)
    resid = lib.y[None, :] - np.einsum("urk,uk->ur", phi, lib.coef)
    return (
        lib.coef.mean(0),
        np.cov(lib.coef, rowvar=False),
        resid.mean(0),
        np.cov(resid, rowvar=False),
    )


def gaussian_posterior(units: Units, coords: Coordinates, mu, sigma, m_e, s_e):
    """Posterior mean and log marginal likelihood under c ~ N(μ, Σ), y = Φc + e, e ~ N(m_e, S_e)."""
    phi = coords.basis(units.f, units.t)
    gram = phi @ sigma @ phi.transpose(0, 2, 1) + s_e  # (units, 6, 6)
    r = units.y[None, :] - phi @ mu - m_e
    chol = np.linalg.cholesky(gram)
    alpha = np.linalg.solve(gram, r[..., None])[..., 0]
    mean = mu + np.einsum("kj,urj,ur->uk", sigma, phi, alpha)
    logdet = 2.0 * np.log(np.diagonal(chol, axis1=1, axis2=2)).sum(-1)
    loglik = -0.5 * ((r * alpha).sum(-1) + logdet + len(m_e) * np.log(2 * np.pi))
    return mean, loglik


def function_rmse(coef_hat: np.ndarray, units: Units, coords: Coordinates) -> np.ndarray:
    """Per-unit RMSE (hPa) of the predicted pressure at the unit's 60 test points."""
    phi = coords.basis(units.test_f, units.test_t)
    pred = np.einsum("urk,uk->ur", phi, coef_hat)
    return np.sqrt(((pred - units.test_p[None, :]) ** 2).mean(1))
