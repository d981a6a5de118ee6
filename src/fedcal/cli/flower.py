"""``fedcal flower-nodes``: one data file per site for its Flower SuperNode."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fedcal.cli.base import _fail, app, console
from fedcal.cli.options import ConfigOpt, DataOpt, FeaturesOpt, TargetOpt, _resolve
from fedcal.core.errors import ConfigError


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
