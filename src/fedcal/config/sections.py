"""The configuration's sections: one frozen pydantic dataclass per TOML table.

Each field is typed and range-checked; :func:`section` validates one table (``base``'s
values with the file's on top) and refuses an unknown key, every error one line naming the
file, the section and the field (:class:`~fedcal.core.errors.ConfigError`). The run as a
whole (:class:`~fedcal.config.run.RunConfig`) holds one of each.
"""

from __future__ import annotations

import math
from dataclasses import asdict, field, fields
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, ValidationError, model_validator

from fedcal.core.aggregation import AggregationRules
from fedcal.core.algorithm import Recipe
from fedcal.core.errors import ConfigError
from fedcal.core.schema import (
    MAX_ROUNDS,
    Bool,
    Float,
    Int,
    Name,
    Seed,
    Str,
    checked,
    problem,
)
from fedcal.data.fleet import BAROMETRIC_FEATURES, BAROMETRIC_TARGET, CLIENT_COLUMN, SPLIT_COLUMN
from fedcal.data.simulator import FleetSpec, parse_design
from fedcal.engine.settings import EngineSettings


def _design(value: str, where: str) -> str:
    try:
        parse_design(value)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    return value


@checked
class DataConfig:
    path: Str = ""  # CSV/Parquet fleet; empty = the embedded simulator
    features: tuple[Name, ...] = Field(default=BAROMETRIC_FEATURES, min_length=1, max_length=64)
    target: Name = BAROMETRIC_TARGET
    # The target's unit as tables, reports and certificates print it (e.g. "hPa", "µg/m³");
    # empty: read from the column's name where it says one ("pressure [hPa]", "pressure_hpa"),
    # else none is printed — never guessed from another word (issue 37.2).
    target_unit: Annotated[str, Field(strict=True, max_length=32)] = ""
    client_column: Name = CLIENT_COLUMN
    split_column: Name = SPLIT_COLUMN
    test_fraction: Float = Field(default=0.135, gt=0.0, lt=1.0)  # file without a split column
    split_seed: Seed = 0
    train_points: Int = Field(default=0, ge=0, le=10_000_000)  # per sensor; 0 = all
    scaling: Literal["auto", "physical", "federated"] = "auto"  # see fedcal.data.scaling
    # Plausibility bounds of known columns (fedcal.data.loader): column -> [lo, hi], inclusive,
    # ±inf for an open side; replaces the loader's default for that column.
    physical_bounds: dict[Name, tuple[Annotated[float, Field(strict=True)], ...]] = field(
        default_factory=dict
    )
    # Optional time of each row (a number or a date); "time": each sensor's last test_fraction
    # of its time is its test period (fedcal.data.loader.time_split), "random": seeded rows.
    time_column: Str = ""
    split_by: Literal["random", "time"] = "random"
    # Optional feature that reads the target itself (e.g. a PM sensor's uncorrected PM2.5):
    # the uncorrected reading is then a candidate of fedprior's time-respecting choice
    # (algorithms/fedprior_choice.py) and of its no-harm fall-back.
    raw_column: Str = ""

    @model_validator(mode="after")
    def _consistent(self) -> DataConfig:
        if len(set(self.features)) != len(self.features):
            raise ValueError(f"features: a column is named twice in {list(self.features)}")
        if self.target in self.features:
            raise ValueError(f"target: {self.target!r} is also a feature")
        if self.split_by == "time" and not self.time_column:
            raise ValueError("split_by: 'time' needs a time_column")
        if self.raw_column and self.raw_column not in self.features:
            raise ValueError(f"raw_column: {self.raw_column!r} is not one of the features")
        if self.time_column and self.time_column in (*self.features, self.target):
            raise ValueError(f"time_column: {self.time_column!r} is also a feature or the target")
        for col, bounds in self.physical_bounds.items():
            if len(bounds) != 2 or any(math.isnan(b) for b in bounds) or bounds[0] >= bounds[1]:
                raise ValueError(
                    f"physical_bounds.{col}: expected [lo, hi] with lo < hi (±inf for an open "
                    f"side), got {list(bounds)}"
                )
        return self

    def loader_bounds(self) -> dict[str, tuple[float | None, float | None]] | None:
        """``physical_bounds`` as :func:`fedcal.data.loader.load_fleet` takes it (inf → open)."""
        if not self.physical_bounds:
            return None
        return {
            c: tuple(None if math.isinf(b) else b for b in bounds)  # type: ignore[misc]
            for c, bounds in self.physical_bounds.items()
        }


@checked
class FleetConfig(FleetSpec):
    """The simulator's settings (its FleetSpec) and the fleet seed; used when data.path is empty."""

    seed: Seed = 0

    def spec(self) -> FleetSpec:
        """The simulator's settings: every field but the seed."""
        return FleetSpec(**{f.name: getattr(self, f.name) for f in fields(FleetSpec)})


