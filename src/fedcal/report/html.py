"""One self-contained HTML report of a run directory (``fedcal report RUN --html FILE``).

Figures are matplotlib PNGs embedded as base64 ``data:`` URIs and the page has
no script, stylesheet or font from elsewhere, so the file opens offline and can
be mailed as is. Sections (each a ``<section id=…>``; a section whose figure
does not apply says why instead):

``summary``      the mean ±std table over seeds (every cell carries its exact
                 value in ``data-value``/``data-std``, equal to summary.csv's);
``rounds``       error against round per method: median and worst sensor;
``per-sensor``   per-sensor test RMSE by method;
``residuals``    residual against reference, one line per temperature plateau,
                 best and worst sensor of each shown method;
``error-map``    RMS residual over the (reference, temperature) plane;
``sweep``        calibration-point sweep (runs with several budgets);
``uncertainty``  ±2σ predictive bands (methods with ``predictive_std``);
``config``       the resolved configuration (config.json).

The output of ``fedcal calibrate`` (new units against a stored fleet prior;
it has ``units.csv``) gets a calibration report per unit instead
(:func:`build_calibration_report`).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from fedcal.core import runnames
from fedcal.core.atomic import write_text
from fedcal.core.paths import read_json
from fedcal.report import figures
from fedcal.report.rundir import RunDir, read_table, residuals, temperature_column
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

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1150px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; font-size: 0.9em; margin-bottom: 1em; }
th, td { border: 1px solid #ccc; padding: 3px 8px; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.diverged { color: crimson; font-weight: bold; }
img { max-width: 100%; } .note { color: #555; font-style: italic; }
pre { background: #f6f6f6; padding: 1em; font-size: 0.8em; white-space: pre-wrap; }
"""


@dataclass
class Report:
    """What :func:`build_report` wrote: the file, the sections that hold a figure, the notes."""

    path: Path
    figures: list[str] = field(default_factory=list)
    notes: dict[str, str] = field(default_factory=dict)


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


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


def build_report(run_dir: str | Path, out: str | Path, seed: int | None = None) -> Report:
    """Write the HTML report of ``run_dir`` to ``out`` (atomically) and say what it holds."""
    if (Path(run_dir) / runnames.UNITS).exists():
        return build_calibration_report(run_dir, out)
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
    sections: list[tuple[str, str, str]] = []  # (id, title, body)

    def figure(section: str, title: str, fig, caption: str) -> None:
        report.figures.append(section)
        body = f'<figure><img alt="{html.escape(title)}" src="data:image/png;base64,{_png(fig)}">'
        sections.append((section, title, body + f"<figcaption>{caption}</figcaption></figure>"))

    def note(section: str, title: str, why: str) -> None:
        report.notes[section] = why
        sections.append((section, title, f'<p class="note">Not shown: {html.escape(why)}</p>'))

    budget_text = "all calibration points" if budget == 0 else f"{budget} calibration points"
    metrics = run.metrics(budget)
    shown = ranked[:MAX_ROUND_METHODS]
    if regression and not metrics.empty and "test_rmse" in metrics:
        figure(
            "rounds",
            "Error against round",
            figures.error_vs_round(metrics, shown, unit),
            f"Test RMSE after each round ({budget_text}), mean over seeds of the median and of "
            f"the worst sensor. Methods: the {len(shown)} best of {len(ranked)}.",
        )
    else:
        note("rounds", "Error against round", "the run has no per-round test RMSE (metrics.csv)")

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
    else:
        note("per-sensor", "Per-sensor RMSE by method", "the run has no per-sensor test RMSE")

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
            "per temperature plateau; left the method's best sensor, right its worst "
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

    # one line per section (wrapped by the page), not one line per list item
    config_text = "\n".join(
        f"{key} = {json.dumps(value, sort_keys=True)}"
        for key, value in sorted(run.raw_config.items())
    )
    sections.append(("config", "Resolved configuration", f"<pre>{html.escape(config_text)}</pre>"))
    best = ranked[0] if ranked else "—"
    head = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>fedcal report: {html.escape(str(run.path))}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>fedcal report: {html.escape(str(run.path))}</h1>",
        f"<p>{len(run.methods)} methods × {run.summary['seed'].nunique()} seeds; "
        f"target {html.escape(cfg.data.target)}, inputs {html.escape(', '.join(cfg.data.features))}"
        f"; errors on held-out points. Lowest fleet-mean RMSE ({budget_text}): "
        f"<b>{html.escape(best)}</b>.</p>",
        '<section id="summary"><h2>Summary (mean ±std over seeds)</h2>',
        summary_html(table, unit),
        "</section>",
    ]
    _write_page(out, head, sections)
    return report


