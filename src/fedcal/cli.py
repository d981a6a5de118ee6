"""The ``fedcal`` command line.

Stable interface (scripts call it)::

    fedcal run [--data FILE] [--features COL,COL,...] [--target COL]
               [--methods fedgmi,fedavg,local] [--seeds N] [--rounds R]
               [--config FILE] [--out DIR] [--train-points N or 12,24,48]
               [--designs 3x2,4x3] [--fleet-seeds 0,1,2]
    fedcal compare [the same options: one definition; compare also shows bytes sent]
    fedcal simulate --out fleet.parquet
    fedcal methods [--config FILE]
    fedcal export RUN_DIR [--method M] [--seed 0] [--format c|json|onnx] --out FILE|DIR
    fedcal report RUN_DIR [--markdown] [--html FILE]
    fedcal plan --prior RUN_DIR --plateaus K --points N --out design.csv [--spec S]
    fedcal plan --prior RUN_DIR --unit unit.csv --next [--spec S] [--count N]
    fedcal calibrate --prior RUN_DIR --data new_units.csv --out DIR [--sensor-column COL]
    fedcal predict RUN_DIR --data readings.csv --out calibrated.csv [--method M]

export and predict take the run's only method (several: --method names one);
every command reads sensor ids from the run's column (--sensor-column: another).

run and compare also take --quiet (no progress bar, no table), --html FILE
(write the HTML report when done) and --aggregation RULE. The progress bar
shows only on a terminal.

Exit codes: 0 done, every method ran and no sensor diverged; 1 the table was
printed but a method failed or a sensor diverged (each named above the exit);
2 refused input — a bad option, configuration, data file, method name or run
directory, reported on one line before anything is trained or written; 3 an
internal error (one line; --debug shows the trace); 130 interrupted (Ctrl-C;
the same command resumes from the last checkpoint).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import click
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Column, Table

from fedcal.core import runnames
from fedcal.core.errors import ConfigError

if TYPE_CHECKING:  # imported in the commands: `fedcal --help` loads no torch, pandas or scipy
    from fedcal.config import RunConfig

DEBUG_FLAG = "--debug"


class _App(typer.Typer):
    """The typer app, with one rule for errors nobody anticipated.

    Expected problems (bad data, bad config) are reported by the commands
    themselves (``error: …``, exit 2). Anything else is an internal error:
    one line on stderr and exit 3, unless ``--debug`` (anywhere on the line)
    or ``FEDCAL_DEBUG=1`` asks for the full trace. Tracebacks never show local
    variables (they may hold data or paths a user should not paste).
    """

    def __call__(self, *args, **kwargs):
        argv = list(kwargs.pop("args", None) or (args[0] if args else sys.argv[1:]))
        debug = DEBUG_FLAG in argv or os.environ.get("FEDCAL_DEBUG", "") not in ("", "0")
        argv = [a for a in argv if a != DEBUG_FLAG]
        try:
            return super().__call__(argv, *args[1:], **kwargs)
        except Exception as err:
            if debug:
                raise
            text = str(err).strip().splitlines()
            detail = f": {text[0]}" if text else ""
            sys.stderr.write(
                f"fedcal: internal error: {type(err).__name__}{detail} "
                f"(run with {DEBUG_FLAG} for the full trace)\n"
            )
            sys.exit(3)


app = _App(
    add_completion=False,
    no_args_is_help=True,
    help=__doc__.split("\n")[0],
    pretty_exceptions_show_locals=False,
    suggest_commands=False,  # click suggests a mistyped command itself (once, not twice)
)
console = Console()
err_console = Console(stderr=True)


def _print_version(value: bool) -> None:
    if value:
        from fedcal import __version__

        console.print(f"fedcal {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _options(
    debug: Annotated[
        bool, typer.Option(DEBUG_FLAG, help="on an internal error, show the full trace")
    ] = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="print the version and exit"
        ),
    ] = False,
) -> None:
    # --debug is taken out of the command line by _App (so it works after a
    # subcommand too); declared here so that --help lists it.
    pass


def target_unit(column: str) -> str:
    """:func:`fedcal.report.tables.target_unit`, imported when a command needs it."""
    from fedcal.report.tables import target_unit as unit_of

    return unit_of(column)


KeyFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--key-file",
        help="MAC key file (>= 16 bytes; default $FEDCAL_MAC_KEY): run/calibrate sign the run "
        "folder (fedcal.mac), predict/export/calibrate --prior refuse it unsigned or edited",
    ),
]


def _mac_key(key_file: Path | None) -> bytes | None:
    """The MAC key of --key-file or $FEDCAL_MAC_KEY (None: no MAC); a bad key fails here."""
    from fedcal.core.mac import MacError, read_key

    try:
        return read_key(key_file)
    except MacError as err:
        _fail(str(err))


def _fail(message: str) -> None:
    err_console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    raise typer.Exit(code=2)


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
    if preset is not None:  # the preset's method's table names it (fedcal.presets)
        from fedcal.presets import PRESET_KEY, PRESETS

        if preset not in PRESETS:
            raise ConfigError(f"--preset: unknown preset {preset!r}; known: {', '.join(PRESETS)}")
        table = {PRESETS[preset].method: {PRESET_KEY: preset}}
        cfg = override(cfg, {"methods": table}, "--preset")
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


def _default_out(kind: str, cfg: RunConfig, extra: object) -> Path:
    digest = hashlib.sha256(
        json.dumps([cfg.to_dict(), extra], sort_keys=True, default=list).encode()
    )
    return Path("runs") / f"{kind}-{digest.hexdigest()[:8]}"


def progress_bar(quiet: bool) -> Progress:
    """Methods × seeds × budgets × rounds with ETA, on a terminal only (quiet in CI and pipes)."""
    columns = (  # counts and ETA first: a narrow terminal cuts the description, not them
        BarColumn(bar_width=16),
        MofNCompleteColumn(),
        TextColumn("rounds"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        TextColumn(
            "{task.description}", table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis")
        ),
    )
    return Progress(
        *columns,
        console=err_console,
        transient=True,
        disable=quiet or not err_console.is_terminal,
    )


def _experiment(
    cfg: RunConfig,
    out: Path | None,
    train_points: tuple[int, ...],
    kind: str,
    show_bytes: bool,
    quiet: bool = False,
    html: Path | None = None,
    source: str = "configuration",
    auto_chunk: bool = False,
    key: bytes | None = None,
) -> None:
    import torch

    from fedcal.build import choice_note, load_run_data, validate_methods, with_auto_chunk
    from fedcal.data.loader import FleetDataError
    from fedcal.experiment import run_experiment
    from fedcal.report.tables import aggregate

    torch.set_num_threads(1)  # tiny models: threading overhead dominates
    try:  # a Parquet file by row groups when nothing needs its whole frame (issue 25.1)
        fleet, note = load_run_data(cfg, train_points)
        note = "\n".join(x for x in (note, choice_note(cfg)) if x)  # e.g. choose=auto: off
        for line in note.splitlines():  # one line each (issue 37.2)
            err_console.print(f"note: {escape(line)}", soft_wrap=True)
        if auto_chunk:  # no --chunk-size: chosen from the fleet's units and rows (config.json)
            cfg, note = with_auto_chunk(cfg, fleet)
            if note:
                err_console.print(f"note: {escape(note)}", soft_wrap=True)
        names = validate_methods(cfg, fleet)
    except ConfigError as err:  # found while building: name the file it came from
        _fail(f"{source} {err}" if str(err).startswith("[") else str(err))
    except FleetDataError as err:
        _fail(str(err))
    out = out or _default_out(kind, cfg, list(train_points))
    total = (
        len(names)
        * cfg.seeds
        * len(train_points)
        * cfg.engine.rounds
        * max(len(cfg.designs), 1)
        * max(len(cfg.fleet_seeds), 1)
    )
    with progress_bar(quiet) as progress:
        bar = progress.add_task("starting", total=total)
        seen: dict[str, int] = {}

        def on_progress(label: str, t: int, summary: dict) -> None:
            step = t - seen.get(label, 0)
            seen[label] = t
            first = next(iter(summary.values()), None)  # the round's first metric, short
            shown = f": {first:.3g}" if first is not None else ""
            progress.update(bar, advance=step, description=f"{label}{shown}")

        def on_skip(method: str, why: str) -> None:
            if not quiet:
                err_console.print(f"skipped {method}: {escape(why)}")

        noted: set[tuple[str, str]] = set()

        def on_note(method: str, note: str) -> None:  # what a user must know: even with --quiet
            if (method, note) not in noted:  # once, not once per seed and design
                noted.add((method, note))
                err_console.print(f"note ({method}): {escape(note)}")

        def on_status(label: str, note: str) -> None:  # sensors not ok, rejections:
            pass  # per_sensor.csv and rejections.csv; the table's "not ok" lines (issue 37.2)

        failures: list[str] = []

        def on_fail(label: str, reason: str) -> None:
            failures.append(f"{label}: {reason}")
            err_console.print(f"[bold red]failed[/] {escape(label)}: {escape(reason)}")

        try:
            summary = run_experiment(
                cfg,
                fleet,
                out,
                cfg.methods,
                train_points,
                on_progress,
                on_skip=on_skip,
                on_fail=on_fail,
                on_note=on_note,
                on_status=on_status,
            )
        except ConfigError as err:
            _fail(str(err))
    if key is not None:  # signed: predict/export/calibrate --prior with the key check it
        from fedcal.core.mac import write_mac

        write_mac(out, key)
    if not quiet:
        table = aggregate(summary)
        _print_table(table, target_unit(cfg.data.target), show_bytes)
        console.print(
            f"results in [bold]{out}[/] (summary.csv, runs/*/per_sensor.csv, "
            "runs/*/model.safetensors)"
        )
    if html is not None:
        _write_html(out, html, quiet)
    has = "diverged" in summary.columns
    diverged = summary[summary["diverged"].fillna(0) > 0] if has else summary.iloc[0:0]
    for _, row in diverged.iterrows():
        err_console.print(
            f"[bold red]diverged[/] {row['method']} seed={row['seed']}: "
            f"{int(row['diverged'])} sensor(s) (status in per_sensor.csv)"
        )
    for line in failures:
        err_console.print(f"[bold red]failed[/] {escape(line)}")
    if failures or len(diverged):
        raise typer.Exit(code=1)


def _write_html(run_dir: Path, html: Path, quiet: bool) -> None:
    from fedcal.report.html import build_report

    report = build_report(run_dir, html)
    if not quiet:
        console.print(
            f"HTML report: [bold]{report.path.resolve()}[/] ({len(report.figures)} figures)",
            soft_wrap=True,
        )


def _print_table(table, unit: str, show_bytes: bool) -> None:
    from fedcal.report.tables import excluded_note, rich_tables, table_columns

    for t in rich_tables(table, table_columns(table, unit, show_bytes), unit):
        console.print(t)
    for line in excluded_note(table):  # which statuses the "not ok" column counts
        console.print(f"not ok: {escape(line)}", soft_wrap=True)


# Fixed choices, as the schema's Literal types (tests/cli/test_cli_api_habits.py checks they
# agree); written here so that `fedcal --help` imports no schema (and no torch).
AGGREGATION_RULES = ("mean", "median", "trimmed_mean", "krum")
SPLIT_BY = ("random", "time")
EXPORT_FORMATS = ("c", "json", "onnx")
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
    typer.Option(
        "--aggregation",
        help="server rule" + _default("aggregation", "rule"),
        click_type=click.Choice(AGGREGATION_RULES),
    ),
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
    typer.Option(
        "--split-by",
        help="random, or time: each sensor's last test fraction is test"
        + _default("data", "split_by", "random"),
        click_type=click.Choice(SPLIT_BY),
    ),
]
RawColumnOpt = Annotated[
    str | None,
    typer.Option("--raw-column", help="the feature that reads the target itself (uncorrected)"),
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


def train(
    ctx: typer.Context,
    data: DataOpt = None,
    features: FeaturesOpt = None,
    target: TargetOpt = None,
    methods: MethodsOpt = None,
    seeds: SeedsOpt = None,
    rounds: RoundsOpt = None,
    config: ConfigOpt = None,
    out: OutOpt = None,
    aggregation: AggregationOpt = None,
    train_points: Annotated[
        str | None,
        typer.Option(
            "--train-points",
            help="calibration points per sensor (0 = all), or a sweep: 12,24,48"
            + _default("data", "train_points"),
        ),
    ] = None,
    designs: Annotated[
        str | None,
        typer.Option("--designs", help="chamber-design sweep of the simulator, e.g. 3x2,4x3,6x4"),
    ] = None,
    fleet_seeds: Annotated[
        str | None, typer.Option("--fleet-seeds", help="fleet-seed sweep, e.g. 0,1,2")
    ] = None,
    html: HtmlOpt = None,
    quiet: QuietOpt = False,
    device: DeviceOpt = None,
    chunk_size: ChunkOpt = None,
    time_column: TimeColumnOpt = None,
    split_by: SplitByOpt = None,
    sensor_column: SensorOpt = None,
    raw_column: RawColumnOpt = None,
    preset: PresetOpt = None,
    key_file: KeyFileOpt = None,
) -> None:
    """``fedcal run`` and ``fedcal compare``: one definition (compare also shows bytes sent)."""
    from fedcal.config import file_sets, override

    kind = ctx.info_name or "run"
    key = _mac_key(key_file)
    try:
        cfg = _resolve(
            config,
            data,
            features,
            target,
            methods,
            seeds,
            rounds,
            aggregation,
            designs,
            fleet_seeds,
            device,
            chunk_size,
            time_column,
            split_by,
            sensor_column,
            raw_column,
            preset,
        )
        points = (
            tuple(_int_list(train_points, "--train-points"))
            if train_points
            else (cfg.data.train_points,)
        )
        for p in points:
            override(cfg, {"data": {"train_points": p}}, "--train-points")
        _check_run_out(out, html, [Path(p) for p in (cfg.data.path, config) if p])
    except (ConfigError, ValueError) as err:
        _fail(str(err))
    source = str(config) if config is not None else "configuration (default + options)"
    # chosen from the fleet unless the user set it (--chunk-size, or [engine] in their file)
    auto = chunk_size is None and not file_sets(config, "engine", "chunk_size")
    _experiment(cfg, out, points, kind, kind == "compare", quiet, html, source, auto, key)


app.command(
    "run", help="Train a personalized calibration model per sensor and print the error summary."
)(train)
app.command(
    "compare",
    help="Compare methods on the same fleet, splits and seeds, optionally over point budgets.",
)(train)


@app.command()
def simulate(
    out: Annotated[Path, typer.Option("--out", help="fleet file to write (.csv or .parquet)")],
    sensors: Annotated[int, typer.Option(help="number of sensors")] = 20,
    seed: Annotated[int, typer.Option(help="fleet seed")] = 0,
    preset: Annotated[
        str, typer.Option(help="noise preset", click_type=click.Choice(SIMULATOR_CHOICES["preset"]))
    ] = "nominal",
    family: Annotated[
        str,
        typer.Option(help="sensor family", click_type=click.Choice(SIMULATOR_CHOICES["family"])),
    ] = "quartz",
    lots: Annotated[int, typer.Option(help="latent production lots")] = 1,
    test_design: Annotated[
        str,
        typer.Option(
            help="cycle (seed protocol) or random (off-grid)",
            click_type=click.Choice(SIMULATOR_CHOICES["test_design"]),
        ),
    ] = "cycle",
    train_design: Annotated[
        str, typer.Option(help="calibration points: campaign (384) or PxT, e.g. 3x2 (6 points)")
    ] = "campaign",
) -> None:
    """Write a simulated fleet (the embedded default) to a file."""
    from fedcal.data.loader import save_chunks
    from fedcal.data.simulator import FleetSpec, simulate_chunks

    try:
        spec = FleetSpec(
            num_sensors=sensors,
            preset=preset,
            family=family,
            num_lots=lots,
            test_design=test_design,
            train_design=train_design,
        )
        # 1,000 sensors a chunk (a Parquet row group): memory bounded at 100,000 sensors
        rows, count = save_chunks(simulate_chunks(spec, seed, chunk_size=1000), out)
    except ValueError as err:
        _fail(str(err))
    console.print(f"wrote {rows} rows, {count} sensors to {out}")


@app.command()
def methods(config: ConfigOpt = None) -> None:
    """List every method and config variant with the parameter values a run will use."""
    import dataclasses

    from fedcal.algorithms import REGISTRY
    from fedcal.build import method_values
    from fedcal.config import load_config

    try:
        cfg = load_config(config)
        recipe = dataclasses.asdict(cfg.train)
        variants = [n for n, p in cfg.method_params.items() if "base" in p and n not in REGISTRY]
        rows = []
        for name in [*sorted(REGISTRY), *sorted(variants)]:
            table = dict(cfg.method_params.get(name, {}))
            base = table.pop("base", name)
            cls = REGISTRY[base]
            configured = {**(cfg.method_params.get(base, {}) if base != name else {}), **table}
            shown = []
            for key, value in method_values(name, cfg).items():
                if key in recipe and value == recipe[key] and key not in configured:
                    continue  # the shared recipe, printed once above the table
                shown.append(f"{key}={value!r}" + ("*" if key in configured else ""))
            rows.append((name, base if base != name else "", cls, ", ".join(shown)))
    except ConfigError as err:
        _fail(str(err))
    console.print(
        "local recipe ([train]) of every method without its own: "
        + ", ".join(f"{k}={v!r}" for k, v in recipe.items()),
        highlight=False,
        markup=False,
    )
    t = Table(  # narrow columns and a legend: readable at 80 columns, parameters wrap
        caption=escape(
            "fed: federated (y/n); task: reg = regression, cls = classification. "
            "The values a run uses; * set by the configuration ([methods.<name>]); "
            "a recipe value shown differs from [train]: the method's own"
        ),
        caption_justify="left",
        pad_edge=False,
    )
    t.add_column("method", no_wrap=True)
    t.add_column("fed", no_wrap=True)
    t.add_column("task", no_wrap=True)
    t.add_column("parameters used", ratio=1, overflow="fold")
    short = {"regression": "reg", "classification": "cls"}
    for name, base, cls, params in rows:
        label = f"{name}\n(of {base})" if base else name  # a variant: its base below
        kind = short.get(cls.task_kind, cls.task_kind)
        t.add_row(label, "y" if cls.federated else "n", kind, escape(params))
    console.print(t)


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="a run directory of fedcal run/compare")],
    method: MethodOpt = None,
    seed: Annotated[int, typer.Option(help="which training seed")] = 0,
    train_points: Annotated[
        int, typer.Option("--train-points", help="which point budget (0 = all)")
    ] = 0,
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            help="c (header for firmware), json, or onnx (one file per sensor)",
            click_type=click.Choice(EXPORT_FORMATS),
        ),
    ] = "c",
    out: Annotated[
        Path | None,
        typer.Option("--out", help="file to write (default: stdout); a directory for onnx"),
    ] = None,
    key_file: KeyFileOpt = None,
) -> None:
    """Export every sensor's calibrated model: C header, JSON, or ONNX (one file per sensor).

    Every format carries each sensor's valid range: the span of its calibration points.
    """
    from fedcal.core.atomic import write_bytes, write_text
    from fedcal.core.paths import safe_name
    from fedcal.report.export import choose_method, to_c_header, to_json
    from fedcal.report.rundir import load_served

    key = _mac_key(key_file)
    if fmt not in ("c", "json", "onnx"):
        _fail(f"--format must be 'c', 'json' or 'onnx', got {fmt!r}")
    if fmt == "onnx" and out is None:
        _fail("--format onnx writes one file per sensor: give a directory with --out")
    try:
        _check_out(out, run_dir, directory=fmt == "onnx")
        method = choose_method(run_dir, method)
        if key is not None:
            _check_mac([run_dir], key)
        fleet, ranges = load_served(run_dir, method, seed, train_points)  # checked models
        if fmt == "onnx":
            from fedcal.report.onnx_export import to_onnx

            files = {  # a sensor id names a file: only through the sanitizer (core/paths.py)
                safe_name(sid, "sensor id"): to_onnx(fleet, sid, method, ranges.get(sid))
                for sid in sorted(fleet.params)
            }
        else:
            text = (
                to_c_header(fleet, valid_range=ranges, method=method)
                if fmt == "c"
                else to_json(fleet, valid_range=ranges, method=method)
            )
    except (FileNotFoundError, ValueError, ConfigError) as err:
        _fail(str(err))
    if fmt == "onnx":
        out.mkdir(parents=True, exist_ok=True)
        for sid, blob in files.items():
            write_bytes(out / f"{sid}.onnx", blob)
        console.print(f"wrote {len(files)} ONNX models ({{sensor}}.onnx) to {out}")
    elif out is None:
        console.out(text, highlight=False)
    else:
        write_text(out, text)
        console.print(f"wrote {len(fleet.params)} sensors' models to {out}")
        _print_footprint(fleet, method)
    _print_excluded(fleet)
    _print_without_sigma(fleet)


def _print_without_sigma(fleet) -> None:
    """One stderr line when some sensors' models state no σ: exported without one."""
    missing = fleet.without_sigma()
    if missing:
        err_console.print(
            f"[bold yellow]warning[/] no σ stated for {len(missing)} of {len(fleet.params)} "
            f"sensor(s) ({', '.join(missing)}; their interval was declined): exported without "
            "σ (C fedcal_has_std 0, JSON has_sigma false, ONNX no σ output)"
        )


