"""Parts of the HTML report that fit a 1280 px page (issue 37.4): the summary split by role,
the configuration as a table, one section per unit with a link to its certificate.

Certificates: ``fedcal certificate RUN --out DIR`` writes ``DIR/<unit>.html`` and
``DIR/<unit>.pdf``; the report links a unit's files where they exist, relative to the
report's own location (so the folder can be moved as a whole), from ``certificates``
(``fedcal report --certificates DIR``) or else ``certificates/`` beside the report
(``fedcal certificate`` refuses to write into the run folder it reads). So a hand-over
folder holds ``report.html`` and ``certificates/`` and links without an option.
"""

from __future__ import annotations

import html
import json
import math
import os
from pathlib import Path
from urllib.parse import quote

import pandas as pd

from fedcal.core.paths import PathError, safe_name
from fedcal.report.tables import (
    NO_INTERVAL,
    cell,
    check_notes,
    excluded_note,
    fmt_num,
    sections_of,
)

MAX_UNIT_SECTIONS = 500  # per-unit sections; a larger fleet's rest is in per_sensor.csv

# (column stem, header) of a role's table: the numbers a reader compares, in this order
ROLE_COLUMNS = (
    ("rmse_mean", "RMSE mean"),
    ("rmse_worst", "RMSE worst unit"),
    ("max_abs_worst", "max |err| worst"),
    ("coverage95_mean", "95 % coverage mean"),
    ("coverage95_worst", "95 % coverage min"),
    ("pred_sd_mean", "stated σ mean"),
    ("excluded", "not ok"),
)
COST_COLUMNS = (("wall_s", "wall s"), ("bytes_up_per_round", "up kB/round"))
ROLE_NAMES = {
    "new": "New units (calibrated from few points)",
    "reference": "Reference units (fully calibrated)",
    "": "All units",
}


def _cells(row: pd.Series, columns: list[tuple[str, str]]) -> str:
    """The row's cells, each with its exact mean and std (summary.csv's) in data-*."""
    out = []
    for c, _ in columns:
        mean, std = float(row[c]), float(row.get(f"{c}_std", math.nan))
        text = cell(row, c)
        if c.startswith("pred_sd") and math.isnan(mean) and not row.get("diverged_seeds", 0):
            text = NO_INTERVAL  # a method without a predictive σ states none
        klass = "num diverged" if text == "diverged" else "num"
        out.append(
            f'<td class="{klass}" data-column="{c}" data-value="{mean!r}" '
            f'data-std="{std!r}">{html.escape(text)}</td>'
        )
    return "".join(out)


def _table(part: pd.DataFrame, columns: list[tuple[str, str]], klass: str, tp: int) -> str:
    heads = "".join(f"<th>{html.escape(h)}</th>" for _, h in columns)
    rows = [
        f'<tr><td class="method">{html.escape(str(row["method"]))}</td>'
        + _cells(row, columns)
        + f'<td class="num">{int(row["seeds"])}</td></tr>'
        for _, row in part.iterrows()
    ]
    return (
        f'<table class="{klass}" data-train-points="{tp}"><tr><th>method</th>{heads}'
        f"<th>runs</th></tr>{''.join(rows)}</table>"
    )


