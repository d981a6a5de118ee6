"""Run configuration: one schema, one TOML file, one round trip (TOML ↔ object ↔ JSON).

The shipped default (``fedcal/configs/default.toml``) reproduces the seed's
protocol on the embedded simulated fleet. A user's file only lists what it
changes; command-line options override both (:func:`override`). Every section
is a frozen pydantic dataclass: each field is typed and range-checked,
unknown sections, keys and method bases are refused, and every error is one
line naming the file, the section and the field (:class:`ConfigError`).

The *layout* is the TOML file's shape (``[run]``, ``[data]`` …,
``[methods.<name>]``); :func:`to_layout` / :func:`apply` convert between it and
:class:`RunConfig`, and :func:`to_json` / :func:`from_json` carry it as JSON
(run directories, Flower messages). ``[train]`` is the shared local recipe: a
method's own recipe (e.g. FedLSA's lr, clustered's sample weighting) wins over
the shipped one unless the user sets the value (see :meth:`RunConfig.recipe_overrides`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import tomllib
from dataclasses import asdict, field, fields
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, model_validator
from pydantic.dataclasses import dataclass

from fedcal.core.aggregation import AggregationRules
from fedcal.core.algorithm import Recipe, SettingError, check_settings, setting_types
from fedcal.core.errors import ConfigError, did_you_mean
from fedcal.core.paths import PathError, read_text, safe_name
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
from fedcal.core.task import Task
from fedcal.data.fleet import BAROMETRIC_FEATURES, BAROMETRIC_TARGET, CLIENT_COLUMN, SPLIT_COLUMN
from fedcal.data.simulator import FleetSpec, parse_design
from fedcal.engine.settings import EngineSettings
from fedcal.models import build_model
from fedcal.presets import PRESET_KEY, PresetError, expanded, preset_settings


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


@dataclass(frozen=True, config=ConfigDict(extra="forbid", arbitrary_types_allowed=True))
class RunConfig:
    methods: tuple[str, ...] = ("fedgmi", "fedavg", "local")
    seeds: int = 3
    designs: tuple[str, ...] = ()
    fleet_seeds: tuple[int, ...] = ()
    unconverged_tol: float = 1e-3
    data: DataConfig = field(default_factory=DataConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineSection = field(default_factory=EngineSection)
    train: TrainConfig = field(default_factory=TrainConfig)
    aggregation: AggregationRules = field(default_factory=AggregationRules)
    privacy: PrivacySection = field(default_factory=PrivacySection)
    method_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    # [train] keys the user set (file or command line), even to the shipped value: they win
    # over a method's own recipe. Not compared: see recipe_overrides().
    train_set: tuple[str, ...] = field(default=(), compare=False)

    def recipe_overrides(self) -> frozenset[str]:
        """[train] keys that beat a method's own recipe: user-set, or not the shipped value."""
        shipped = asdict(shipped_recipe())
        changed = {k for k, v in asdict(self.train).items() if v != shipped[k]}
        return frozenset(changed | set(self.train_set))

    def to_dict(self) -> dict[str, Any]:
        """The configuration in its TOML layout (see :func:`to_layout`)."""
        return to_layout(self)


SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "fleet": FleetConfig,
    "model": ModelConfig,
    "engine": EngineSection,
    "train": TrainConfig,
    "aggregation": AggregationRules,
    "privacy": PrivacySection,
}
RUN_KEYS = tuple(f.name for f in fields(RunSection))  # fields of [run]
# Keys a run directory's config.json adds to the layout (fedcal.build.run_record).
RECORD_KEYS = ("resolved", "train_points_sweep", "data_sha256")


# ----------------------------------------------------------------------------
# errors: one line, naming the file, the section and the field
# ----------------------------------------------------------------------------
def _fail(err: ValidationError, where: str, section: str, known: list[str]) -> ConfigError:
    return ConfigError(f"{where} [{section}] {problem(err, known)}")


def _validate(cls: type, values: dict[str, Any], where: str, section: str) -> Any:
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


# ----------------------------------------------------------------------------
# [methods.<name>]: tables of registered methods, and variants with a base
# ----------------------------------------------------------------------------
def _registry() -> dict[str, type]:
    from fedcal.algorithms import REGISTRY

    return REGISTRY


