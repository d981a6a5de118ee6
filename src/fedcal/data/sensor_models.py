"""The simulated sensors' physics (:mod:`fedcal.data.simulator`): the parent units of each
family (Digiquartz's published units, a synthetic silicon production pool), the forward
models (quartz, silicon) and each sensor's parameters around its parent or lot.
"""

from __future__ import annotations

import importlib.resources
from functools import cache

import numpy as np
import pandas as pd

from fedcal.data.fleetspec import (
    _NUM_POOL_UNITS,
    _S_LOT,
    _S_LOT_ASSIGN,
    _S_PARENTS,
    _S_SENSOR,
    _SILICON_POOL_SEED,
    LOT_SPREAD,
    PSI_TO_HPA,
    QUARTZ_FULL_SCALE_HPA,
    QUARTZ_PARAMS,
    SENSOR_SPREAD,
    SILICON_NOMINAL,
    SILICON_P_SCALE,
    SILICON_PARAMS,
    SILICON_T_REF,
    SILICON_T_SCALE,
    WITHIN_LOT_SPREAD,
    X_FULL_SCALE,
    FleetSpec,
)


def load_digiquartz_units() -> pd.DataFrame:
    """The 21 real Digiquartz units as shipped (C in psia, periods in µs); a fresh copy."""
    return _digiquartz_units().copy()


@cache
def _digiquartz_units() -> pd.DataFrame:
    path = importlib.resources.files("fedcal.data") / "resources" / "digiquartz_coefficients.csv"
    with path.open("r") as fh:
        return pd.read_csv(fh)


@cache
def quartz_c_scale() -> float:
    """Common factor from a unit's C1 [hPa] to the barometer's C1 [hPa] (see module doc)."""
    units = _digiquartz_units()
    d1 = units["D1"].mean()
    c_target = QUARTZ_FULL_SCALE_HPA / (X_FULL_SCALE - d1 * X_FULL_SCALE**2)
    return float(c_target / (units["C1_psia"].mean() * PSI_TO_HPA))


@cache
def _family_pool(family: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(parent units (K, d), ids (K,), per-coefficient spread (d,)) of a family."""
    if family == "quartz":
        u = _digiquartz_units()
        c1 = u["C1_psia"].to_numpy(float)
        pool = np.column_stack(
            [
                u["U0_us"],
                u["Y1"],
                u["Y2"],
                c1 * PSI_TO_HPA * quartz_c_scale(),
                u["C2_psia"] / c1,
                u["C3_psia"] / c1,
                u["D1"],
                u["T1_us"],
                u["T2"],
                u["T3"],
                u["T4"],
            ]
        ).astype(float)
        ids = u["serial"].to_numpy(np.int64)
        sigma = pool.std(axis=0, ddof=1)
    else:
        nominal = np.array([v[0] for v in SILICON_NOMINAL.values()])
        sigma = np.array([v[1] for v in SILICON_NOMINAL.values()])
        rng = np.random.Generator(np.random.PCG64(_SILICON_POOL_SEED))
        pool = nominal + sigma * rng.standard_normal((_NUM_POOL_UNITS, len(nominal)))
        ids = np.arange(_NUM_POOL_UNITS, dtype=np.int64)
    for a in (pool, ids, sigma):
        a.setflags(write=False)
    return pool, ids, sigma


def param_names(family: str) -> tuple[str, ...]:
    """The coefficient names of a sensor family's frequency model (columns of sensor_parameters)."""
    return QUARTZ_PARAMS if family == "quartz" else SILICON_PARAMS


@cache
def _pool_response(family: str) -> np.ndarray:
    """Each parent unit's frequencies on a coarse (P, T) grid, (K, 9): its behaviour."""
    pool, _, _ = _family_pool(family)
    p, t = np.meshgrid([50.0, 800.0, 1550.0], [-40.0, 10.0, 60.0])
    names = param_names(family)
    return np.stack(
        [frequency(family, p.ravel(), t.ravel(), dict(zip(names, u, strict=True))) for u in pool]
    )


def _lot_parents(family: str, first: int, num_lots: int) -> list[int]:
    """Parent unit of each lot: greedy farthest-point in behaviour, from unit ``first``.

    Lots then differ in how they respond, not only in coefficients that barely
    move the frequency; beyond the K units the order repeats.
    """
    resp = _pool_response(family)
    order = [first]
    dist = np.linalg.norm(resp - resp[first], axis=1)
    for _ in range(len(resp) - 1):
        nxt = int(np.argmax(dist))
        order.append(nxt)
        dist = np.minimum(dist, np.linalg.norm(resp - resp[nxt], axis=1))
    return [order[lot % len(order)] for lot in range(num_lots)]


def quartz_frequency(pressure_hpa, temperature_c, coeffs) -> np.ndarray:
    """Pressure-resonator frequency (Hz) of a Digiquartz sensor at true (P, T).

    ``coeffs`` maps the quartz parameter names (:data:`QUARTZ_PARAMS`) to values.
    """
    p = np.asarray(pressure_hpa, dtype=float)
    t = np.asarray(temperature_c, dtype=float)
    y1, y2 = coeffs["Y1"], coeffs["Y2"]
    # Y2·U² + Y1·U − T = 0, the root near 0 in its cancellation-free form.
    u = 2.0 * t / (y1 + np.sign(y1) * np.sqrt(y1 * y1 + 4.0 * y2 * t))
    c = coeffs["C1_hpa"] * (1.0 + coeffs["c2"] * u + coeffs["c3"] * u * u)
    d = coeffs["D1"]
    t0 = coeffs["T1_us"] + coeffs["T2"] * u + coeffs["T3"] * u**2 + coeffs["T4"] * u**3
    q = p / c
    # D·x² − x + q = 0, the root near q.
    x = 2.0 * q / (1.0 + np.sqrt(1.0 - 4.0 * d * q))
    tau_us = t0 / np.sqrt(1.0 - x)
    return 1e6 / tau_us


def silicon_frequency(pressure_hpa, temperature_c, coeffs) -> np.ndarray:
    """Resonator frequency (Hz) of the silicon family at true (P, T) (see module doc)."""
    p = np.asarray(pressure_hpa, dtype=float) / SILICON_P_SCALE
    t = (np.asarray(temperature_c, dtype=float) - SILICON_T_REF) / SILICON_T_SCALE
    poly = np.zeros(np.broadcast(p, t).shape)
    for k in range(5):
        a_k = 1.0 if k == 0 else coeffs[f"k{k}0"]
        a_k = a_k + sum(coeffs[f"k{k}{j}"] * t**j for j in (1, 2, 3))
        poly = poly + a_k * p**k
    return coeffs["f0_hz"] * poly


def frequency(family: str, pressure_hpa, temperature_c, coeffs) -> np.ndarray:
    """The family's resonator frequency (Hz) at (P, T), coefficients by :func:`param_names`."""
    if family == "quartz":
        return quartz_frequency(pressure_hpa, temperature_c, coeffs)
    return silicon_frequency(pressure_hpa, temperature_c, coeffs)


def _rng(seed: int, *key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=key)))