def _print_excluded(fleet) -> None:
    """One stderr line per sensor the run refused: not exported (it has no model)."""
    for sensor in fleet.excluded:
        err_console.print(f"[bold yellow]warning[/] not exported: {fleet.no_model(sensor)}")


def _print_footprint(fleet, method: str) -> None:
    """The C header's constants per unit, for a model linear in a basis (docs/firmware.md)."""
    from fedcal.report.linear_export import linear_form

    form = linear_form(fleet, method)
    if form is not None:
        sigma = ", with σ" if form.has_std else ""
        if form.unstated:
            sigma += f" for {len(form.sensors) - len(form.unstated)} of {len(form.sensors)} units"
        deployed = (
            f"; + {form.deployed.bytes_per_unit()} per unit whose σ is the prior's "
            "discrepancy model"
            if form.deployed is not None
            else ""
        )
        console.print(
            f"footprint: {form.bytes_per_unit()} bytes of constants per unit "
            f"({form.terms.shape[0]} basis terms{sigma}){deployed}"
        )


@app.command()
def calibrate(
    prior: Annotated[
        Path, typer.Option("--prior", help="a run directory with a fedprior run, or its prior.json")
    ],
    data: Annotated[
        Path,
        typer.Option("--data", help="CSV/Parquet of the new units' calibration points"),
    ],
    out: Annotated[Path, typer.Option("--out", help="directory to write (a run directory)")],
    method: Annotated[str, typer.Option(help="which fedprior method of the run")] = "fedprior",
    seed: Annotated[int, typer.Option(help="which training seed of the run")] = 0,
    train_points: Annotated[
        int, typer.Option("--train-points", help="which point budget of the run (0 = all)")
    ] = 0,
    sensor_column: SensorOpt = None,
    time_column: TimeColumnOpt = None,
    key_file: KeyFileOpt = None,
) -> None:
    """Calibrate new units from a few points each, against a trained fleet prior.

    Every row of --data is a calibration point unless the file has a split column
    (rows marked 'test' are then held out and scored). Writes coefficients.csv,
    per_sensor.csv and a run directory that `fedcal export`/`predict` read.
    The same code as the Python API: FleetPrior.load(...).calibrate(data).save(out).
    """
    import torch

    from fedcal.api import FleetPrior
    from fedcal.calibration import find_prior
    from fedcal.core.paths import check_dir_output, run_folders_of
    from fedcal.data.loader import FleetDataError

    torch.set_num_threads(1)
    key = _mac_key(key_file)
    try:
        path = find_prior(prior, method, seed, train_points)
        check_dir_output(out, "--out", run_folders_of(path), [data, path])
        if key is not None:
            _check_mac(run_folders_of(path)[-1:] or [path], key)
        units = FleetPrior.load(path).calibrate(data, sensor_column, time_column)
        table = units.save(out)
        if key is not None:
            from fedcal.core.mac import write_mac

            write_mac(out, key)
    except (FileNotFoundError, ValueError, ConfigError, FleetDataError) as err:
        _fail(str(err))
    _print_calibrated(
        table, out, units.prior.target, f"{len(table)} unit(s) calibrated against {path}"
    )
    from fedcal.calibration import declined_note

    note = declined_note(units.prior, units.result)
    if note:  # coverage empty: say why, in one line
        console.print(f"[yellow]{note}[/]")
    _print_findings(out)
    console.print(f"wrote {out}/coefficients.csv, per_sensor.csv, units.csv and a run directory")


