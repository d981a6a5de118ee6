"""Reading a layout onto a configuration: :func:`apply` (a parsed TOML file, its JSON, or
command-line values over a base), every section validated whole, the ``[methods]`` tables
merged and checked, ``[run] methods`` known and safe."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict
from typing import Any

from fedcal.config.methods import (
    check_method_name,
    check_method_tables,
    described_task,
    registered,
)
from fedcal.config.run import RUN_KEYS, SECTIONS, RunConfig
from fedcal.config.sections import RunSection, section, validate
from fedcal.core.errors import ConfigError, did_you_mean


def _tuples(value: Any) -> Any:
    """TOML/JSON lists as tuples (the algorithms' fields are tuples)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


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
        updates.update(asdict(validate(RunSection, run_raw, where, "run")))
    for name, cls in SECTIONS.items():
        if name in raw:
            updates[name] = section(cls, getattr(base, name), raw[name], where, name)
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
        check_method_name(method, f"{where} [methods]")
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
        check_method_name(m, f"{where} [run] methods")
    registry = registered()
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