def _frame_html(frame: pd.DataFrame, klass: str, digits: int = 4) -> str:
    """A table of a DataFrame; numbers carry their exact value in ``data-value``."""
    out = [f'<table class="{klass}"><tr>']
    out += [f"<th>{html.escape(str(c))}</th>" for c in frame.columns]
    out.append("</tr>")
    for _, row in frame.iterrows():
        out.append("<tr>")
        for c in frame.columns:
            v = row[c]
            if isinstance(v, (float, np.floating)) and not isinstance(v, bool):
                text = "nan" if math.isnan(v) else f"{v:.{digits}g}"
                out.append(
                    f'<td class="num" data-column="{html.escape(str(c))}" '
                    f'data-value="{float(v)!r}">{text}</td>'
                )
            else:
                out.append(f'<td data-column="{html.escape(str(c))}">{html.escape(str(v))}</td>')
        out.append("</tr>")
    out.append("</table>")
    return "".join(out)


def build_calibration_report(run_dir: str | Path, out: str | Path) -> Report:
    """The report of a ``fedcal calibrate`` output: one calibration report per new unit.

    Sections: ``units`` (status, distance from the fleet, σ, residuals, test
    errors when held-out rows were given; units unlike the fleet are named as QA
    findings), ``fleet-distance``, ``coefficients`` (with the basis they are
    coefficients of), ``sigma`` (predictive σ over the prior's operating range),
    ``residuals`` (at the calibration points), ``config``. Numbers from
    ``units.csv``, ``coefficients.csv``, ``calibration_points.csv`` and
    ``per_sensor.csv`` (:func:`fedcal.calibration.unit_diagnostics`).
    """
    run_dir, out = Path(run_dir), Path(out)
    report = Report(out)
    ids = {"sensor_id": str}  # ids like "007" stay text
    units = read_table(run_dir / runnames.UNITS, dtype=ids)
    qa_level = float(units["qa_level"].iloc[0]) if len(units) else float("nan")  # as flagged
    coef = read_table(run_dir / "coefficients.csv", dtype=ids)
    points = read_table(run_dir / "calibration_points.csv", dtype=ids)
    per_sensor = read_table(run_dir / runnames.PER_SENSOR, dtype=ids)
    prior_files = sorted(run_dir.glob(f"{runnames.RUNS}/*/{runnames.PRIOR}"))
    prior = read_json(prior_files[0], allow_nan=True) if prior_files else {}
    target = prior.get("target", "target")
    unit = target_unit(target)
    sections: list[tuple[str, str, str]] = []

    def figure(section: str, title: str, fig, caption: str, extra: str = "") -> None:
        report.figures.append(section)
        body = f'<figure><img alt="{html.escape(title)}" src="data:image/png;base64,{_png(fig)}">'
        body += f"<figcaption>{caption}</figcaption></figure>{extra}"
        sections.append((section, title, body))

    flagged = units[units["status"] != "ok"]
    findings = (
        "<p><b>QA findings:</b> "
        + "; ".join(
            f"{html.escape(r.sensor_id)}: {html.escape(r.status)} "
            f"(d² = {r.d2:.3g} &gt; {r.d2_threshold:.3g})"
            if r.status == "unlike the fleet"
            else f"{html.escape(r.sensor_id)}: {html.escape(r.status)}"
            for r in flagged.itertuples()
        )
        + "</p>"
        if len(flagged)
        else "<p>QA: every unit is like the fleet (no finding).</p>"
    )
    tests = [c for c in per_sensor.columns if c.startswith("test_")]
    table = units.merge(per_sensor[["sensor_id", *tests]], on="sensor_id", how="left")
    shown = ["sensor_id", "points", "status", "d2", "dof", "d2_threshold", "p_value"]
    shown += ["sigma_mean", "sigma_max", "resid_rms", "resid_max_abs", *tests]
    sections.append(
        (
            "units",
            "New units",
            findings
            + _frame_html(table[shown], "units")
            + f'<p class="note">d²: the unit\'s distance from the fleet — the Mahalanobis '
            "distance of its coefficients' posterior mean under the fleet prior (its "
            "distribution for a unit of the fleet, N(μ, Σ − V)); with Σ estimated from the "
            "fleet's N units, d² of a unit of the fleet follows Hotelling's prediction law "
            "(d²·N(N−dof)/(dof(N−1)(N+1)) ~ F(dof, N−dof)); above its "
            f"{qa_level:.1%} quantile (d2_threshold) a unit is flagged as unlike the fleet. "
            f"σ in {html.escape(unit)} over the fleet's operating range; residuals "
            f"(calibrated − reference, {html.escape(unit)}) at the unit's calibration points.</p>",
        )
    )
    figure(
        "fleet-distance",
        "Distance from the fleet",
        figures.unit_fleet_distance(units),
        f"Each unit's d² over its {qa_level:.1%} threshold; red: unlike the fleet.",
    )
    features = prior.get("features", [])
    scaler = prior.get("scaler", {})
    maps = (
        ", ".join(
            f"x{j} = ({html.escape(c)} − {scaler['x_offset'][j]:.6g}) / {scaler['x_scale'][j]:.6g}"
            for j, c in enumerate(features)
        )
        if scaler
        else ""
    )
    basis_text = (
        f"<p>{html.escape(target)} = Σ_k c_k φ_k(x) in {html.escape(unit)}, with {maps}; "
        "φ_k products of normalized Legendre polynomials P̃n = √(2n+1)·Pn of the scaled "
        "inputs (each of unit mean square on [−1, 1]). So '1' is the unit's mean output "
        "over the fleet's scaled input box, P1(x) terms its linear sensitivities, higher "
        "orders the curvature; terms b·… are half the up/down sweep split. noise_sd: the "
        f"unit's noise σ ({html.escape(unit)}).</p>"
    )
    sections.append(
        (
            "coefficients",
            "Coefficients",
            basis_text + _frame_html(coef, "coefficients", digits=6),
        )
    )
    figure(
        "sigma",
        "Predictive σ over the operating range",
        figures.unit_sigma(units, unit),
        "Mean and maximum predictive σ (posterior + noise) of each unit over a grid of the "
        "prior fleet's calibrated input range"
        + (
            ": "
            + ", ".join(
                f"{html.escape(c)} {lo:.6g}…{hi:.6g}"
                for c, (lo, hi) in prior["input_range"].items()
            )
            if "input_range" in prior
            else ""
        )
        + ".",
    )
    figure(
        "residuals",
        "Residuals at the calibration points",
        figures.unit_residuals(points, target, unit),
        "Calibrated − reference at each unit's own calibration points, with ±2σ bars.",
        _frame_html(points, "points", digits=7),
    )
    config = read_json(run_dir / runnames.CONFIG)
    config_text = "\n".join(
        f"{key} = {json.dumps(value, sort_keys=True)}" for key, value in sorted(config.items())
    )
    sections.append(("config", "Resolved configuration", f"<pre>{html.escape(config_text)}</pre>"))
    points_per_unit = sorted(set(units["points"].astype(int)))
    head = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>fedcal calibration report: {html.escape(str(run_dir))}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>fedcal calibration report: {html.escape(str(run_dir))}</h1>",
        f"<p>{len(units)} new unit(s) calibrated against a fleet prior "
        f"({html.escape(str(prior_files[0]) if prior_files else 'prior.json')}); calibration "
        f"points per unit: {', '.join(map(str, points_per_unit))}; target "
        f"{html.escape(target)}, inputs {html.escape(', '.join(features))}; "
        f"{len(flagged)} QA finding(s).</p>",
    ]
    _write_page(out, head, sections)
    return report


def _write_page(out: Path, head: list[str], sections: list[tuple[str, str, str]]) -> None:
    """The page: its head, then one <section> per (id, title, HTML content), atomically."""
    body = [
        f'<section id="{sid}"><h2>{html.escape(title)}</h2>{content}</section>'
        for sid, title, content in sections
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text(out, "\n".join([*head, *body, "</body></html>", ""]))
