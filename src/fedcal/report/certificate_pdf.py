"""A :class:`~fedcal.report.certificate.Certificate` as a PDF (A4), with matplotlib alone, and
the files of ``fedcal certificate`` (:func:`write_certificates`: HTML and PDF per unit).

matplotlib's PDF backend with the 14 standard PDF fonts (``pdf.use14corefonts``): the
text is written as plain Latin-1 strings in Helvetica, which every PDF reader has, so
nothing is embedded and any text extractor reads it back (``tests/report/test_certificate.py``
does, from the content streams). Text outside Latin-1 is spelled out (:func:`latin1`).
The sections, fields and numbers are those of the HTML (:func:`fedcal.report.
certificate_html.sections`), in the same order.
"""

from __future__ import annotations

import io
import logging
import textwrap
from pathlib import Path

from fedcal.core.atomic import write_bytes, write_text
from fedcal.core.paths import safe_name
from fedcal.report.certificate import CalibrationRun, Certificate, build_certificate
from fedcal.report.certificate_html import to_html

PAGE = (8.27, 11.69)  # A4, inches
LEFT, RIGHT, TOP, BOTTOM = 0.07, 0.93, 0.95, 0.05
WIDTH_PT = (RIGHT - LEFT) * PAGE[0] * 72
EM = 0.53  # characters per line = width / (EM · font size): Helvetica's digits are 0.556 em
SPELLED = {"−": "-", "–": "-", "—": "-", "≤": "<=", "≥": ">=", "σ": "sigma", "μ": "mu"}
SPELLED |= {"Σ": "sum", "√": "sqrt", "φ": "phi", "…": "...", "’": "'", "‘": "'", "“": '"'}
SPELLED |= {"”": '"'}


def latin1(text: str) -> str:
    """``text`` in the standard fonts' Latin-1: symbols outside it spelled out (σ → sigma)."""
    for symbol, spelled in SPELLED.items():
        text = text.replace(symbol, spelled)
    return text.encode("latin-1", "replace").decode("latin-1")


class _Flow:
    """Text, field rows, tables and figures placed top to bottom, a new page when full."""

    def __init__(self, pdf, title: str) -> None:
        self.pdf, self.title, self.page, self.fig, self.y = pdf, title, 0, None, TOP

    def _new_page(self) -> None:
        import matplotlib.pyplot as plt

        if self.fig is not None:
            self.pdf.savefig(self.fig)
            plt.close(self.fig)
        self.page += 1
        self.fig = plt.figure(figsize=PAGE)
        self.fig.text(LEFT, 0.975, latin1(self.title), fontsize=8, parse_math=False)
        self.fig.text(RIGHT, 0.975, f"page {self.page}", fontsize=8, ha="right")
        self.y = TOP

    def need(self, height: float) -> None:
        if self.fig is None or self.y - height < BOTTOM:
            self._new_page()

    @staticmethod
    def _a(size: float) -> float:
        """From a line's top to its baseline: one font size (the ascent, with leading)."""
        return size / 72 / PAGE[1]

    @staticmethod
    def _h(size: float, lines: int = 1) -> float:
        return lines * size * 1.45 / 72 / PAGE[1]

    def text(
        self,
        text: str,
        size: float = 9,
        bold: bool = False,
        x: float = LEFT,
        width_pt: float = WIDTH_PT,
    ) -> None:
        lines = textwrap.wrap(latin1(text), max(20, int(width_pt / (EM * size)))) or [""]
        for line in lines:
            self.need(self._h(size))
            self.fig.text(
                x,
                self.y - self._a(size),
                line,
                fontsize=size,
                va="baseline",
                parse_math=False,
                weight="bold" if bold else "normal",
            )
            self.y -= self._h(size)

    def gap(self, size: float = 5) -> None:
        self.y -= self._h(size)

    def fields(self, rows: list[tuple[str, str]], size: float = 9) -> None:
        split = 0.38
        for name, value in rows:
            left = textwrap.wrap(latin1(name), int(split * WIDTH_PT / (EM * size)))
            right = textwrap.wrap(latin1(value), int((1 - split) * WIDTH_PT / (EM * size)))
            n = max(len(left), len(right), 1)
            self.need(self._h(size, n))
            x_value = LEFT + split * (RIGHT - LEFT)
            value_style = {"weight": "bold" if name == "Verdict" else "normal"}
            for x, lines, style in ((LEFT, left, {"color": "0.25"}), (x_value, right, value_style)):
                for i, line in enumerate(lines):
                    top = self.y - self._h(size, i) - self._a(size)
                    self.fig.text(
                        x, top, line, fontsize=size, va="baseline", parse_math=False, **style
                    )
            self.y -= self._h(size, n) + self._h(2)

    def table(self, head: list[str], rows: list[list[str]], size: float = 7.5) -> None:
        n = len(head)
        step = (RIGHT - LEFT) / n
        wrapped = [textwrap.wrap(latin1(h), int(step * PAGE[0] * 72 / (EM * size))) for h in head]
        depth = max(len(w) for w in wrapped)
        self.need(self._h(size, depth + min(len(rows), 3)))
        for j, lines in enumerate(wrapped):
            for i, line in enumerate(lines):
                self.fig.text(
                    LEFT + (j + 1) * step - 0.005,
                    self.y - self._h(size, i) - self._a(size),
                    line,
                    fontsize=size,
                    va="baseline",
                    ha="right",
                    weight="bold",
                )
        self.y -= self._h(size, depth)
        self.fig.add_artist(_rule(self.y + self._h(1)))
        for row in rows:
            self.need(self._h(size))
            for j, value in enumerate(row):
                self.fig.text(
                    LEFT + (j + 1) * step - 0.005,
                    self.y - self._a(size),
                    latin1(value),
                    fontsize=size,
                    va="baseline",
                    ha="right",
                    parse_math=False,
                )
            self.y -= self._h(size)
        self.gap()

    def figure(self, c: Certificate, height: float = 0.27) -> None:
        from fedcal.report.certificate_html import draw_u

        self.need(height)
        ax = self.fig.add_axes(
            [LEFT + 0.07, self.y - height + 0.04, RIGHT - LEFT - 0.3, height - 0.05]
        )
        draw_u(ax, c, latin1)
        self.y -= height

    def close(self) -> None:
        import matplotlib.pyplot as plt

        if self.fig is not None:
            self.pdf.savefig(self.fig)
            plt.close(self.fig)