def _tuples(value: Any) -> Any:
    """TOML/JSON lists as tuples (the algorithms' fields are tuples)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list | tuple):
        return all(_finite(v) for v in value)
    return True


def check_method_tables(
    tables: Any, where: str, task: Task | None = None
) -> dict[str, dict[str, Any]]:
    """``[methods.<name>]`` tables: known names and bases, each parameter in its declared range.

    A table named after a registered method sets its parameters; any other name is a
    variant and needs ``base = "<registered method>"`` (a registered name cannot be
    re-based: ``[methods.local] base = "fedavg"`` would run FedAvg under the name
    local). Each value is checked against the type and range its method declares for it
    (:func:`fedcal.core.algorithm.check_settings`; a configuration's numbers are also
    finite); then, given the ``task`` the configuration describes (:func:`described_task`),
    the method is built on it, which runs its task checks
    (:meth:`fedcal.core.algorithm.Algorithm.check_task`).
    """
    if not isinstance(tables, dict):
        raise ConfigError(f"{where} [methods]: must be a table of per-method tables")
    registry = _registry()
    out: dict[str, dict[str, Any]] = {}
    for name, params in tables.items():
        section = f"methods.{name}"
        if not isinstance(params, dict):
            raise ConfigError(f"{where} [{section}]: expected a table, got {params!r}")
        base = params.get("base", name)
        if not isinstance(base, str) or base not in registry:
            known = ", ".join(sorted(registry))
            what = "base" if "base" in params else "name"
            if "base" in tables.get(base, {}) if isinstance(base, str) else False:
                known = f"{known} (a variant cannot be the base of another)"
            raise ConfigError(
                f"{where} [{section}] {what}: unknown method {base!r}"
                f"{did_you_mean([str(base)], registry)}; known: {known}"
            )
        if name in registry and base != name:
            raise ConfigError(
                f"{where} [{section}] base: {name!r} is a registered method and cannot be "
                f"re-based on {base!r}; name the variant differently"
            )
        cls = registry[base]
        types = setting_types(cls)
        values = {k: v for k, v in params.items() if k not in ("base", PRESET_KEY)}
        if PRESET_KEY in params:  # a named preset (fedcal.presets): known and for this method
            try:
                preset_settings(params[PRESET_KEY], cls, name)
            except PresetError as err:
                raise ConfigError(f"{where} [{section}] {PRESET_KEY}: {err}") from None
        for key, value in values.items():
            if key not in types:
                raise ConfigError(
                    f"{where} [{section}] {key}: unknown parameter of {base}; "
                    f"known: {', '.join(sorted(types))}"
                )
            try:
                check_settings(cls, {key: value})
            except SettingError as err:
                raise ConfigError(f"{where} [{section}] {err.field}: {err.problem}") from None
            if not _finite(value):
                raise ConfigError(f"{where} [{section}] {key}: must be finite, got {value!r}")
        if task is not None and cls.task_kind == task.kind:
            _task_checks(cls, expanded(params, cls, name), task, f"{where} [{section}]")
        out[name] = dict(params)
    return out


def _task_checks(cls: type, values: dict[str, Any], task: Task, where: str) -> None:
    """The method built on ``task`` with ``values``: its :meth:`check_task` runs."""
    try:
        cls(task=task, **values)
    except SettingError as err:
        raise ConfigError(f"{where} {err.field}: {err.problem}") from None
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where}: {err}") from None


def described_task(cfg: RunConfig) -> Task | None:
    """The task the configuration describes, for the methods' task checks at load.

    A regression on the simulator (the barometer's inputs) or on a file (``[data]
    features``), with ``[model]``'s model; None where only the fleet tells (a built-in
    data set's inputs and kind) or ``[model]`` cannot be built (the build reports that).
    Only shapes matter: a whitened basis has its plain basis's.
    """
    d, m = cfg.data, cfg.model
    if d.path.startswith("builtin:") or m.family == "classifier":
        return None
    inputs = len(d.features) if d.path else len(BAROMETRIC_FEATURES)
    if m.family == "basis" and len(m.poly_orders) != inputs:
        return None
    try:
        model = build_model(m.family, inputs, 1, m.hidden, m.activation, m.poly_orders)
        task = Task(model, head_layers=m.head_layers)
        task.head  # noqa: B018 — head_layers against the model's layers
    except ValueError:
        return None
    return task


# ----------------------------------------------------------------------------
# the round trip: layout (TOML / JSON) <-> RunConfig
# ----------------------------------------------------------------------------
def apply(base: RunConfig, raw: Any, where: str) -> RunConfig:
    """``base`` overridden by ``raw`` (a parsed TOML file, or its JSON), every field validated.

    Each section is validated whole (``base``'s values with ``raw``'s on top), so
    rules across fields see what will be used. Errors are one-line ConfigErrors
    naming ``where`` (the file), the section and the field.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a table of sections, got {type(raw).__name__}")
    unknown = sorted(set(raw) - {"run", "methods", *SECTIONS})
    if unknown:
        raise ConfigError(
            f"{where} [{unknown[0]}]: unknown section(s) {', '.join(unknown)}; known: "
            f"run, {', '.join(SECTIONS)}, methods"
        )
    updates: dict[str, Any] = {}
    if "run" in raw:
        current = {k: getattr(base, k) for k in RUN_KEYS}
        run_raw = raw["run"]
        if isinstance(run_raw, dict):
            run_raw = {k: _tuples(v) for k, v in run_raw.items()}
        if isinstance(run_raw, dict) and not (set(run_raw) - set(RUN_KEYS)):
            run_raw = {**current, **run_raw}
        updates.update(asdict(_validate(RunSection, run_raw, where, "run")))
    for name, cls in SECTIONS.items():
        if name in raw:
            values = raw[name]
            if isinstance(values, dict) and not (set(values) - {f.name for f in fields(cls)}):
                values = {**asdict(getattr(base, name)), **values}
            updates[name] = _validate(cls, values, where, name)
    if "train" in raw and isinstance(raw["train"], dict):
        updates["train_set"] = tuple(sorted({*base.train_set, *raw["train"]}))
    if "methods" in raw:
        updates["method_params"] = _merged_tables(base, raw["methods"], where)
    cfg = dataclasses.replace(base, **updates)
    if "methods" in raw:
        _check_tables(cfg, base, raw["methods"], where)
    if "run" in raw or "methods" in raw:
        _check_run_methods(cfg, where)
    return cfg


