"""The ``fedcal`` command line.

Stable interface (scripts call it)::

    fedcal run [--data FILE] [--features COL,COL,...] [--target COL]
               [--methods fedgmi,fedavg,local] [--seeds N] [--rounds R]
               [--config FILE] [--out DIR]
    fedcal compare [same options] [--train-points 12,24,48,96,384]
    fedcal simulate --out fleet.parquet
    fedcal methods
    fedcal export RUN_DIR --method fedgmi [--seed 0] --out FILE

Exit codes of run/compare: 0 every method ran and no sensor diverged; 1 the table
was printed but a method failed or a sensor diverged (said above the exit); 2 bad
input (data, configuration, options), nothing trained.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fedcal.config import ConfigError, RunConfig, load_config

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.split("\n")[0])
console = Console()
err_console = Console(stderr=True)


def _fail(message: str) -> None:
    err_console.print(f"[bold red]error:[/] {escape(message)}")
    raise typer.Exit(code=2)


def _csv_list(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    return tuple(t.strip() for t in text.split(",") if t.strip())


def _resolve(
    config: Path | None,
    data: Path | None,
    features: str | None,
    target: str | None,
    methods: str | None,
    seeds: int | None,
    rounds: int | None,
) -> RunConfig:
    cfg = load_config(config)
    d = cfg.data
    if data is not None:
        d = replace(d, path=str(data))
    if features is not None:
        d = replace(d, features=_csv_list(features))
    if target is not None:
        d = replace(d, target=target)
    cfg = replace(cfg, data=d)
    if methods is not None:
        cfg = replace(cfg, methods=_csv_list(methods))
    if seeds is not None:
        if seeds < 1:
            raise ConfigError("--seeds must be at least 1")
        cfg = replace(cfg, seeds=seeds)
    if rounds is not None:
        if rounds < 1:
            raise ConfigError("--rounds must be at least 1")
        cfg = replace(cfg, engine=replace(cfg.engine, rounds=rounds))
    return cfg


def _with_aggregation(cfg: RunConfig, rule: str | None) -> RunConfig:
    return cfg if rule is None else replace(cfg, aggregation=replace(cfg.aggregation, rule=rule))


def _default_out(kind: str, cfg: RunConfig, extra: object) -> Path:
    digest = hashlib.sha256(
        json.dumps([cfg.to_dict(), extra], sort_keys=True, default=list).encode()
    )
    return Path("runs") / f"{kind}-{digest.hexdigest()[:8]}"


def _experiment(
    cfg: RunConfig, out: Path | None, train_points: tuple[int, ...], kind: str, show_bytes: bool
) -> None:
    import torch

    from fedcal.data.loader import FleetDataError
    from fedcal.experiment import check_methods, load_data, run_experiment, task_kind
    from fedcal.report.tables import aggregate

    torch.set_num_threads(1)  # tiny models: threading overhead dominates
    try:
        fleet = load_data(cfg)
        check_methods(cfg.methods, cfg, task_kind(fleet))
    except (ConfigError, FleetDataError) as err:
        _fail(str(err))
    out = out or _default_out(kind, cfg, list(train_points))
    total = (
        len(check_methods(cfg.methods, cfg, task_kind(fleet)))
        * cfg.seeds
        * len(train_points)
        * cfg.engine.rounds
    )
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} rounds"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err_console, transient=True) as progress:
        bar = progress.add_task("starting", total=total)
        seen: dict[str, int] = {}

        def on_progress(label: str, t: int, summary: dict) -> None:
            step = t - seen.get(label, 0)
            seen[label] = t
            first = next(iter(summary.items()))
            progress.update(bar, advance=step, description=f"{label}  {first[0]}={first[1]:.4g}")

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
                on_skip=lambda m, why: err_console.print(f"skipped {m}: {escape(why)}"),
                on_fail=on_fail,
                on_note=lambda m, note: err_console.print(f"note ({m}): {escape(note)}"),
            )
        except ConfigError as err:
            _fail(str(err))
    table = aggregate(summary)
    unit = target_unit(cfg.data.target)
    _print_table(table, unit, show_bytes)
    console.print(
        f"results in [bold]{out}[/] (summary.csv, runs/*/per_sensor.csv, runs/*/model.pt)"
    )
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


UNITS = {"hpa": "hPa", "pa": "Pa", "kpa": "kPa", "c": "°C", "k": "K", "percent": "%", "ppm": "ppm"}


def target_unit(column: str) -> str:
    """The unit a column name ends with (``pressure_hpa`` → hPa), or '' if none is known."""
    suffix = column.rsplit("_", 1)[-1].lower() if "_" in column else ""
    return UNITS.get(suffix, suffix)


def _table_columns(table, unit: str, show_bytes: bool) -> list[tuple[str, str]]:
    if "rmse_mean" in table.columns:
        cols = [
            ("rmse_mean", f"RMSE mean ({unit})"),
            ("rmse_worst", f"RMSE worst ({unit})"),
            ("mae_mean", f"MAE mean ({unit})"),
            ("max_abs_worst", f"max|err| worst ({unit})"),
            ("rmse_mean_pct_fs", "RMSE %FS"),
            ("max_abs_worst_pct_fs", "max|err| %FS"),
        ]
    else:
        cols = [
            (c, c)
            for c in table.columns
            if c.endswith(("_mean", "_worst")) and not c.endswith("_std")
        ]
    cols.append(("wall_s", "wall s"))
    if "diverged" in table.columns and (table["diverged"].fillna(0) > 0).any():
        cols.append(("diverged", "diverged sensors"))
    if show_bytes:
        cols += [("bytes_up_per_round", "up B/round"), ("bytes_down_per_round", "down B/round")]
    return cols


def _print_table(table, unit: str, show_bytes: bool) -> None:
    from fedcal.report.tables import fmt_pm

    cols = _table_columns(table, unit, show_bytes)
    for tp, part in table.groupby("train_points", sort=False):
        title = "calibration points per sensor: " + ("all" if tp == 0 else str(tp))
        t = Table(title=title, title_justify="left")
        t.add_column("method")
        for _, header in cols:
            t.add_column(header, justify="right")
        for _, row in part.iterrows():
            if row.get("failed", 0) == 1:  # every seed failed: no numbers to show
                t.add_row(row["method"], *["failed"] * len(cols))
                continue
            t.add_row(row["method"], *[fmt_pm(row[c], row[f"{c}_std"]) for c, _ in cols])
        console.print(t)


OutOpt = Annotated[
    Path | None, typer.Option("--out", help="run directory (default: runs/<kind>-<config hash>)")
]
DataOpt = Annotated[
    Path | None, typer.Option("--data", help="CSV or Parquet fleet (default: the simulator)")
]
FeaturesOpt = Annotated[
    str | None, typer.Option("--features", help="input columns, comma separated")
]
TargetOpt = Annotated[str | None, typer.Option("--target", help="target column")]
MethodsOpt = Annotated[str | None, typer.Option("--methods", help="comma separated, or 'all'")]
SeedsOpt = Annotated[int | None, typer.Option("--seeds", help="number of training seeds")]
RoundsOpt = Annotated[int | None, typer.Option("--rounds", help="federated rounds")]
AggregationOpt = Annotated[
    str | None,
    typer.Option("--aggregation", help="server rule: mean, median, trimmed_mean or krum"),
]
ConfigOpt = Annotated[
    Path | None, typer.Option("--config", help="TOML file overriding the defaults")
]


@app.command()
def run(
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
        int, typer.Option("--train-points", help="calibration points per sensor (0 = all)")
    ] = 0,
) -> None:
    """Train a personalized calibration model per sensor and print the error summary."""
    try:
        cfg = _with_aggregation(
            _resolve(config, data, features, target, methods, seeds, rounds), aggregation
        )
    except ConfigError as err:
        _fail(str(err))
    _experiment(cfg, out, (train_points or cfg.data.train_points,), "run", show_bytes=False)


@app.command()
def compare(
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
        str | None, typer.Option("--train-points", help="sweep, e.g. 12,24,48,96,384")
    ] = None,
) -> None:
    """Compare methods on the same fleet, splits and seeds, optionally over point budgets."""
    try:
        cfg = _with_aggregation(
            _resolve(config, data, features, target, methods, seeds, rounds), aggregation
        )
        points = (
            tuple(int(p) for p in _csv_list(train_points))
            if train_points
            else (cfg.data.train_points,)
        )
    except ConfigError as err:
        _fail(str(err))
    except ValueError:
        _fail(f"--train-points must be whole numbers separated by commas, got {train_points!r}")
    _experiment(cfg, out, points, "compare", show_bytes=True)


@app.command()
def simulate(
    out: Annotated[Path, typer.Option("--out", help="fleet file to write (.csv or .parquet)")],
    sensors: Annotated[int, typer.Option(help="number of sensors")] = 20,
    seed: Annotated[int, typer.Option(help="fleet seed")] = 0,
    preset: Annotated[str, typer.Option(help="nominal or harsh")] = "nominal",
    family: Annotated[str, typer.Option(help="quartz or silicon")] = "quartz",
    lots: Annotated[int, typer.Option(help="latent production lots")] = 1,
    test_design: Annotated[
        str, typer.Option(help="cycle (seed protocol) or random (off-grid)")
    ] = "cycle",
) -> None:
    """Write a simulated fleet (the embedded default) to a file."""
    from fedcal.data.loader import save_fleet
    from fedcal.data.simulator import FleetSpec, simulate_fleet

    try:
        spec = FleetSpec(
            num_sensors=sensors,
            preset=preset,
            family=family,
            num_lots=lots,
            test_design=test_design,
        )
        fleet = simulate_fleet(spec, seed=seed)
        save_fleet(fleet, out)
    except ValueError as err:
        _fail(str(err))
    console.print(f"wrote {len(fleet.frame)} rows, {fleet.num_clients} sensors to {out}")


@app.command()
def methods() -> None:
    """List the registered methods and their parameters."""
    import dataclasses

    from fedcal.algorithms import REGISTRY

    t = Table()
    t.add_column("method")
    t.add_column("federated")
    t.add_column("task")
    t.add_column("parameters (defaults)")
    for name, cls in sorted(REGISTRY.items()):
        params = ", ".join(
            f"{f.name}={f.default!r}"
            for f in dataclasses.fields(cls)
            if f.name != "task" and f.default is not dataclasses.MISSING
        )
        t.add_row(name, "yes" if cls.federated else "no", cls.task_kind, params)
    console.print(t)


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="a run directory of fedcal run/compare")],
    method: Annotated[str, typer.Option(help="which method's models")] = "fedgmi",
    seed: Annotated[int, typer.Option(help="which training seed")] = 0,
    train_points: Annotated[
        int, typer.Option("--train-points", help="which point budget (0 = all)")
    ] = 0,
    fmt: Annotated[str, typer.Option("--format", help="c (header for firmware) or json")] = "c",
    out: Annotated[
        Path | None, typer.Option("--out", help="file to write (default: stdout)")
    ] = None,
) -> None:
    """Export every sensor's calibrated model for firmware (C header) or other tools (JSON)."""
    from fedcal.report.export import load_models, to_c_header, to_json

    try:
        fleet = load_models(run_dir, method, seed, train_points)
        if fmt not in ("c", "json"):
            raise ValueError(f"--format must be 'c' or 'json', got {fmt!r}")
        text = to_c_header(fleet) if fmt == "c" else to_json(fleet)
    except (FileNotFoundError, ValueError, ConfigError) as err:
        _fail(str(err))
    if out is None:
        console.out(text, highlight=False)
    else:
        out.write_text(text)
        console.print(f"wrote {len(fleet.params)} sensors' models to {out}")


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
) -> None:
    """Calibrate new units from a few points each, against a trained fleet prior.

    Every row of --data is a calibration point unless the file has a split column
    (rows marked 'test' are then held out and scored). Writes coefficients.csv,
    per_sensor.csv and a run directory that `fedcal export`/`predict` read.
    """
    import torch

    from fedcal import calibration
    from fedcal.data.loader import FleetDataError, load_fleet

    torch.set_num_threads(1)
    try:
        path = calibration.find_prior(prior, method, seed, train_points)
        doc = calibration.load_prior(path)
        fleet = load_fleet(
            data,
            features=doc["features"],
            target=doc["target"],
            test_fraction=0.0,
            min_train_points=1,
            min_test_points=0,
        )
        result = calibration.calibrate(doc, fleet, str(data))
        table = calibration.write(out, doc, fleet, result)
    except (FileNotFoundError, ValueError, ConfigError, FleetDataError) as err:
        _fail(str(err))
    unit = target_unit(doc["target"])
    t = Table(title=f"{len(table)} unit(s) calibrated against {path}", title_justify="left")
    columns = [c for c in table.columns if c != "sensor_id"]
    t.add_column("sensor")
    for c in columns:
        t.add_column(c.replace("_", " ") + (f" ({unit})" if c.endswith(("sd", "rmse")) else ""))
    for _, row in table.iterrows():
        t.add_row(str(row["sensor_id"]), *[f"{row[c]:.4g}" for c in columns])
    console.print(t)
    console.print(f"wrote {out}/coefficients.csv, per_sensor.csv and a run directory")