DECISION_RULES = ("guarded", "simple")  # fedcal.report.certificate.RULES (tested equal)


@app.command()
def certificate(
    run_dir: Annotated[Path, typer.Argument(help="the output directory of fedcal calibrate")],
    out: Annotated[Path, typer.Option("--out", help="directory for <unit>.html and <unit>.pdf")],
    reference: Annotated[
        str | None,
        typer.Option(help="the reference instrument (make, model, serial, its certificate)"),
    ] = None,
    reference_column: Annotated[
        str | None,
        typer.Option(help="or: the column of --data naming each unit's reference instrument"),
    ] = None,
    data: Annotated[
        Path | None, typer.Option(help="with --reference-column: the calibration data file")
    ] = None,
    spec: Annotated[
        float | None,
        typer.Option(
            help="specification S: error within ±S (target unit) at k = 2; "
            "adds a statement of conformity"
        ),
    ] = None,
    rule: Annotated[
        str,
        typer.Option(
            "--decision-rule",
            help="with --spec: guarded (guard band w = U, ILAC-G8 4.2.2) or simple (w = 0)",
            click_type=click.Choice(DECISION_RULES),
        ),
    ] = "guarded",
    issued: Annotated[
        str | None, typer.Option(help="date of issue, YYYY-MM-DD (default: today, UTC)")
    ] = None,
    sensor: Annotated[
        list[str] | None, typer.Option("--sensor", help="only this unit id (repeatable)")
    ] = None,
    measurand_unit: Annotated[
        str | None,
        typer.Option(help="the measurand's unit, e.g. hPa (default: from a known column suffix)"),
    ] = None,
    sensor_column: SensorOpt = None,
    key_file: KeyFileOpt = None,
) -> None:
    """Write a calibration certificate per unit (HTML and PDF): U at k = 2, range, status.

    docs/certificate.md says what each field means; U = 2u, u the unit's predictive
    standard uncertainty as `fedcal predict` states it. A unit without one gets a
    certificate that says so and states no U.
    """
    import datetime

    from fedcal.core.paths import check_dir_output
    from fedcal.report.certificate import reference_ids
    from fedcal.report.certificate_pdf import write_certificates

    key = _mac_key(key_file)
    try:
        check_dir_output(out, "--out", [run_dir], [*([data] if data else [])])
        if key is not None:  # a signed calibrate output: refused unsigned or edited
            _check_mac([run_dir], key)
        if issued is not None:
            datetime.date.fromisoformat(issued)  # a date, or a one-line error
        if reference_column is not None and data is None:
            raise ValueError("--reference-column needs --data (the file given to calibrate)")
        refs = None
        if reference_column is not None:
            column = sensor_column or _calibrated_column(run_dir)
            refs = reference_ids(data, column, reference_column)
        certs = write_certificates(
            run_dir, out, refs, reference, spec, rule, issued, sensor, measurand_unit
        )
    except (FileNotFoundError, ValueError, KeyError, ConfigError) as err:
        _fail(str(err).strip("'\""))
    for c in certs:
        stated = f"U ≤ {c.u_max:.3g} {c.symbol}" if not c.declined else "no U stated"
        verdict = f", {c.conformity.verdict}" if c.conformity is not None else ""
        console.print(f"{c.unit}: {c.certificate_id} ({c.status}; {stated}{verdict})")
    console.print(f"wrote {len(certs)} certificate(s) to {out} (<unit>.html, <unit>.pdf)")