def role_summary(table: pd.DataFrame, unit: str) -> str:
    """Per point budget: one table per role (new / reference units; else all units) with the
    columns that fit 1280 px, then the cost table; the notes of excluded sensors and of
    judged coverages. Every cell carries summary.csv's mean and std (data-value, data-std)."""
    roles = [r for r in ("new", "reference") if f"rmse_mean_{r}" in table.columns] or [""]
    u = f" ({unit})" if unit else ""
    out = []
    for title, part in sections_of(table):
        tp = int(part["train_points"].iloc[0])
        out.append(f"<h3>{html.escape(title or 'Errors on held-out points')}</h3>")
        for role in roles:
            suffix = f"_{role}" if role else ""
            columns = [
                (f"{c}{suffix}", h + (u if c.startswith(("rmse", "max_abs", "pred_sd")) else ""))
                for c, h in ROLE_COLUMNS
                if f"{c}{suffix}" in part.columns
            ]
            count = part.get(f"sensors{suffix}")
            many = f", {fmt_num(float(count.max()))} units" if count is not None else ""
            out.append(f"<h4>{html.escape(ROLE_NAMES[role])}{many}</h4>")
            out.append(_table(part, columns, f"summary role-{role or 'all'}", tp))
        cost = [(c, h) for c, h in COST_COLUMNS if c in part.columns]
        out.append("<h4>Cost</h4>" + _table(part, cost, "summary cost", tp))
        out += [f'<p class="note">{html.escape(line)}</p>' for line in excluded_note(part)]
        out += [f'<p class="note">{html.escape(line)}</p>' for line in check_notes(part)]
    return "\n".join(out)


def _shown(value: object) -> str:
    """A config value as a reader reads it: lists comma-separated, no quotes on text."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, list):
        return ", ".join(_shown(v) for v in value) if value else "[]"
    if isinstance(value, dict):
        return "{}"
    return repr(value)


def _value(key: str, value: object, label: str = "") -> str:
    """One value with its dotted key and exact JSON value (data-key, data-value)."""
    exact = html.escape(json.dumps(value, sort_keys=True))
    text = html.escape(f"{label} = {_shown(value)}" if label else _shown(value))
    return f'<span data-key="{html.escape(key)}" data-value="{exact}">{text}</span>'


def _leaves(value: object, key: str, label: str = "") -> list[tuple[str, str, object]]:
    """(dotted key, label relative to the row, leaf value) of a nested dict."""
    if isinstance(value, dict) and value:
        return [
            leaf
            for k in sorted(value)
            for leaf in _leaves(value[k], f"{key}.{k}", f"{label}.{k}" if label else k)
        ]
    return [(key, label, value)]


def _row(key: str, name: str, value: object, strong: bool) -> str:
    """A table row: a plain value, or a nested table's values on one line (k = v; …)."""
    shown = "; ".join(_value(k, v, label) for k, label, v in _leaves(value, key))
    head = f"<b>{html.escape(name)}</b>" if strong else html.escape(name)
    return f"<tr><th>{head}</th><td>{shown}</td></tr>"


def _rows_of(section: dict) -> list[tuple[str, object]]:
    """A section's rows: (key, value), a table of tables (e.g. every method's settings)
    opened into one row per inner table (``methods.fedprior``)."""
    rows = []
    for key, value in sorted(section.items()):
        nested = isinstance(value, dict) and value
        if nested and all(isinstance(v, dict) and v for v in value.values()):
            rows += [(f"{key}.{k}", v) for k, v in _rows_of(value)]
        else:
            rows.append((key, value))
    return rows


def config_tables(config: dict, methods: list[str] = ()) -> str:
    """The resolved configuration (config.json) as one two-column table per section, laid
    out side by side; a nested table's values on one line. Each value carries its dotted
    key (data-key) and exact JSON value (data-value). ``methods``: the run's, in bold."""
    groups: dict[str, list[tuple[str, object]]] = {"": []}  # "": the top-level values
    for key, value in sorted(config.items()):
        if isinstance(value, dict) and value:
            groups[key] = _rows_of(value)
        else:
            groups[""].append((key, value))
    out = ['<div class="config">']
    for section, rows in groups.items():
        prefix = f"{section}." if section else ""
        body = "".join(
            _row(prefix + k, k, v, k.rpartition(".")[2] in methods and "methods" in section + k)
            for k, v in rows
        )
        caption = html.escape(section or "run folder")
        if rows:
            out.append(f'<table class="config"><caption>{caption}</caption>{body}</table>')
    out.append("</div>")
    return "".join(out)


