"""A generic-feature benchmark: a fleet of capacitive humidity sensors (ours).

Data path ``builtin:humidity``. Three named inputs — ``capacitance_pf`` (the
readout's capacitance), ``temperature_c`` (the unit's thermistor) and
``supply_v`` (its supply voltage) — and the target ``rh_percent`` (the
chamber's reference hygrometer). Few, noisy, heteroscedastic points per unit
and a few outliers: the regime where a per-unit fit overfits and a pooled fit
ignores what makes units differ.

Physics (a polymer-dielectric capacitive RH sensor on a ratiometric readout)
----------------------------------------------------------------------------
With h the true relative humidity (%), ΔT = T − 25 °C and ΔV = V − 3.3 V::

    C      = C0·(1 + α·ΔT) + S·h·(1 + β·ΔT) + k·h²        sensor capacitance (pF)
    C_read = C·(1 + γ·ΔV) + ε                             what the readout reports

Fleet law (nominal unit): C0 = 180 pF, S = 0.30 pF/%RH, α = 4·10⁻⁴ /K (dry
dielectric), β = 2·10⁻³ /K (water uptake grows with temperature), k = 4·10⁻⁴
pF/%RH² (clustering of water at high humidity), γ = 0.01 /V (readout
supply sensitivity). Each unit's coefficient is law·(1 + spread·z), z ~ N(0, 1):
spreads 3 % (C0: ±5 pF ≈ ±18 %RH — a pooled fit cannot absorb it), 8 % (S),
30 % (α, k), 20 % (β), 50 % (γ). Its inverse h(C_read, T, V) is smooth and
close to a total-degree-2 polynomial in the three inputs whose coefficients
vary around the fleet's.

Non-idealities
--------------
* noise ε ~ N(0, σ_i²·(1 + h/30)²): each unit's own level σ_i, log-uniform in
  [0.02, 0.15] pF (≈ 0.07–0.5 %RH at h = 0), growing with the signal (×4 at 90 %RH);
* thermistor reading T + N(0, 0.1²) °C; supply reading V + N(0, 0.005²) V;
* outliers: each calibration point's reference reading is, with probability
  ``outlier_rate``, off by ±U(8, 20) %RH (the reference not yet settled);
  test points' references are clean (column ``outlier`` flags them).

Design: unit i gets n_i ~ U{``min_points``…``max_points``} calibration points and
``test_points`` test points, each at (h, T, V) uniform over 10–90 %RH ×
0–50 °C × 3.0–3.6 V (no shared grid: generic features).

Randomness: numpy ``PCG64`` from ``SeedSequence(seed, spawn_key=(purpose, i))``,
one stream per unit and purpose; the same seed gives a bit-identical frame and
unit i does not change when units are added.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pandas as pd

from fedcal.data.fleet import CLIENT_COLUMN, Fleet

FEATURES = ("capacitance_pf", "temperature_c", "supply_v")
TARGET = "rh_percent"
# coefficient: (fleet law, relative spread between units)
LAW: dict[str, tuple[float, float]] = {
    "c0_pf": (180.0, 0.03),
    "s_pf_per_rh": (0.30, 0.08),
    "alpha_per_k": (4e-4, 0.30),
    "beta_per_k": (2e-3, 0.20),
    "k_pf_per_rh2": (4e-4, 0.30),
    "gamma_per_v": (0.01, 0.50),
}
RH_RANGE = (10.0, 90.0)
T_RANGE = (0.0, 50.0)
V_RANGE = (3.0, 3.6)
T_REF, V_REF = 25.0, 3.3
NOISE_PF = (0.02, 0.15)  # per-unit noise level range (log-uniform), pF at h = 0
NOISE_GROWTH_RH = 30.0  # σ grows as (1 + h / 30)
OUTLIER_RH = (8.0, 20.0)
_S_UNIT, _S_POINTS = 0, 1


@dataclass(frozen=True)
class HumiditySpec:
    num_units: int = 40
    min_points: int = 8
    max_points: int = 15
    test_points: int = 40
    outlier_rate: float = 0.05
    heterogeneity: float = 1.0  # scales every spread; 0 = every unit is the fleet law

    def __post_init__(self) -> None:
        if self.num_units < 1:
            raise ValueError(f"num_units must be >= 1, got {self.num_units}")
        if not 1 <= self.min_points <= self.max_points:
            raise ValueError(
                f"need 1 <= min_points <= max_points, got {self.min_points}, {self.max_points}"
            )
        if self.test_points < 1:
            raise ValueError(f"test_points must be >= 1, got {self.test_points}")
        if not 0.0 <= self.outlier_rate < 1.0:
            raise ValueError(f"outlier_rate must be in [0, 1), got {self.outlier_rate}")
        if self.heterogeneity < 0:
            raise ValueError(f"heterogeneity must be >= 0, got {self.heterogeneity}")


def _rng(seed: int, *key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=key)))


def unit_parameters(spec: HumiditySpec = HumiditySpec(), seed: int = 0) -> pd.DataFrame:
    """Each unit's coefficients (:data:`LAW` names), noise level and point count, by sensor_id."""
    if not isinstance(seed, int | np.integer) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    rows = []
    for i in range(spec.num_units):
        r = _rng(seed, _S_UNIT, i)
        z = r.standard_normal(len(LAW))
        row = {
            name: law * (1.0 + spec.heterogeneity * spread * zk)
            for (name, (law, spread)), zk in zip(LAW.items(), z, strict=True)
        }
        lo, hi = np.log(NOISE_PF[0]), np.log(NOISE_PF[1])
        row["noise_pf"] = float(np.exp(r.uniform(lo, hi)))
        row["train_points"] = int(r.integers(spec.min_points, spec.max_points + 1))
        rows.append({"sensor_id": f"H{i:03d}", **row})
    return pd.DataFrame(rows).set_index("sensor_id")


