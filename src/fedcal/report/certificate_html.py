"""A :class:`~fedcal.report.certificate.Certificate` as HTML, and the layout both renderings
share: the sections and their fields (:func:`sections`), the results table
(:func:`points_table`) and the figure of U (:func:`draw_u`).

The HTML is self-contained (the figure embedded as a PNG, no script, no font fetched) and
prints on A4; the PDF (:mod:`fedcal.report.certificate_pdf`) states the same sections in the
same order.
"""

from __future__ import annotations

import html
import math

import numpy as np

from fedcal.report.certificate import RULES, Certificate, K

Section = tuple[str, str, list[str], list[tuple[str, str]]]  # id, title, paragraphs, fields


def num(value: float, digits: int = 4) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:.{digits}g}"


def sections(c: Certificate) -> list[Section]:
    """(id, title, paragraphs, (field, value) rows) in the certificate's order."""
    s, unit = c.symbol, c.unit
    item = [
        ("Certificate number", c.certificate_id),
        ("Item calibrated (unit id)", unit),
        ("Measurand", f"{c.target} ({s}), from the unit's readings {', '.join(c.features)}"),
        ("Date of calibration", c.calibrated_on),
        ("Date of issue", c.issued_on),
        ("Status", f"{c.status}: {c.status_meaning}"),
    ]
    p = c.prior
    method = [
        (
            f"The unit's coefficients are its posterior under a fleet prior (fedcal calibrate, "
            f"method {p.method}): the distribution of the coefficients of units of this design, "
            "learned by federation from fully calibrated reference units, updated by this "
            "unit's own calibration points."
        )
    ]
    prior = [
        ("Fleet prior (file)", p.path),
        ("sha256 of the prior file", p.sha256),
        ("Units in the fleet", "not recorded" if p.num_units is None else str(p.num_units)),
        ("Their calibration designs", p.designs),
        (
            "Design (model)",
            f"{p.terms} normalized Legendre terms, orders ({p.orders}) in {', '.join(c.features)}",
        ),
    ]
    plateaus = (
        ", ".join(f"{t:.2f} °C" for t in c.plateaus) or "not identified (no temperature input)"
    )
    conditions = [
        ("Calibration points", str(len(c.points))),
        ("Temperature plateaus (mean of the unit's readings)", plateaus),
    ]
    trace = [
        (
            "The results are traceable through the reference instrument named here, whose own "
            "calibration certificate establishes its traceability to the SI; fedcal does not "
            "verify it."
            if c.reference != "not stated"
            else "The reference instrument is not stated: traceability of these results cannot be "
            "established from this certificate (give it with --reference or --reference-column)."
        )
    ]
    return [
        ("item", "1. Item and calibration", [], item),
        ("method", "2. Method and fleet prior", method, prior),
        ("conditions", "3. Conditions of the calibration", [], conditions),
        ("traceability", "4. Traceability", trace, [("Reference instrument", c.reference)]),
        ("results", "5. Results before and after adjustment", _results_text(c), []),
        ("uncertainty", "6. Expanded uncertainty", *_uncertainty(c)),
        ("range", "7. Valid range (range guard)", _range_text(c), []),
        ("coefficients", "8. Coefficients", _coef_text(c), []),
        ("recalibration", "9. Recalibration", [_recal_text(c)], []),
        ("conformity", "10. Statement of conformity", *_conformity(c)),
    ]


def _results_text(c: Certificate) -> list[str]:
    s = c.symbol
    if not len(c.points):
        return ["No results: the unit's calibration failed; nothing is certified."]
    text = [
        f"At each calibration point: the unit's readings, the reference value ({s}), the "
        f"error before adjustment (as found: the design's typical calibration, the prior mean "
        f"μ, before this unit's adjustment), the calibrated value and the error after "
        f"adjustment (calibrated − reference), and U (k = 2) in {s}."
    ]
    if "as_found_error" not in c.points.columns:
        text.append("As found: not shown (the prior has a sweep-direction term).")
    if c.check:
        text.append(
            f"Held-out check points (not used to calibrate): RMS error {num(c.check['rmse'])} {s}, "
            f"largest |error| {num(c.check['max_abs'])} {s}."
        )
    return text


