"""Which columns a results table shows (terminal, Markdown, HTML): :func:`table_columns`.

Re-exported by :mod:`fedcal.report.tables`, which renders them.
"""

from __future__ import annotations

import pandas as pd

COVERAGE = "coverage95"  # the terminal's one coverage cell: "mean/min" over sensors


def table_columns(
    table: pd.DataFrame, unit: str, show_bytes: bool, full: bool = False
) -> list[tuple[str, str]]:
    """``(column, header)`` pairs to show; the short set fits a 100-column terminal.

    ``full`` adds MAE and max|err| in % of full scale (Markdown and HTML have room). The
    terminal's set makes room for coverage ("mean/min" in one cell) and the count of
    excluded sensors: with coverage it leaves out %FS; a mixed fleet shows the new and the
    reference units' errors and coverage instead; the HTML report and Markdown show every
    column.
    """
    u = f" ({unit})" if unit and full else ""  # terminal tables name the unit in the title
    mixed = not full and "rmse_mean_new" in table.columns
    if mixed:  # mixed fleet: new and reference units, each with its coverage
        cols = _mixed_columns(table)
    elif "rmse_mean" in table.columns:
        cols = _error_columns(table, u, full)
    else:
        cols = [
            (c, c.replace("_", " "))
            for c in table.columns
            if c.endswith(("_mean", "_worst")) and not c.endswith("_std")
        ]
    if "coverage95_mean" in table.columns and not mixed:  # (a mixed fleet's: per role above)
        if full:
            cols += [("coverage95_mean", "cov95 mean"), ("coverage95_worst", "cov95 worst")]
        else:  # one cell "mean/worst" (worst = the lowest sensor's)
            cols.append((COVERAGE, "cov95 mean/min"))
    return cols + _cost_columns(table, show_bytes and not mixed)


def _mixed_columns(table: pd.DataFrame) -> list[tuple[str, str]]:
    """A mixed fleet's terminal columns: per role its errors and coverage (:data:`MIXED`)."""
    cols = []
    for r, ms in MIXED:
        for m, h in ms:
            cols.append((f"{m}_{r}", f"{h} {r[:3]}"))
            if m == "rmse_mean":  # like with like (issue 34.4), where it differs
                cols += [(c, f"{h} {r[:3]}") for c, h in like_with_like(table, f"_{r}")]
    return [c for c in cols if c[0] in table.columns]


def _error_columns(table: pd.DataFrame, u: str, full: bool) -> list[tuple[str, str]]:
    """A regression run's error columns (``full``: MAE, %FS and each role's too)."""
    same = like_with_like(table, "", full)
    cols = [
        ("rmse_mean", f"RMSE {'ok' if same else 'mean'}{u}"),
        *((c, f"{h}{u}") for c, h in same),
        ("rmse_worst", f"RMSE worst{u}"),
    ]
    if full:
        cols.append(("mae_mean", f"MAE mean{u}"))
    cols.append(("max_abs_worst", f"max|err| worst{u}"))
    if full or "coverage95_mean" not in table.columns:  # %FS gives way to coverage
        cols.append(("rmse_mean_pct_fs", "RMSE %FS"))
    if not full:
        return cols
    cols.append(("max_abs_worst_pct_fs", "max|err| %FS"))
    for role in ("new", "reference"):  # mixed fleets: the same per role
        if f"rmse_mean_{role}" in table.columns:
            cols += [
                (f"rmse_mean_{role}", f"RMSE mean {role}{u}"),
                *((c, f"{h} {role}{u}") for c, h in like_with_like(table, f"_{role}", True)),
                (f"rmse_worst_{role}", f"RMSE worst {role}{u}"),
            ]
            if f"coverage95_mean_{role}" in table.columns:  # fedprior's 95 % interval
                cols.append((f"coverage95_mean_{role}", f"95 % coverage {role}"))
    return cols


def _cost_columns(table: pd.DataFrame, show_bytes: bool) -> list[tuple[str, str]]:
    """Wall time, the count of sensors not ok (or diverged) and, if asked, bytes up."""
    cols = [("wall_s", "wall s")]
    if "excluded" in table.columns:
        cols.append(("excluded", "not ok"))  # sensors not ok (mean count over seeds)
    elif "diverged" in table.columns and (table["diverged"].fillna(0) > 0).any():
        cols.append(("diverged", "diverged sensors"))  # mean count over seeds
    if show_bytes:  # (a mixed fleet's terminal table has no room: HTML has it)
        cols.append(("bytes_up_per_round", "up kB/round"))
    return cols


def like_with_like(table: pd.DataFrame, role: str = "", full: bool = False) -> list:
    """The columns that rank methods on the same sensors (issue 34.4), ``(column, header)``:
    the RMSE over the sensors every method has ok (``rmse_mean_common``) where some method
    has fewer ok sensors than that set's sensors, and over every sensor (``rmse_mean_all``)
    where some sensor is not ok (else each equals the ok mean); the same in every table
    (``full``: Markdown, HTML). ``role``: a mixed fleet's suffix (``_new``)."""
    sensors = table.get(f"sensors{role}", table.get("sensors"))
    excluded = table.get(f"excluded{role}")
    out = []
    common = table.get(f"common_sensors{role}")
    ok = sensors - excluded if sensors is not None and excluded is not None else None
    if common is not None and ok is not None and bool((common < ok).any()):
        out.append((f"rmse_mean_common{role}", "RMSE common"))
    written = f"rmse_mean_all{role}" in table.columns and excluded is not None
    if written and bool((excluded > 0).any()):
        out.append((f"rmse_mean_all{role}", "RMSE all"))
    return out


# a mixed fleet's terminal columns, per role ("new", "ref"): errors and interval coverage
_ROLE = (("rmse_mean", "RMSE"), ("rmse_worst", "worst"), ("coverage95_mean", "cov95"))
MIXED = (("new", _ROLE), ("reference", (_ROLE[0], _ROLE[2])))  # 80 columns: no ref worst