def certificate_links(units: list[str], where: Path | None, page: Path) -> dict[str, str]:
    """{unit: HTML of its certificate links} for the units with a certificate in ``where``
    (``<unit>.html``, ``<unit>.pdf``), each href relative to the report ``page``."""
    if where is None or not Path(where).is_dir():
        return {}
    out = {}
    for unit in units:
        try:
            name = safe_name(unit, "unit id")
        except PathError:
            continue  # an id that names no file has no certificate file
        links = []
        for ext in ("html", "pdf"):
            path = Path(where) / f"{name}.{ext}"
            if path.is_file():
                rel = os.path.relpath(os.path.abspath(path), os.path.abspath(page.parent))
                href = quote(Path(rel).as_posix())
                links.append(f'<a class="certificate" href="{href}">certificate ({ext})</a>')
        if links:
            out[unit] = " · ".join(links)
    return out


def unit_sections(
    rows: dict[str, tuple[str, str]], links: dict[str, str], total: int | None = None
) -> str:
    """One collapsible section per unit, ``id="unit-<id>"``: its summary line, its
    certificate links (if any) and its detail HTML; ``rows``: {unit: (line, detail)}."""
    out = []
    for k, (unit, (line, detail)) in enumerate(list(rows.items())[:MAX_UNIT_SECTIONS]):
        cert = f'<p class="cert">{links[unit]}</p>' if unit in links else ""
        first = " open" * (k == 0)  # the first one open: the reader sees what each holds
        out.append(
            f'<details class="unit" id="unit-{html.escape(unit)}"{first}><summary>'
            f"<b>{html.escape(unit)}</b> {line}</summary>{cert}{detail}</details>"
        )
    shown = min(len(rows), MAX_UNIT_SECTIONS)
    if (total or len(rows)) > shown:
        out.append(
            f'<p class="note">{shown} of {total or len(rows)} units shown; every unit is in '
            "per_sensor.csv.</p>"
        )
    return "\n".join(out)


def run_unit_rows(means: pd.DataFrame, methods: list[str], unit: str) -> dict:
    """{unit: (summary line, table of every method)} for a ``fedcal run`` report, from
    :func:`fedcal.report.figures_units.unit_means` (mean over seeds) and its statuses."""
    u = f" {unit}" if unit else ""
    out: dict[str, tuple[str, str]] = {}
    cols = [
        ("status", "status"),
        ("test_rmse", f"test RMSE{u}"),
        ("test_max_abs", f"max |err|{u}"),
        ("test_pred_sd", f"stated σ{u}"),
        ("test_coverage95", "95 % coverage"),
        ("train_rmse", f"calibration-point RMSE{u}"),
    ]
    order = {m: i for i, m in enumerate(methods)}
    means = means[means["method"].isin(order)]
    for client, part in means.groupby("client", sort=True):
        part = part.sort_values("method", key=lambda s: s.map(order))
        role = str(part["role"].iloc[0])
        lead = part.iloc[0]
        line = f"({role}) " if role else ""
        line += html.escape(f"{lead['method']}: RMSE {fmt_num(lead['test_rmse'])}{u}")
        shown = [(c, h) for c, h in cols if c in part.columns]
        head = "".join(f"<th>{html.escape(h)}</th>" for _, h in shown)
        body = "".join(
            f'<tr><td class="method">{html.escape(str(r["method"]))}</td>'
            + "".join(
                f"<td>{html.escape(str(r[c]))}</td>"
                if c == "status"
                else f'<td class="num" data-field="{c}" data-value="{float(r[c])!r}">'
                f"{'–' if pd.isna(r[c]) else fmt_num(float(r[c]))}</td>"
                for c, _ in shown
            )
            + "</tr>"
            for _, r in part.iterrows()
        )
        table = f'<table class="unit"><tr><th>method</th>{head}</tr>{body}</table>'
        out[str(client)] = (line, table)
    roles = means.drop_duplicates("client").set_index("client")["role"].astype(str)
    first = {"new": 0, "reference": 1}  # new units first: they are what a reader checks
    return dict(sorted(out.items(), key=lambda kv: (first.get(roles.get(kv[0], ""), 2), kv[0])))