def _calibrated_column(run_dir: Path) -> str:
    """The sensor column of a calibrate output (its config.json)."""
    from fedcal.core.paths import read_json

    return str(read_json(run_dir / runnames.CONFIG)["data"]["client_column"])


# calibrate's console: what each unit states (its σ, not the fleet's noise), then, when the
# file has test rows, how that held; every other column is in per_sensor.csv / units.csv.
_CALIBRATED = (
    ("points", "points", False),
    ("status", "status", False),
    ("sigma_mean", "σ mean over range", True),
    ("sigma_max", "σ max", True),
    ("test_rmse", "test RMSE", True),
    ("test_coverage95", "coverage 95 %", False),
)


def _print_calibrated(table, out: Path, target: str, title: str) -> None:
    """One row per unit: points, QA status, the σ it states over the prior's operating range
    (units.csv: mean and max; "—" where its interval was declined) and, with test rows, its
    test RMSE and the coverage of its stated 95 % interval (per_sensor.csv)."""
    import pandas as pd

    from fedcal.report.tables import fmt_num, target_unit

    unit = target_unit(target)
    qa = pd.read_csv(out / runnames.UNITS, dtype={"sensor_id": str})[
        ["sensor_id", "status", "sigma_mean", "sigma_max"]
    ]
    rows = table.astype({"sensor_id": str}).merge(qa, on="sensor_id", how="left")
    shown = [
        (c, label, in_unit)
        for c, label, in_unit in _CALIBRATED
        if c in rows and (not c.startswith("test_") or rows[c].notna().any())
    ]
    t = Table(title=title, title_justify="left")
    t.add_column("sensor")
    for _, label, in_unit in shown:
        t.add_column(label + (f" ({unit})" if in_unit and unit else ""), justify="right")

    def text(value) -> str:
        if isinstance(value, str):
            return value
        if value is None or value != value:  # NaN: no σ stated / not scored
            return "—"
        return fmt_num(value, keep_zeros=True) if isinstance(value, float) else str(value)

    for _, row in rows.iterrows():
        t.add_row(str(row["sensor_id"]), *[text(row[c]) for c, _, _ in shown])
    console.print(t)


