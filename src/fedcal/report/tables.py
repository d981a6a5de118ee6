"""Tables of results: per-method mean ± std over seeds, as data, rich tables and Markdown.

A seed whose run diverged (a NaN metric, or ``status`` other than ``ok`` where
summary.csv has that column) makes the method's mean NaN, which every
renderer prints as ``diverged`` — never as a number averaged over the seeds
that happened to survive. Within a run, fleet means are over the sensors whose
status is ``ok`` (:mod:`fedcal.status`); the table says how many were excluded
("excl.", and :func:`excluded_note` per status), and a run with no ok sensor has
no number ("n/a"). A coverage the method declines to state (NaN) is "—".
"""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd
from rich.table import Table

from fedcal.core.coverage import SEVERITY
from fedcal.report.columns import COVERAGE, MIXED, like_with_like, table_columns  # noqa: F401 (re-exported)
from fedcal.status import COUNT_COLUMNS, Status

SWEEP_KEYS = ("design", "train_points")  # a table section per value (design: chamber sweeps)
POOLED = ("seed", "fleet_seed")  # averaged over: training seeds and fleet seeds together
# errors every run of a task writes: NaN in one of them means the run diverged
HEADLINE = ("rmse_mean", "rmse_worst", "mae_mean", "max_abs_worst", "accuracy_mean")
DIVERGED = Status.DIVERGED

UNITS = {
    "hpa": "hPa",
    "pa": "Pa",
    "kpa": "kPa",
    "c": "°C",
    "degc": "°C",
    "k": "K",
    "percent": "%",
    "pct": "%",
    "ppm": "ppm",
    "ppb": "ppb",
    "ugm3": "µg/m³",
    "mm": "mm",
}  # a column name's suffix → its unit


def target_unit(column: str, declared: str = "") -> str:
    """The target's unit as printed: the one the user declared (``[data] target_unit``,
    ``--unit``), else the one the column's name states in brackets (``pressure [hPa]``,
    ``pm25 (µg/m³)``), else a known unit suffix (``pressure_hpa`` → hPa), else '': a suffix
    that names no unit (``pm25_ref``) is not printed as one ("errors in ref", issue 37.2)."""
    if declared:
        return declared
    bracketed = re.search(r"[\[(]\s*([^\[\]()]{1,32}?)\s*[\])]\s*$", column)
    if bracketed and not re.fullmatch(r"[\d\s.,+-]*", bracketed.group(1)):  # "x(1)": an index
        return bracketed.group(1)
    suffix = column.rsplit("_", 1)[-1].lower() if "_" in column else ""
    return UNITS.get(suffix, "")


def _nan_mean(values: pd.Series) -> float:
    return float(np.mean(values.to_numpy(float)))  # NaN if any seed is NaN


def _nan_std(values: pd.Series) -> float:
    return float(np.std(values.to_numpy(float)))  # over seeds, ddof = 0


