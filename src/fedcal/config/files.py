"""The configuration files: a user's TOML file read safely, the shipped ones by name, and
the shipped ``[train]`` recipe (what a method's own recipe is compared with)."""

from __future__ import annotations

import functools
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

from fedcal.config.sections import TrainConfig, section
from fedcal.core.errors import ConfigError
from fedcal.core.paths import PathError, read_text

# fedcal/configs/<name>.toml, usable as --config <name>
SHIPPED = ("physics", "digits", "fewpoint", "generic", "quickstart", "seed", "default")
DEFAULT_FILE = "fedcal/configs/default.toml"


def read_toml(path: Path, name: str) -> dict[str, Any]:
    """The TOML file at ``path`` (``name`` in errors): a regular file within the size limit,
    or a one-line ConfigError."""
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
def shipped_layout(name: str) -> dict[str, Any]:
    """The shipped ``fedcal/configs/<name>.toml``, parsed (cached: do not modify it)."""
    text = resources.files("fedcal").joinpath(f"configs/{name}.toml").read_text()
    return tomllib.loads(text)


@functools.cache
def shipped_recipe() -> TrainConfig:
    """The shipped ``[train]`` recipe (default.toml): what methods without their own use.

    default.toml's ``[train]`` over the schema's defaults, validated as
    :func:`fedcal.config.apply` validates it when it reads the whole file (the same value as
    ``default_config().train``: tested)."""
    raw = shipped_layout("default").get("train", {})
    return section(TrainConfig, TrainConfig(), raw, DEFAULT_FILE, "train")
