"""The run's configuration as one value (:class:`RunConfig`) and its TOML layout.

The *layout* is the TOML file's shape (``[run]``, ``[data]`` …, ``[methods.<name>]``):
:func:`to_layout` writes it, :func:`to_json` carries it as JSON (run directories, Flower
messages); :func:`fedcal.config.apply` reads it back.
"""

from __future__ import annotations

import json
from dataclasses import asdict, field, fields
from typing import Any

from pydantic import ConfigDict
from pydantic.dataclasses import dataclass

from fedcal.config import sections
from fedcal.config.files import shipped_recipe
from fedcal.core.aggregation import AggregationRules


@dataclass(frozen=True, config=ConfigDict(extra="forbid", arbitrary_types_allowed=True))
class RunConfig:
    methods: tuple[str, ...] = ("fedgmi", "fedavg", "local")
    seeds: int = 3
    designs: tuple[str, ...] = ()
    fleet_seeds: tuple[int, ...] = ()
    unconverged_tol: float = 1e-3
    data: sections.DataConfig = field(default_factory=sections.DataConfig)
    fleet: sections.FleetConfig = field(default_factory=sections.FleetConfig)
    model: sections.ModelConfig = field(default_factory=sections.ModelConfig)
    engine: sections.EngineSection = field(default_factory=sections.EngineSection)
    train: sections.TrainConfig = field(default_factory=sections.TrainConfig)
    aggregation: AggregationRules = field(default_factory=AggregationRules)
    privacy: sections.PrivacySection = field(default_factory=sections.PrivacySection)
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
    "data": sections.DataConfig,
    "fleet": sections.FleetConfig,
    "model": sections.ModelConfig,
    "engine": sections.EngineSection,
    "train": sections.TrainConfig,
    "aggregation": AggregationRules,
    "privacy": sections.PrivacySection,
}
RUN_KEYS = tuple(f.name for f in fields(sections.RunSection))  # fields of [run]
# Keys a run directory's config.json adds to the layout (fedcal.build.run_record).
RECORD_KEYS = ("resolved", "train_points_sweep", "data_sha256")


def to_layout(cfg: RunConfig) -> dict[str, Any]:
    """The configuration in its TOML layout; :func:`~fedcal.config.apply` on the default
    reads it back.

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
