"""One self-contained HTML report of a run directory (``fedcal report RUN --html FILE``).

Figures are matplotlib PNGs embedded as base64 ``data:`` URIs and the page has
no script, stylesheet or font from elsewhere, so the file opens offline and can
be mailed as is. Sections (each a ``<section id=…>``; a section whose figure
does not apply says why instead):

``summary``      per point budget, one table per role (new units, reference units;
                 else all units) with the columns that fit 1280 px, and the cost;
                 every column in a collapsed table (and summary.csv); every cell
                 carries its exact value in ``data-value``/``data-std`` (summary.csv's);
``rounds``       error against round of the iterative methods: median and worst sensor;
``per-sensor``   per-sensor test RMSE by method;
``unit-errors``  each unit's test RMSE beside the σ it states, per role;
``prior``        the fleet prior's spread across units (a method with prior.json);
``residuals``    residual against reference, one line per temperature plateau,
                 best and worst sensor of each shown method;
``error-map``    RMS residual over the (reference, temperature) plane;
``sweep``        calibration-point sweep (runs with several budgets);
``uncertainty``  ±2σ predictive bands (methods with ``predictive_std``);
``config``       the resolved configuration (config.json), a table per section;
``units``        one collapsible section per unit (``id="unit-<id>"``): every
                 method's error, σ, coverage and status, and a link to the unit's
                 certificate where ``fedcal certificate`` wrote one
                 (:mod:`fedcal.report.html_parts`).

The output of ``fedcal calibrate`` (new units against a stored fleet prior;
it has ``units.csv``) gets a calibration report per unit instead
(:func:`build_calibration_report`).
"""

from __future__ import annotations

import html
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from fedcal.core import runnames
from fedcal.core.paths import read_json
from fedcal.report import figures, figures_units
from fedcal.report.html_page import STYLE, Report, png, write_page
from fedcal.report.html_parts import (
    certificate_links,
    config_tables,
    role_summary,
    run_unit_rows,
    unit_sections,
)
from fedcal.report.rundir import RunDir, residuals, temperature_column
from fedcal.report.tables import (
    aggregate,
    cell,
    check_notes,
    excluded_note,
    sections_of,
    table_columns,
    target_unit,
)
from fedcal.status import Status

MAX_DETAIL_METHODS = 6  # residual and map panels: the best methods, one row each
MAX_ROUND_METHODS = 10  # lines in the error-against-round figure


def _ranked(table: pd.DataFrame, budget: int) -> list[str]:
    """Methods at one budget, lowest fleet-mean error first, diverged last."""
    part = table[table["train_points"] == budget]
    if "rmse_mean" in part.columns:
        part = part.sort_values("rmse_mean", na_position="last", kind="stable")
    return list(pd.unique(part["method"]))  # once each, also with a design sweep


def summary_html(table: pd.DataFrame, unit: str) -> str:
    """The summary table; each number's cell carries the exact mean and std it shows."""
    columns = table_columns(table, unit, show_bytes="bytes_up_per_round" in table, full=True)
    out = []
    for title, part in sections_of(table):
        tp = int(part["train_points"].iloc[0])
        design = ""
        if "design" in part:
            design = f' data-design="{html.escape(str(part["design"].iloc[0]))}"'
        out.append(f"<h3>{html.escape(title)}</h3>")
        out.append(f'<table class="summary" data-train-points="{tp}"{design}><tr><th>method</th>')
        out += [f"<th>{html.escape(h)}</th>" for _, h in columns]
        out.append("<th>seeds</th></tr>")
        for _, row in part.iterrows():
            out.append(f'<tr><td class="method">{html.escape(str(row["method"]))}</td>')
            for c, _ in columns:
                mean, std = float(row[c]), float(row.get(f"{c}_std", math.nan))
                text = cell(row, c)
                # NaN: diverged, or no ok sensor ("n/a"), or a coverage not stated ("—")
                klass = "num diverged" if text == "diverged" else "num"
                out.append(
                    f'<td class="{klass}" data-column="{c}" data-value="{mean!r}" '
                    f'data-std="{std!r}">{html.escape(text)}</td>'
                )
            bad = int(row.get("diverged_seeds", 0))
            seeds = f"{int(row['seeds'])}" + (f" ({bad} diverged)" if bad else "")
            out.append(f'<td class="num">{seeds}</td></tr>')
        out.append("</table>")
        # which statuses the "excl." column counts: sensors left out of the means
        out += [f'<p class="note">{html.escape(line)}</p>' for line in excluded_note(part)]
        out += [f'<p class="note">{html.escape(line)}</p>' for line in check_notes(part)]
    return "\n".join(out)