def _check_mac(run_dirs: list[Path], key: bytes) -> None:
    """Refuse a run folder read with a key whose MAC is missing or wrong (core/mac.py)."""
    from fedcal.core.mac import MacError, check_mac

    target = run_dirs[0]
    if not target.is_dir():
        raise MacError(f"{target}: not in a run folder: there is no MAC to check it against")
    check_mac(target, key)


def _print_units(run_dir: Path) -> None:
    """The per-unit table of a calibrate output (units.csv) and its QA findings."""
    from fedcal.report.rundir import read_table

    units = read_table(run_dir / runnames.UNITS, dtype={"sensor_id": str})  # guarded
    points = ", ".join(map(str, sorted(set(units["points"].astype(int)))))
    t = Table(
        title=f"{len(units)} new unit(s); calibration points per unit: {points}",
        title_justify="left",
    )
    columns = ["points", "status", "d2", "d2_threshold", "sigma_mean", "sigma_max", "resid_rms"]
    t.add_column("sensor")
    for c in columns:
        t.add_column(c.replace("_", " "))
    for _, row in units.iterrows():
        cells = [row[c] if isinstance(row[c], str) else f"{row[c]:.4g}" for c in columns]
        t.add_row(str(row["sensor_id"]), *cells)
    console.print(t)
    _print_findings(run_dir)