@app.command()
def predict(
    run_dir: Annotated[Path, typer.Argument(help="a run directory of fedcal run/compare")],
    data: Annotated[
        Path, typer.Option("--data", help="CSV/Parquet with the sensor column and the features")
    ],
    out: Annotated[
        Path, typer.Option("--out", help="CSV to write: the input rows plus the calibrated target")
    ],
    method: Annotated[str, typer.Option(help="which method's models")] = "fedgmi",
    seed: Annotated[int, typer.Option(help="which training seed")] = 0,
    train_points: Annotated[
        int, typer.Option("--train-points", help="which point budget (0 = all)")
    ] = 0,
) -> None:
    """Calibrate raw readings with each sensor's personalized model."""
    import pandas as pd

    from fedcal.report.export import load_models

    try:
        fleet = load_models(run_dir, method, seed, train_points)
        frame = pd.read_parquet(data) if data.suffix in (".parquet", ".pq") else pd.read_csv(data)
        missing = [c for c in ("sensor_id", *fleet.features) if c not in frame.columns]
        if missing:
            raise ValueError(f"{data}: missing column(s) {', '.join(missing)}")
        column = f"{fleet.target}_calibrated"
        frame[column] = float("nan")
        for sensor, rows in frame.groupby("sensor_id", sort=False):
            x = rows[list(fleet.features)].to_numpy(float)
            frame.loc[rows.index, column] = fleet.predict(str(sensor), x)[:, 0]
    except (FileNotFoundError, ValueError, KeyError, ConfigError) as err:
        _fail(str(err))
    frame.to_csv(out, index=False)
    console.print(f"wrote {len(frame)} calibrated rows to {out}")