def capacitance(rh, temperature_c, supply_v, prm) -> np.ndarray:
    """Noise-free readout capacitance (pF) of a unit with coefficients ``prm`` (module doc)."""
    dt = np.asarray(temperature_c, float) - T_REF
    dv = np.asarray(supply_v, float) - V_REF
    h = np.asarray(rh, float)
    c = (
        prm["c0_pf"] * (1.0 + prm["alpha_per_k"] * dt)
        + prm["s_pf_per_rh"] * h * (1.0 + prm["beta_per_k"] * dt)
        + prm["k_pf_per_rh2"] * h * h
    )
    return c * (1.0 + prm["gamma_per_v"] * dv)


def humidity_fleet(spec: HumiditySpec = HumiditySpec(), seed: int = 0) -> Fleet:
    """Simulate the fleet (see the module doc); same spec and seed → bit-identical frame."""
    params = unit_parameters(spec, seed)
    frames = []
    for i, (sid, prm) in enumerate(params.iterrows()):
        r = _rng(seed, _S_POINTS, i)
        n_train = int(prm["train_points"])
        n = n_train + spec.test_points
        h = r.uniform(*RH_RANGE, n)
        t = r.uniform(*T_RANGE, n)
        v = r.uniform(*V_RANGE, n)
        noise = prm["noise_pf"] * (1.0 + h / NOISE_GROWTH_RH) * r.standard_normal(n)
        c_read = capacitance(h, t, v, prm) + noise
        t_read = t + 0.1 * r.standard_normal(n)
        v_read = v + 0.005 * r.standard_normal(n)
        is_train = np.arange(n) < n_train
        outlier = is_train & (r.uniform(size=n) < spec.outlier_rate)
        jump = r.choice([-1.0, 1.0], n) * r.uniform(*OUTLIER_RH, n)
        label = h + np.where(outlier, jump, 0.0)
        frames.append(
            pd.DataFrame(
                {
                    CLIENT_COLUMN: np.full(n, sid, dtype=object),
                    "capacitance_pf": c_read,
                    "temperature_c": t_read,
                    "supply_v": v_read,
                    TARGET: label,
                    "split": np.where(is_train, "train", "test").astype(object),
                    "outlier": outlier,
                }
            )
        )
    meta = {
        "source": "builtin:humidity",
        "spec": dataclasses.asdict(spec),
        "seed": int(seed),
        "units": params.reset_index().to_dict(orient="records"),
    }
    return Fleet(
        frame=pd.concat(frames, ignore_index=True),
        features=FEATURES,
        target=TARGET,
        client_column=CLIENT_COLUMN,
        meta=meta,
    )
