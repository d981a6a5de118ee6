"""The options commands share (typed once), their shipped defaults in ``--help``, the
fixed choices, and the run configuration resolved from a file and the command line."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import click
import typer

from fedcal.core.errors import ConfigError

if TYPE_CHECKING:  # imported in the commands: `fedcal --help` loads no torch, pandas or scipy
    from fedcal.config import RunConfig


def _csv_list(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    return tuple(t.strip() for t in text.split(",") if t.strip())


def _int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(t) for t in _csv_list(text) or ()]
    except ValueError:
        values = []
    if not values:
        raise ConfigError(f"{option}: expected integers like 0,1,2, got {text!r}")
    return values


def _with_preset(cfg: RunConfig, preset: str) -> RunConfig:
    """``--preset``: the table of the preset's method names it (:mod:`fedcal.presets`)."""
    from fedcal.config import override
    from fedcal.presets import PRESET_KEY, PRESETS

    if preset not in PRESETS:
        raise ConfigError(f"--preset: unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    table = {PRESETS[preset].method: {PRESET_KEY: preset}}
    return override(cfg, {"methods": table}, "--preset")


def _resolve(
    config: Path | None,
    data: Path | None = None,
    features: str | None = None,
    target: str | None = None,
    methods: str | None = None,
    seeds: int | None = None,
    rounds: int | None = None,
    aggregation: str | None = None,
    designs: str | None = None,
    fleet_seeds: str | None = None,
    device: str | None = None,
    chunk_size: int | None = None,
    time_column: str | None = None,
    split_by: str | None = None,
    sensor_column: str | None = None,
    raw_column: str | None = None,
    preset: str | None = None,
    unit: str | None = None,
) -> RunConfig:
    """The configuration file with the command line's options on top, validated like the file.

    Each option goes through the schema (:func:`fedcal.config.override`), so its error
    names the option, the section and the field.
    """
    from fedcal.config import check_design, load_config, override

    cfg = load_config(config)
    if methods is not None:
        names = _csv_list(methods)
        if not names:
            raise ConfigError("--methods is empty; give names separated by commas, or 'all'")
        repeated = sorted({m for m in names if names.count(m) > 1})
        if repeated:
            raise ConfigError(f"--methods names {', '.join(repeated)} more than once")
    if designs is not None:
        chosen = _csv_list(designs)
        for d in chosen or ():
            check_design(d, "--designs")
        if not chosen or len(set(chosen)) != len(chosen):
            raise ConfigError(f"--designs: need distinct designs like 3x2,4x3, got {designs!r}")
    options = [  # (option, section, field, value)
        ("--data", "data", "path", None if data is None else str(data)),
        ("--features", "data", "features", _csv_list(features)),
        ("--target", "data", "target", target),
        ("--time-column", "data", "time_column", time_column),
        ("--split-by", "data", "split_by", split_by),
        ("--sensor-column", "data", "client_column", sensor_column),
        ("--raw-column", "data", "raw_column", raw_column),
        ("--unit", "data", "target_unit", unit),
        ("--methods", "run", "methods", _csv_list(methods)),
        ("--seeds", "run", "seeds", seeds),
        ("--rounds", "engine", "rounds", rounds),
        ("--aggregation", "aggregation", "rule", aggregation),
        ("--device", "engine", "device", device),
        ("--chunk-size", "engine", "chunk_size", chunk_size),
        ("--designs", "run", "designs", _csv_list(designs)),
        (
            "--fleet-seeds",
            "run",
            "fleet_seeds",
            None if fleet_seeds is None else _int_list(fleet_seeds, "--fleet-seeds"),
        ),
    ]
    if preset is not None:
        cfg = _with_preset(cfg, preset)
    # one override per section, so fields checked together (features vs target) see each other
    given: dict[str, tuple[list[str], dict]] = {}
    for option, section, key, value in options:
        if value is not None:
            names, values = given.setdefault(section, ([], {}))
            names.append(option)
            values[key] = list(value) if isinstance(value, tuple) else value
    for section, (names, values) in given.items():
        cfg = override(cfg, {section: values}, "/".join(names))
    if data is not None and fleet_seeds is None and cfg.fleet_seeds:
        # A shipped config's sweep regenerates its built-in fleet; a user's file is one fleet
        # (e.g. `--config generic --data my.csv` runs generic's methods on the file).
        cfg = override(cfg, {"run": {"fleet_seeds": []}}, "--data")
    return cfg


# Fixed choices, as the schema's Literal types (tests/cli/test_cli_api_habits.py checks they
# agree); written here so that `fedcal --help` imports no schema (and no torch).
AGGREGATION_RULES = ("mean", "median", "trimmed_mean", "krum")
SPLIT_BY = ("random", "time")
EXPORT_FORMATS = ("c", "json", "onnx")
DECISION_RULES = ("guarded", "simple")  # fedcal.report.certificate.RULES (tested equal)
SIMULATOR_CHOICES = {
    "preset": ("nominal", "harsh"),
    "family": ("quartz", "silicon"),
    "test_design": ("cycle", "random"),
}


@functools.cache
def _shipped() -> dict:
    """The shipped default configuration (configs/default.toml), read with tomllib alone."""
    import tomllib
    from importlib import resources

    return tomllib.loads(resources.files("fedcal").joinpath("configs/default.toml").read_text())


def _default(section: str, key: str, schema: str = "") -> str:
    """' (default: 3, or --config's)': the shipped value a run uses unless set.

    Parentheses, not typer's "[default: …]": square brackets are rich markup in help text.
    """
    value = _shipped().get(section, {}).get(key, schema)  # schema: the field's own default
    text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
    return f" (default: {text or 'none'}, or --config's)"


def choice(option: str, text: str, choices: tuple[str, ...]) -> Any:
    """``option`` taking one of ``choices`` (listed by ``--help``, refused otherwise)."""
    return typer.Option(option, help=text, click_type=click.Choice(choices))


RunDirArg = Annotated[Path, typer.Argument(help="a run directory of fedcal run/compare")]
PriorOpt = Annotated[
    Path, typer.Option("--prior", help="a run directory with a fedprior run, or its prior.json")
]
ExportFormatOpt = Annotated[
    str,
    choice(
        "--format", "c (header for firmware), json, or onnx (one file per sensor)", EXPORT_FORMATS
    ),
]
DecisionRuleOpt = Annotated[
    str,
    choice(
        "--decision-rule",
        "with --spec: guarded (guard band w = U, ILAC-G8 4.2.2) or simple (w = 0)",
        DECISION_RULES,
    ),
]
OutOpt = Annotated[
    Path | None, typer.Option("--out", help="run directory (default: runs/<kind>-<config hash>)")
]
DataOpt = Annotated[
    Path | None, typer.Option("--data", help="CSV or Parquet fleet (default: the simulator)")
]
FeaturesOpt = Annotated[
    str | None,
    typer.Option(
        "--features", help="input columns, comma separated" + _default("data", "features")
    ),
]
TargetOpt = Annotated[
    str | None, typer.Option("--target", help="target column" + _default("data", "target"))
]
SensorOpt = Annotated[
    str | None,
    typer.Option("--sensor-column", help="column of sensor ids (default: the run's, or sensor_id)"),
]
MethodOpt = Annotated[
    str | None, typer.Option("--method", help="which method (default: the run's only one)")
]
RunSeedOpt = Annotated[int, typer.Option("--seed", help="which training seed of the run")]
RunPointsOpt = Annotated[
    int, typer.Option("--train-points", help="which point budget of the run (0 = all)")
]
PriorMethodOpt = Annotated[str, typer.Option("--method", help="which fedprior method of the run")]
MethodsOpt = Annotated[
    str | None,
    typer.Option("--methods", help="comma separated, or 'all'" + _default("run", "methods")),
]
SeedsOpt = Annotated[
    int | None,
    typer.Option("--seeds", help="number of training seeds" + _default("run", "seeds")),
]
RoundsOpt = Annotated[
    int | None, typer.Option("--rounds", help="federated rounds" + _default("engine", "rounds"))
]
AggregationOpt = Annotated[
    str | None,
    choice("--aggregation", "server rule" + _default("aggregation", "rule"), AGGREGATION_RULES),
]
ConfigOpt = Annotated[
    Path | None, typer.Option("--config", help="TOML file overriding the defaults")
]
QuietOpt = Annotated[
    bool, typer.Option("--quiet", "-q", help="no progress bar and no table; errors only")
]
DeviceOpt = Annotated[
    str | None,
    typer.Option(
        "--device", help="where clients train: cpu, cuda, cuda:N" + _default("engine", "device")
    ),
]
ChunkOpt = Annotated[
    int | None,
    typer.Option(
        "--chunk-size",
        help="clients trained at once (0 = all); bounds memory (default: chosen from the fleet)",
    ),
]
TimeColumnOpt = Annotated[
    str | None, typer.Option("--time-column", help="column of each row's time (number or date)")
]
SplitByOpt = Annotated[
    str | None,
    choice(
        "--split-by",
        "random, or time: each sensor's last test fraction is test"
        + _default("data", "split_by", "random"),
        SPLIT_BY,
    ),
]
RawColumnOpt = Annotated[
    str | None,
    typer.Option("--raw-column", help="the feature that reads the target itself (uncorrected)"),
]
UnitOpt = Annotated[
    str | None,
    typer.Option(
        "--unit",
        help="the target's unit as printed, e.g. hPa (default: from the target column's name, "
        "e.g. pressure_hpa or 'pressure (hPa)', else none)",
    ),
]
PresetOpt = Annotated[
    str | None,
    typer.Option(
        "--preset",
        help="the fleet prior's settings by name: chamber (fedprior), field (fedprior_drift);"
        " see docs/which-prior.md",
    ),
]
HtmlOpt = Annotated[
    Path | None, typer.Option("--html", help="also write the HTML report to this file")
]