@app.command("flower-nodes")
def flower_nodes(
    out: Annotated[
        Path, typer.Option("--out", help="directory for the node files (one per sensor)")
    ],
    data: DataOpt = None,
    features: FeaturesOpt = None,
    target: TargetOpt = None,
    config: ConfigOpt = None,
    train_points: Annotated[
        int, typer.Option("--train-points", help="calibration points per sensor (0 = all)")
    ] = 0,
    state_dir: Annotated[
        Path, typer.Option("--state-dir", help="where each SuperNode keeps its state (per sensor)")
    ] = Path("flower-state"),
) -> None:
    """Write one data file per sensor for its Flower SuperNode; print each node's --node-config."""
    from fedcal.data.loader import FleetDataError
    from fedcal.engine.flower.nodes import node_config, prepare_node_files
    from fedcal.experiment import load_data

    try:
        cfg = _resolve(config, data, features, target, None, None, None)
        fleet = load_data(cfg)
        points = train_points or cfg.data.train_points
        if points:
            fleet = fleet.with_train_points(points, seed=cfg.data.split_seed)
        written = prepare_node_files(fleet, out)
    except (ConfigError, FleetDataError, ValueError) as err:
        _fail(str(err))
    console.print(f"wrote {len(written)} node files to {out}; start one SuperNode per sensor with:")
    for index, (sensor, path) in enumerate(written):
        cfg_text = node_config(path, sensor, index, state_dir / sensor)
        console.print(f'  {sensor}: --node-config "{cfg_text}"', highlight=False, soft_wrap=True)


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="a run directory of fedcal run/compare")],
    markdown: Annotated[bool, typer.Option(help="print Markdown instead of a rich table")] = False,
) -> None:
    """Print the mean ± std table of a run directory's summary.csv."""
    import pandas as pd

    from fedcal.report.tables import aggregate, to_markdown

    path = run_dir / "summary.csv"
    if not path.exists():
        _fail(f"{path} does not exist: not a fedcal run directory, or no run finished yet")
    table = aggregate(pd.read_csv(path))
    cfg = json.loads((run_dir / "config.json").read_text())
    unit = target_unit(cfg["data"]["target"])
    if markdown:
        console.out(to_markdown(table, _table_columns(table, unit, True)), highlight=False)
    else:
        _print_table(table, unit, True)


def main() -> None:  # pragma: no cover - console entry
    app()