def _statuses(per_sensor: pd.DataFrame, seed: int) -> dict[str, dict[str, str]]:
    """{method: {sensor: status}} of one seed (per_sensor.csv); empty without statuses."""
    if per_sensor.empty or "status" not in per_sensor.columns:
        return {}
    part = per_sensor[per_sensor["seed"] == seed]
    status = part["status"].fillna(Status.DIVERGED).astype(str)
    out: dict[str, dict[str, str]] = {}
    for method, client, value in zip(part["method"], part["client"], status, strict=True):
        out.setdefault(str(method), {})[str(client)] = value
    return out


@dataclass
class _Page:
    """What the run report's steps share: the run, its table at the shown budget, the
    methods ranked, and the sections written so far (id, title, HTML)."""

    run: RunDir
    out: Path
    report: Report
    table: pd.DataFrame
    unit: str
    budget: int
    seed: int
    ranked: list[str]
    sections: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def regression(self) -> bool:
        return "rmse_mean" in self.table.columns

    @property
    def budget_text(self) -> str:
        return "all calibration points" if self.budget == 0 else f"{self.budget} calibration points"

    def figure(self, section: str, title: str, fig, caption: str) -> None:
        self.report.figures.append(section)
        body = f'<figure><img alt="{html.escape(title)}" src="data:image/png;base64,{png(fig)}">'
        self.sections.append(
            (section, title, body + f"<figcaption>{caption}</figcaption></figure>")
        )

    def note(self, section: str, title: str, why: str) -> None:
        self.report.notes[section] = why
        self.sections.append((section, title, f'<p class="note">Not shown: {html.escape(why)}</p>'))


def build_report(
    run_dir: str | Path,
    out: str | Path,
    seed: int | None = None,
    certificates: str | Path | None = None,
) -> Report:
    """Write the HTML report of ``run_dir`` to ``out`` (atomically) and say what it holds.

    ``certificates``: the folder ``fedcal certificate`` wrote (``<unit>.html``/``.pdf``),
    linked from each unit's section; default: ``certificates/`` beside the report ``out``
    (``fedcal certificate`` refuses to write into the run folder it reads)."""
    certificates = Path(certificates) if certificates else Path(out).parent / "certificates"
    if (Path(run_dir) / runnames.UNITS).exists():
        from fedcal.report.html_calibration import build_calibration_report

        return build_calibration_report(run_dir, out, certificates)
    page = _open(run_dir, Path(out), seed)
    metrics = page.run.metrics(page.budget) if page.regression else pd.DataFrame()
    _round_figure(metrics, page.ranked, page.unit, page.budget_text, page.figure, page.note)
    per_sensor = page.run.per_sensor(page.budget, mask=False)  # every status, marked
    _sensor_figures(page, per_sensor)
    _prior_figure(page.run, page.ranked, page.budget, page.seed, page.unit, page.figure, page.note)
    res, fleet, temperature = _residual_figures(page, per_sensor)
    _sweep_figure(page, fleet)
    _uncertainty_figure(page, res, fleet, temperature)
    title = "Configuration (config.json; this run's methods in bold)"
    page.sections.append(("config", title, config_tables(page.run.raw_config, page.run.methods)))
    _units_section(page, per_sensor, certificates)
    write_page(page.out, _head(page), page.sections)
    return page.report


def _open(run_dir: str | Path, out: Path, seed: int | None) -> _Page:
    """The run, its table and the shown budget and seed; methods ranked by the fleet-mean
    RMSE, or in a mixed fleet by the new units' (the result a reader looks for)."""
    run = RunDir.open(run_dir)
    table = aggregate(run.summary)
    budget = 0 if 0 in run.budgets else max(run.budgets)
    ranked = _ranked(table, budget)
    if "rmse_mean_new" in table.columns:
        part = table[table["train_points"] == budget].sort_values(
            "rmse_mean_new", na_position="last", kind="stable"
        )
        ranked = list(pd.unique(part["method"]))
    seed = int(run.summary["seed"].min()) if seed is None else seed
    unit = target_unit(run.config.data.target, run.config.data.target_unit)
    return _Page(run, out, Report(out), table, unit, budget, seed, ranked)


