"""The HTML report: every figure present and embedded, numbers equal to summary.csv, offline."""

import base64
import io
import math
import re
import shutil
from dataclasses import replace
from html.parser import HTMLParser

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image

from fedcal.algorithms.polynomial import PolynomialCalibration
from fedcal.report import rundir
from fedcal.report.html import build_report
from fedcal.report.rundir import RunDir, plateaus, residuals
from fedcal.report.screenshot import find_browser, screenshot
from fedcal.report.tables import MEAN_ONLY, fmt_num, fmt_pm

FIGURES = ["rounds", "per-sensor", "unit-errors", "residuals", "error-map", "sweep"]


class Page(HTMLParser):
    """Sections → embedded images; summary cells → (train_points, method, column, value, text)."""

    def __init__(self) -> None:
        super().__init__()
        self.section = None
        self.images: dict[str, list[str]] = {}
        self.cells: list[dict] = []
        self.refs: list[str] = []
        self.links: list[str] = []
        self._tp = None
        self._method = None
        self._cell = None
        self._in_method = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "src" in a:
            self.refs.append(a["src"])
        if "href" in a:
            self.links.append(a["href"])
        if tag == "section":
            self.section = a["id"]
        elif tag == "img":
            self.images.setdefault(self.section, []).append(a["src"])
        elif tag == "table" and "data-train-points" in a:
            self._tp = int(a["data-train-points"])
        elif tag == "td" and a.get("class") == "method":
            self._in_method, self._method = True, ""
        elif tag == "td" and "data-column" in a:
            self._cell = {
                "train_points": self._tp,
                "method": self._method,
                "column": a["data-column"],
                "value": float(a["data-value"]),
                "std": float(a["data-std"]),
                "klass": a["class"],
                "text": "",
            }

    def handle_data(self, data):
        if self._in_method:
            self._method += data
        elif self._cell is not None:
            self._cell["text"] += data

    def handle_endtag(self, tag):
        if tag == "td" and self._in_method:
            self._in_method = False
        elif tag == "td" and self._cell is not None:
            self.cells.append(self._cell)
            self._cell = None


def parse(path) -> Page:
    page = Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def png_size(src: str) -> tuple[int, int]:
    prefix = "data:image/png;base64,"
    assert src.startswith(prefix)
    return Image.open(io.BytesIO(base64.b64decode(src[len(prefix) :]))).size


def test_every_figure_is_embedded_and_nothing_is_fetched(compare_run):
    _, _, html, output = compare_run
    assert f"HTML report: {html.resolve()}" in output.replace("\n", "")
    page = parse(html)
    for section in FIGURES:
        images = page.images.get(section, [])
        assert len(images) == 1, section
        width, height = png_size(images[0])
        assert width > 300 and height > 200
    # no method here has a predictive distribution: the section says so instead of a figure
    assert "uncertainty" not in page.images
    assert "Not shown: no shown method gives a predictive distribution" in html.read_text()
    assert all(ref.startswith("data:") for ref in page.refs)  # no network, no other file
    assert not re.search(r"https?://", html.read_text())
    # links (not loaded): only to files beside the run, relative, that exist (summary.csv)
    assert page.links and all((html.parent / link).is_file() for link in page.links)
    assert '<section id="config">' in html.read_text()
    assert 'data-key="engine.rounds" data-value="3"' in html.read_text()
    # no figure of dots: with a closed-form method, the round figure draws the others
    assert "One evaluation only (closed form, see the summary): polynomial" in html.read_text()


