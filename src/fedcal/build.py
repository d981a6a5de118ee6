"""From a validated configuration to the things a run needs: data, task, algorithm, policy.

The one place that builds them, used by the experiment, the CLI, the exports and the
Flower engine alike (so a method runs with the same values wherever it runs). It sits
above data, models, core and algorithms, below the experiment (which it never imports);
of the engine it uses only ``prepare`` (:func:`validate_methods`: the task's inputs).

An algorithm's parameters (:func:`method_settings`), lowest precedence first:

1. the class's defaults — the base contract's recipe (core/algorithm.py) and the
   method's own values;
2. the shipped ``[train]`` recipe, for recipe fields the method does not set itself;
3. ``[train]`` values the user set (file or command line): they beat the method's own;
4. the settings of the preset the table names (``preset = "chamber"``, :mod:`fedcal.presets`);
5. ``[methods.<base>]`` for a variant, then ``[methods.<name>]``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, fields
from typing import Any

import numpy as np

from fedcal.algorithms import REGISTRY, get
from fedcal.config import ConfigError, RunConfig, to_layout
from fedcal.core.aggregation import AggregationError, AggregationPolicy
from fedcal.core.algorithm import Algorithm
from fedcal.core.classification import ClassificationTask
from fedcal.core.errors import did_you_mean
from fedcal.core.task import Task
from fedcal.data.fleet import BAROMETRIC_FEATURES, SPLIT_COLUMN, Fleet
from fedcal.models import build_model
from fedcal.models.basis import Basis, whitened
from fedcal.presets import PresetError, expanded


def load_data(config: RunConfig) -> Fleet:
    """The fleet named by the configuration: a file, or the embedded simulator."""
    d = config.data
    if d.path == "builtin:digits":
        from fedcal.data.digits import digits_fleet

        return digits_fleet(seed=config.fleet.seed)
    if d.path == "builtin:humidity":
        from fedcal.data.humidity import HumiditySpec, humidity_fleet

        return humidity_fleet(HumiditySpec(num_units=config.fleet.num_sensors), config.fleet.seed)
    if d.path:
        return load_configured(config, d.path)
    from fedcal.data.simulator import simulate_fleet

    return simulate_fleet(config.fleet.spec(), seed=config.fleet.seed)


def _loader_options(config: RunConfig) -> dict[str, Any]:
    """What ``[data]`` tells the loader (columns, split, guards): the same for a whole file
    (``load_fleet``) and its row groups (``load_fleet_chunks``)."""
    d = config.data
    return {
        "features": d.features,
        "target": d.target,
        "client_column": d.client_column,
        "split_column": d.split_column,
        "test_fraction": d.test_fraction,
        "seed": d.split_seed,
        "physical_bounds": d.loader_bounds(),
        "time_column": d.time_column or None,
        "split_by": d.split_by,
    }


def load_configured(config: RunConfig, source) -> Fleet:
    """A fleet file or DataFrame ``source`` read as ``[data]`` says (columns, split, guards)."""
    from fedcal.data.loader import load_fleet

    return load_fleet(source, **_loader_options(config))


def valid_ranges(fleet: Fleet) -> dict[str, Any]:
    """Per sensor, the span of its calibration points: {sensor: {column: [min, max]}}.

    Inputs and target; a model is only validated inside this range, so exports carry it.
    """
    train = fleet.frame[fleet.frame[SPLIT_COLUMN] == "train"]
    columns = [*fleet.features, fleet.target]
    groups = train.groupby(fleet.client_column, sort=False)[columns]
    # Column-wise (two arrays), not a row lookup per sensor: 100,000 sensors take a second.
    low, high = groups.min(), groups.max()
    names = [str(s) for s in low.index]
    low, high = low.to_numpy(float).tolist(), high.to_numpy(float).tolist()
    return {
        sensor: {c: [lo[j], hi[j]] for j, c in enumerate(columns)}
        for sensor, lo, hi in zip(names, low, high, strict=True)
    }


@dataclasses.dataclass(frozen=True)
class FleetOutline:
    """What a run reads of a fleet besides its tensors, gathered row group by row group
    (issue 25.1: ``fedcal run`` on a Parquet file of 100,000 units without its whole
    frame). Each field equals what the run computes from :class:`Fleet`'s frame:
    ``content_digest`` :meth:`Fleet.content_digest`, ``full_scale`` the target's
    max − min, ``valid_ranges`` and ``input_range`` the train rows' spans per sensor and
    over the fleet, ``roles`` :attr:`Fleet.roles` (tested equal, file run both ways)."""

    tensors: Any  # engine FleetTensors, built by prepare_chunks
    features: tuple[str, ...]
    target: str
    client_column: str
    meta: dict
    roles: dict[str, str] | None
    full_scale: float
    valid_ranges: dict[str, Any]
    input_range: dict[str, list[float]]
    digest: str

    @property
    def num_clients(self) -> int:
        return len(self.tensors.client_ids)

    def content_digest(self) -> str:
        return self.digest


class _Gather:
    """The outline's pieces of each row group, summed as the groups go by: the digest's
    bytes per column (:meth:`Fleet.content_digest` hashes column after column, so each
    column's bytes are kept until the end, ~40 bytes a row: in a temporary file beyond
    16 MB a column, not in memory), the target's extremes, the train rows' spans per
    sensor, the roles."""

    SPILL = 16 * 1024**2

    def __init__(self) -> None:
        self.pieces: dict[str, tempfile.SpooledTemporaryFile] = {}
        self.low, self.high = np.inf, -np.inf
        self.valid: dict[str, Any] = {}
        self.roles: dict[str, str] | None = None
        self.meta: dict | None = None
        self.names: tuple = ((), "", "")

    def add(self, part: Fleet) -> None:
        columns = [part.client_column, *part.features, part.target, SPLIT_COLUMN]
        for col in columns:
            values = part.frame[col]
            if col in (*part.features, part.target):
                piece = values.to_numpy(dtype="float64").tobytes()
            else:  # the "\x1f"-joined text of the whole column, a chunk at a time
                sep = "\x1f" if col in self.pieces else ""
                piece = (sep + "\x1f".join(map(str, values.tolist()))).encode(
                    "utf-8", "surrogatepass"
                )
            if col not in self.pieces:  # closed by digest() (or deleted when collected)
                spill = tempfile.SpooledTemporaryFile(max_size=self.SPILL)  # noqa: SIM115
                self.pieces[col] = spill
            self.pieces[col].write(piece)
        target = part.frame[part.target].to_numpy(float)
        self.low, self.high = min(self.low, target.min()), max(self.high, target.max())
        self.valid.update(valid_ranges(part))  # a sensor lies in one row group
        roles = part.roles
        if roles is not None:
            self.roles = {**(self.roles or {}), **roles}
        if self.meta is None:
            self.meta, self.names = part.meta, (part.features, part.target, part.client_column)

    def digest(self, columns: list[str]) -> str:
        h = hashlib.sha256(json.dumps(columns).encode())
        for col in columns:
            if col in self.pieces:
                with self.pieces.pop(col) as f:
                    f.seek(0)
                    while block := f.read(1024**2):
                        h.update(block)
            h.update(b"\x1e")
        return h.hexdigest()


def load_outline(config: RunConfig, path: str) -> FleetOutline:
    """The fleet outline of the Parquet file ``path`` read as ``[data]`` says: its tensors by
    ``prepare_chunks`` of ``load_fleet_chunks`` (the same numbers as ``prepare`` of
    ``load_fleet``, to the bit) and the rest gathered from the same row groups. Raises
    ``SensorSplitError`` for a file whose sensor spans two row groups (read it whole),
    ``FleetDataError`` for bad data and ``ConfigError`` for a scaling the data refuse."""
    from fedcal.data.loader import FleetDataError, load_fleet_chunks
    from fedcal.engine.simulation import prepare_chunks

    d = config.data
    gather = _Gather()
    calls = 0

    def parts():
        nonlocal calls
        calls += 1
        chunks = load_fleet_chunks(path, **_loader_options(config))
        if calls > 1:  # prepare_chunks' second pass: the first one gathers
            return chunks
        return (gather.add(c) or c for c in chunks)

    try:
        tensors = prepare_chunks(parts, d.scaling, config.engine.dtype)
    except FleetDataError:
        raise
    except ValueError as err:  # as validate_methods words prepare's refusal
        raise ConfigError(f"[data] scaling: {err}") from None
    meta = gather.meta or {}
    part_features, part_target, client = gather.names
    columns = [client, *part_features, part_target, SPLIT_COLUMN]
    valid = gather.valid
    input_range = {
        c: [min(v[c][0] for v in valid.values()), max(v[c][1] for v in valid.values())]
        for c in part_features
    }
    return FleetOutline(
        tensors,
        part_features,
        part_target,
        client,
        meta,
        gather.roles,
        float(gather.high - gather.low),
        valid,
        input_range,
        gather.digest(columns),
    )


def _with_warnings(fleet: Fleet) -> tuple[Fleet, str]:
    """The fleet and its loader's warnings (repeated rows, an undeclared time column), one
    line each (issue 34.5)."""
    return fleet, "\n".join(fleet.meta.get("warnings", ()))


def load_run_data(
    config: RunConfig, train_points: Sequence[int] = (0,)
) -> tuple[Fleet | FleetOutline, str]:
    """The fleet of ``fedcal run``/``compare`` and a one-line note (empty if none): a Parquet
    file read by row groups (:func:`load_outline`) when nothing needs its frame (no
    calibration-point budget, no sweep), else :func:`load_data`; a file whose sensor spans
    two row groups is read whole, with a note saying so."""
    from fedcal.data.loader import PARQUET_SUFFIXES, SensorSplitError

    path = config.data.path
    frame_needed = any(train_points) or config.designs or config.fleet_seeds
    if not path or path.startswith("builtin:") or frame_needed:
        return _with_warnings(load_data(config))
    if not path.lower().endswith(PARQUET_SUFFIXES):
        return _with_warnings(load_data(config))
    try:
        return load_outline(config, path), ""
    except SensorSplitError as err:
        return load_data(config), f"{err.problem.split(':')[0]}: read whole (one frame)"


# Rows (train + test, padded) of the clients run at once when ``fedcal run`` chooses the
# chunk size: a chunk's designs of 64 float64 terms then take ~230 MB. At 444 rows a unit
# (the simulator's campaign, 384 + 60) it is 1,000 units a chunk, the fastest of 250-5,000
# measured at 10,000 units (docs/benchmarks.md).
AUTO_CHUNK_ROWS = 450_000


def auto_chunk_size(num_units: int, rows_per_unit: int) -> int:
    """Units a chunk for a fleet of ``num_units`` of ``rows_per_unit`` rows each: 0 (all at
    once) when the whole fleet's rows fit :data:`AUTO_CHUNK_ROWS`, else that many rows' worth
    of units, rounded down to a hundred when at least 100 units fit, else as many as fit (at
    least 1)."""
    rows_per_unit = max(int(rows_per_unit), 1)
    if num_units * rows_per_unit <= AUTO_CHUNK_ROWS:
        return 0
    size = AUTO_CHUNK_ROWS // rows_per_unit
    return max(100, size // 100 * 100) if size >= 100 else max(size, 1)


def with_auto_chunk(config: RunConfig, fleet: Fleet | FleetOutline) -> tuple[RunConfig, str]:
    """``config`` with ``[engine] chunk_size`` chosen by :func:`auto_chunk_size` from the
    fleet's units and rows a unit, and a one-line note saying so (empty: unchanged). Only
    when ``chunk_size`` is 0 (the default: all at once); a chunk size the user chose
    is kept — the CLI calls this only when neither ``--chunk-size`` nor the user's config
    file sets one, so an explicit 0 stays all at once. The value used is the run's:
    config.json records it. Rows a unit are the padded rows the engine holds: the largest
    train count plus the largest test count of any unit."""
    from fedcal.config import override

    if config.engine.chunk_size != 0:
        return config, ""
    n = fleet.num_clients
    if isinstance(fleet, FleetOutline):  # padded rows: what the engine's tensors hold
        rows = int(fleet.tensors.train.x.shape[1]) + int(fleet.tensors.test.x.shape[1])
    else:  # the engine pads every unit to the largest train and the largest test count
        per = fleet.frame.groupby([fleet.client_column, "split"], observed=True).size()
        rows = int(per.groupby(level="split", observed=True).max().sum()) if len(per) else 0
    size = auto_chunk_size(n, rows)
    if size == 0:
        return config, ""
    note = (
        f"chunk size {size} units ({n} units × {rows} rows a unit; "
        "--chunk-size N to choose, --chunk-size 0 for all at once)"
    )
    return override(config, {"engine": {"chunk_size": size}}, "chunk size"), note


def task_kind(fleet: Fleet) -> str:
    return "classification" if fleet.meta.get("task") == "classification" else "regression"


def build_task(
    config: RunConfig,
    num_features: int,
    meta: dict | None = None,
    train_inputs: list | None = None,
) -> Task:
    """The model and its head split.

    ``meta`` (the fleet's) says whether this is a classification task and how many
    classes it has; ``train_inputs`` (each client's scaled training inputs) are
    read only by a whitened basis, which needs the fleet's (federated) moments of
    its terms.
    """
    m = config.model
    meta = meta or {}
    if meta.get("task") == "classification":  # any family: logits, trained on cross-entropy
        classes = int(meta["num_classes"])
        model = build_model(m.family, num_features, classes, m.hidden, m.activation, m.poly_orders)
        return ClassificationTask(model, head_layers=m.head_layers)
    if m.family == "classifier":
        raise ConfigError("[model] family: 'classifier' needs a classification fleet")
    if m.family == "basis" and len(m.poly_orders) != num_features:
        raise ConfigError(
            f"[model] poly_orders: {len(m.poly_orders)} order(s) for {num_features} input(s)"
        )
    try:
        model = build_model(
            m.family,
            num_features,
            1,
            hidden=m.hidden,
            activation=m.activation,
            poly_orders=m.poly_orders,
        )
    except ValueError as err:
        raise ConfigError(f"[model]: {err}") from None
    if m.whiten:
        if not isinstance(model, Basis):
            raise ConfigError("[model] whiten = true needs family = 'basis'")
        if train_inputs is None:
            raise ConfigError("[model] whiten = true needs the fleet's training inputs")
        model = whitened(model, train_inputs)
    try:
        return Task(model, head_layers=m.head_layers)
    except ValueError as err:
        raise ConfigError(f"[model] head_layers: {err}") from None


def client_inputs(tensors: Any) -> list:
    """Each client's real (unpadded) scaled training inputs (of engine FleetTensors)."""
    train = tensors.train
    return [train.x[c, :n] for c, n in enumerate(train.count.tolist())]


def _own_recipe(cls: type[Algorithm]) -> set[str]:
    """Recipe fields whose default the method sets itself (not inherited from the contract)."""
    recipe = {f.name for f in fields(Algorithm)} - {"task"}
    own = set()
    for name in recipe:
        owner = next(k for k in cls.__mro__ if name in vars(k))
        if owner not in Algorithm.__mro__:  # Algorithm takes its recipe from a base
            own.add(name)
    return own


def method_settings(name: str, config: RunConfig) -> tuple[type[Algorithm], dict[str, Any]]:
    """The registered class behind ``name`` and the parameters the config sets for it.

    See the module docstring for the precedence. Parameters not returned keep the
    class defaults (the method's own values).
    """
    own = dict(config.method_params.get(name, {}))
    base = own.pop("base", name)
    try:
        cls = get(base)
    except KeyError as err:
        raise ConfigError(f"[methods.{name}] base: {str(err).strip(chr(39) + chr(34))}") from None
    if base != name:
        own = {**config.method_params.get(base, {}), **own}
        own.pop("base", None)
    try:  # a named preset's settings, the table's own keys on top (fedcal.presets)
        own = expanded(own, cls, name)
    except PresetError as err:
        raise ConfigError(f"[methods.{name}] preset: {err}") from None
    known = {f.name for f in fields(cls)} - {"task"}
    keep_own = _own_recipe(cls) - config.recipe_overrides()
    values: dict[str, Any] = {
        k: v for k, v in asdict(config.train).items() if k in known and k not in keep_own
    }
    unknown = sorted(set(own) - known)
    if unknown:
        raise ConfigError(
            f"[methods.{name}]: unknown parameter(s) {', '.join(unknown)}; "
            f"{name} takes: {', '.join(sorted(known))}"
        )
    values.update(own)
    _generic_basis(cls, values, config)
    built = cls.built_class(values)
    return built, _resolve_choice(built, values, config)


def _generic_basis(cls: type[Algorithm], values: dict[str, Any], config: RunConfig) -> None:
    """A fleet prior's ``basis = "auto"`` on features other than the barometer's: total degree.

    The shipped ``orders = [4, 3]`` are the barometer's (frequency, temperature) surface; on
    any other two named features they were taken as a tensor basis too (issue 26). For other
    features "auto" is the total-degree basis, its degree chosen by the fleet's BIC
    (``select``) among 0..``degree``. ``basis = "tensor"`` keeps the orders.
    """
    fields_of = {f.name: f.default for f in fields(cls)}
    if "basis" not in fields_of or "orders" not in fields_of:
        return
    barometric = tuple(config.data.features) == BAROMETRIC_FEATURES
    if not barometric and values.get("basis", fields_of["basis"]) == "auto":
        values["basis"] = "total"


def method_values(name: str, config: RunConfig) -> dict[str, Any]:
    """Every parameter ``name`` runs with (class defaults included), as the run records them."""
    cls, values = method_settings(name, config)
    out = {f.name: f.default for f in fields(cls) if f.name != "task"}
    out.update(values)
    return out


def build_algorithm(name: str, config: RunConfig, task: Task) -> Algorithm:
    """The named method with its parameters from the config (see :func:`method_settings`).

    A name may also be a *variant* defined in the config: a ``[methods.<name>]``
    table with ``base = "<registered method>"`` and the parameters it changes
    (e.g. FedGMI's ablations).
    """
    cls, values = method_settings(name, config)
    try:
        algorithm = cls(task=task, **values)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"[methods.{name}]: {err}") from None
    if algorithm.local_epochs == 0 and algorithm.uses_local_epochs:
        raise ConfigError(
            f"[methods.{name}] local_epochs: 0 would train nothing ({name} learns by local "
            "epochs); use >= 1"
        )
    return algorithm


def _resolve_choice(cls: type, values: dict[str, Any], config: RunConfig) -> dict[str, Any]:
    """fedprior's ``choose = "auto"`` (algorithms/fedprior_choice.py) resolved by the run's
    data: "time" with a ``[data] time_column``, "off" without one or under client-level DP
    (its scores are not among the DP statistics), so that the replies of a run have one
    structure whatever a site's rows (a Flower server checks them against a probe's)."""
    if "choose" not in {f.name for f in fields(cls)}:
        return values
    if values.get("choose", "auto") != "auto":
        return values
    timed = bool(config.data.time_column) and not config.privacy.epsilon > 0
    return {**values, "choose": "time" if timed else "off"}


def choice_note(config: RunConfig) -> str:
    """One line when fedprior's ``choose = "auto"`` resolves to "off" for the run's methods
    (:func:`_resolve_choice`: no time column, or client-level DP), naming the raw column it
    then leaves unused; "" when the choice acts, no method has it, or nothing the user gave
    goes unused (a chamber fleet: no time column, no raw column — auto means off there)."""
    if config.data.time_column and not config.privacy.epsilon > 0:
        return ""
    if not config.data.time_column and not config.data.raw_column:
        return ""
    off = []
    for name in config.methods:
        try:
            cls, _ = method_settings(name, config)
        except (ConfigError, KeyError, ValueError):
            continue  # refused later, with its own message
        asked = config.method_params.get(name, {}).get("choose", "auto")
        if "choose" in {f.name for f in fields(cls)} and asked == "auto":
            off.append(name)
    if not off:
        return ""
    why = "client-level DP" if config.privacy.epsilon > 0 else "no time column"
    note = f"choose=auto: off for {', '.join(off)} ({why})"
    if config.data.raw_column:
        note += f"; raw column {config.data.raw_column!r} unused"
    return note


def with_raw_column(algorithm: Algorithm, config: RunConfig, tensors: Any) -> Algorithm:
    """``algorithm`` told which input reads the target itself (``[data] raw_column``) and
    how, in its scaled units: y = x_raw is y_s = (x_s·s_x + o_x − o_y) / s_y (the run's
    scaler). Unchanged without a raw column or for a method without a ``raw_input`` field
    (fedprior's time-respecting choice, algorithms/fedprior_choice.py)."""
    name = config.data.raw_column
    if not name or "raw_input" not in {f.name for f in fields(algorithm)}:
        return algorithm
    j = list(config.data.features).index(name)
    return dataclasses.replace(algorithm, raw_input=j).with_scaler(tensors.scaler)


def build_recorded(
    name: str, config: RunConfig, task: Task, recorded: dict[str, Any] | None
) -> Algorithm:
    """The method as a run directory recorded it (``resolved.methods[name]`` of config.json).

    Built from the configuration; a parameter whose recorded value differs from what
    this fedcal would use (a default changed since the run) takes the recorded value,
    so a saved model is always rebuilt with the values it was trained with.
    """
    if not recorded:
        return build_algorithm(name, config, task)
    cls, values = method_settings(name, config)
    current = json.loads(json.dumps(method_values(name, config), default=list))
    for key, value in recorded.items():
        if key in current and current[key] != value:
            values[key] = value
    try:
        return cls(task=task, **values)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"[methods.{name}]: {err}") from None