def _sensor_figures(page: _Page, per_sensor: pd.DataFrame) -> None:
    """Per-sensor RMSE by method, and each unit's error beside its stated σ."""
    if not page.regression or per_sensor.empty:
        page.note("per-sensor", "Per-sensor RMSE by method", "the run has no per-sensor test RMSE")
        return
    page.figure(
        "per-sensor",
        "Per-sensor RMSE by method",
        figures.per_sensor_rmse(per_sensor, page.ranked, page.unit),
        f"Each sensor's test RMSE ({page.budget_text}), mean over seeds; best method first "
        "(a mixed fleet: its new and reference units apart). "
        "Boxes: the ok sensors; sensors of another status (weak, unconverged, rejected) "
        "are drawn with their own marker (legend) and left out of the means; diverged "
        "and refused sensors are named.",
    )
    shown = page.ranked[: figures_units.MAX_UNIT_METHODS]
    page.figure(
        "unit-errors",
        "Each unit's error and its stated σ",
        figures_units.unit_error_and_sigma(per_sensor, shown, page.unit),
        f"Per unit ({page.budget_text}, mean over seeds), new and reference units apart: the "
        "test RMSE against the reference (dot) and, for a method that states one, the σ it "
        "states averaged over the unit's test points (dash). Where σ is right the dot sits "
        "on the dash; the stated 95 % interval is ±1.96σ (each unit's coverage: its "
        f"section under Units). Methods: the {len(shown)} best.",
    )


RESIDUAL_SECTIONS = (
    ("residuals", "Residuals by temperature plateau"),
    ("error-map", "Error over the (P, T) plane"),
)


def _residual_figures(page: _Page, per_sensor: pd.DataFrame):
    """Residuals by plateau and the error map of the best methods; returns (residuals by
    method, the fleet, its temperature column) for the figures that follow."""
    detail = page.ranked[:MAX_DETAIL_METHODS]
    res: dict[str, pd.DataFrame] = {}
    fleet, why = None, "residuals apply to regression runs"
    if page.regression:
        try:
            fleet = page.run.fleet()
            res = {m: residuals(page.run, fleet, m, page.budget, page.seed) for m in detail}
        except (FileNotFoundError, ValueError, KeyError) as err:
            why = f"the run's models or data could not be read back ({err})"
    if not res:
        for section, title in RESIDUAL_SECTIONS:
            page.note(section, title, why)
        return res, fleet, None
    temperature = temperature_column(fleet)
    page.figure(
        "residuals",
        "Residuals by temperature plateau",
        figures.residuals_by_plateau(
            res, fleet.target, temperature, page.unit, _statuses(per_sensor, page.seed)
        ),
        f"Predicted − reference on the held-out points, seed {page.seed}, {page.budget_text}; "
        "one line per temperature plateau (off-grid points: dots per temperature bin); left "
        "the method's best sensor, right its worst (a status other than ok in its title). "
        f"Methods: the {len(detail)} best.",
    )
    if temperature:
        page.figure(
            "error-map",
            "Error over the (P, T) plane",
            figures.error_map(res, fleet.target, temperature, page.unit),
            f"RMS over sensors of the held-out residual per cell, seed {page.seed}, "
            f"{page.budget_text}; log colour scale, one scale per method.",
        )
    else:
        page.note("error-map", "Error over the (P, T) plane", "the inputs have no temperature")
    return res, fleet, temperature


def _sweep_figure(page: _Page, fleet) -> None:
    """Fleet-mean RMSE against calibration points, for a run with several budgets."""
    budgets = page.run.budgets
    if not page.regression or len(budgets) < 2:
        why = "the run has a single calibration-point budget"
        page.note("sweep", "Calibration-point sweep", why)
        return
    counts = {tp: tp for tp in budgets}
    if 0 in counts:
        full = int(max(len(x) for x, _ in fleet.arrays("train"))) if fleet else None
        counts[0] = full or max(budgets) * 2
    page.figure(
        "sweep",
        "Calibration-point sweep",
        figures.point_sweep(page.table, _ranked(page.table, min(budgets)), counts, page.unit),
        "Fleet-mean test RMSE against calibration points per sensor, mean ± std over seeds.",
    )


def _uncertainty_figure(page: _Page, res: dict, fleet, temperature) -> None:
    """±2σ bands and residual / σ of the shown methods that state a σ."""
    with_std = {m: r for m, r in res.items() if np.isfinite(r["std"]).any()}
    if not with_std:
        why = "no shown method gives a predictive distribution (predictive_std)"
        page.note("uncertainty", "Predictive uncertainty", why)
        return
    fig, coverage = figures.uncertainty_bands(with_std, fleet.target, temperature, page.unit)
    cover = ", ".join(f"{m} {c:.1%}" for m, c in coverage.items())
    page.figure(
        "uncertainty",
        "Predictive uncertainty",
        fig,
        "Left: the method's 2σ predictive band of its median sensor per temperature "
        "plateau, with that sensor's |residual|. Right: residual / σ of every held-out "
        f"point; share within ±1.96σ (95 % interval), all sensors: {cover}.",
    )


def _units_section(page: _Page, per_sensor: pd.DataFrame, certificates: Path) -> None:
    """A section per unit (every method's errors, σ, status; its certificate's links)."""
    if per_sensor.empty:
        return
    means = figures_units.unit_means(per_sensor)
    status = figures.sensor_points(per_sensor, page.ranked)[["method", "client", "status"]]
    means = means.merge(status, on=["method", "client"], how="left")
    rows = run_unit_rows(means, page.ranked, page.unit)
    links = certificate_links(list(rows), certificates, page.out)
    page.sections.append(("units", "Units", _units_intro(links) + unit_sections(rows, links)))


