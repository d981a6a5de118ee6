"""The report of a ``fedcal calibrate`` output (it has ``units.csv``): one calibration
report per new unit, a section per unit with a link to its certificate
(:func:`fedcal.report.html_parts.certificate_links`)."""

from __future__ import annotations

import html
from pathlib import Path

from fedcal.core import runnames
from fedcal.core.paths import read_json
from fedcal.report import figures, figures_units
from fedcal.report.html_page import STYLE, Report, frame_html, png, write_page
from fedcal.report.html_parts import certificate_links, config_tables, unit_sections
from fedcal.report.rundir import read_table
from fedcal.report.tables import target_unit


def build_calibration_report(
    run_dir: str | Path, out: str | Path, certificates: str | Path | None = None
) -> Report:
    """The report of a ``fedcal calibrate`` output: one calibration report per new unit.

    Sections: ``units`` (status, distance from the fleet, σ, residuals, test
    errors when held-out rows were given; units unlike the fleet are named as QA
    findings), ``fleet-distance``, ``coefficients`` (with the basis they are
    coefficients of), ``sigma`` (predictive σ over the prior's operating range),
    ``residuals`` (at the calibration points), ``prior`` (the fleet prior's spread across
    units), ``config`` (a table per section), ``unit-list`` (a section per unit: its
    points, coefficients and a link to its certificate from ``certificates``, default the
    ``certificates/`` beside the report). Numbers from
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
        body = f'<figure><img alt="{html.escape(title)}" src="data:image/png;base64,{png(fig)}">'
        body += f"<figcaption>{caption}</figcaption></figure>{extra}"
        sections.append((section, title, body))

    sections.append(("units", "New units", _units_table(units, per_sensor, unit, qa_level)))
    figure(
        "fleet-distance",
        "Distance from the fleet",
        figures.unit_fleet_distance(units),
        f"Each unit's d² over its {qa_level:.1%} threshold; red: unlike the fleet.",
    )
    sections.append(("coefficients", "Coefficients", _coefficients(prior, coef, target, unit)))
    figure(
        "sigma",
        "Predictive σ over the operating range",
        figures.unit_sigma(units, unit),
        "Mean and maximum predictive σ (posterior + noise) of each unit over a grid of the "
        f"prior fleet's calibrated input range{_range_text(prior)}.",
    )
    figure(
        "residuals",
        "Residuals at the calibration points",
        figures.unit_residuals(points, target, unit),
        "Calibrated − reference at each unit's own calibration points, with ±2σ bars; "
        "each unit's points in its section below.",
    )
    if "sigma" in prior and "terms" in prior:
        figure(
            "prior",
            "The fleet prior: how units differ",
            figures_units.prior_spread(prior, unit),
            "The prior these units were calibrated against: left, per basis term the spread "
            "across units √Σkk (bars) against the fleet mean |μk| (dots); right, the 1σ spread "
            "of a unit's calibration curve around the fleet's mean curve before calibration.",
        )
    config = read_json(run_dir / runnames.CONFIG)
    sections.append(("config", "Configuration (config.json)", config_tables(config)))
    where = Path(certificates) if certificates else out.parent / "certificates"
    sections.append(("unit-list", "Units", _unit_list(units, points, coef, unit, where, out)))
    head = _head(run_dir, units, prior_files[0] if prior_files else None, prior)
    write_page(out, head, sections)
    return report


def _unit_rows(units, points, coef, unit: str) -> dict[str, tuple[str, str]]:
    """{unit: (summary line, its calibration points and coefficients as tables)}."""
    u = f" {unit}" if unit else ""
    out = {}
    for row in units.itertuples():
        sid = str(row.sensor_id)
        line = html.escape(
            f"{row.status} · {int(row.points)} points · σ mean {row.sigma_mean:.3g}{u} · "
            f"residual RMS {row.resid_rms:.3g}{u}"
            if row.status != "refused"  # by calibrate's range guard: no model
            else f"refused · {int(row.points)} points · no model: {_reason(row)}"
        )
        own = points[points["sensor_id"] == sid].drop(columns="sensor_id")
        coefficients = coef[coef["sensor_id"] == sid].drop(columns="sensor_id")
        terms = coefficients.T.reset_index()  # one row per term: fits any width
        terms.columns = ["term", "coefficient"][: terms.shape[1]]
        detail = (
            '<div class="unit-detail">'
            + frame_html(own, "unit-points", digits=7)
            + frame_html(terms, "unit-coef", digits=6).replace("data-column=", "data-field=")
            + "</div>"
        )
        out[sid] = (line, detail)
    return out


def _units_table(units, per_sensor, unit: str, qa_level: float) -> str:
    """The QA findings, the units table (the columns that fit 1280 px; every column
    collapsed below it) and what d² is."""
    flagged = units[units["status"] != "ok"]
    findings = (
        "<p><b>QA findings:</b> "
        + "; ".join(
            f"{html.escape(r.sensor_id)}: {html.escape(r.status)} "
            f"(d² = {r.d2:.3g} &gt; {r.d2_threshold:.3g})"
            if r.status == "unlike the fleet"
            else f"{html.escape(r.sensor_id)}: {html.escape(r.status)}"
            + (f" ({html.escape(_reason(r))})" if r.status == "refused" else "")
            for r in flagged.itertuples()
        )
        + "</p>"
        if len(flagged)
        else "<p>QA: every unit is like the fleet (no finding).</p>"
    )
    tests = [c for c in per_sensor.columns if c.startswith("test_")]
    table = units.merge(per_sensor[["sensor_id", *tests]], on="sensor_id", how="left")
    # the columns that fit 1280 px; every column in a collapsed table (and units.csv)
    shown = ["sensor_id", "points", "status", "d2", "p_value", "sigma_mean", "sigma_max"]
    shown += ["resid_rms", *[c for c in ("test_rmse", "test_coverage95") if c in tests]]
    every = ["sensor_id", "points", "status", "d2", "dof", "d2_threshold", "p_value"]
    every[3:3] = ["status_reason"] * ("status_reason" in table.columns)  # why refused
    every += ["sigma_mean", "sigma_max", "resid_rms", "resid_max_abs", *tests]
    full = frame_html(table[every], "units-all").replace("data-column=", "data-field=")
    return (
        findings
        + frame_html(table[shown], "units")
        + "<details><summary>Every column (also units.csv, per_sensor.csv)</summary>"
        + f'<div class="wide">{full}</div></details>'
        + f'<p class="note">d²: the unit\'s distance from the fleet — the Mahalanobis '
        "distance of its coefficients' posterior mean under the fleet prior (its "
        "distribution for a unit of the fleet, N(μ, Σ − V)); with Σ estimated from the "
        "fleet's N units, d² of a unit of the fleet follows Hotelling's prediction law "
        "(d²·N(N−dof)/(dof(N−1)(N+1)) ~ F(dof, N−dof)); above its "
        f"{qa_level:.1%} quantile (d2_threshold) a unit is flagged as unlike the fleet. "
        f"σ in {html.escape(unit)} over the fleet's operating range; residuals "
        f"(calibrated − reference, {html.escape(unit)}) at the unit's calibration points.</p>",
    )


def _reason(row) -> str:
    """units.csv's ``status_reason`` of a row ("" where none is written)."""
    why = getattr(row, "status_reason", "")
    return why if isinstance(why, str) else ""


