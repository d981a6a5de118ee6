"""A physically grounded simulator of a fleet of resonant barometers.

Each sensor is a resonant pressure transducer put through the seed's chamber
protocol; the simulator returns what such a campaign records: the pressure
resonator's frequency, the sensor's own temperature reading and the chamber
reference pressure, row by row in measurement order (:class:`Fleet`).

Quartz family (Paroscientific Digiquartz equation)
--------------------------------------------------
With U = τ_T − U0 (µs), the calibration equations are::

    T  = Y1·U + Y2·U²
    C  = C1 + C2·U + C3·U²          D = D1
    T0 = T1 + T2·U + T3·U² + T4·U³  (µs)
    P  = C·(1 − T0²/τ²)·(1 − D·(1 − T0²/τ²))   τ: pressure period (µs)

Forward model used here: given the true chamber temperature T, U is the
root of ``Y2·U² + Y1·U − T = 0`` nearest 0; given the pressure P the sensor
feels, x = 1 − T0²/τ² is the root of ``D·x² − x + P/C = 0`` nearest P/C; then
τ = T0/√(1 − x) µs and f = 10⁶/τ Hz. The temperature resonator itself is not
simulated: the reported temperature is the true temperature with a bias, a
gain error and noise (U0 is carried along but unused).

Coefficients come from 21 real (deep-range) units shipped as package data
(C in psia, 1 psi = 68.94757 hPa). A barometer keeps a unit's temperature
behaviour (Y1, Y2, C2/C1, C3/C1, D1, T1..T4) with C rescaled. Our reading of
"rescale C so that full scale reaches |x| ≈ 0.2": **one common factor** for
all units, chosen so that the *average* unit reaches x = −0.2 at 1550 hPa and
U = 0. Note the signs: the real C1 are negative, so x is negative and the
frequency rises with pressure. Rescaling every unit to the same |x| would give
all sensors the same sensitivity (1.95–1.99 Hz/hPa), which contradicts the
spread of 1.9–2.8 Hz/hPa in the spec; a common factor keeps the real spread of
C1 and reproduces all the spec's figures for the 21 parent units::

    zero pressure       32.75–33.42 kHz     (spec ~32.8–33.4)
    1550 hPa            35.77–37.58 kHz     (spec ~35.8–37.6)
    (f1550 − f50)/1500  1.85–2.83 Hz/hPa    (spec 1.9–2.8)
    temperature effect  −22…+7 hPa          (spec roughly −21…+7)

(temperature effect: pressure read at 1000 hPa over −40…60 °C when the
coefficients are evaluated at a fixed 20 °C instead of the true temperature).

Silicon family (our design; TERPS-like silicon resonator)
---------------------------------------------------------
With p = P / 1600 hPa and t = (T − 20 °C)/100 °C::

    f = f0·(1 + a1·p + a2·p² + a3·p³ + a4·p⁴),  a_k = Σ_j k_kj·t^j  (j ≤ 3)
    (the constant term is 1 + k01·t + k02·t² + k03·t³)

f0 ≈ 30 kHz; the nominal a_k are the Taylor terms of a stress-stiffened beam
f = f0·√(1 + 0.3·p); temperature coefficients of −30 ppm/K on f0 and
−200 ppm/K on the sensitivity. Default fleet: 29.2–31.1 kHz at 50 hPa,
33.1–35.6 kHz at 1550 hPa, 2.3–3.0 Hz/hPa, uncompensated temperature effect
−27…+42 hPa at 1000 hPa (same definition as for quartz). 20 coefficients per sensor
(f0 and 19 k_kj, those with zero nominal value stay zero). The 21 "parent
units" of this family are a fixed synthetic production history drawn around
the nominal with a documented spread (:data:`SILICON_NOMINAL`).

Sensors, lots and heterogeneity
-------------------------------
A sensor's coefficient vector θ is drawn in a family parametrization (quartz:
U0, Y1, Y2, C1 [hPa, rescaled], C2/C1, C3/C1, D1, T1..T4); σ is the spread of
the 21 parent units per coefficient, θ_ref their mean.

* ``num_lots == 1``: sensor i takes parent unit ``perm[i mod 21]`` (perm a
  seeded permutation) plus a perturbation 0.25·σ·N(0, 1).
* ``num_lots == L > 1``: the lots' parent units are spread apart: greedy
  farthest-point over the units' frequencies on a coarse (P, T) grid, starting
  at ``perm[0]`` (so lots differ in behaviour, not only in coefficients that
  barely move the frequency). Lot centre = parent + 0.25·σ·N(0, 1); its
  sensors scatter around it by 0.05·σ·N(0, 1) (≈10 Hz rms, still ~5 hPa:
  personalization stays necessary within a lot). Sensors are assigned to
  lots in blocks of L consecutive ids, a seeded permutation of the lots in
  each block (balanced, and stable when sensors are added).
* ``heterogeneity`` h: θ = θ_ref + h·(θ_drawn − θ_ref); h = 0 makes every
  sensor the reference unit (identical up to the non-idealities below).

Non-idealities (the sensor "feels" P_eff; the label is the true P)
------------------------------------------------------------------
P_eff = P + hysteresis + ripple + noise (+ drift on test rows), then
f = f(P_eff, T_true):

* white noise, std ``pressure_noise_hpa`` (nominal 0.01, harsh 0.05 hPa);
* hysteresis ±H·sin(π·(P − Pmin)/(Pmax − Pmin)), H ~ U(hysteresis_hpa) per
  sensor (nominal 0.02–0.10, harsh 0.10–0.50 hPa); **+ when descending,
  − when ascending** (the sensor lags the pressure it came from);
* ripple: A·Σ_k w_k·sin(2π(ν_k·P/1600 hPa + μ_k·(T + 40)/100) + φ_k)/Σ w_k over
  three random components (ν ∈ [1.5, 4], μ ∈ [0, 1.5]); A ~ U(0.5, 1)·
  ``ripple_hpa`` (nominal 0.03, harsh 0.15 hPa), so |ripple| ≤ ripple_hpa;
* drift: rate = ``drift_hpa_per_year``·U(0.5, 1)·(random sign) per sensor,
  applied as an offset ``rate·test_delay_years`` to test rows only;
* chamber: the true temperature of a (plateau, sweep) is its setpoint plus
  N(0, ``plateau_offset_c``²), **shared by all sensors** (one chamber);
* temperature reading: T_rep = T_true·(1 + g) + b + noise, b ~ N(0, 0.2²) °C,
  g ~ N(0, 0.002²) per sensor, noise N(0, 0.01²) °C per reading.

Protocol (seed)
---------------
16 pressure levels (50…1550 hPa) × 6 plateaus (−40…60 °C), plateau by
plateau. At each plateau: ``train_sweeps`` sweeps over all levels (up, down,
up, down) = 384 training rows, then the test cycle (``sweep`` =
``train_sweeps``): ascending through 5 levels then descending through the
same 5 — the levels nearest ``linspace`` over the grid, 50, 450, 850, 1150,
1550 hPa — 60 test rows. ``test_design="random"``: instead, after all
training, 60 off-grid points with P ~ U(50, 1550) hPa, T ~ U(−40, 60) °C and a
random direction, the same points for every sensor (one chamber run): uniform
over the whole calibrated rectangle [min level, max level] × [min plateau,
max plateau] (true chamber temperature; the sensor reads it with its bias).

Chamber designs (few-point calibration)
---------------------------------------
``train_design`` says which calibration points a unit gets: ``"campaign"`` is
the seed protocol above (16 × 6 × 4 sweeps = 384 rows); ``"PxT"`` (e.g.
``"3x2"``, ``"4x3"``, ``"6x4"``) is what a production chamber does with few
points: P pressure levels evenly spread over the calibrated range
(``linspace(min level, max level, P)``, so the ends are always included) at
each of T temperature plateaus, also evenly spread and including both ends of
the range (``linspace(min plateau, max plateau, T)``; T = 1: the middle of the
range), one ascending sweep per plateau, plateaus cold to hot — P·T rows.
``"points"``: the explicit points of ``design_points`` (pressure, set point,
sweep direction), e.g. a design planned by ``fedcal plan``, measured in the
given order; plateaus are its distinct set points.
The physics is the campaign's: each plateau's true temperature is its setpoint
plus N(0, ``plateau_offset_c``²) (its own chamber run, shared by every unit of
that design: stream ``(seed, design)``), and the ascending sweep carries the
hysteresis of an ascending branch (the campaign averages both branches, a
one-sweep design cannot). Test rows are the campaign's, whatever the design
(same points, same chamber temperatures, same noise draws), so designs are
compared on identical test data.

Mixed fleets: ``num_reference`` units calibrated with ``reference_design``
(default the campaign) then ``num_new`` units with ``train_design``; sensor
ids run on (reference units first), each unit is drawn exactly as in a plain
fleet of that size, and the frame gains a ``role`` column ("reference" /
"new"). With both counts 0 (the default) the fleet is ``num_sensors`` units
of ``train_design`` and has no role column.

Randomness: numpy ``Generator(PCG64)`` from ``SeedSequence(seed,
spawn_key=...)``, one stream per purpose and per sensor, so sensor i does not
change when sensors are added and the same seed gives a bit-identical frame;
training rows do not depend on the test design (own noise stream).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import re
from collections.abc import Iterator
from functools import cache
from typing import Annotated, Literal

import numpy as np
import pandas as pd
from pydantic import Field, model_validator

from fedcal.core.schema import MAX_CLIENTS, Float, Int, Str, checked
from fedcal.data.fleet import (
    BAROMETRIC_FEATURES,
    BAROMETRIC_TARGET,
    CLIENT_COLUMN,
    ROLE_COLUMN,
    Fleet,
)

PSI_TO_HPA = 68.94757
CAMPAIGN = "campaign"
ROLES = ("reference", "new")

# Per preset: white noise (hPa), hysteresis half-amplitude range (hPa), ripple bound (hPa).
PRESET_VALUES: dict[str, dict] = {
    "nominal": {"noise": 0.01, "hysteresis": (0.02, 0.10), "ripple": 0.03},
    "harsh": {"noise": 0.05, "hysteresis": (0.10, 0.50), "ripple": 0.15},
}

# Spreads in units of the parent units' per-coefficient std.
SENSOR_SPREAD = 0.25  # a sensor around its parent unit (num_lots == 1)
LOT_SPREAD = 0.25  # a lot centre around its parent unit (num_lots > 1)
WITHIN_LOT_SPREAD = 0.05  # a sensor around its lot centre

# Quartz: the full scale used to rescale C (the average unit reaches x = X_FULL_SCALE here).
QUARTZ_FULL_SCALE_HPA = 1550.0
X_FULL_SCALE = -0.2
QUARTZ_PARAMS = ("U0_us", "Y1", "Y2", "C1_hpa", "c2", "c3", "D1", "T1_us", "T2", "T3", "T4")

# Silicon: p = P / SILICON_P_SCALE, t = (T − SILICON_T_REF) / SILICON_T_SCALE.
SILICON_P_SCALE = 1600.0
SILICON_T_REF = 20.0
SILICON_T_SCALE = 100.0
# name: (nominal, spread between production units)
SILICON_NOMINAL: dict[str, tuple[float, float]] = {
    "f0_hz": (30_000.0, 450.0),
    "k01": (-3.0e-3, 4.5e-4),
    "k02": (-4.0e-4, 2.0e-4),
    "k03": (1.0e-4, 5.0e-5),
    "k10": (0.15, 7.5e-3),
    "k11": (-3.0e-3, 6.0e-4),
    "k12": (6.0e-4, 3.0e-4),
    "k13": (-1.5e-4, 7.5e-5),
    "k20": (-0.01125, 1.1e-3),
    "k21": (2.0e-4, 5.0e-5),
    "k22": (-4.0e-5, 2.0e-5),
    "k23": (0.0, 0.0),
    "k30": (1.6875e-3, 3.0e-4),
    "k31": (-3.0e-5, 1.0e-5),
    "k32": (0.0, 0.0),
    "k33": (0.0, 0.0),
    "k40": (-3.164e-4, 1.0e-4),
    "k41": (0.0, 0.0),
    "k42": (0.0, 0.0),
    "k43": (0.0, 0.0),
}
SILICON_PARAMS = tuple(SILICON_NOMINAL)
_SILICON_POOL_SEED = 20_240_601  # fixed: the synthetic production history of the family
_NUM_POOL_UNITS = 21

# Stream purposes (first element of a SeedSequence spawn key).
_S_PARENTS, _S_LOT, _S_LOT_ASSIGN, _S_CHAMBER, _S_RANDOM_TEST, _S_SENSOR, _S_NOISE = range(7)
_S_DESIGN_CHAMBER = 7
_S_POINTS_CHAMBER = 8
POINTS = "points"  # train_design: the explicit chamber points of ``design_points``

_DESIGN_PATTERN = re.compile(r"(\d+)x(\d+)")


def parse_design(design: str) -> tuple[int, int] | None:
    """``"campaign"`` → None; ``"PxT"`` → (P, T) pressure levels × temperature plateaus.

    Raises ValueError (one line, naming the value) for anything else, P < 2 or T < 1.
    """
    if design == CAMPAIGN:
        return None
    match = _DESIGN_PATTERN.fullmatch(str(design).strip().lower())
    if match is None:
        raise ValueError(f"{design!r} is not 'campaign' or PxT like '3x2'")
    p, t = int(match[1]), int(match[2])
    if p < 2 or t < 1:
        raise ValueError(f"{design!r}: need at least 2 pressure levels and 1 temperature plateau")
    return p, t


NonNegative = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0.0)]
Hpa = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0.0, le=1e4)]
Count = Annotated[int, Field(strict=True, ge=0, le=MAX_CLIENTS)]


@checked
class FleetSpec:
    """Settings of a simulated fleet; defaults reproduce the seed's protocol.

    ``num_sensors`` sizes a plain fleet; a mixed fleet (``num_reference`` or
    ``num_new`` > 0) has ``num_reference + num_new`` units instead (see the
    module doc, "Chamber designs"). Every field is typed and range-checked
    (:func:`fedcal.core.schema.checked`); the configuration's ``[fleet]`` is this
    class plus the fleet seed.
    """

    num_sensors: Int = Field(default=20, ge=1, le=MAX_CLIENTS)
    pressure_levels_hpa: tuple[Hpa, ...] = Field(
        default=tuple(float(p) for p in range(50, 1551, 100)), min_length=2, max_length=1000
    )
    temperature_plateaus_c: tuple[Float, ...] = Field(
        default=(-40.0, -20.0, 0.0, 20.0, 40.0, 60.0), min_length=1, max_length=1000
    )
    train_sweeps: Int = Field(default=4, ge=0, le=1000)
    test_points_per_plateau: Int = Field(default=10, ge=0, le=100_000)
    test_design: Literal["cycle", "random"] = "cycle"
    family: Literal["quartz", "silicon"] = "quartz"
    preset: Literal["nominal", "harsh"] = "nominal"
    heterogeneity: Float = Field(default=1.0, ge=0.0, le=100.0)
    num_lots: Int = Field(default=1, ge=1, le=MAX_CLIENTS)
    pressure_noise_hpa: Hpa | None = None  # None: the preset's
    hysteresis_hpa: tuple[Hpa, Hpa] | None = None  # (lo, hi) half-amplitudes; None: preset's
    ripple_hpa: Hpa | None = None
    temperature_bias_c: Float = 0.2
    temperature_gain_std: NonNegative = 0.002
    temperature_noise_c: NonNegative = 0.01
    plateau_offset_c: NonNegative = 0.2
    drift_hpa_per_year: Float = 0.0
    test_delay_years: NonNegative = 0.0
    train_design: Str = CAMPAIGN  # "campaign" (16 P x 6 T x 4 sweeps) or "PxT", e.g. "3x2"
    num_reference: Count = 0  # mixed fleet: reference units
    num_new: Count = 0  # + new units; 0, 0 = plain fleet
    reference_design: Str = CAMPAIGN
    # train_design = "points": each unit's chamber points (pressure hPa, set point °C, sweep
    # "up"/"down") in measurement order, e.g. a `fedcal plan` design.csv (module doc).
    design_points: tuple[tuple[Hpa, Float, Literal["up", "down"]], ...] = Field(
        default=(), max_length=100_000
    )

    @model_validator(mode="after")
    def _designs(self) -> FleetSpec:
        for name in ("train_design", "reference_design"):
            if getattr(self, name) == POINTS:
                if not self.design_points:
                    raise ValueError(f"{name}: 'points' needs design_points (none given)")
                continue
            try:
                parse_design(getattr(self, name))
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from None
        return self

    @property
    def mixed(self) -> bool:
        """A fleet of reference units and new units (roles recorded)."""
        return self.num_reference + self.num_new > 0

    @property
    def sensor_count(self) -> int:
        return self.num_reference + self.num_new if self.mixed else self.num_sensors

    def role(self, i: int) -> str | None:
        """ "reference" or "new" for unit ``i`` of a mixed fleet; None in a plain fleet."""
        if not self.mixed:
            return None
        return ROLES[0] if i < self.num_reference else ROLES[1]

    def design(self, i: int) -> str:
        """The chamber design that calibrates unit ``i``."""
        return self.reference_design if self.role(i) == ROLES[0] else self.train_design

    # Effective non-ideality levels (explicit overrides win over the preset).
    @property
    def noise_hpa(self) -> float:
        p = PRESET_VALUES[self.preset]["noise"]
        return p if self.pressure_noise_hpa is None else float(self.pressure_noise_hpa)

    @property
    def hysteresis_range_hpa(self) -> tuple[float, float]:
        h = self.hysteresis_hpa
        lo, hi = PRESET_VALUES[self.preset]["hysteresis"] if h is None else h
        return float(lo), float(hi)

    @property
    def ripple_bound_hpa(self) -> float:
        r = PRESET_VALUES[self.preset]["ripple"]
        return r if self.ripple_hpa is None else float(self.ripple_hpa)


# ---------------------------------------------------------------------------
# Parent units of each family


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


# ---------------------------------------------------------------------------
# Forward models


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


# ---------------------------------------------------------------------------
# Sensors


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


# ---------------------------------------------------------------------------
# Protocol


def measurement_plan(
    spec: FleetSpec = FleetSpec(), seed: int = 0, design: str | None = None
) -> pd.DataFrame:
    """The chamber schedule of every unit of one design, in measurement order.

    ``design`` defaults to ``spec.train_design``. Columns: ``pressure_hpa``
    (true, reference gauge), ``temperature_true_c`` (chamber, setpoint +
    plateau offset), ``plateau`` (index into the design's plateaus, −1 for
    random test points), ``sweep``, ``direction``, ``split``. Test rows are the
    campaign's whatever the design.
    """
    _check_seed(seed)
    design = spec.train_design if design is None else design
    campaign = _campaign_plan(spec, seed)
    if design == POINTS:
        train = _points_plan(spec, seed)
    elif (grid := parse_design(design)) is None:
        return campaign
    else:
        train = _grid_plan(spec, seed, *grid)
    test = campaign[campaign["split"] == "test"]
    return pd.concat([train, test], ignore_index=True)


def design_levels(spec: FleetSpec, num_levels: int, num_plateaus: int) -> tuple[np.ndarray, ...]:
    """(pressure levels, temperature setpoints) of a PxT design: evenly spread, ends included."""
    levels = np.asarray(spec.pressure_levels_hpa, dtype=float)
    plateaus = np.asarray(spec.temperature_plateaus_c, dtype=float)
    p = np.linspace(levels.min(), levels.max(), num_levels)
    if num_plateaus == 1:
        t = np.array([(plateaus.min() + plateaus.max()) / 2.0])
    else:
        t = np.linspace(plateaus.min(), plateaus.max(), num_plateaus)
    return p, t


def _grid_plan(spec: FleetSpec, seed: int, num_levels: int, num_plateaus: int) -> pd.DataFrame:
    """Training rows of a PxT design: one ascending sweep per plateau, cold to hot."""
    p, t = design_levels(spec, num_levels, num_plateaus)
    offsets = spec.plateau_offset_c * _rng(
        seed, _S_DESIGN_CHAMBER, num_levels, num_plateaus
    ).standard_normal(num_plateaus)
    n = num_levels * num_plateaus
    return pd.DataFrame(
        {
            "pressure_hpa": np.tile(p, num_plateaus),
            "temperature_true_c": np.repeat(t + offsets, num_levels),
            "plateau": np.repeat(np.arange(num_plateaus, dtype=np.int64), num_levels),
            "sweep": np.zeros(n, dtype=np.int64),
            "direction": np.full(n, "up", dtype=object),
            "split": np.full(n, "train", dtype=object),
        }
    )


def _points_plan(spec: FleetSpec, seed: int) -> pd.DataFrame:
    """Training rows of the explicit design ``design_points``, in the given order.

    Plateaus are the distinct set points in order of first appearance; each one's true
    temperature is its set point plus N(0, ``plateau_offset_c``²) from its own stream
    (seed, plateau index), shared by every unit of the design (one chamber run).
    """
    pressure = np.array([p for p, _, _ in spec.design_points], dtype=float)
    setpoint = np.array([t for _, t, _ in spec.design_points], dtype=float)
    plateaus, index = np.unique(setpoint, return_inverse=True)
    first = [int(np.flatnonzero(index == k)[0]) for k in range(len(plateaus))]
    order = np.argsort(first)  # plateau numbers in order of first appearance
    rank = np.empty(len(plateaus), dtype=np.int64)
    rank[order] = np.arange(len(plateaus))
    offsets = spec.plateau_offset_c * _rng(seed, _S_POINTS_CHAMBER).standard_normal(len(plateaus))
    plateau = rank[index]
    n = len(pressure)
    return pd.DataFrame(
        {
            "pressure_hpa": pressure,
            "temperature_true_c": setpoint + offsets[plateau],
            "plateau": plateau.astype(np.int64),
            "sweep": np.zeros(n, dtype=np.int64),
            "direction": np.array([d for _, _, d in spec.design_points], dtype=object),
            "split": np.full(n, "train", dtype=object),
        }
    )


def _campaign_plan(spec: FleetSpec, seed: int) -> pd.DataFrame:
    levels = np.asarray(spec.pressure_levels_hpa, dtype=float)
    plateaus = np.asarray(spec.temperature_plateaus_c, dtype=float)
    n_sweeps = spec.train_sweeps + 1  # the test cycle is sweep index train_sweeps
    offsets = spec.plateau_offset_c * _rng(seed, _S_CHAMBER).standard_normal(
        (len(plateaus), n_sweeps)
    )
    cycle = spec.test_design == "cycle"
    n_up = (spec.test_points_per_plateau + 1) // 2
    n_down = spec.test_points_per_plateau // 2
    up_idx = np.round(np.linspace(0, len(levels) - 1, n_up)).astype(int)
    down_idx = np.round(np.linspace(0, len(levels) - 1, n_down)).astype(int)[::-1]

    cols: dict[str, list] = {k: [] for k in ("p", "t", "plateau", "sweep", "dir", "split")}

    def add(p, t, plateau, sweep, direction, split):
        n = len(p)
        cols["p"].append(np.asarray(p, float))
        cols["t"].append(np.broadcast_to(np.asarray(t, float), (n,)))
        cols["plateau"].append(np.full(n, plateau, dtype=np.int64))
        cols["sweep"].append(np.full(n, sweep, dtype=np.int64))
        cols["dir"].append(np.full(n, direction, dtype=object))
        cols["split"].append(np.full(n, split, dtype=object))

    for j, t_set in enumerate(plateaus):
        for s in range(spec.train_sweeps):
            up = s % 2 == 0
            add(levels if up else levels[::-1], t_set + offsets[j, s], j, s, _dir(up), "train")
        if cycle:
            t_test = t_set + offsets[j, spec.train_sweeps]
            add(levels[up_idx], t_test, j, spec.train_sweeps, "up", "test")
            add(levels[down_idx], t_test, j, spec.train_sweeps, "down", "test")
    if not cycle:
        n = spec.test_points_per_plateau * len(plateaus)
        r = _rng(seed, _S_RANDOM_TEST)
        p = r.uniform(levels.min(), levels.max(), n)
        t = r.uniform(plateaus.min(), plateaus.max(), n)
        ups = r.uniform(size=n) < 0.5
        for k in range(n):
            add(p[k : k + 1], t[k], -1, spec.train_sweeps, _dir(bool(ups[k])), "test")
    cat = {k: np.concatenate(v) if v else np.zeros(0) for k, v in cols.items()}
    return pd.DataFrame(
        {
            "pressure_hpa": cat["p"].astype(float),
            "temperature_true_c": cat["t"].astype(float),
            "plateau": cat["plateau"].astype(np.int64),
            "sweep": cat["sweep"].astype(np.int64),
            "direction": cat["dir"].astype(object),
            "split": cat["split"].astype(object),
        }
    )


def _dir(up: bool) -> str:
    return "up" if up else "down"


# ---------------------------------------------------------------------------
# The fleet


def noise_draws(seed: int, sensor: int, is_test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sensor ``sensor``'s standard normal draws (z_p, z_t), one per row of its plan.

    ``simulate_fleet`` reads pressure noise ``noise_hpa · z_p`` and temperature noise
    ``temperature_noise_c · z_t``. Train and test rows (``is_test``) draw from separate
    streams (z_p then z_t in each), so the training data do not depend on the test design.
    """
    n = len(is_test)
    z_p, z_t = np.empty(n), np.empty(n)
    for k, rows in enumerate((~is_test, is_test)):
        noise = _rng(seed, _S_NOISE, sensor, k)
        z_p[rows] = noise.standard_normal(int(rows.sum()))
        z_t[rows] = noise.standard_normal(int(rows.sum()))
    return z_p, z_t


