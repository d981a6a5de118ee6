"""A simulated fleet's settings (:class:`FleetSpec`), its chamber designs (``PxT``,
``campaign``, explicit points) and the sensor families' constants (:mod:`fedcal.data.simulator`
describes the model).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, model_validator

from fedcal.core.schema import MAX_CLIENTS, Float, Int, Str, checked

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