# δ when [privacy] delta is omitted and the number of units is not known before the run
# (a Flower server), and the largest default δ of any fleet (1/N² above it for N < 317)
UNKNOWN_UNITS_DELTA = 1e-5


def privacy_delta(config: RunConfig, units: int | None) -> tuple[float, str]:
    """δ and how it was chosen: ``[privacy] delta`` if set, else min(1/N², 1e-5) with N the
    run's ``units`` (δ well below 1/N: a mechanism that released one unit's data whole with
    probability δ would expose 1/N of the fleet in expectation; the 1e-5 cap keeps a small
    fleet from a meaningless δ such as 1/9 for 3 units), else UNKNOWN_UNITS_DELTA."""
    if config.privacy.delta is not None:
        return config.privacy.delta, "set in [privacy] delta"
    if units and 1.0 / units**2 < UNKNOWN_UNITS_DELTA:
        return 1.0 / units**2, f"1/N^2, N = {units} units"
    if units:
        return UNKNOWN_UNITS_DELTA, f"1e-5 (1/N^2 would be larger: N = {units} units)"
    return UNKNOWN_UNITS_DELTA, "1e-5: the number of units is not known before the run"


def _account(config: RunConfig, delta: float):
    """The accountant's split: the sums' σ alone, or with adaptive clipping's counts."""
    from fedcal.core.privacy import account, account_adaptive

    p, e = config.privacy, config.engine
    if p.quantile > 0:
        args = (p.epsilon, delta, e.participation, e.rounds, p.quantile_steps, p.quantile_share)
        return account_adaptive(*args)
    return account(p.epsilon, delta, e.participation, e.rounds)


