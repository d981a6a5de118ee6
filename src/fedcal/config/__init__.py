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

The modules, top down (each imports only those below it; an import contract):

    load      the sources: the shipped default, a file, command-line values, a run's JSON
    merge     a layout onto a configuration (:func:`apply`), every table validated
    methods   the ``[methods.<name>]`` tables and method names
    run       :class:`RunConfig` and its layout (:func:`to_layout`, :func:`to_json`)
    files     TOML files read safely, the shipped ones, the shipped ``[train]`` recipe
    sections  one pydantic dataclass per table, validated one at a time
"""

from fedcal.config.files import SHIPPED, shipped_layout, shipped_recipe
from fedcal.config.load import (
    default_config,
    file_sets,
    from_dict,
    from_json,
    load_config,
    override,
)
from fedcal.config.merge import apply
from fedcal.config.methods import check_method_tables, described_task
from fedcal.config.run import RECORD_KEYS, RUN_KEYS, SECTIONS, RunConfig, to_json, to_layout
from fedcal.config.sections import (
    AggregationSection,
    DataConfig,
    EngineSection,
    FleetConfig,
    ModelConfig,
    PrivacySection,
    RunSection,
    TrainConfig,
    check_design,
)
from fedcal.core.errors import ConfigError

__all__ = [
    "RECORD_KEYS",
    "RUN_KEYS",
    "SECTIONS",
    "SHIPPED",
    "AggregationSection",
    "ConfigError",
    "DataConfig",
    "EngineSection",
    "FleetConfig",
    "ModelConfig",
    "PrivacySection",
    "RunConfig",
    "RunSection",
    "TrainConfig",
    "apply",
    "check_design",
    "check_method_tables",
    "default_config",
    "described_task",
    "file_sets",
    "from_dict",
    "from_json",
    "load_config",
    "override",
    "shipped_layout",
    "shipped_recipe",
    "to_json",
    "to_layout",
]
