"""``fedcal run``, ``compare``, ``simulate`` and ``methods``: train and compare methods on a
fleet (torch: imported when a run starts)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import click
import typer
from rich.markup import escape
from rich.table import Table

from fedcal.cli.base import (
    KeyFileOpt,
    _fail,
    _mac_key,
    _print_table,
    _write_html,
    app,
    console,
    err_console,
    progress_bar,
    target_unit,
)
from fedcal.cli.options import (
    SIMULATOR_CHOICES,
    AggregationOpt,
    ChunkOpt,
    ConfigOpt,
    DataOpt,
    DeviceOpt,
    FeaturesOpt,
    HtmlOpt,
    MethodsOpt,
    OutOpt,
    PresetOpt,
    QuietOpt,
    RawColumnOpt,
    RoundsOpt,
    SeedsOpt,
    SensorOpt,
    SplitByOpt,
    TargetOpt,
    TimeColumnOpt,
    UnitOpt,
    _default,
    _int_list,
    _resolve,
)
from fedcal.core.errors import ConfigError

if TYPE_CHECKING:
    from fedcal.config import RunConfig


def _default_out(kind: str, cfg: RunConfig, extra: object) -> Path:
    digest = hashlib.sha256(
        json.dumps([cfg.to_dict(), extra], sort_keys=True, default=list).encode()
    )
    return Path("runs") / f"{kind}-{digest.hexdigest()[:8]}"


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
    """Load the fleet, run every method, print the table; exit 1 on a failure or divergence."""
    import torch

    torch.set_num_threads(1)  # tiny models: threading overhead dominates
    cfg, fleet, names = _prepare(cfg, train_points, source, auto_chunk)
    out = out or _default_out(kind, cfg, list(train_points))
    summary, failures = _run(cfg, fleet, out, train_points, len(names), quiet)
    if key is not None:  # signed: predict/export/calibrate --prior with the key check it
        from fedcal.core.mac import write_mac

        write_mac(out, key)
    if not quiet:
        from fedcal.report.tables import aggregate

        table = aggregate(summary)
        _print_table(table, target_unit(cfg.data.target, cfg.data.target_unit), show_bytes)
        console.print(
            f"results in [bold]{out}[/] (summary.csv, runs/*/per_sensor.csv, "
            "runs/*/model.safetensors)"
        )
    if html is not None:
        _write_html(out, html, quiet)
    _print_failures(summary, failures)


def _prepare(cfg: RunConfig, train_points: tuple[int, ...], source: str, auto_chunk: bool):
    """(cfg, fleet, method names): the run's data and its methods checked, notes printed."""
    from fedcal.build import choice_note, load_run_data, validate_methods, with_auto_chunk
    from fedcal.data.loader import FleetDataError

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
    return cfg, fleet, names


class _Hooks:
    """The run's callbacks: the progress bar, skipped methods, notes (once each), failures."""

    def __init__(self, progress, bar, quiet: bool) -> None:
        self.progress, self.bar, self.quiet = progress, bar, quiet
        self.seen: dict[str, int] = {}
        self.noted: set[tuple[str, str]] = set()
        self.failures: list[str] = []

    def on_progress(self, label: str, t: int, summary: dict) -> None:
        step = t - self.seen.get(label, 0)
        self.seen[label] = t
        first = next(iter(summary.values()), None)  # the round's first metric, short
        shown = f": {first:.3g}" if first is not None else ""
        self.progress.update(self.bar, advance=step, description=f"{label}{shown}")

    def on_skip(self, method: str, why: str) -> None:
        if not self.quiet:
            err_console.print(f"skipped {method}: {escape(why)}")

    def on_note(self, method: str, note: str) -> None:  # what a user must know: even --quiet
        if (method, note) not in self.noted:  # once, not once per seed and design
            self.noted.add((method, note))
            err_console.print(f"note ({method}): {escape(note)}")

    def on_status(self, label: str, note: str) -> None:  # sensors not ok, rejections:
        pass  # per_sensor.csv and rejections.csv; the table's "not ok" lines (issue 37.2)

    def on_fail(self, label: str, reason: str) -> None:
        self.failures.append(f"{label}: {reason}")
        err_console.print(f"[bold red]failed[/] {escape(label)}: {escape(reason)}")


def _run(cfg: RunConfig, fleet, out: Path, train_points: tuple[int, ...], methods: int, quiet):
    """(summary, failures): every method × seed × budget × design × fleet seed, with a bar."""
    from fedcal.experiment import run_experiment

    total = (
        methods
        * cfg.seeds
        * len(train_points)
        * cfg.engine.rounds
        * max(len(cfg.designs), 1)
        * max(len(cfg.fleet_seeds), 1)
    )
    with progress_bar(quiet) as progress:
        hooks = _Hooks(progress, progress.add_task("starting", total=total), quiet)
        try:
            summary = run_experiment(
                cfg,
                fleet,
                out,
                cfg.methods,
                train_points,
                hooks.on_progress,
                on_skip=hooks.on_skip,
                on_fail=hooks.on_fail,
                on_note=hooks.on_note,
                on_status=hooks.on_status,
            )
        except ConfigError as err:
            _fail(str(err))
    return summary, hooks.failures


def _print_failures(summary, failures: list[str]) -> None:
    """Diverged sensors and failed methods, one line each; exit 1 if any."""
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
    unit: UnitOpt = None,
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
            unit=unit,
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


def _check_run_out(out: Path | None, html: Path | None, inputs: list[Path]) -> None:
    """run/compare: --html is no input, and no input is a file the run folder writes."""
    from fedcal.core.paths import PathError, check_file_output, run_owned

    if html is not None:
        check_file_output(html, "--html", inputs, [out] if out is not None else [])
    for src in inputs if out is not None else ():
        if Path(src).exists() and run_owned(src, out):
            raise PathError(f"--out {out}: the run would overwrite its input {src}")