def _print_findings(out: Path) -> None:
    """The QA findings of a calibrate run (units.csv): units unlike the fleet, failed units."""
    from fedcal.report.rundir import read_table

    units = read_table(out / runnames.UNITS, dtype={"sensor_id": str})  # guarded
    bad = units[units["status"] != "ok"]
    for r in bad.itertuples():
        why = f" (fleet distance d² {r.d2:.3g} > {r.d2_threshold:.3g})" * (r.status != "failed")
        console.print(f"QA finding: {r.sensor_id}: {r.status}{why}", highlight=False)
    if bad.empty:
        console.print(f"QA: all {len(units)} unit(s) like the fleet (units.csv)")


@app.command()
def predict(
    run_dir: Annotated[Path, typer.Argument(help="a run directory of fedcal run/compare")],
    data: Annotated[
        Path, typer.Option("--data", help="CSV/Parquet with the sensor column and the features")
    ],
    out: Annotated[
        Path, typer.Option("--out", help="CSV to write: the input rows plus the calibrated target")
    ],
    method: MethodOpt = None,
    seed: Annotated[int, typer.Option(help="which training seed")] = 0,
    train_points: Annotated[
        int, typer.Option("--train-points", help="which point budget (0 = all)")
    ] = 0,
    strict: Annotated[
        bool,
        typer.Option(
            "--strict",
            help="refuse readings beyond the calibrated range or of a sensor the run refused",
        ),
    ] = False,
    sensor_column: SensorOpt = None,
    key_file: KeyFileOpt = None,
) -> None:
    """Calibrate raw readings with each sensor's personalized model.

    Adds <target>_calibrated, <target>_std (when the method has a predictive σ) and
    in_range: readings beyond the sensor's calibrated span by more than 5 % of it are
    flagged in_range = False (refused with --strict), never silently extrapolated.
    Rows of a sensor the run refused (no model) are left empty and named in a warning
    (refused with --strict).
    """

    from fedcal.core.atomic import write_text
    from fedcal.data.loader import load_readings
    from fedcal.report.export import calibrate_frame, choose_method, uncalibrated_notes
    from fedcal.report.rundir import load_served

    key = _mac_key(key_file)
    try:
        _check_out(out, run_dir, inputs=[data])
        method = choose_method(run_dir, method)
        if key is not None:
            _check_mac([run_dir], key)
        fleet, ranges = load_served(run_dir, method, seed, train_points)  # checked models
        column = sensor_column or fleet.sensor_column
        # The loader's guards: regular file, size limit, checksums, finite plausible values.
        frame = load_readings(data, fleet.features, column)
        # <target>_calibrated and _std through the Python API's path, and in_range
        frame = calibrate_frame(fleet, frame, ranges, strict, column)
    except (FileNotFoundError, ValueError, KeyError, ConfigError) as err:
        _fail(str(err))
    write_text(out, frame.to_csv(index=False))
    # rows of a sensor the run refused have no value to call extrapolated (said below)
    valued = frame[f"{fleet.target}_calibrated"].notna()
    outside = int((~frame["in_range"] & valued).sum())
    console.print(f"wrote {len(frame)} calibrated rows to {out}")
    if outside:  # extrapolated values are flagged, and said
        err_console.print(
            f"[bold yellow]warning[/] {outside} row(s) beyond the calibrated range "
            "(in_range = False): extrapolated, not calibrated"
        )
    for note in uncalibrated_notes(fleet, frame, column):  # sensors the run refused
        err_console.print(f"[bold yellow]warning[/] {note}")