@checked
class ModelConfig:
    family: Literal["mlp", "basis", "classifier"] = "mlp"  # mlp: the seed's FCN
    hidden: tuple[Annotated[int, Field(strict=True, ge=1, le=4096)], ...] = Field(
        default=(64, 64), max_length=16
    )
    activation: Literal["tanh", "relu", "silu"] = "tanh"
    head_layers: Int = Field(default=1, ge=1, le=17)
    poly_orders: tuple[Annotated[int, Field(strict=True, ge=0, le=16)], ...] = Field(
        default=(3, 3), min_length=1, max_length=16
    )  # basis: Legendre order per input
    whiten: Bool = False  # basis: decorrelate the polynomial terms over the fleet

    @model_validator(mode="after")
    def _head(self) -> ModelConfig:
        if self.family == "mlp" and self.head_layers > len(self.hidden) + 1:
            raise ValueError(
                f"head_layers: {self.head_layers} exceeds the MLP's {len(self.hidden) + 1} layers"
            )
        return self


@checked
class EngineSection(EngineSettings):
    """The engine's settings (fedcal.engine.settings) and how often a run checkpoints."""

    checkpoint_every: Int = Field(default=10, ge=1, le=MAX_ROUNDS)


# [train] is the local recipe every method shares, defined once with the algorithm contract
# (a method's own recipe wins unless the user sets it: RunConfig.recipe_overrides)
TrainConfig = Recipe

# [aggregation] is the server's rules (screening, clipping, robust rule), defined in core
AggregationSection = AggregationRules


@checked
class PrivacySection:
    """Client-level DP (DP-FedAvg); off when epsilon = 0."""

    epsilon: Float = Field(default=0.0, ge=0.0, le=1e4)  # target ε over the whole run
    # δ; omitted (None): min(1/N², 1e-5), N the run's units (clients), resolved by build_policy
    delta: Float | None = Field(default=None, gt=0.0, lt=1.0)
    clip: Float = Field(default=0.0, ge=0.0, le=1e6)  # fixed L2 bound on each client's update
    # Declared statistics (fedprior): adapt each bound to this quantile of the clients' norms
    # by private quantile estimation (Andrew et al. 2021; 0: as declared), quantile_steps
    # noisy counts per round, initial rate η, the counts' share of the budget.
    quantile: Float = Field(default=0.0, ge=0.0, lt=1.0)
    quantile_steps: Int = Field(default=12, ge=1, le=100)
    quantile_rate: Float = Field(default=2.0, gt=0.0, le=100.0)
    quantile_share: Float = Field(default=0.1, gt=0.0, lt=1.0)
    # Where the noise comes from: "secret", a seed the server draws from the OS per run and
    # never records (a party who knows the run's seed cannot reproduce the noise and subtract
    # it); "seeded", from the run's seed (reproducible numbers, studies and tests: NOT private
    # against anyone who knows that seed, e.g. every Flower site, which gets it).
    noise: Literal["secret", "seeded"] = "secret"


@checked
class RunSection:
    """``[run]``: what to run. Held on :class:`RunConfig` itself (cfg.methods, cfg.seeds …)."""

    methods: tuple[Name, ...] = Field(default=("fedgmi", "fedavg", "local"), min_length=1)
    seeds: Int = Field(default=3, ge=1, le=1000)
    designs: tuple[Str, ...] = Field(default=(), max_length=100)  # sweep of [fleet] train_design
    fleet_seeds: tuple[Seed, ...] = Field(default=(), max_length=1000)  # sweep of [fleet] seed
    # A sensor whose train error still falls by more than this (relative, per round) at the
    # end is "unconverged" and left out of the means (fedcal.status); 1 = never.
    unconverged_tol: Float = Field(default=1e-3, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _distinct(self) -> RunSection:
        for key in ("methods", "designs", "fleet_seeds"):
            values = list(getattr(self, key))
            repeated = sorted({str(v) for v in values if values.count(v) > 1})
            if repeated:
                raise ValueError(f"{key}: {', '.join(repeated)} named more than once")
        if "all" in self.methods and len(self.methods) > 1:
            raise ValueError("methods: 'all' cannot be combined with other names")
        for d in self.designs:
            _design(d, "designs")
        return self


def check_design(design: Any, where: str) -> str:
    """A chamber design name ("campaign" or "PxT"), or a one-line ConfigError naming ``where``."""
    if not isinstance(design, str):
        raise ConfigError(f"{where}: expected a string like '3x2', got {design!r}")
    try:
        return _design(design, where)
    except ValueError as err:
        raise ConfigError(str(err)) from None


# ----------------------------------------------------------------------------
# errors: one line, naming the file, the section and the field
# ----------------------------------------------------------------------------
def _fail(err: ValidationError, where: str, section: str, known: list[str]) -> ConfigError:
    return ConfigError(f"{where} [{section}] {problem(err, known)}")


def validate(cls: type, values: dict[str, Any], where: str, section: str) -> Any:
    known = [f.name for f in fields(cls)]
    if not isinstance(values, dict):
        raise ConfigError(f"{where} [{section}]: expected a table, got {values!r}")
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(
            f"{where} [{section}] {', '.join(unknown)}: unknown field(s); known: {', '.join(known)}"
        )
    try:
        return TypeAdapter(cls).validate_python(values)
    except ValidationError as err:
        raise _fail(err, where, section, known) from None


def section(cls: type, current: Any, values: Any, where: str, name: str) -> Any:
    """The table ``[name]`` validated whole: ``current``'s values with ``values`` on top
    (when every key of ``values`` is a field: else the unknown keys are the error), so rules
    across fields see what will be used."""
    if isinstance(values, dict) and not (set(values) - {f.name for f in fields(cls)}):
        values = {**asdict(current), **values}
    return validate(cls, values, where, name)