def test_summary_numbers_equal_summary_csv(compare_run):
    _, run, html, _ = compare_run
    summary = pd.read_csv(run / "summary.csv")
    page = parse(html)
    cells = pd.DataFrame(page.cells)
    assert set(cells["method"]) == {"polynomial", "fedpoly", "fedgmi"}
    assert set(cells["train_points"]) == {12, 24}
    checked = 0
    for cell in page.cells:
        seeds = summary.query("method == @cell['method'] and train_points == @cell['train_points']")
        assert len(seeds) == 2
        values = seeds[cell["column"]].to_numpy(float)
        assert cell["value"] == pytest.approx(values.mean(), rel=1e-12, abs=1e-300)
        assert cell["std"] == pytest.approx(values.std(), rel=1e-9, abs=1e-12)
        if cell["column"].startswith("bytes_"):
            assert cell["text"] == fmt_num(values.mean() / 1e3)
        elif cell["column"] in ("wall_s", "excluded"):  # costs and counts: no trailing zeros
            assert cell["text"] == fmt_num(values.mean())
        elif cell["column"] in MEAN_ONLY:  # errors: 3 digits that compare (0.190, 3.10)
            assert cell["text"] == fmt_num(values.mean(), keep_zeros=True)
        else:
            assert cell["text"] == fmt_pm(values.mean(), values.std(), keep_zeros=True)
        checked += 1
    # methods × budgets × columns: every column (6 errors, wall s, excluded sensors, up kB)
    # and the legible tables (all units: RMSE mean, worst, max|err| worst, not ok; cost:
    # wall s, up kB)
    assert checked == 3 * 2 * (9 + 4 + 2)


def test_a_diverged_seed_is_shown_as_diverged(compare_run, tmp_path):
    _, run, _, _ = compare_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    summary = pd.read_csv(copy / "summary.csv")
    bad = (summary["method"] == "fedgmi") & (summary["seed"] == 1)
    summary.loc[bad, "rmse_mean"] = np.nan
    summary["status"] = np.where(bad, "diverged", "ok")
    summary.to_csv(copy / "summary.csv", index=False)
    build_report(copy, tmp_path / "r.html")
    cells = [c for c in parse(tmp_path / "r.html").cells if c["method"] == "fedgmi"]
    # costs and the count of excluded sensors stay numbers
    errors = [c for c in cells if not c["column"].startswith(("wall", "bytes", "excluded"))]
    assert errors and all(c["text"] == "diverged" and "diverged" in c["klass"] for c in errors)
    assert all(math.isnan(c["value"]) for c in errors)
    assert "2 (1 diverged)" in (tmp_path / "r.html").read_text()


def test_residuals_are_the_reported_test_errors(compare_run):
    _, run, _, _ = compare_run
    rd = RunDir.open(run)
    fleet = rd.fleet()
    for method in ("polynomial", "fedgmi"):
        res = residuals(rd, fleet, method, 24, seed=1)
        rmse = res.groupby("sensor")["residual"].agg(lambda r: np.sqrt(np.mean(r**2)))
        per_sensor = rd.per_sensor(24).query("method == @method and seed == 1")
        reported = per_sensor.set_index("client")["test_rmse"]
        # the engine scores in float32: 1e-4 hPa is float32 rounding at 1600 hPa full scale
        assert np.allclose(rmse.sort_index(), reported.sort_index(), rtol=1e-4, atol=1e-4)
        assert res["std"].isna().all()  # neither method has a predictive distribution


def test_plateaus_group_chamber_set_points_and_bin_off_grid_data():
    t = np.array([20.3, -40.1, 60.0, -39.9, 20.0, 59.5])
    assert plateaus(t).tolist() == [1, 0, 2, 0, 1, 2]
    off_grid = np.linspace(-40, 60, 100)  # no plateaus: six quantile bins
    groups = plateaus(off_grid)
    assert sorted(set(groups.tolist())) == list(range(6))
    assert np.all(np.diff(groups) >= 0)


class WithStd(PolynomialCalibration):
    """The polynomial with a fixed predictive σ of 0.01 (scaled units): the interface only."""

    def predictive_std(self, params, x):
        return torch.full((*x.shape[:-1], 1), 0.01, dtype=x.dtype)