@app.command("flower-nodes")
def flower_nodes(
    out: Annotated[Path, typer.Option("--out", help="directory for the site files (one per site)")],
    data: DataOpt = None,
    features: FeaturesOpt = None,
    target: TargetOpt = None,
    config: ConfigOpt = None,
    train_points: Annotated[
        int, typer.Option("--train-points", help="calibration points per sensor (0 = all)")
    ] = 0,
    sites: Annotated[
        Path | None,
        typer.Option(
            "--sites",
            help="CSV with columns sensor_id,site: which site (SuperNode) serves each sensor; "
            "default: one site per sensor",
        ),
    ] = None,
    state_dir: Annotated[
        Path, typer.Option("--state-dir", help="where each SuperNode keeps its state (per site)")
    ] = Path("flower-state"),
    workers: Annotated[
        bool,
        typer.Option(
            "--workers",
            help="each site also runs a warm worker (its socket in the site's state directory): "
            "no torch/fedcal import per round message; prints the worker's command",
        ),
    ] = False,
) -> None:
    """Write one data file per site for its Flower SuperNode; print each node's --node-config."""
    from fedcal.build import load_data
    from fedcal.data.loader import FleetDataError
    from fedcal.engine.flower.nodes import node_config, prepare_site_files, read_site_map

    try:
        cfg = _resolve(config, data, features, target)
        mapping = read_site_map(sites, cfg.data.client_column) if sites is not None else None
        fleet = load_data(cfg)
        points = train_points or cfg.data.train_points
        if points:
            fleet = fleet.with_train_points(points, seed=cfg.data.split_seed)
        written = prepare_site_files(fleet, out, mapping)
    except (ConfigError, FleetDataError, ValueError, FileNotFoundError) as err:
        _fail(str(err))
    console.print(f"wrote {len(written)} site files to {out}; start one SuperNode per site with:")
    for site, sensors, path in written:
        # the site's folder under --state-dir by its file-name-safe name (the site file's),
        # never the raw id: "../../X" or "/abs/X" would point outside it (issue 36.5)
        site_dir = state_dir / path.stem
        socket = site_dir / "worker.sock" if workers else None
        try:
            cfg_text = node_config(path, site, site_dir, worker_socket=socket)
        except ValueError as err:
            _fail(str(err))
        console.print(
            f'  {site} ({len(sensors)} sensors): --node-config "{cfg_text}"',
            highlight=False,
            soft_wrap=True,
        )
        if workers:
            console.print(
                f'    worker: python -m fedcal.engine.flower.worker --node-config "{cfg_text}"',
                highlight=False,
                soft_wrap=True,
            )


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="a run directory of fedcal run/compare")],
    markdown: Annotated[bool, typer.Option(help="print Markdown instead of a rich table")] = False,
    html: Annotated[
        Path | None,
        typer.Option("--html", help="write a self-contained HTML report (figures embedded)"),
    ] = None,
) -> None:
    """Print the mean ± std table of a run directory; with --html, write the full report."""
    from fedcal.report.rundir import RunDir
    from fedcal.report.tables import aggregate, table_columns, to_markdown

    if (run_dir / runnames.UNITS).exists():  # a `fedcal calibrate` output: one row per new unit
        if markdown:
            _fail("--markdown: a calibrate output's units table prints as a table only")
        try:
            if html is not None:
                _check_out(html, run_dir, option="--html")
            _print_units(run_dir)
            if html is not None:
                _write_html(run_dir, html, quiet=False)
        except (OSError, ValueError, ConfigError) as err:
            _fail(str(err))
        return
    try:  # the run folder's guards: regular files, size limits, checked tables and JSON
        if html is not None:
            _check_out(html, run_dir, option="--html")
        run = RunDir.open(run_dir)
        table = aggregate(run.summary)
        cfg = run.config
    except (OSError, ValueError, ConfigError) as err:
        _fail(str(err))
    if html is not None:  # first: a run file it refuses leaves one line, no table above it
        import torch

        torch.set_num_threads(1)
        try:  # the run's tables and models, read through the same guards
            _write_html(run_dir, html, quiet=False)
        except (OSError, ValueError, ConfigError) as err:
            _fail(str(err))
    unit = target_unit(cfg.data.target)
    if markdown:
        columns = table_columns(table, unit, True, full=True)
        console.out(to_markdown(table, columns), highlight=False)
    else:
        _print_table(table, unit, True)


def _check_out(
    out: Path | None,
    run_dir: Path,
    inputs: list[Path] = (),
    directory: bool = False,
    option: str = "--out",
) -> None:
    """Refuse an output that is an input or a file of the run folder read (core/paths.py)."""
    from fedcal.core.paths import check_dir_output, check_file_output

    if out is None:
        return
    if directory:
        check_dir_output(out, option, [run_dir], contain=False)
    else:
        check_file_output(out, option, inputs, [run_dir])
        if option == "--out" and not out.parent.is_dir():  # (the HTML report makes its own)
            raise FileNotFoundError(f"{option} {out}: the directory {out.parent} does not exist")