def aggregate(summary: pd.DataFrame) -> pd.DataFrame:
    """Mean and std over seeds per ([design,] train_points, method), methods in given order.

    With a fleet-seed sweep the mean and std are over training seeds and fleet
    seeds together.

    A NaN value makes its own cell's mean NaN (shown as diverged), never
    skipped; a column only some methods write (e.g. ``weak_directions``)
    affects only that column. Non-numeric columns (e.g. ``status``) are not
    averaged; a seed whose ``status`` is not ``ok`` counts as NaN in every
    error metric. ``diverged_seeds`` counts seeds with such a status or a NaN
    headline error (:data:`HEADLINE`).
    """
    summary = summary.copy()
    keys = [k for k in SWEEP_KEYS if k in summary.columns]
    checks = [c for c in summary.columns if c.startswith(CHECK) and c != f"{CHECK}_note"]
    metrics = [
        c
        for c in summary.columns
        if c not in ("method", *POOLED, *keys)
        and not c.startswith(CHECK)  # verdicts and notes (text; all-empty reads as NaN)
        and pd.api.types.is_numeric_dtype(summary[c])
    ]
    headline = [c for c in HEADLINE if c in summary.columns]
    bad = summary[headline].isna().any(axis=1)
    if "status" in summary.columns:
        bad |= summary["status"].fillna(DIVERGED).astype(str) != "ok"
    # cost columns and sensor counts stay meaningful for a diverged run; error metrics do not
    counts = ("sensors", "excluded", "rejected", "failed", *STATUS_COUNTS)
    tallies = ("wall_s", "bytes_", "unscored", "common_sensors", "sensors_", "excluded_")
    errors = [c for c in metrics if not c.startswith(tallies) and c not in counts]
    # The means over every sensor are not masked: they count each sensor with a finite error
    # whatever its status, and the ones without (diverged, refused) as unscored apart —
    # a run whose sensors are all excluded still shows them (issue 34.4).
    errors = [c for c in errors if "_mean_all" not in c]
    summary[errors] = summary[errors].astype(float).mask(bad, np.nan)
    summary["diverged_seeds"] = bad.astype(int)
    order = {m: i for i, m in enumerate(pd.unique(summary["method"]))}
    grouped = summary.groupby([*keys, "method"], sort=False)
    parts = [
        grouped[metrics].agg(_nan_mean),
        grouped[metrics].agg(_nan_std).add_suffix("_std"),
        grouped["diverged_seeds"].sum(),
    ]
    if checks:  # coverage checks: the most severe run's verdict, and how many runs had it
        parts += [grouped[checks].agg(_worst_check), grouped[checks].agg(_check_runs)]
        parts[-1] = parts[-1].add_suffix("_runs")
    table = pd.concat(parts, axis=1).reset_index()
    table["seeds"] = grouped.size().to_numpy()
    table["_order"] = table["method"].map(order)
    return table.sort_values([*keys, "_order"]).drop(columns="_order").reset_index(drop=True)


CHECK = "coverage_check"  # summary.csv: the stated intervals judged on the test rows
CHECK_MARK = {"under": "!", "low": "?", "over": "^", "high": "~"}  # on the coverage cell
CHECK_SIDE = {
    "under": "below 95 % beyond chance",
    "low": "below the 93–97 % band (beyond its test points' noise, within chance over units)",
    "over": "above 99 % beyond chance",
    "high": "above the 93–97 % band (beyond its test points' noise, within chance over units)",
}
CHECK_LEGEND = (
    "!/^: the stated 95 % intervals covered below 95 % / above 99 % beyond chance over the "
    "units; ?/~: below 93 % / above 97 % beyond the noise of their test points "
    "(coverage_check_note in summary.csv)"
)


def _worst_check(values: pd.Series) -> str:
    """The most severe coverage check over a method's runs (``core.coverage.SEVERITY``), ""
    (not judged; read back from CSV as NaN)."""
    seen = {v for v in values if isinstance(v, str)}
    return next((v for v in SEVERITY if v in seen), "")


def _check_runs(values: pd.Series) -> int:
    """How many runs have the verdict :func:`_worst_check` shows."""
    worst = _worst_check(values)
    return int(sum(v == worst for v in values if isinstance(v, str))) if worst else 0


def _check_column(column: str) -> str:
    """The coverage check behind a coverage cell ("" for none): the fleet's, or a role's."""
    if column in ("coverage95", "coverage95_mean"):
        return CHECK
    if column.startswith("coverage95_mean_"):
        return f"{CHECK}_{column.removeprefix('coverage95_mean_')}"
    return ""


