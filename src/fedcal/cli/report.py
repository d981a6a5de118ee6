"""``fedcal report``: a run's table, or a calibrate output's units; the HTML report."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fedcal.cli.base import _check_out, _fail, _print_table, _write_html, app, console, target_unit
from fedcal.cli.calibrate import _print_units
from fedcal.cli.options import RunDirArg
from fedcal.core import runnames
from fedcal.core.errors import ConfigError


@app.command()
def report(
    run_dir: RunDirArg,
    markdown: Annotated[bool, typer.Option(help="print Markdown instead of a rich table")] = False,
    html: Annotated[
        Path | None,
        typer.Option("--html", help="write a self-contained HTML report (figures embedded)"),
    ] = None,
    certificates: Annotated[
        Path | None,
        typer.Option(
            help="with --html: the folder of fedcal certificate's <unit>.html/.pdf, linked "
            "from each unit's section (default: certificates/ beside the --html file)"
        ),
    ] = None,
) -> None:
    """Print the mean ± std table of a run directory; with --html, write the full report."""
    if (run_dir / runnames.UNITS).exists():  # a `fedcal calibrate` output (torch-free sans --html)
        if markdown:
            _fail("--markdown: a calibrate output's units table prints as a table only")
        try:
            if html is not None:
                _check_out(html, run_dir, option="--html")
            _print_units(run_dir)
            if html is not None:
                _write_html(run_dir, html, quiet=False, certificates=certificates)
        except (OSError, ValueError, ConfigError) as err:
            _fail(str(err))
        return
    from fedcal.report.rundir import RunDir
    from fedcal.report.tables import aggregate, table_columns, to_markdown

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
            _write_html(run_dir, html, quiet=False, certificates=certificates)
        except (OSError, ValueError, ConfigError) as err:
            _fail(str(err))
    unit = target_unit(cfg.data.target, cfg.data.target_unit)
    if markdown:
        columns = table_columns(table, unit, True, full=True)
        console.out(to_markdown(table, columns), highlight=False)
    else:
        _print_table(table, unit, True)
