"""A configuration from its sources: the shipped default, a user's file or a shipped one by
name, command-line values over it, a run directory's JSON."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

from fedcal.config.files import DEFAULT_FILE, SHIPPED, read_toml, shipped_layout
from fedcal.config.merge import apply
from fedcal.config.run import RECORD_KEYS, RUN_KEYS, SECTIONS, RunConfig
from fedcal.core.errors import ConfigError


@functools.cache
def _default() -> RunConfig:
    cfg = apply(RunConfig(), shipped_layout("default"), DEFAULT_FILE)
    return dataclasses.replace(cfg, train_set=())  # the shipped recipe is not a user's choice


def default_config() -> RunConfig:
    """The shipped default configuration."""
    cfg = _default()
    return dataclasses.replace(
        cfg, method_params={k: dict(v) for k, v in cfg.method_params.items()}
    )


def load_config(path: str | Path | None) -> RunConfig:
    """The shipped default, overridden by the file at ``path`` (if any).

    ``path`` may also name a shipped configuration (see :data:`SHIPPED`).
    """
    base = default_config()
    if path is None:
        return base
    if str(path) in SHIPPED and not Path(path).exists():
        return apply(base, shipped_layout(str(path)), f"fedcal/configs/{path}.toml")
    p = Path(path)
    return apply(base, read_toml(p, str(p)), str(p))


def file_sets(path: str | Path | None, section: str, key: str) -> bool:
    """Whether the configuration ``path`` names (a file, or a shipped one other than the
    default) sets ``[section] key`` itself: the user's choice, unlike a value :func:`load_config`
    took from default.toml."""
    if path is None or (str(path) == "default" and not Path(path).exists()):
        return False
    if str(path) in SHIPPED and not Path(path).exists():
        raw = shipped_layout(str(path))
    else:
        raw = read_toml(Path(path), str(path))
    part = raw.get(section)
    return isinstance(part, dict) and key in part


def override(cfg: RunConfig, layout: dict[str, Any], where: str = "command line") -> RunConfig:
    """Command-line values (in the layout's shape) over ``cfg``, validated like a file."""
    return apply(cfg, layout, where)


def from_dict(raw: dict[str, Any], where: str = "config") -> RunConfig:
    """A RunConfig from a parsed TOML layout over the schema's own defaults (not default.toml)."""
    return apply(RunConfig(), raw, where)


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
