"""The ``fedcal`` app and what every command shares: the consoles, the one-line error
(:func:`_fail`), the MAC key, output checks, the progress bar, the run's table and report.

Imports only typer, click and rich at module level: each command imports its heavy
modules (pandas, torch, the algorithms) when it runs, so ``fedcal --help`` stays fast.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

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
from rich.table import Column

HELP = "The ``fedcal`` command line."  # the first line of fedcal.cli's docstring
DEBUG_FLAG = "--debug"


class _App(typer.Typer):
    """The typer app, with one rule for errors nobody anticipated.

    Expected problems (bad data, bad config) are reported by the commands
    themselves (``error: …``, exit 2). Anything else is an internal error:
    one line on stderr and exit 3, unless ``--debug`` (anywhere on the line)
    or ``FEDCAL_DEBUG=1`` asks for the full trace. Tracebacks never show local
    variables (they may hold data or paths a user should not paste). A command that
    needs torch where it is not installed says so in one line (exit 3).
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
            if _missing_torch(err):  # what needed it (a model the NumPy path does not cover)
                why = getattr(err, "why", None) or (str(err).splitlines()[0] if str(err) else "")
                why = "" if why.startswith("No module named") else f"{why}: "
                sys.stderr.write(f"fedcal: {why}{NO_TORCH}\n")
                sys.exit(3)
            text = str(err).strip().splitlines()
            detail = f": {text[0]}" if text else ""
            sys.stderr.write(
                f"fedcal: internal error: {type(err).__name__}{detail} "
                f"(run with {DEBUG_FLAG} for the full trace)\n"
            )
            sys.exit(3)


NO_TORCH = (
    "this needs torch, which is not installed: pip install 'fedcal[neural]' (the CPU build: "
    "docs/getting-started.md#install); without it: calibrate, plan, predict, export (c, json), "
    "certificate and report of a fedprior prior"
)


def _missing_torch(err: BaseException) -> bool:
    """Whether ``err`` is torch (or a part of it) not being importable."""
    name = getattr(err, "name", None) or ""
    return isinstance(err, ImportError) and (name == "torch" or name.startswith("torch."))


app = _App(
    add_completion=False,
    no_args_is_help=True,
    help=HELP,
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


def target_unit(column: str, declared: str = "") -> str:
    """:func:`fedcal.report.tables.target_unit`, imported when a command needs it."""
    from fedcal.report.tables import target_unit as unit_of

    return unit_of(column, declared)


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


def _write_html(run_dir: Path, html: Path, quiet: bool, certificates: Path | None = None) -> None:
    from fedcal.report.html import build_report

    report = build_report(run_dir, html, certificates=certificates)
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


def _check_mac(run_dirs: list[Path], key: bytes) -> None:
    """Refuse a run folder read with a key whose MAC is missing or wrong (core/mac.py)."""
    from fedcal.core.mac import MacError, check_mac

    target = run_dirs[0]
    if not target.is_dir():
        raise MacError(f"{target}: not in a run folder: there is no MAC to check it against")
    check_mac(target, key)


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


def main() -> None:  # pragma: no cover - console entry
    app()