def _check_run_out(out: Path | None, html: Path | None, inputs: list[Path]) -> None:
    """run/compare: --html is no input, and no input is a file the run folder writes."""
    from fedcal.core.paths import PathError, check_file_output, run_owned

    if html is not None:
        check_file_output(html, "--html", inputs, [out] if out is not None else [])
    for src in inputs if out is not None else ():
        if Path(src).exists() and run_owned(src, out):
            raise PathError(f"--out {out}: the run would overwrite its input {src}")


@app.command()
def plan(
    prior: Annotated[
        Path, typer.Option("--prior", help="a run directory with a fedprior run, or its prior.json")
    ],
    plateaus: Annotated[int | None, typer.Option(help="K temperature plateaus")] = None,
    points: Annotated[int | None, typer.Option(help="N chamber points in all")] = None,
    out: Annotated[Path | None, typer.Option(help="design.csv to write")] = None,
    spec: Annotated[float | None, typer.Option(help="target RMSE over the range")] = None,
    quantile: Annotated[float, typer.Option(help="units' RMSE quantile the spec holds")] = 0.95,
    plateau_minutes: Annotated[float, typer.Option("--plateau-minutes")] = 90.0,
    point_minutes: Annotated[float, typer.Option("--point-minutes")] = 5.0,
    t_min: Annotated[float | None, typer.Option("--t-min", help="lowest set point")] = None,
    t_max: Annotated[float | None, typer.Option("--t-max", help="highest set point")] = None,
    t_step: Annotated[float, typer.Option("--t-step", help="set-point grid step")] = 5.0,
    pressures: Annotated[
        str | None, typer.Option(help="pressure steps, comma separated (default 50…1550 by 100)")
    ] = None,
    max_plateaus: Annotated[int, typer.Option("--max-plateaus")] = 4,
    max_points: Annotated[int, typer.Option("--max-points")] = 24,
    unit: Annotated[Path | None, typer.Option(help="one unit's points so far (CSV)")] = None,
    next_: Annotated[bool, typer.Option("--next", help="sequential: the unit's next point(s)")] = (
        False
    ),
    count: Annotated[int, typer.Option(help="with --next: how many next points")] = 1,
    method: Annotated[str, typer.Option(help="which fedprior method of the run")] = "fedprior",
    seed: Annotated[int, typer.Option(help="which training seed of the run")] = 0,
) -> None:
    """Plan a new unit's chamber points from the fleet prior (fedcal.planning).

    --plateaus K --points N: the design minimizing the expected predictive
    variance over the range; --spec S alone: the cheapest design meeting it;
    --unit FILE --next: whether that unit meets --spec, else its next points.
    """
    import torch

    from fedcal import calibration, planning
    from fedcal.core.atomic import write_text
    from fedcal.core.paths import check_file_output, run_folders_of
    from fedcal.data.loader import FleetDataError, load_fleet

    torch.set_num_threads(1)
    try:
        path = calibration.find_prior(prior, method, seed, 0)
        if out is not None:  # not one of its inputs, nor a file of the prior's run folders
            check_file_output(out, "--out", [path, *([unit] if unit else [])], run_folders_of(path))
        doc = calibration.load_prior(path)
        steps = tuple(float(v) for v in pressures.split(",")) if pressures else None
        chamber = planning.default_chamber(
            doc, t_min, t_max, t_step, steps, plateau_minutes, point_minutes
        )
        planner = planning.planner(doc, chamber, quantile)
        unit_name = target_unit(doc.target)
        if next_:
            if unit is None or spec is None:
                _fail("--next needs --unit FILE and --spec")
            fleet = load_fleet(
                unit,
                doc.features,
                doc.target,
                test_fraction=0.0,
                min_train_points=1,
                min_test_points=0,
            )
            step = planning.unit_next(planner, fleet, spec, count, str(unit))
            console.print(
                f"unit now: RMS σ {step.now.rms:.4g} {unit_name}, worst σ {step.now.worst:.4g} "
                f"over the range → {'meets' if step.done else 'does not meet'} spec {spec:g}"
            )
            for p, t, d, after, minutes in step.steps:
                console.print(
                    f"next: {p:g} hPa at {t:g} °C, {d}: RMS σ → {after:.4g} ({minutes:g} min)"
                )
            if step.steps:
                frame = planning._as_design([s[:3] for s in step.steps]).frame()
                if out is not None:
                    write_text(out, frame.to_csv(index=False))  # atomic
            return
        if plateaus is not None and points is not None:
            result = planning.optimize(planner, plateaus, points)
            best = {"planned": result.design, "start": result.start}
        elif spec is not None:
            found = planning.cheapest(planner, spec, max_plateaus, max_points)
            if not found:
                _fail(
                    f"no design of ≤ {max_plateaus} plateaus and ≤ {max_points} points "
                    f"meets {spec:g}"
                )
            best = {"planned": found[0].design}
        else:
            _fail("give --plateaus and --points, or --spec, or --unit with --next")
        table = planning.compare(planner, {**best, **planning.standard_grids(chamber)}, spec)
        if out is not None:
            write_text(out, best["planned"].frame().to_csv(index=False))  # atomic
    except (FileNotFoundError, ValueError, ConfigError, FleetDataError) as err:
        _fail(str(err))
    console.print(f"expected over the range ({unit_name}; sd: predictive σ, rmse: over units)")
    console.out(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"), highlight=False)
    if out is not None:
        console.print(f"wrote {out} ({best['planned'].size} points)")


def main() -> None:  # pragma: no cover - console entry
    app()