def simulate_fleet(spec: FleetSpec = FleetSpec(), seed: int = 0) -> Fleet:
    """Simulate ``spec.sensor_count`` sensors through their chamber designs.

    Same ``spec`` and ``seed`` give a bit-identical frame; sensor i does not
    change when more sensors are added.
    """
    _check_seed(seed)
    params = sensor_parameters(spec, seed)
    (frame,) = simulate_chunks(spec, seed, chunk_size=0, params=params)
    return Fleet(
        frame=frame,
        features=BAROMETRIC_FEATURES,
        target=BAROMETRIC_TARGET,
        client_column=CLIENT_COLUMN,
        meta=simulated_meta(spec, seed, params),
    )


def simulated_meta(spec: FleetSpec, seed: int, params: pd.DataFrame | None = None) -> dict:
    """The provenance :func:`simulate_fleet` puts in its fleet's ``meta`` (``params``: the
    :func:`sensor_parameters` of ``spec`` and ``seed``, if already drawn)."""
    params = sensor_parameters(spec, seed) if params is None else params
    meta = {
        "source": "simulator",
        "spec": dataclasses.asdict(spec),
        "seed": int(seed),
        "lots": {sid: int(lot) for sid, lot in params["lot"].items()},
    }
    if spec.mixed:
        meta["roles"] = {sid: spec.role(i) for i, sid in enumerate(params.index)}
    return meta