def _coefficients(prior: dict, coef, target: str, unit: str) -> str:
    """What the coefficients are coefficients of (the basis, the input scaling); every
    unit's coefficients collapsed below."""
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
    return (
        basis_text
        + "<details><summary>Every unit's coefficients (also coefficients.csv; each unit's "
        + "in its section under Units)</summary>"
        + f'<div class="wide">{frame_html(coef, "coefficients", digits=6)}</div></details>',
    )


def _unit_list(units, points, coef, unit: str, where: Path, out: Path) -> str:
    """A section per unit, with its certificate's links where ``where`` holds them."""
    rows = _unit_rows(units, points, coef, unit)
    links = certificate_links(list(rows), where, out)
    said = f"{len(links)} of {len(rows)} unit(s) link their certificate (from {where})."
    said = f"Each unit's calibration points and coefficients. {said}"
    return f'<p class="note">{html.escape(said)}</p>' + unit_sections(rows, links)


def _range_text(prior: dict) -> str:
    """ ": frequency_hz 32767…37514, temperature_c −40.6…60.7" (the prior's input range)."""
    if "input_range" not in prior:
        return ""
    return ": " + ", ".join(
        f"{html.escape(c)} {lo:.6g}…{hi:.6g}" for c, (lo, hi) in prior["input_range"].items()
    )


def _head(run_dir: Path, units, prior_file: Path | None, prior: dict) -> list[str]:
    """The page's head: the units, the prior, the points per unit and the QA findings."""
    target = prior.get("target", "target")
    features = prior.get("features", [])
    flagged = units[units["status"] != "ok"]
    points_per_unit = sorted(set(units["points"].astype(int)))
    return [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>fedcal calibration report: {html.escape(str(run_dir))}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>fedcal calibration report: {html.escape(str(run_dir))}</h1>",
        f"<p>{len(units)} new unit(s) calibrated against a fleet prior "
        f"({html.escape(str(prior_file or 'prior.json'))}); calibration "
        f"points per unit: {', '.join(map(str, points_per_unit))}; target "
        f"{html.escape(target)}, inputs {html.escape(', '.join(features))}; "
        f"{len(flagged)} QA finding(s).</p>",
    ]