def points_table(c: Certificate) -> tuple[list[str], list[list[str]]]:
    """The results table: header and rows of text."""
    s = c.symbol
    cols = [*c.features, "reference", "as_found_error", "calibrated", "error", "U"]
    cols = [k for k in cols if k in c.points.columns]
    names = {
        "reference": f"reference ({s})",
        "as_found_error": f"as found error ({s})",
        "calibrated": f"calibrated ({s})",
        "error": f"error after adj. ({s})",
        "U": f"U, k = 2 ({s})",
    }
    digits = {"reference": 7, "calibrated": 7}
    rows = [
        [num(float(r[k]), digits.get(k, 4 if k not in c.features else 7)) for k in cols]
        for _, r in c.points.iterrows()
    ]
    return [names.get(k, k) for k in cols], rows


def _uncertainty(c: Certificate) -> tuple[list[str], list[tuple[str, str]]]:
    s = c.symbol
    if c.declined:
        return [
            f"No uncertainty could be stated for this unit: {c.declined}. No value of U is "
            "given, and none should be assumed."
        ], []
    text = [
        f"U = k·u with k = {K:g}: u is the unit's predictive standard uncertainty at the "
        "reading, as fedcal predict states it (posterior of the unit's coefficients and its "
        "noise, with the design's model error); k = 2 is the calibration convention (EA-4/02, "
        "ILAC-P14), a coverage probability of about 95 % for a normal distribution. U at each "
        "calibration point is in the results table; the figure shows U over the valid range."
    ]
    rows = [
        (f"U over the valid range, largest ({s})", num(c.u_max)),
        (f"U over the valid range, mean ({s})", num(c.u_mean)),
        (f"Unit noise σ ({s})", num(c.noise_sd)),
    ]
    return text, rows


def _range_text(c: Certificate) -> list[str]:
    lines = [
        f"{f}: calibrated {num(c.span[f][0], 7)} to {num(c.span[f][1], 7)}; accepted "
        f"(range guard, span ± 5 %) {num(c.guard[f][0], 7)} to {num(c.guard[f][1], 7)}"
        for f in c.features
    ]
    t = c.target
    if t in c.span:
        lines.append(
            f"{t}: reference values {num(c.span[t][0], 7)} to {num(c.span[t][1], 7)} {c.symbol}"
        )
    lines.append(
        "Outside the range guard, predict flags a reading in_range = False (refused with "
        "--strict): it is extrapolated, not calibrated, and this certificate does not cover it."
    )
    return lines


def _coef_text(c: Certificate) -> list[str]:
    maps = ", ".join(f"z_{f} = ({f} − {o:.6g}) / {sc:.6g}" for f, (o, sc) in c.scaling.items())
    return [
        f"{c.target} = Σ_k c_k φ_k(z) in {c.symbol}, with {maps}; φ_k a product of normalized "
        "Legendre polynomials √(2a+1)·P_a of the scaled inputs (term '1' carries the offset).",
        "; ".join(f"{k} = {v:.10g}" for k, v in c.coefficients.items()),
    ]


def _recal_text(c: Certificate) -> str:
    if c.recalibrate_at is None:
        return (
            "No drift model for this prior (or no drift learned): no recalibration date is "
            "stated; recalibrate at the interval the user's quality system sets."
        )
    return (
        f"Recalibrate at time {c.recalibrate_at:.6g} (the calibration's time column's unit; "
        "dates were read as seconds since 1970-01-01 UTC): when the unit's mean predictive σ "
        "over its calibration inputs has grown to the prior's recalibrate_ratio times its "
        "value now (fedprior_drift)."
    )


def _conformity(c: Certificate) -> tuple[list[str], list[tuple[str, str]]]:
    v = c.conformity
    if v is None:
        return ["No specification was given (--spec): no statement of conformity is made."], []
    if v.verdict == "not stated":
        return [
            f"Specification ±{v.spec:g} {c.symbol} (k = 2). No statement of conformity can be "
            "made: no uncertainty is stated for this unit."
        ], [("Verdict", "not stated")]
    return [f"Decision rule: {RULES[v.rule]}."], [
        ("Specification", f"error within ±{v.spec:g} {c.symbol} at k = 2 over the valid range"),
        ("Evidence", v.text),
        ("Verdict", v.verdict),
    ]