def simulate_chunks(
    spec: FleetSpec = FleetSpec(),
    seed: int = 0,
    chunk_size: int = 0,
    params: pd.DataFrame | None = None,
) -> Iterator[pd.DataFrame]:
    """:func:`simulate_fleet`'s frame, ``chunk_size`` sensors at a time (0: one frame).

    The frames, concatenated, are :func:`simulate_fleet`'s frame to the bit: each sensor
    is drawn from its own seeded streams (:func:`noise_draws`) whatever the chunking.
    Only one chunk's rows are in memory at a time (``fedcal simulate`` at 100,000 units).
    ``params``: :func:`sensor_parameters` of ``spec`` and ``seed``, if already drawn.
    """
    _check_seed(seed)
    params = sensor_parameters(spec, seed) if params is None else params
    names = param_names(spec.family)
    levels = np.asarray(spec.pressure_levels_hpa, dtype=float)
    p_min, p_max = levels.min(), levels.max()
    designs = {spec.design(i) for i in range(spec.sensor_count)}
    plans = {d: measurement_plan(spec, seed, d) for d in designs}

    # Columns gathered as arrays and framed once: a DataFrame per sensor cost ~1 ms each.
    by_design = {
        d: (
            plan["pressure_hpa"].to_numpy(float),
            plan["temperature_true_c"].to_numpy(float),
            np.where(plan["direction"].to_numpy() == "down", 1.0, -1.0),
            (plan["split"] == "test").to_numpy(),
            plan["split"].to_numpy(),
            plan["sweep"].to_numpy(np.int64),
            plan["direction"].to_numpy(),
        )
        for d, plan in plans.items()
    }
    size = chunk_size if chunk_size > 0 else max(len(params), 1)
    for first in range(0, max(len(params), 1), size):
        columns: dict[str, list[np.ndarray]] = {}
        part = params.iloc[first : first + size]
        for i, (sid, prm) in enumerate(part.iterrows(), start=first):
            p_true, t_true, sign, is_test, split, sweep, direction = by_design[spec.design(i)]
            shape_h = np.sin(np.pi * np.clip((p_true - p_min) / (p_max - p_min), 0.0, 1.0))
            n = len(p_true)
            z_p, z_t = noise_draws(seed, i, is_test)
            hyst = sign * prm["hysteresis_hpa"] * shape_h
            ripple = _ripple(p_true, t_true, prm)
            drift = np.where(is_test, prm["drift_hpa_per_year"] * spec.test_delay_years, 0.0)
            p_eff = p_true + hyst + ripple + drift + spec.noise_hpa * z_p
            coeffs = {k: float(prm[k]) for k in names}
            freq = frequency(spec.family, p_eff, t_true, coeffs)
            t_read = (
                t_true * (1.0 + prm["temperature_gain"])
                + prm["temperature_bias_c"]
                + spec.temperature_noise_c * z_t
            )
            row = {
                CLIENT_COLUMN: np.full(n, sid, dtype=object),
                "frequency_hz": freq.astype(np.float64),
                "temperature_c": t_read.astype(np.float64),
                BAROMETRIC_TARGET: p_true.copy(),
                "split": split,
                "lot": np.full(n, int(prm["lot"]), dtype=np.int64),
                "sweep": sweep,
                "direction": direction,
            }
            if spec.mixed:
                row[ROLE_COLUMN] = np.full(n, spec.role(i), dtype=object)
            for name, values in row.items():
                columns.setdefault(name, []).append(values)
        yield pd.DataFrame({name: np.concatenate(parts) for name, parts in columns.items()})


def _ripple(p: np.ndarray, t: np.ndarray, prm) -> np.ndarray:
    """Smooth non-polynomial ripple, |ripple| ≤ ripple_amp_hpa."""
    w = np.asarray(prm["ripple_weight"])
    total = np.zeros_like(p)
    for nu, mu, ph, wk in zip(
        prm["ripple_nu"], prm["ripple_mu"], prm["ripple_phase"], w, strict=True
    ):
        total = total + wk * np.sin(2.0 * np.pi * (nu * p / 1600.0 + mu * (t + 40.0) / 100.0) + ph)
    return prm["ripple_amp_hpa"] * total / w.sum()