def test_uncertainty_bands_from_predictive_std(compare_run, tmp_path, monkeypatch):
    _, run, _, _ = compare_run
    real = rundir.load_models

    def with_std(run_dir, method, seed=0, train_points=0, **options):
        fleet = real(run_dir, method, seed, train_points, **options)
        if method != "polynomial":
            return fleet
        algorithm = fleet.algorithm
        return replace(fleet, algorithm=WithStd(**{**algorithm.__dict__}))

    monkeypatch.setattr(rundir, "load_models", with_std)
    report = build_report(run, tmp_path / "u.html")
    assert "uncertainty" in report.figures
    page = parse(tmp_path / "u.html")
    assert len(page.images["uncertainty"]) == 1
    # the caption's coverage is the share of residuals inside ±1.96σ, σ = 0.01 · y_scale
    rd = RunDir.open(run)
    res = rundir.residuals(rd, rd.fleet(), "polynomial", 24, seed=0)
    scale = abs(real(run, "polynomial", 0, 24).scaler.y_scale[0])
    assert np.allclose(res["std"], 0.01 * scale)
    coverage = float((res["residual"].abs() <= 1.96 * res["std"]).mean())
    assert f"polynomial {coverage:.1%}" in (tmp_path / "u.html").read_text()


@pytest.mark.skipif(find_browser() is None, reason="no Chromium on this machine (apt: chromium)")
def test_report_renders_in_headless_chromium(compare_run, tmp_path):
    _, _, html, _ = compare_run
    png = screenshot(html, tmp_path / "shot.png", width=1000, height=3000)
    image = Image.open(png).convert("L")
    assert image.size == (1000, 3000)
    pixels = np.asarray(image)
    # rendered content, not a blank page: many rows hold dark pixels (text, plot lines)
    assert (pixels < 128).any(axis=1).mean() > 0.3


def test_a_diverged_sensor_has_no_error_to_draw(compare_run, tmp_path):
    _, run, _, _ = compare_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    path = copy / "runs" / "fedgmi_tp24_seed0" / "per_sensor.csv"
    frame = pd.read_csv(path)
    frame["status"] = ["diverged"] + ["ok"] * (len(frame) - 1)
    frame.to_csv(path, index=False)
    table = RunDir.open(copy).per_sensor(24).query("method == 'fedgmi' and seed == 0")
    assert table["test_rmse"].isna().tolist() == [True] + [False] * (len(frame) - 1)
    report = build_report(copy, tmp_path / "d.html")
    assert "per-sensor" in report.figures  # drawn, with the diverged sensor named, not plotted


def test_the_per_sensor_figure_shows_non_ok_sensors_marked_by_status(
    compare_run, tmp_path, monkeypatch
):
    """Sensors left out of the means are drawn with their status's marker and a legend
    entry (weak here), and those without an error to draw are named with their status
    (diverged, refused), not dropped silently; the box is over the ok sensors."""
    from fedcal.report.figures import per_sensor_rmse, sensor_points

    _, run, _, _ = compare_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    raw = {}
    for method, plant in (("fedgmi", {"S00": "weak", "S01": "diverged"}), ("polynomial", {})):
        for seed in (0, 1):
            path = copy / "runs" / f"{method}_tp24_seed{seed}" / "per_sensor.csv"
            frame = pd.read_csv(path)
            frame["status"] = [plant.get(c, "ok") for c in frame["client"]]
            if method == "polynomial":  # S02 refused in seed 1: no model, no error
                frame.loc[frame["client"] == "S02", "status"] = ["ok", "refused"][seed]
                if seed == 1:
                    frame.loc[frame["client"] == "S02", "test_rmse"] = np.nan
            frame.to_csv(path, index=False)
            raw[method, seed] = frame.set_index("client")["test_rmse"]
    table = RunDir.open(copy).per_sensor(24, mask=False)
    points = sensor_points(table, ["fedgmi", "polynomial"]).set_index(["method", "client"])
    weak = points.loc[("fedgmi", "S00")]
    assert weak["status"] == "weak" and weak["drawn"]
    assert weak["rmse"] == pytest.approx((raw["fedgmi", 0]["S00"] + raw["fedgmi", 1]["S00"]) / 2)
    assert points.loc[("fedgmi", "S01"), "status"] == "diverged"
    assert not points.loc[("fedgmi", "S01"), "drawn"]  # a diverged model's number: never
    assert points.loc[("polynomial", "S02"), "status"] == "refused"
    assert not points.loc[("polynomial", "S02"), "drawn"]
    assert points.loc[("fedgmi", "S02"), "status"] == "ok" and points["drawn"].sum() == 4
    fig = per_sensor_rmse(table, ["fedgmi", "polynomial"], "hPa")
    ax = fig.axes[0]
    dots = {c.get_gid(): c.get_offsets()[:, 1].tolist() for c in ax.collections}
    assert dots == {
        "fedgmi|ok": [points.loc[("fedgmi", "S02"), "rmse"]],
        "fedgmi|weak": [weak["rmse"]],
        "polynomial|ok": [points.loc[("polynomial", s), "rmse"] for s in ("S00", "S01")],
    }
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["weak (not in the means)"]
    note = " ".join(t.get_text() for t in ax.texts)
    assert "fedgmi: S01 (diverged)" in note and "polynomial: S02 (refused)" in note
    # the box of fedgmi is over its one ok sensor: its median line sits on that sensor
    medians = [ln.get_ydata()[0] for ln in ax.lines if ln.get_color() in ("C1", "#ff7f0e")]
    assert points.loc[("fedgmi", "S02"), "rmse"] in medians
    # the report hands the figure every sensor's error (not masked to NaN when not ok)
    from fedcal.report import figures

    class Seen(Exception):
        pass

    given = []

    def capture(per_sensor, methods, unit):
        given.append(per_sensor)
        raise Seen  # the rest of the report is not needed here

    monkeypatch.setattr(figures, "per_sensor_rmse", capture)
    with pytest.raises(Seen):
        build_report(copy, tmp_path / "r.html")
    got = given[0].query("method == 'fedgmi' and seed == 0").set_index("client")
    assert got.loc["S00", "status"] == "weak"
    assert got.loc["S00", "test_rmse"] == raw["fedgmi", 0]["S00"]