def _rule(y: float):
    from matplotlib.lines import Line2D

    return Line2D([LEFT, RIGHT], [y, y], lw=0.6, color="k")


def to_pdf(c: Certificate, version: str = "") -> bytes:
    """The certificate as PDF bytes (A4 pages; the same sections as :func:`to_html`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.backends.backend_pdf import PdfPages

    from fedcal.report.certificate_html import points_table, sections

    buf = io.BytesIO()
    style = {"pdf.use14corefonts": True, "font.family": "sans-serif", "axes.unicode_minus": False}
    quiet = logging.getLogger("matplotlib.font_manager")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # "Helvetica: weight normal, using medium": the same face
    meta = {
        "Title": f"Calibration certificate {c.certificate_id}",
        "Subject": f"unit {c.unit}",
        "Creator": f"fedcal {version}",
        "CreationDate": None,
    }
    try:
        with plt.rc_context(style), PdfPages(buf, metadata=meta) as pdf:
            flow = _Flow(pdf, f"Calibration certificate No. {c.certificate_id}")
            flow.need(0.1)
            flow.text("Calibration certificate", size=16, bold=True)
            flow.text(f"No. {c.certificate_id}   unit {c.unit}", size=10)
            flow.gap(8)
            for sid, title, paragraphs, rows in sections(c):
                flow.need(0.06)
                flow.text(title, size=11, bold=True)
                for p in paragraphs:
                    flow.text(p)
                flow.fields(rows)
                if sid == "results" and len(c.points):
                    flow.table(*points_table(c))
                if sid == "uncertainty" and c.grid is not None:
                    flow.figure(c)
                flow.gap()
            flow.text(
                "This certificate refers only to the unit named above, and to readings "
                "within its valid range. It shall not be reproduced except in full.",
                size=8,
            )
            flow.gap(10)
            flow.text("Authorized by: ______________________ (name, function, signature)", size=9)
            flow.text(f"Generated by fedcal {version} from the calibration run {c.source}.", size=8)
            flow.close()
    finally:
        quiet.setLevel(level)
    return buf.getvalue()


def write_certificates(
    run_dir: str | Path,
    out: str | Path,
    references: dict[str, str] | None = None,
    reference: str | None = None,
    spec: float | None = None,
    rule: str = "guarded",
    issued_on: str | None = None,
    units: list[str] | None = None,
    symbol: str | None = None,
) -> list[Certificate]:
    """``<unit>.html`` and ``<unit>.pdf`` in ``out`` for every unit (or ``units``) of a
    ``fedcal calibrate`` output. ``references``: per-unit reference instruments (a data
    column), ``reference``: one for all; ``symbol``: the measurand's unit
    (:func:`~fedcal.report.certificate.measurand_unit`). A unit ``calibrate`` refused has
    no model and gets none (:attr:`CalibrationRun.refused` lists them)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        __version__ = version("fedcal")
    except PackageNotFoundError:  # a source tree that was never installed
        __version__ = "(not installed)"

    run = CalibrationRun.open(run_dir)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    done = []
    for unit in units or list(run.units.index):
        if unit in run.refused:  # no model, no certificate (the command lists it)
            continue
        ref = (references or {}).get(unit) or reference
        cert = build_certificate(run, unit, ref, spec, rule, issued_on, symbol=symbol)
        name = safe_name(unit, "unit id")  # an id names a file: sanitized
        write_text(out / f"{name}.html", to_html(cert, __version__))
        write_bytes(out / f"{name}.pdf", to_pdf(cert, __version__))
        done.append(cert)
    return done