def build_policy(
    config: RunConfig, units: int | None = None
) -> tuple[AggregationPolicy, dict[str, Any]]:
    """The server's aggregation policy, with DP noise calibrated by the accountant.

    ``units``: the run's number of units N (δ = 1/N² when ``[privacy] delta`` is omitted;
    :func:`privacy_delta`). Returns the policy and what the run records about privacy
    (empty without DP).
    """
    a, p = config.aggregation, config.privacy
    privacy: dict[str, Any] = {}
    adaptive: dict[str, Any] = {}
    sigma, secret = 0.0, None
    if p.epsilon > 0:
        if p.clip <= 0:
            raise ConfigError("[privacy] clip: epsilon > 0 needs clip > 0 (the update norm bound)")
        try:
            delta, rule = privacy_delta(config, units)
            spent = _account(config, delta)
        except ValueError as err:
            raise ConfigError(f"[privacy]: {err}") from None
        sigma = spent.noise_multiplier
        privacy = {**asdict(spent), "clip": p.clip, "accountant": "opacus RDP", "noise": p.noise}
        privacy["delta_rule"] = rule
        if p.noise == "secret":  # drawn here, never recorded (config.PrivacySection.noise)
            import secrets

            secret = secrets.randbits(63)
        if p.quantile > 0:
            privacy.update(quantile=p.quantile, quantile_share=p.quantile_share)
            adaptive = dict(
                dp_quantile=p.quantile,
                dp_quantile_steps=p.quantile_steps,
                dp_quantile_rate=p.quantile_rate,
                dp_count_multiplier=spent.count_multiplier,
            )
    try:
        policy = AggregationPolicy(
            **asdict(a),
            dp_noise_multiplier=sigma,
            dp_clip=p.clip if sigma else 0.0,
            dp_noise_secret=secret,
            **adaptive,
        )
    except AggregationError as err:
        raise ConfigError(f"[aggregation]: {err}") from None
    return policy, privacy


