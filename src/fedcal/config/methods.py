"""``[methods.<name>]``: tables of registered methods and variants with a base, each value in
the range its method declares, built on the task the configuration describes; and a
method name as the run folder's name it becomes."""

from __future__ import annotations

import math
from typing import Any

from fedcal.config.run import RunConfig
from fedcal.core.algorithm import SettingError, check_settings, setting_types
from fedcal.core.errors import ConfigError, did_you_mean
from fedcal.core.paths import PathError, safe_name
from fedcal.core.task import Task
from fedcal.data.fleet import BAROMETRIC_FEATURES
from fedcal.models import build_model
from fedcal.presets import PRESET_KEY, PresetError, expanded, preset_settings


def registered() -> dict[str, type]:
    """The registered methods by name (:data:`fedcal.algorithms.REGISTRY`, read when asked)."""
    from fedcal.algorithms import REGISTRY

    return REGISTRY


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
    registry = registered()
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


def check_method_name(name: Any, where: str) -> None:
    """A method name is a run folder's name: one safe file-name component (core/paths.py)."""
    try:
        safe_name(name, "method name")
    except PathError as err:
        raise ConfigError(f"{where}: {err}") from None
