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
from collections.abc import Iterator

import numpy as np
import pandas as pd

from fedcal.data.fleet import (
    BAROMETRIC_FEATURES,
    BAROMETRIC_TARGET,
    CLIENT_COLUMN,
    ROLE_COLUMN,
    Fleet,
)
from fedcal.data.fleetspec import (
    _S_NOISE,
    CAMPAIGN,
    POINTS,
    PSI_TO_HPA,
    QUARTZ_PARAMS,
    ROLES,
    SILICON_PARAMS,
    FleetSpec,
    parse_design,
)
from fedcal.data.protocol import (
    design_levels,
    measurement_plan,
)
from fedcal.data.sensor_models import (
    _check_seed,
    _rng,
    frequency,
    load_digiquartz_units,
    param_names,
    quartz_c_scale,
    quartz_frequency,
    sensor_parameters,
    silicon_frequency,
)


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


# The simulator's names, wherever they live (the fleet's settings, the sensors' physics, the
# protocol): callers import them from here.
__all__ = [
    "CAMPAIGN",
    "POINTS",
    "PSI_TO_HPA",
    "QUARTZ_PARAMS",
    "ROLES",
    "SILICON_PARAMS",
    "FleetSpec",
    "design_levels",
    "frequency",
    "load_digiquartz_units",
    "measurement_plan",
    "noise_draws",
    "param_names",
    "parse_design",
    "quartz_c_scale",
    "quartz_frequency",
    "sensor_parameters",
    "silicon_frequency",
    "simulate_chunks",
    "simulate_fleet",
    "simulated_meta",
]