def engine_settings(config: RunConfig) -> dict[str, Any]:
    """``[engine]`` as keyword arguments of the engine's EngineConfig (its EngineSettings).

    The run loop adds the seed and the aggregation policy; ``checkpoint_every`` is an
    argument of the loop, not of the engine's config.
    """
    return {k: v for k, v in asdict(config.engine).items() if k != "checkpoint_every"}


def check_methods(
    methods: Sequence[str], config: RunConfig | None = None, task_kind: str = "regression"
) -> list[str]:
    """Expand ``all`` (every method and config variant for ``task_kind``); refuse unknown names.

    ``all`` runs each system once: a registered method whose class a config variant of
    *another* method builds (a setting selects it, :meth:`Algorithm.built_class`: FedGMI's
    ``interpolation = "posterior"`` builds ``fedgmi_bayes``) runs as that variant only,
    which is its documented configuration; by name it stays usable.
    """
    variants = {
        name: params["base"]
        for name, params in (config.method_params.items() if config else [])
        if "base" in params
    }
    if list(methods) == ["all"]:
        extra = [
            v for v, b in variants.items() if b in REGISTRY and REGISTRY[b].task_kind == task_kind
        ]
        reached = set()  # classes a variant of another registered method builds
        for v in extra:
            try:
                cls, _ = method_settings(v, config)
            except ConfigError:
                continue  # a bad table is refused where the variant is built
            if cls is not REGISTRY[variants[v]]:
                reached.add(cls)
        names = [
            n
            for n in sorted(REGISTRY)
            if REGISTRY[n].task_kind == task_kind and REGISTRY[n] not in reached
        ]
        names += extra
    else:
        names = list(methods)
    unknown = [m for m in names if m not in REGISTRY and variants.get(m) not in REGISTRY]
    if unknown:
        raise ConfigError(
            f"unknown method(s) {', '.join(unknown)}{did_you_mean(unknown, [*REGISTRY, *variants])}"
            f"; known: {', '.join(sorted(REGISTRY))}"
        )
    # a classification method needs classes; a regression method (FedAvg…) may run on either
    other = [
        m for m in names if REGISTRY[variants.get(m, m)].task_kind == "classification" != task_kind
    ]
    if other:
        raise ConfigError(
            f"[run] methods: {', '.join(other)} is written for classification and cannot "
            f"run on this {task_kind} fleet"
        )
    return names


