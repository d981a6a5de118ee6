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
from pathlib import Path

import numpy as np
import pandas as pd

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
    status = part["status"].fillna("diverged").astype(str)
    out: dict[str, dict[str, str]] = {}
    for method, client, value in zip(part["method"], part["client"], status, strict=True):
        out.setdefault(str(method), {})[str(client)] = value
    return out


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
    if (Path(run_dir) / "units.csv").exists():
        from fedcal.report.html_calibration import build_calibration_report

        return build_calibration_report(run_dir, out, certificates)
    run = RunDir.open(run_dir)
    cfg = run.config
    out = Path(out)
    report = Report(out)
    table = aggregate(run.summary)
    unit = target_unit(cfg.data.target)
    regression = "rmse_mean" in table.columns
    budget = 0 if 0 in run.budgets else max(run.budgets)
    seed = int(run.summary["seed"].min()) if seed is None else seed
    ranked = _ranked(table, budget)
    if "rmse_mean_new" in table.columns:  # a mixed fleet: the new units' result ranks
        part = table[table["train_points"] == budget].sort_values(
            "rmse_mean_new", na_position="last", kind="stable"
        )
        ranked = list(pd.unique(part["method"]))
    sections: list[tuple[str, str, str]] = []  # (id, title, body)

    def figure(section: str, title: str, fig, caption: str) -> None:
        report.figures.append(section)
        body = f'<figure><img alt="{html.escape(title)}" src="data:image/png;base64,{png(fig)}">'
        sections.append((section, title, body + f"<figcaption>{caption}</figcaption></figure>"))

    def note(section: str, title: str, why: str) -> None:
        report.notes[section] = why
        sections.append((section, title, f'<p class="note">Not shown: {html.escape(why)}</p>'))

    budget_text = "all calibration points" if budget == 0 else f"{budget} calibration points"
    metrics = run.metrics(budget)
    metrics = metrics if regression else pd.DataFrame()
    _round_figure(metrics, ranked, unit, budget_text, figure, note)

    per_sensor = run.per_sensor(budget, mask=False)  # every status, marked in the figure
    if regression and not per_sensor.empty:
        figure(
            "per-sensor",
            "Per-sensor RMSE by method",
            figures.per_sensor_rmse(per_sensor, ranked, unit),
            f"Each sensor's test RMSE ({budget_text}), mean over seeds; best method first. "
            "Boxes: the ok sensors; sensors of another status (weak, unconverged, rejected) "
            "are drawn with their own marker (legend) and left out of the means; diverged "
            "and refused sensors are named.",
        )
        shown = ranked[: figures_units.MAX_UNIT_METHODS]
        figure(
            "unit-errors",
            "Each unit's error and its stated σ",
            figures_units.unit_error_and_sigma(per_sensor, shown, unit),
            f"Per unit ({budget_text}, mean over seeds), new and reference units apart: the "
            "test RMSE against the reference (dot) and, for a method that states one, the σ it "
            "states averaged over the unit's test points (dash). Where σ is right the dot sits "
            "on the dash; the stated 95 % interval is ±1.96σ (each unit's coverage: its "
            f"section under Units). Methods: the {len(shown)} best.",
        )
    else:
        note("per-sensor", "Per-sensor RMSE by method", "the run has no per-sensor test RMSE")
    _prior_figure(run, ranked, budget, seed, unit, figure, note)

    detail = ranked[:MAX_DETAIL_METHODS]
    res: dict[str, pd.DataFrame] = {}
    fleet = None
    if regression:
        try:
            fleet = run.fleet()
            res = {m: residuals(run, fleet, m, budget, seed) for m in detail}
        except (FileNotFoundError, ValueError, KeyError) as err:
            why = f"the run's models or data could not be read back ({err})"
            for section, title in (
                ("residuals", "Residuals by temperature plateau"),
                ("error-map", "Error over the (P, T) plane"),
            ):
                note(section, title, why)
    else:
        for section, title in (
            ("residuals", "Residuals by temperature plateau"),
            ("error-map", "Error over the (P, T) plane"),
        ):
            note(section, title, "residuals apply to regression runs")
    temperature = temperature_column(fleet) if fleet is not None else None
    if res:
        figure(
            "residuals",
            "Residuals by temperature plateau",
            figures.residuals_by_plateau(
                res, fleet.target, temperature, unit, _statuses(per_sensor, seed)
            ),
            f"Predicted − reference on the held-out points, seed {seed}, {budget_text}; one line "
            "per temperature plateau (off-grid points: dots per temperature bin); left the "
            "method's best sensor, right its worst "
            "(a status other than ok in its title). "
            f"Methods: the {len(detail)} best.",
        )
        if temperature:
            figure(
                "error-map",
                "Error over the (P, T) plane",
                figures.error_map(res, fleet.target, temperature, unit),
                f"RMS over sensors of the held-out residual per cell, seed {seed}, "
                f"{budget_text}; log colour scale, one scale per method.",
            )
        else:
            note("error-map", "Error over the (P, T) plane", "the inputs have no temperature")

    if regression and len(run.budgets) > 1:
        counts = {tp: tp for tp in run.budgets}
        if 0 in counts:
            full = int(max(len(x) for x, _ in fleet.arrays("train"))) if fleet else None
            counts[0] = full or max(run.budgets) * 2
        figure(
            "sweep",
            "Calibration-point sweep",
            figures.point_sweep(table, _ranked(table, min(run.budgets)), counts, unit),
            "Fleet-mean test RMSE against calibration points per sensor, mean ± std over seeds.",
        )
    else:
        note("sweep", "Calibration-point sweep", "the run has a single calibration-point budget")

    with_std = {m: r for m, r in res.items() if np.isfinite(r["std"]).any()}
    if with_std:
        fig, coverage = figures.uncertainty_bands(with_std, fleet.target, temperature, unit)
        cover = ", ".join(f"{m} {c:.1%}" for m, c in coverage.items())
        figure(
            "uncertainty",
            "Predictive uncertainty",
            fig,
            "Left: the method's 2σ predictive band of its median sensor per temperature "
            "plateau, with that sensor's |residual|. Right: residual / σ of every held-out "
            f"point; share within ±1.96σ (95 % interval), all sensors: {cover}.",
        )
    else:
        note(
            "uncertainty",
            "Predictive uncertainty",
            "no shown method gives a predictive distribution (predictive_std)",
        )

    config_html = config_tables(run.raw_config, run.methods)
    title = "Configuration (config.json; this run's methods in bold)"
    sections.append(("config", title, config_html))
    means = figures_units.unit_means(per_sensor) if not per_sensor.empty else pd.DataFrame()
    if not means.empty:
        status = figures.sensor_points(per_sensor, ranked)[["method", "client", "status"]]
        means = means.merge(status, on=["method", "client"], how="left")
        rows = run_unit_rows(means, ranked, unit)
        links = certificate_links(list(rows), certificates, out)
        sections.append(("units", "Units", _units_intro(links) + unit_sections(rows, links)))
    best = ranked[0] if ranked else "—"
    summary_csv = html.escape(_relative(run.path / "summary.csv", out))
    head = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>fedcal report: {html.escape(str(run.path))}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>fedcal report: {html.escape(str(run.path))}</h1>",
        f"<p>{len(run.methods)} methods × {run.summary['seed'].nunique()} seeds; "
        f"target {html.escape(cfg.data.target)}, inputs {html.escape(', '.join(cfg.data.features))}"
        f"; errors on held-out points. {_best_text(table, budget, budget_text, best)}</p>",
        '<section id="summary"><h2>Summary</h2>',
        role_summary(table, unit),
        "<details><summary>Every column (mean ±std over runs; also "
        f'<a href="{summary_csv}">summary.csv</a>, one row per run)</summary><div class="wide">',
        summary_html(table, unit),
        "</div></details></section>",
    ]
    write_page(out, head, sections)
    return report


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
        why = "every method has one evaluated round (closed form, or [engine] eval_every ≥ rounds)"
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
        path = run.run_path(method, budget, seed) / "prior.json"
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
