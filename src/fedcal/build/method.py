"""A method's task and algorithm from the configuration: the model, each setting's
value by precedence (:mod:`fedcal.build`), the generic basis, the time-respecting
choice, the raw column a method reads.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, fields
from typing import Any

from fedcal.algorithms import get
from fedcal.config import ConfigError, RunConfig
from fedcal.core.algorithm import Algorithm
from fedcal.core.classification import ClassificationTask
from fedcal.core.hooks import with_scaler
from fedcal.core.task import Task
from fedcal.data.fleet import BAROMETRIC_FEATURES, Fleet
from fedcal.models import build_model
from fedcal.models.basis import Basis, whitened
from fedcal.presets import PresetError, expanded


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
    return with_scaler(dataclasses.replace(algorithm, raw_input=j), tensors.scaler)


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