def validate_methods(config: RunConfig, fleet: Fleet | FleetOutline) -> list[str]:
    """Every method name and parameter, checked before anything trains.

    Unknown names, unknown or invalid method parameters and methods that cannot
    run on the configured model raise ConfigError (with ``all``, such methods
    are skipped by the experiment instead, so only names are checked).
    """
    from fedcal.engine.simulation import prepare  # the task's inputs, as the engine scales them

    names = check_methods(config.methods, config, task_kind(fleet))
    check_fit(config, fleet)
    try:  # an outline's tensors are built already (load_outline)
        tensors = (
            fleet.tensors
            if isinstance(fleet, FleetOutline)
            else prepare(fleet, config.data.scaling, config.engine.dtype)
        )
    except ValueError as err:
        raise ConfigError(f"[data] scaling: {err}") from None
    if list(config.methods) != ["all"]:
        task = build_task(config, tensors.train.x.shape[-1], fleet.meta, client_inputs(tensors))
        for name in names:
            build_algorithm(name, config, task)
    build_policy(config, fleet.num_clients)
    return names


def check_fit(config: RunConfig, fleet: Fleet) -> None:
    """Rules between the configuration and the fleet it runs on (its number of clients)."""
    n = fleet.num_clients
    e, a = config.engine, config.aggregation
    per_round = n if e.participation >= 1.0 else round(e.participation * n)
    if per_round < 1:
        raise ConfigError(
            f"[engine] participation: {e.participation} of {n} clients is no client per round"
        )
    if a.rule == "krum" and per_round < 2 * a.krum_byzantine + 3:
        raise ConfigError(
            f"[aggregation] krum_byzantine: Krum tolerates f attackers among n >= 2f + 3 "
            f"clients per round; f = {a.krum_byzantine} with n = {per_round}"
        )
    if a.rule == "krum" and a.krum_select > per_round:
        raise ConfigError(
            f"[aggregation] krum_select: {a.krum_select} > the {per_round} clients per round"
        )
    if not config.data.path and config.fleet.num_lots > n:
        raise ConfigError(f"[fleet] num_lots: {config.fleet.num_lots} lots for {n} sensors")


def run_record(
    config: RunConfig, methods: Sequence[str], train_points: Sequence[int]
) -> dict[str, Any]:
    """A run directory's ``config.json``: the layout (methods expanded) and the values used.

    ``resolved`` holds the full ``[train]`` recipe and, per method, every parameter
    it runs with — what ``fedcal methods`` shows — so a reader needs no defaults.
    :func:`fedcal.config.from_json` reads the file back.
    """
    cfg = dataclasses.replace(config, methods=tuple(methods))
    layout = to_layout(cfg)
    resolved = {
        "train": asdict(config.train),
        "methods": {m: method_values(m, config) for m in methods},
    }
    return {**layout, "resolved": resolved, "train_points_sweep": list(train_points)}