def check_notes(table: pd.DataFrame, console: bool = False) -> list[str]:
    """One line per method (and role) whose stated intervals a run judged off (beyond chance,
    or outside the 93–97 % band), then the markers' legend; empty when none. ``console``:
    only the verdicts beyond chance over the units (the user must act), and the legend of
    the marks shown (issue 37.2)."""
    lines, marked = [], False
    runs = [c for c in table.columns if c.startswith(CHECK) and c.endswith("_runs")]
    for _, row in table.iterrows():
        for column in runs:
            check = column.removesuffix("_runs")
            verdict = row.get(check, "")
            if verdict not in CHECK_MARK:
                continue
            role = check.removeprefix(CHECK).strip("_")
            if role == "" and len(runs) > 1:
                continue  # a mixed fleet's overall verdict: its roles' lines say it
            marked = True
            if console and verdict not in ("under", "over"):
                continue  # within chance over the units: the mark and the file say it
            parts = [f"{row['train_points']} pts"] if row.get("train_points") else []
            parts += [f"{role} units"] if role else []
            where = f" ({', '.join(parts)})" if parts else ""
            lines.append(
                f"{row['method']}{where}: stated 95 % intervals covered {CHECK_SIDE[verdict]} "
                f"in {int(row[column])} of {int(row['seeds'])} run(s) "
                f"({CHECK_MARK[verdict]}; coverage_check_note in summary.csv)"
            )
    return [*lines, CHECK_LEGEND] if marked else []


def sections_of(table: pd.DataFrame):
    """(title, rows) per ([design,] train_points) of an ``aggregate`` table, in its order."""
    keys = [k for k in SWEEP_KEYS if k in table.columns]
    for values, part in table.groupby(keys, sort=False):
        named = dict(zip(keys, values, strict=True))
        tp = named["train_points"]
        # "all" is not said: a mixed fleet's new units have their few points whatever it is
        parts = [f"design {named['design']}"] if "design" in named else []
        parts += [f"calibration points per sensor: {tp}"] if tp else []
        yield ", ".join(parts), part


