"""``fedcal plan``: a new unit's chamber points from the fleet prior (fedcal.planning)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fedcal.cli.base import _fail, app, console, target_unit
from fedcal.cli.options import PriorMethodOpt, PriorOpt, RunSeedOpt
from fedcal.core.errors import ConfigError


@app.command()
def plan(
    prior: PriorOpt,
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
    method: PriorMethodOpt = "fedprior",
    seed: RunSeedOpt = 0,
) -> None:
    """Plan a new unit's chamber points from the fleet prior (fedcal.planning).

    --plateaus K --points N: the design minimizing the expected predictive
    variance over the range; --spec S alone: the cheapest design meeting it;
    --unit FILE --next: whether that unit meets --spec, else its next points.
    """
    from fedcal import planning
    from fedcal.core.atomic import write_text
    from fedcal.core.paths import check_file_output, run_folders_of
    from fedcal.data.loader import FleetDataError
    from fedcal.prior.find import find_prior
    from fedcal.prior.model import PriorModel

    try:
        path = find_prior(prior, method, seed, 0)
        if out is not None:  # not one of its inputs, nor a file of the prior's run folders
            check_file_output(out, "--out", [path, *([unit] if unit else [])], run_folders_of(path))
        doc = PriorModel.load(path)
        steps = tuple(float(v) for v in pressures.split(",")) if pressures else None
        chamber = planning.default_chamber(
            doc, t_min, t_max, t_step, steps, plateau_minutes, point_minutes
        )
        # NumPy; a variant it does not cover: torch (fedcal[neural]), else one line (exit 3)
        planner = planning.planner(
            doc, chamber, quantile, forecast=planning.forecaster(doc, str(path))
        )
        unit_name = target_unit(doc.target)
        if next_:
            if unit is None or spec is None:
                _fail("--next needs --unit FILE and --spec")
            _next_points(planner, doc, unit, spec, count, out, unit_name)
            return
        best = _best_design(planner, plateaus, points, spec, max_plateaus, max_points)
        table = planning.compare(planner, {**best, **planning.standard_grids(chamber)}, spec)
        if out is not None:
            write_text(out, best["planned"].frame().to_csv(index=False))  # atomic
    except (FileNotFoundError, ValueError, ConfigError, FleetDataError) as err:
        _fail(str(err))
    console.print(f"expected over the range ({unit_name}; sd: predictive σ, rmse: over units)")
    console.out(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"), highlight=False)
    if out is not None:
        console.print(f"wrote {out} ({best['planned'].size} points)")


def _next_points(planner, doc, unit: Path, spec: float, count: int, out, unit_name: str) -> None:
    """--unit FILE --next: whether the unit meets --spec now, else its next point(s)."""
    from fedcal import planning
    from fedcal.core.atomic import write_text
    from fedcal.data.loader import load_fleet

    fleet = load_fleet(
        unit, doc.features, doc.target, test_fraction=0.0, min_train_points=1, min_test_points=0
    )
    step = planning.unit_next(planner, fleet, spec, count, str(unit))
    console.print(
        f"unit now: RMS σ {step.now.rms:.4g} {unit_name}, worst σ {step.now.worst:.4g} "
        f"over the range → {'meets' if step.done else 'does not meet'} spec {spec:g}"
    )
    for p, t, d, after, minutes in step.steps:
        console.print(f"next: {p:g} hPa at {t:g} °C, {d}: RMS σ → {after:.4g} ({minutes:g} min)")
    if step.steps:
        frame = planning.as_design([s[:3] for s in step.steps]).frame()
        if out is not None:
            write_text(out, frame.to_csv(index=False))  # atomic


def _best_design(planner, plateaus, points, spec, max_plateaus: int, max_points: int) -> dict:
    """{"planned": design[, "start": the grid it started from]}: --plateaus/--points' optimum,
    or --spec's cheapest design."""
    from fedcal import planning

    if plateaus is not None and points is not None:
        result = planning.optimize(planner, plateaus, points)
        return {"planned": result.design, "start": result.start}
    if spec is not None:
        found = planning.cheapest(planner, spec, max_plateaus, max_points)
        if not found:
            limits = f"≤ {max_plateaus} plateaus and ≤ {max_points} points"
            _fail(f"no design of {limits} meets {spec:g}")
        return {"planned": found[0].design}
    _fail("give --plateaus and --points, or --spec, or --unit with --next")
    raise AssertionError  # _fail exits