def test_the_residual_panels_name_a_sensor_s_status_when_not_ok():
    """The best/worst sensor panels say when that sensor is left out of the means."""
    from fedcal.report.figures import residuals_by_plateau

    rows = []
    for sensor, err in (("A", 0.1), ("B", 2.0)):
        for p, t in ((100.0, 0.0), (500.0, 0.0), (100.0, 40.0), (500.0, 40.0)):
            rows.append({"sensor": sensor, "p": p, "t": t, "residual": err})
    res = pd.DataFrame(rows)
    fig = residuals_by_plateau({"m": res}, "p", "t", "hPa", {"m": {"A": "ok", "B": "weak"}})
    best, worst = (ax.get_title() for ax in fig.axes[:2])
    assert best == "m — best sensor A: RMSE 0.1 hPa"
    assert worst == "m — worst sensor B [weak, not in the means]: RMSE 2 hPa"
    plain = residuals_by_plateau({"m": res}, "p", "t", "hPa")  # no statuses: as before
    assert plain.axes[1].get_title() == "m — worst sensor B: RMSE 2 hPa"


def test_a_status_the_figure_does_not_know_is_never_shown_as_ok(monkeypatch):
    """A sensor ok in one seed and of a status outside fedcal.status's list in another (a
    file of another fedcal) is not ok: it takes that status (not the box), whatever order
    the set of its statuses iterates in. The tie with ok went by the set's hash order:
    here each set iterates in order of appearance (one order CPython's hashing gives,
    e.g. {"ok", "legacy0"} under PYTHONHASHSEED=0), and then in the reverse one."""
    from fedcal.report import figures

    table = pd.DataFrame(
        {
            "method": ["m"] * 4,
            "client": ["A", "A", "B", "B"],
            "seed": [0, 1, 0, 1],
            "test_rmse": [1.0, 3.0, 0.5, 0.5],
            "status": ["ok", "legacy0", "ok", "ok"],
        }
    )
    for iterate in (lambda v: list(dict.fromkeys(v)), lambda v: list(dict.fromkeys(v))[::-1]):
        monkeypatch.setattr(figures, "set", iterate, raising=False)
        points = figures.sensor_points(table, ["m"]).set_index("client")
        assert points.loc["A", "status"] == "legacy0" and points.loc["A", "rmse"] == 2.0
        assert points.loc["B", "status"] == "ok"
        for order in (["legacy0", "legacy1"], ["legacy1", "legacy0"]):  # two unknown: by name
            two = figures.sensor_points(table.assign(status=[*order, "ok", "ok"]), ["m"])
            assert two.loc[0, "status"] == "legacy1"