def _merged_tables(base: RunConfig, tables: Any, where: str) -> dict[str, dict[str, Any]]:
    """``base``'s ``[methods.*]`` tables with ``tables``' keys on top, table by table."""
    if not isinstance(tables, dict):
        raise ConfigError(f"{where} [methods]: must be a table of per-method tables")
    params = {k: dict(v) for k, v in base.method_params.items()}
    for method, values in tables.items():
        _method_name(method, f"{where} [methods]")
        if not isinstance(values, dict):
            raise ConfigError(f"{where} [methods.{method}]: expected a table, got {values!r}")
        params[method] = {**params.get(method, {}), **values}
    return params


def _check_tables(cfg: RunConfig, base: RunConfig, raw: dict[str, Any], where: str) -> None:
    """Each table ``raw`` names, as it will be used (a variant's base may come from the
    default), on the task this configuration describes."""
    tables = {m: cfg.method_params[m] for m in raw}
    # A table the file inherits unchanged for a method it does not run (a run's
    # config.json lists every default table, e.g. fedpoly_p3 beside a 3-input fleet) is
    # checked without the task: it will not be built on it.
    runs = set(cfg.methods)
    on_task = {
        m: t
        for m, t in tables.items()
        if "all" in runs or m in runs or t != base.method_params.get(m)
    }
    check_method_tables(on_task, where, described_task(cfg))
    check_method_tables({m: t for m, t in tables.items() if m not in on_task}, where)


def _check_run_methods(cfg: RunConfig, where: str) -> None:
    """``[run] methods``: safe folder names, each registered or a variant of [methods]."""
    for m in cfg.methods:  # a method name becomes a run folder's name
        _method_name(m, f"{where} [run] methods")
    registry = _registry()
    unknown = [
        m
        for m in cfg.methods
        if m != "all" and m not in registry and "base" not in cfg.method_params.get(m, {})
    ]
    if unknown:
        raise ConfigError(
            f"{where} [run] methods: unknown method(s) {', '.join(unknown)}"
            f"{did_you_mean(unknown, [*registry, *cfg.method_params])}; known: "
            f"{', '.join(sorted(registry))} and the variants of [methods]"
        )


def to_layout(cfg: RunConfig) -> dict[str, Any]:
    """The configuration in its TOML layout; :func:`apply` on the default reads it back.

    ``[train]`` lists only the keys that override a method's own recipe
    (:meth:`RunConfig.recipe_overrides`); the others are the shipped recipe.
    """
    overrides = cfg.recipe_overrides()
    layout: dict[str, Any] = {"run": {k: _lists(getattr(cfg, k)) for k in RUN_KEYS}}
    for name in SECTIONS:
        values = {k: _lists(v) for k, v in asdict(getattr(cfg, name)).items()}
        if name == "train":
            values = {k: v for k, v in values.items() if k in overrides}
        layout[name] = values
    layout["methods"] = {
        k: {p: _lists(v) for p, v in t.items()} for k, t in cfg.method_params.items()
    }
    return layout


def _lists(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_lists(v) for v in value]
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    return value


def to_json(cfg: RunConfig) -> str:
    """The layout as JSON (sorted keys): run directories and the ServerApp's config-json."""
    return json.dumps(to_layout(cfg), sort_keys=True)