def _lot_of(spec: FleetSpec, seed: int, i: int) -> int:
    lots = spec.num_lots
    if lots == 1:
        return 0
    block, pos = divmod(i, lots)
    return int(_rng(seed, _S_LOT_ASSIGN, block).permutation(lots)[pos])


def sensor_parameters(spec: FleetSpec = FleetSpec(), seed: int = 0) -> pd.DataFrame:
    """Ground truth of every sensor, indexed by ``sensor_id``.

    Columns: ``lot``, ``parent`` (serial of the real quartz unit, or index of
    the synthetic silicon unit; for lots, the lot's parent), the family's
    coefficients (quartz: :data:`QUARTZ_PARAMS` plus ``C2_hpa``, ``C3_hpa``;
    silicon: :data:`SILICON_PARAMS`), and the per-sensor non-ideality levels
    ``hysteresis_hpa``, ``ripple_amp_hpa``, ``temperature_bias_c``,
    ``temperature_gain``, ``drift_hpa_per_year``, plus the ripple's shape
    (``ripple_nu``, ``ripple_mu``, ``ripple_phase``, ``ripple_weight``: 3-tuples).
    """
    _check_seed(seed)
    pool, ids, sigma = _family_pool(spec.family)
    names = param_names(spec.family)
    ref = pool.mean(axis=0)
    k_units, d = pool.shape
    parents = _rng(seed, _S_PARENTS).permutation(k_units)
    lot_parents = _lot_parents(spec.family, int(parents[0]), spec.num_lots)
    lot_centres: dict[int, tuple[int, np.ndarray]] = {}
    h_lo, h_hi = spec.hysteresis_range_hpa
    rows = []
    for i in range(spec.sensor_count):
        r = _rng(seed, _S_SENSOR, i)
        # Fixed draw order whatever the spec, so one seed means the same sensor.
        z_coef = r.standard_normal(d)
        u_hyst = r.uniform()
        u_ripple = r.uniform()
        nu = r.uniform(1.5, 4.0, 3)
        mu = r.uniform(0.0, 1.5, 3)
        phase = r.uniform(0.0, 2.0 * np.pi, 3)
        weight = r.uniform(0.2, 1.0, 3)
        z_bias, z_gain = r.standard_normal(2)
        u_drift = r.uniform(0.5, 1.0)
        s_drift = 1.0 if r.uniform() < 0.5 else -1.0

        lot = _lot_of(spec, seed, i)
        if spec.num_lots == 1:
            parent = int(parents[i % k_units])
            theta = pool[parent] + SENSOR_SPREAD * sigma * z_coef
        else:
            if lot not in lot_centres:
                parent_l = lot_parents[lot]
                z_lot = _rng(seed, _S_LOT, lot).standard_normal(d)
                lot_centres[lot] = (parent_l, pool[parent_l] + LOT_SPREAD * sigma * z_lot)
            parent, centre = lot_centres[lot]
            theta = centre + WITHIN_LOT_SPREAD * sigma * z_coef
        theta = ref + spec.heterogeneity * (theta - ref)

        row = {"sensor_id": _sensor_id(i), "lot": lot, "parent": int(ids[parent])}
        row.update(dict(zip(names, theta.tolist(), strict=True)))
        if spec.family == "quartz":
            row["C2_hpa"] = row["c2"] * row["C1_hpa"]
            row["C3_hpa"] = row["c3"] * row["C1_hpa"]
        row.update(
            hysteresis_hpa=h_lo + (h_hi - h_lo) * u_hyst,
            ripple_amp_hpa=spec.ripple_bound_hpa * (0.5 + 0.5 * u_ripple),
            temperature_bias_c=spec.temperature_bias_c * z_bias,
            temperature_gain=spec.temperature_gain_std * z_gain,
            drift_hpa_per_year=spec.drift_hpa_per_year * u_drift * s_drift,
            ripple_nu=tuple(nu.tolist()),
            ripple_mu=tuple(mu.tolist()),
            ripple_phase=tuple(phase.tolist()),
            ripple_weight=tuple(weight.tolist()),
        )
        rows.append(row)
    return pd.DataFrame(rows).set_index("sensor_id")


def _sensor_id(i: int) -> str:
    return f"S{i:03d}"


def _check_seed(seed: int) -> None:
    if not isinstance(seed, int | np.integer) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
