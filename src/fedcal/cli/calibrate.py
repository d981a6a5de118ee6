"""``fedcal calibrate`` and ``fedcal certificate``: new units against a stored prior, and
their calibration certificates."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from fedcal.cli.base import (
    KeyFileOpt,
    _check_mac,
    _fail,
    _mac_key,
    app,
    console,
    err_console,
    target_unit,
)
from fedcal.cli.options import (
    DecisionRuleOpt,
    PriorMethodOpt,
    PriorOpt,
    RunPointsOpt,
    RunSeedOpt,
    SensorOpt,
    TimeColumnOpt,
    UnitOpt,
)
from fedcal.core import runnames
from fedcal.core.errors import ConfigError


@app.command()
def calibrate(
    prior: PriorOpt,
    data: Annotated[
        Path,
        typer.Option("--data", help="CSV/Parquet of the new units' calibration points"),
    ],
    out: Annotated[Path, typer.Option("--out", help="directory to write (a run directory)")],
    method: PriorMethodOpt = "fedprior",
    seed: RunSeedOpt = 0,
    train_points: RunPointsOpt = 0,
    sensor_column: SensorOpt = None,
    time_column: TimeColumnOpt = None,
    unit: UnitOpt = None,
    key_file: KeyFileOpt = None,
    strict: Annotated[
        bool,
        typer.Option(
            "--strict", help="refuse the whole file if any unit lies outside the prior's range"
        ),
    ] = False,
) -> None:
    """Calibrate new units from a few points each, against a trained fleet prior.

    Every row of --data is a calibration point unless the file has a split column
    (rows marked 'test' are then held out and scored). Writes coefficients.csv,
    per_sensor.csv and a run directory that `fedcal export`/`predict` read.
    A unit whose calibration points lie outside the prior's calibrated range (±5 % of
    its span) is refused alone (status "refused" in units.csv, named in a warning);
    the others are calibrated. With --strict the whole file is refused instead.
    The same code as the Python API: FleetPrior.load(...).calibrate(data).save(out).
    """
    from fedcal.core.paths import check_dir_output, run_folders_of
    from fedcal.data.loader import FleetDataError
    from fedcal.prior.find import find_prior

    key = _mac_key(key_file)
    try:
        path = find_prior(prior, method, seed, train_points)
        check_dir_output(out, "--out", run_folders_of(path), [data, path])
        if key is not None:
            _check_mac(run_folders_of(path)[-1:] or [path], key)
        table, units = _calibrate(path, data, out, sensor_column, time_column, strict)
        if key is not None:
            from fedcal.core.mac import write_mac

            write_mac(out, key)
    except (FileNotFoundError, ValueError, ConfigError, FleetDataError) as err:
        _fail(str(err))
    _print_calibrated(
        table,
        out,
        target_unit(units.prior.target, unit or ""),
        f"{len(table) - len(units.refused)} unit(s) calibrated against {path}",
    )
    if units.refused:  # outside the prior's range: refused alone, the others calibrated
        from fedcal.calibrated import refused_line

        line = refused_line(units.result)
        err_console.print(f"[bold yellow]warning[/] {escape(line)}", soft_wrap=True)
    note = units.declined_note
    if note:  # coverage empty: say why, in one line
        console.print(f"[yellow]{note}[/]")
    _print_findings(out)
    console.print(f"wrote {out}/coefficients.csv, per_sensor.csv, units.csv and a run directory")


def _calibrate(path: Path, data: Path, out: Path, sensor_column, time_column, strict: bool):
    """(per_sensor table, the calibrated units) by the Python API: NumPy for a prior the
    NumPy posterior covers, FedPrior (torch) otherwise, and without torch a one-line
    :class:`fedcal.report.served.NeedsTorch` (:mod:`fedcal.calibrated`)."""
    import warnings

    from fedcal.api import FleetPrior, RefusedUnitsWarning

    with warnings.catch_warnings():  # said once, on stderr, by the command
        warnings.simplefilter("ignore", RefusedUnitsWarning)
        units = FleetPrior.load(path).calibrate(data, sensor_column, time_column, strict)
    return units.save(out), units


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
    rule: DecisionRuleOpt = "guarded",
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
    from fedcal.report.sensors import calibrate_refused

    refused = {u: w for u, w in calibrate_refused(run_dir).items() if not sensor or u in sensor}
    for unit, why in refused.items():  # by calibrate's range guard: no model
        console.print(f"{unit}: no certificate (refused: {why})", highlight=False)
    without = f"; {len(refused)} refused unit(s) without one" if refused else ""
    console.print(f"wrote {len(certs)} certificate(s) to {out} (<unit>.html, <unit>.pdf){without}")


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


def _print_calibrated(table, out: Path, unit: str, title: str) -> None:
    """One row per unit: points, QA status, the σ it states over the prior's operating range
    (units.csv: mean and max; "—" where its interval was declined) and, with test rows, its
    test RMSE and the coverage of its stated 95 % interval (per_sensor.csv)."""
    import pandas as pd

    from fedcal.report.tables import fmt_num

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


def _print_units(run_dir: Path) -> None:
    """The per-unit table of a calibrate output (units.csv) and its QA findings."""
    from fedcal.core.csvfile import read_table  # torch-free

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
    from fedcal.core.csvfile import read_table  # torch-free

    units = read_table(out / runnames.UNITS, dtype={"sensor_id": str})  # guarded
    bad = units[units["status"] != "ok"]
    for r in bad.itertuples():
        why = f" (fleet distance d² {r.d2:.3g} > {r.d2_threshold:.3g})" * (r.status != "failed")
        if r.status == "refused":  # by the range guard: no model (units.csv's reason)
            why = f" ({getattr(r, 'status_reason', '')})"
        console.print(f"QA finding: {r.sensor_id}: {r.status}{why}", highlight=False)
    if bad.empty:
        console.print(f"QA: all {len(units)} unit(s) like the fleet (units.csv)")