def u_figure(c: Certificate):
    """The figure of U over the valid range (:func:`draw_u`), for the HTML page."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 3.0), layout="constrained")
    draw_u(ax, c)
    return fig


def draw_u(ax, c: Certificate, text=str) -> None:
    """U (k = 2) against the calibrated value at five temperatures across the valid range
    (ends included; U grows between the plateaus); dots: U at the calibration points;
    dashed: the specification S."""
    grid = c.grid
    temp = next((f for f in c.features if "temp" in f.lower()), None)
    if temp is not None and len(c.features) == 2:  # lines at 5 temperatures across the range
        levels = np.unique(grid[temp].to_numpy())
        for t in levels[np.linspace(0, len(levels) - 1, 5).round().astype(int)]:
            line = grid[grid[temp] == t].sort_values("calibrated")
            ax.plot(line["calibrated"], line["U"], lw=1.0, label=text(f"{temp} = {t:.1f}"))
    else:
        ax.plot(grid["calibrated"], grid["U"], ".", ms=2, label="grid of the valid range")
    ax.plot(c.points["reference"], c.points["U"], "ko", ms=4, label="calibration points")
    if c.conformity is not None and math.isfinite(c.conformity.worst_range):
        ax.axhline(c.conformity.spec, color="crimson", ls="--", lw=1, label="specification S")
    ax.set_xlabel(text(f"{c.target} ({c.symbol})"))
    ax.set_ylabel(text(f"U, k = 2 ({c.symbol})"))
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside: hides nothing


STYLE = """
body { font-family: Helvetica, Arial, sans-serif; color: #000; max-width: 180mm; margin: 1em auto;
  font-size: 10.5pt; line-height: 1.35; }
h1 { font-size: 16pt; margin: 0; } h2 { font-size: 11.5pt; border-bottom: 1px solid #000;
  margin: 1.1em 0 0.4em; } .head { display: flex; justify-content: space-between;
  border-bottom: 2px solid #000; padding-bottom: 4px; }
table { border-collapse: collapse; margin: 0.3em 0; font-size: 9.5pt; }
th, td { border: 1px solid #777; padding: 2px 6px; vertical-align: top; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
table.fields th { width: 38%; font-weight: normal; background: #f2f2f2; }
.verdict { font-weight: bold; }
.foot { margin-top: 2em; font-size: 9pt; border-top: 1px solid #000; }
img { max-width: 100%; }
@page { size: A4; margin: 15mm; } @media print { body { margin: 0; } h2 { break-after: avoid; } }
"""


def _fields_html(rows: list[tuple[str, str]], sid: str) -> str:
    out = ['<table class="fields">']
    for i, (name, value) in enumerate(rows):
        klass = ' class="verdict"' if name == "Verdict" else ""
        out.append(
            f'<tr><th>{html.escape(name)}</th><td data-field="{sid}.{i}"{klass}>'
            f"{html.escape(value)}</td></tr>"
        )
    return "".join(out) + "</table>"


def to_html(c: Certificate, version: str = "") -> str:
    """The certificate as one self-contained HTML page (A4 when printed)."""
    from fedcal.report.html_page import png as _png

    body = []
    for sid, title, paragraphs, rows in sections(c):
        part = [f'<section id="{sid}"><h2>{html.escape(title)}</h2>']
        part += [f"<p>{html.escape(p)}</p>" for p in paragraphs]
        part.append(_fields_html(rows, sid) if rows else "")
        if sid == "results" and len(c.points):
            head, table = points_table(c)
            part.append(
                "<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"
            )
            part += [
                "<tr>" + "".join(f'<td class="num">{v}</td>' for v in r) + "</tr>" for r in table
            ]
            part.append("</table>")
        if sid == "uncertainty" and c.grid is not None:
            part.append(
                f'<figure><img alt="U over the valid range" src="data:image/png;base64,'
                f'{_png(u_figure(c))}"><figcaption>U (k = 2) over the valid range against the '
                f"calibrated value at five temperatures across it; dots: U at the calibration "
                "points.</figcaption></figure>"
            )
        body.append("".join(part) + "</section>")
    head = (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>Calibration '
        f"certificate {html.escape(c.certificate_id)}</title><style>{STYLE}</style></head><body>"
        f'<div class="head"><h1>Calibration certificate</h1><div>No. <b id="certificate-id">'
        f"{html.escape(c.certificate_id)}</b><br>unit {html.escape(c.unit)}</div></div>"
    )
    foot = (
        '<div class="foot"><p>This certificate refers only to the unit named above, and to '
        "readings within its valid range. It shall not be reproduced except in full.</p>"
        "<p>Authorized by: ______________________ (name, function, signature)</p>"
        f"<p>Generated by fedcal {html.escape(version)} from the calibration run "
        f"{html.escape(c.source)}.</p></div></body></html>"
    )
    return head + "\n".join(body) + foot
