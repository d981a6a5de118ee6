"""The page of an HTML report: its style, the figure and table encoders, the atomic write.

Shared by the run report (:mod:`fedcal.report.html`) and the calibration report
(:mod:`fedcal.report.html_calibration`).
"""

from __future__ import annotations

import base64
import html
import io
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from fedcal.core.atomic import write_text

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1150px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; font-size: 0.9em; margin-bottom: 1em; }
th, td { border: 1px solid #ccc; padding: 3px 8px; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.diverged { color: crimson; font-weight: bold; }
img { max-width: 100%; } .note { color: #555; font-style: italic; }
pre { background: #f6f6f6; padding: 1em; font-size: 0.8em; white-space: pre-wrap; }
h3 { font-size: 1.05em; margin-bottom: 0.3em; } h4 { font-size: 0.95em; margin: 0.6em 0 0.2em; }
.wide { overflow-x: auto; } details > summary { cursor: pointer; }
div.config { display: grid; grid-template-columns: repeat(auto-fill, minmax(340px, 1fr));
  gap: 0 1.5em; align-items: start; }
table.config { width: 100%; } table.config caption { text-align: left; font-weight: bold; }
table.config th { text-align: left; font-weight: normal; color: #555; vertical-align: top; }
table.config td { overflow-wrap: break-word; }
div.unit-detail { display: flex; gap: 1.5em; align-items: flex-start; flex-wrap: wrap; }
details.unit { margin: 0.15em 0; } details.unit table { margin: 0.3em 0 0.6em 1.5em; }
"""


@dataclass
class Report:
    """What :func:`build_report` wrote: the file, the sections that hold a figure, the notes."""

    path: Path
    figures: list[str] = field(default_factory=list)
    notes: dict[str, str] = field(default_factory=dict)


def png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def frame_html(frame: pd.DataFrame, klass: str, digits: int = 4) -> str:
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


def write_page(out: Path, head: list[str], sections: list[tuple[str, str, str]]) -> None:
    """The page: its head, then one <section> per (id, title, HTML content), atomically."""
    body = [
        f'<section id="{sid}"><h2>{html.escape(title)}</h2>{content}</section>'
        for sid, title, content in sections
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text(out, "\n".join([*head, *body, "</body></html>", ""]))