def from_json(text: str | dict, where: str = "config-json") -> RunConfig:
    """Inverse of :func:`to_json`: the layout applied to the shipped default.

    A run directory's ``config.json`` (the layout plus :data:`RECORD_KEYS`) reads the
    same way, and so does one written before the layout was used (top-level
    ``method_params``).
    """
    try:
        raw = json.loads(text) if isinstance(text, str) else dict(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{where}: not valid JSON: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    raw = {k: v for k, v in raw.items() if k not in RECORD_KEYS}
    if "method_params" in raw:  # a run directory of an older fedcal
        run = {k: raw.pop(k) for k in RUN_KEYS if k in raw}
        raw["methods"] = raw.pop("method_params")
        raw["run"] = run
    base = default_config()
    if set(raw) >= {"run", "methods", *SECTIONS}:  # a whole layout: its tables are all there are
        base = dataclasses.replace(base, method_params={})
    return apply(base, raw, where)


# ----------------------------------------------------------------------------
# files
# ----------------------------------------------------------------------------
def _method_name(name: Any, where: str) -> None:
    """A method name is a run folder's name: one safe file-name component (core/paths.py)."""
    try:
        safe_name(name, "method name")
    except PathError as err:
        raise ConfigError(f"{where}: {err}") from None


def _read_toml(path: Path, name: str) -> dict[str, Any]:
    if not path.exists() and not path.is_symlink():
        raise ConfigError(f"config file {name} does not exist")
    if path.is_dir():
        raise ConfigError(f"config file {name} is a directory")
    try:  # a regular file within the size limit: a FIFO or /dev/zero is refused unread
        return tomllib.loads(read_text(path))
    except PathError as err:
        raise ConfigError(f"config file {err}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{name}: not valid TOML: {err}") from None


@functools.cache
def _shipped(name: str) -> dict[str, Any]:
    text = resources.files("fedcal").joinpath(f"configs/{name}.toml").read_text()
    return tomllib.loads(text)


@functools.cache
def _default() -> RunConfig:
    cfg = apply(RunConfig(), _shipped("default"), "fedcal/configs/default.toml")
    return dataclasses.replace(cfg, train_set=())  # the shipped recipe is not a user's choice


def shipped_recipe() -> TrainConfig:
    """The shipped ``[train]`` recipe (default.toml): what methods without their own use."""
    return _default().train


def default_config() -> RunConfig:
    """The shipped default configuration."""
    cfg = _default()
    return dataclasses.replace(
        cfg, method_params={k: dict(v) for k, v in cfg.method_params.items()}
    )


# fedcal/configs/<name>.toml, usable as --config <name>
SHIPPED = ("physics", "digits", "fewpoint", "generic", "quickstart", "seed", "default")


def load_config(path: str | Path | None) -> RunConfig:
    """The shipped default, overridden by the file at ``path`` (if any).

    ``path`` may also name a shipped configuration (see :data:`SHIPPED`).
    """
    base = default_config()
    if path is None:
        return base
    if str(path) in SHIPPED and not Path(path).exists():
        return apply(base, _shipped(str(path)), f"fedcal/configs/{path}.toml")
    p = Path(path)
    return apply(base, _read_toml(p, str(p)), str(p))


def file_sets(path: str | Path | None, section: str, key: str) -> bool:
    """Whether the configuration ``path`` names (a file, or a shipped one other than the
    default) sets ``[section] key`` itself: the user's choice, unlike a value :func:`load_config`
    took from default.toml."""
    if path is None or (str(path) == "default" and not Path(path).exists()):
        return False
    if str(path) in SHIPPED and not Path(path).exists():
        raw = _shipped(str(path))
    else:
        raw = _read_toml(Path(path), str(path))
    part = raw.get(section)
    return isinstance(part, dict) and key in part


def override(cfg: RunConfig, layout: dict[str, Any], where: str = "command line") -> RunConfig:
    """Command-line values (in the layout's shape) over ``cfg``, validated like a file."""
    return apply(cfg, layout, where)


def from_dict(raw: dict[str, Any], where: str = "config") -> RunConfig:
    """A RunConfig from a parsed TOML layout over the schema's own defaults (not default.toml)."""
    return apply(RunConfig(), raw, where)


def check_design(design: Any, where: str) -> str:
    """A chamber design name ("campaign" or "PxT"), or a one-line ConfigError naming ``where``."""
    if not isinstance(design, str):
        raise ConfigError(f"{where}: expected a string like '3x2', got {design!r}")
    try:
        return _design(design, where)
    except ValueError as err:
        raise ConfigError(str(err)) from None