def _head(page: _Page) -> list[str]:
    """The page's head: title, the run in one sentence, the summary by role."""
    run, cfg = page.run, page.run.config
    best = page.ranked[0] if page.ranked else "—"
    result = _best_text(page.table, page.budget, page.budget_text, best)
    summary_csv = html.escape(_relative(run.path / runnames.SUMMARY, page.out))
    return [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>fedcal report: {html.escape(str(run.path))}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>fedcal report: {html.escape(str(run.path))}</h1>",
        f"<p>{len(run.methods)} methods × {run.summary['seed'].nunique()} seeds; "
        f"target {html.escape(cfg.data.target)}, inputs {html.escape(', '.join(cfg.data.features))}"
        f"; errors on held-out points. {result}</p>",
        '<section id="summary"><h2>Summary</h2>',
        role_summary(page.table, page.unit),
        "<details><summary>Every column (mean ±std over runs; also "
        f'<a href="{summary_csv}">summary.csv</a>, one row per run)</summary><div class="wide">',
        summary_html(page.table, page.unit),
        "</div></details></section>",
    ]


def _relative(path: Path, page: Path) -> str:
    """``path`` as a link from the page ``page`` (POSIX separators)."""
    return Path(os.path.relpath(Path(path).resolve(), Path(page).resolve().parent)).as_posix()


def _best_text(table: pd.DataFrame, budget: int, budget_text: str, best: str) -> str:
    """The opening sentence's result: the lowest new-unit RMSE in a mixed fleet, else the
    lowest fleet-mean RMSE."""
    part = table[table["train_points"] == budget]
    if "rmse_mean_new" in part.columns and part["rmse_mean_new"].notna().any():
        row = part.loc[part["rmse_mean_new"].astype(float).idxmin()]
        return (
            f"Lowest new-unit RMSE ({budget_text} for the reference units): "
            f"<b>{html.escape(str(row['method']))}</b>."
        )
    return f"Lowest fleet-mean RMSE ({budget_text}): <b>{html.escape(best)}</b>."


def _units_intro(links: dict[str, str]) -> str:
    said = (
        f"{len(links)} unit(s) link their calibration certificate."
        if links
        else "No certificate found for these units (fedcal certificate RUN --out DIR, then "
        "fedcal report RUN --html FILE --certificates DIR; default DIR: certificates/ beside "
        "FILE)."
    )
    return (
        '<p class="note">Each unit: every method\'s errors on its held-out points (mean over '
        f"runs), the σ it states and its status. {said}</p>"
    )


def _round_figure(metrics, ranked, unit, budget_text, figure, note) -> None:
    """Error against round of the methods evaluated at two rounds or more (a closed-form
    method has one evaluation: a dot says nothing; its error is in the summary)."""
    if metrics.empty or "test_rmse" not in metrics:
        note("rounds", "Error against round", "the run has no per-round test RMSE (metrics.csv)")
        return
    rounds = metrics.groupby("method")["round"].nunique()
    iterative = [m for m in ranked if rounds.get(m, 0) >= 2][:MAX_ROUND_METHODS]
    single = [m for m in ranked if 0 < rounds.get(m, 0) < 2]
    if not iterative:
        why = "every method has one evaluated round (closed form, or a one-round run)"
        note("rounds", "Error against round", why)
        return
    also = f" One evaluation only (closed form, see the summary): {', '.join(single)}." * bool(
        single
    )
    figure(
        "rounds",
        "Error against round",
        figures.error_vs_round(metrics, iterative, unit),
        f"Test RMSE after each evaluated round ({budget_text}), mean over seeds of the median "
        f"and of the worst sensor. Methods: {', '.join(iterative)}.{also}",
    )


def _prior_figure(run, ranked, budget, seed, unit, figure, note) -> None:
    """The fleet prior's spread across units, from the best method with a prior.json."""
    for method in ranked:
        path = run.run_path(method, budget, seed) / runnames.PRIOR
        if path.is_file():
            prior = read_json(path, allow_nan=True)
            figure(
                "prior",
                "The fleet prior: how units differ",
                figures_units.prior_spread(prior, unit),
                f"{html.escape(method)}'s prior (seed {seed}): left, per basis term the spread "
                "across units √Σkk (bars) against the fleet mean |μk| (dots); right, the 1σ "
                "spread of a unit's calibration curve around the fleet's mean curve over the "
                "prior's input range — what a new unit's few points must resolve.",
            )
            return
    note("prior", "The fleet prior", "no shown method learns a fleet prior (prior.json)")