def fmt_num(value: float, digits: int = 3, keep_zeros: bool = False) -> str:
    """A short number: ``digits`` significant digits, no exponent between 1e-3 and 1e5;
    ``keep_zeros``: trailing zeros kept, so numbers compare digit for digit (0.100 vs 3.10,
    issue 37.2), else stripped (counts, costs)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return DIVERGED
    v = float(value)
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if v == 0:
        return "0"
    if 1e-3 <= abs(v) < 1e5:
        magnitude = math.floor(math.log10(abs(v)))
        decimals = max(digits - 1 - magnitude, 0)
        text = f"{v:.{decimals}f}"
        if keep_zeros:
            return text
        return text.rstrip("0").rstrip(".") if "." in text else text
    return f"{v:.{digits - 1}e}".replace("e+0", "e").replace("e-0", "e-").replace("e+", "e")


def fmt_pm(mean: float, std: float, digits: int = 3, keep_zeros: bool = False) -> str:
    """``mean ±std`` (std to 2 digits); ``diverged`` for a NaN mean; the mean alone without std."""
    if mean is None or math.isnan(float(mean)):
        return DIVERGED
    if std is None or math.isnan(float(std)):
        return fmt_num(mean, digits, keep_zeros)
    if abs(float(std)) <= 1e-9 * abs(float(mean)):
        std = 0.0  # float noise of identical seeds (a closed-form method), not a spread
    return f"{fmt_num(mean, digits, keep_zeros)} ±{fmt_num(std, 2)}"


NO_INTERVAL = "–"  # a method without a predictive σ has no coverage (not a divergence)

# shown as the mean alone: %FS is RMSE / full scale (its spread is RMSE's), costs vary little
MEAN_ONLY = (
    "rmse_mean_pct_fs",
    "max_abs_worst_pct_fs",
    "wall_s",
    "diverged",
    "excluded",
    "coverage95_mean",
    "coverage95_worst",
)
DECLINED = "—"  # a coverage the method does not state (no interval), not a failure
NONE_OK = "n/a"  # every sensor of the run excluded: no number to show ("excl." says so)
# the summary's count column per status other than ok, and the status it counts
STATUS_COUNTS = {column: str(status) for status, column in COUNT_COLUMNS.items()}


# terminal cells shown as the mean alone (worst values, the new units' mean): room at 100 columns
SHORT = ("rmse_worst", "max_abs_worst", "rmse_worst_new", "rmse_mean_new")


def cell(row: pd.Series, column: str, short: bool = False) -> str:
    """One table cell: mean ±std (mean only for %FS, coverage, counts and costs, and with
    ``short`` — the terminal — for worst values), bytes in kB; NaN is ``diverged``,
    ``n/a`` when no sensor was ok, ``—`` for a coverage the method does not state."""
    check = _check_column(column)
    roles = [k for k in row.index if str(k).startswith(f"{CHECK}_") and k != f"{CHECK}_note"]
    if check == CHECK and any(not str(k).endswith("_runs") for k in roles):
        check = ""  # a mixed fleet's verdicts are per role: the all-unit mean is not judged
    mark = CHECK_MARK.get(str(row.get(check, "")), "")
    if column == COVERAGE:
        mean, worst = row["coverage95_mean"], row.get("coverage95_worst", float("nan"))
        if mean != mean:
            return DECLINED
        low = fmt_num(worst, 2, keep_zeros=True) if worst == worst else DECLINED
        return f"{fmt_num(mean, 2, keep_zeros=True)}{mark}/{low}"
    if mark and not pd.isna(row[column]):  # a coverage judged off: its mean marked
        mean, gap, std = cell(row.drop(check), column, short).partition(" ")
        return f"{mean}{mark}{gap}{std}"
    mean, std = row[column], row.get(f"{column}_std", float("nan"))
    if column.startswith("coverage95") and pd.isna(mean) and not row.get("diverged_seeds", 0):
        return NO_INTERVAL
    if column.startswith("bytes_"):
        return fmt_num(mean / 1e3)
    missing = mean is None or (isinstance(mean, float) and math.isnan(mean))
    if missing and column.startswith("coverage95"):
        return DECLINED
    if missing and column not in ("wall_s", "excluded") and _none_ok(row, column):
        return NONE_OK
    # errors keep their trailing zeros (0.100 vs 3.10); counts and costs do not
    zeros = not column.startswith(("bytes_", "wall_s", "excluded", "diverged", "common_sens"))
    one_run = row.get("seeds", 2) == 1  # one seed: no spread to state (never "±0")
    if column in MEAN_ONLY or (short and column in SHORT) or one_run:
        text = fmt_num(mean, keep_zeros=zeros)
    else:
        text = fmt_pm(mean, std, keep_zeros=zeros)
    if "_mean_all" in column:  # over every sensor: those with no error are counted apart
        unscored = row.get(f"unscored{column.partition('_mean_all')[2]}", 0)
        text += f" +{fmt_num(unscored)} unscored" if unscored and unscored > 0 else ""
    return text


def _none_ok(row: pd.Series, column: str = "") -> bool:
    """Every sensor of the row's runs was excluded (its summary counts say so); for a role's
    column (``rmse_mean_new``), every sensor of that role."""
    # The role's whole name (a role column's value may hold "_"): the longest that ends it.
    roles = [str(k)[len("sensors_") :] for k in row.index if str(k).startswith("sensors_")]
    ends = [r for r in roles if r and column.endswith(f"_{r}") and column != f"sensors_{r}"]
    role = max(ends, key=len) if ends else ""
    if role and f"excluded_{role}" in row.index:
        sensors, excluded = row[f"sensors_{role}"], row[f"excluded_{role}"]
        if sensors == sensors and excluded == excluded and sensors > 0 and excluded >= sensors:
            return True
    sensors, excluded = row.get("sensors", float("nan")), row.get("excluded", float("nan"))
    return bool(sensors == sensors and excluded == excluded and sensors > 0 and excluded >= sensors)


def excluded_note(table: pd.DataFrame) -> list[str]:
    """One line per method with excluded sensors: how many per status (mean over seeds)."""
    lines = []
    present = {c: name for c, name in STATUS_COUNTS.items() if c in table.columns}
    if not present or "excluded" not in table.columns:
        return lines
    for _, row in table.iterrows():
        if not row.get("excluded", 0) > 0:
            continue
        parts = [f"{fmt_num(row[c])} {name}" for c, name in present.items() if row[c] > 0]
        where = f" ({row['train_points']} pts)" if row.get("train_points") else ""
        total = fmt_num(row.get("sensors", float("nan")))
        lines.append(
            f"{row['method']}{where}: {fmt_num(row['excluded'])} of {total} sensors "
            f"excluded from the means: {', '.join(parts)}"
        )
    return lines


def rich_tables(table: pd.DataFrame, columns: list[tuple[str, str]], unit: str = "") -> list[Table]:
    """One rich table per point budget; nothing is cut: a narrow terminal wraps cells."""
    out = []
    for title, part in sections_of(table):
        spread = bool((part.get("seeds", pd.Series([1])) > 1).any())
        said = [title] if title else []
        if unit:
            said.append(f"errors on held-out points in {unit}" + ", mean ±std over runs" * spread)
        t = Table(title="; ".join(said) or None, title_justify="left", pad_edge=False)
        rows = [
            [str(row["method"])]
            + (
                ["failed"] * len(columns)  # every seed raised: no numbers to show
                if row.get("failed", 0) >= 1
                else [cell(row, c, short=True) for c, _ in columns]
            )
            for _, row in part.iterrows()
        ]

        heads = ["method", *(h for _, h in columns)]

        def widest_word(j: int, cells=(*rows, heads)) -> int:  # wrap at spaces, never in a word
            return max(len(w) for r in cells for w in r[j].split() or [""])

        # a narrow terminal wraps "12.9 ±0.3" after the mean; nothing is cut to "…"
        t.add_column("method", no_wrap=True, min_width=widest_word(0))
        for j, (_, header) in enumerate(columns, 1):
            # two-line headers ("RMSE" over "mean"): the numbers, not the words, set the width
            two_lines = "\n".join(header.rsplit(" ", 1))
            t.add_column(two_lines, justify="right", min_width=widest_word(j), overflow="fold")
        for r in rows:
            t.add_row(*r)
        captions = []
        if any(c.endswith(("_new", "_reference")) for c, _ in columns):  # the mixed-fleet legend
            captions.append(
                "new: units calibrated with few points; ref: reference units; "
                f"cov95: share of held-out points inside the 95 % interval ({NO_INTERVAL}: no σ)"
            )
        captions += like_legend(part, columns)
        captions += check_notes(part, console=True)  # beyond chance, and the marks
        if captions:
            t.caption = "\n".join(captions)
            t.caption_justify = "left"
        out.append(t)
    return out


def like_legend(part: pd.DataFrame, columns: list[tuple[str, str]]) -> list[str]:
    """One line saying what "RMSE ok / common / all" average over, when shown."""
    shown = {c for c, _ in columns}
    if not any("_mean_common" in c or "_mean_all" in c for c in shown):
        return []
    said = ["ok: each method's own ok sensors"]
    common = [c for c in part.columns if c.startswith("common_sensors") and c in part]
    if any("_mean_common" in c for c in shown) and common:
        n = part[sorted(common, key=len)[0]]
        many = fmt_num(n.min()) if n.min() == n.max() else f"{fmt_num(n.min())}–{fmt_num(n.max())}"
        said.append(f"common: the {many} sensors every method has ok")
    if any("_mean_all" in c for c in shown):
        said.append("all: every sensor with an error, whatever its status (unscored: none)")
    return ["RMSE " + "; ".join(said)]


def to_markdown(table: pd.DataFrame, columns: list[tuple[str, str]]) -> str:
    """A Markdown table of ``aggregate`` output: method, then ``(column, header)`` as mean ± std."""
    lines = []
    sections = list(sections_of(table))
    for title, part in sections:
        if len(sections) > 1:
            lines.append(f"\n{title}\n")
        lines.append("| method | " + " | ".join(h.replace("|", "\\|") for _, h in columns) + " |")
        lines.append("|---|" + "---:|" * len(columns))
        for _, row in part.iterrows():
            if row.get("failed", 0) >= 1:  # every seed raised: no numbers, and no "diverged"
                cells = ["failed"] * len(columns)
            else:
                cells = [cell(row, c) for c, _ in columns]
            lines.append(f"| {row['method']} | " + " | ".join(cells) + " |")
        notes = excluded_note(part)  # which statuses the "excl." column counts
        if notes:
            lines += ["", *(f"not ok: {line}  " for line in notes)]
        checks = check_notes(part)  # coverages judged off, and the marks
        if checks:
            lines += ["", *(f"{line}  " for line in checks)]
    return "\n".join(lines)
