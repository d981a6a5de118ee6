"""The report that fits and explains (issue 37.4): the summary split by role, a section per
unit, links to the certificates that exist (and none to those that do not), and the
configuration table equal to config.json.

A small mixed fleet (6 reference units fully calibrated, 4 new units with a 3x2 design),
fedprior and the polynomial; then three new units calibrated against its prior, one of
which gets a certificate.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from urllib.parse import unquote

import pandas as pd
import pytest
from typer.testing import CliRunner

from fedcal.cli import app
from fedcal.data.simulator import FleetSpec, simulate_fleet
from fedcal.report.html import build_report

runner = CliRunner(env={"COLUMNS": "200"})
COLS = ["sensor_id", "frequency_hz", "temperature_c", "pressure_hpa", "split"]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """(mixed run folder, its report, calibrate output, certified unit, uncertified units)."""
    root = tmp_path_factory.mktemp("units")
    spec = FleetSpec(num_reference=6, num_new=4, train_design="3x2", test_design="random")
    data = root / "fleet.csv"
    simulate_fleet(spec, seed=3).frame.to_csv(data, index=False)
    cfg = root / "c.toml"
    cfg.write_text("[engine]\nrounds = 10\neval_every = 5\n")
    run, page = root / "run", root / "out" / "report.html"
    args = ["run", "--data", str(data), "--methods", "fedprior,polynomial", "--seeds", "1"]
    args += ["--config", str(cfg), "--out", str(run), "--quiet"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    build_report(run, page)
    new = simulate_fleet(FleetSpec(num_sensors=3, train_design="3x2", test_design="random"), 4)
    frame = new.frame.assign(sensor_id="NEW-" + new.frame["sensor_id"])
    new_file = root / "new.csv"
    frame[COLS].to_csv(new_file, index=False)
    cal = root / "cal"
    args = ["calibrate", "--prior", str(run), "--data", str(new_file), "--out", str(cal)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    certified = "NEW-S001"
    args = ["certificate", str(cal), "--out", str(root / "certs"), "--sensor", certified]
    result = runner.invoke(app, [*args, "--reference", "PACE 5000 s/n 1"])
    assert result.exit_code == 0, result.output
    others = sorted(set(frame["sensor_id"]) - {certified})
    return run, page, cal, root / "certs", certified, others


def _sections(text: str, klass: str) -> dict[str, str]:
    """{unit id: its <details> HTML} of the per-unit sections."""
    found = re.findall(
        rf'<details class="{klass}" id="unit-([^"]+)"(?: open)?>(.*?)</details>', text, re.S
    )
    return dict(found)


def test_the_summary_is_split_by_role_and_equals_summary_csv(mixed):
    run, page, *_ = mixed
    text = page.read_text()
    summary = pd.read_csv(run / "summary.csv")
    for role in ("new", "reference"):
        table = re.search(rf'<table class="summary role-{role}".*?</table>', text, re.S)
        assert table, role
        cells = re.findall(r'<tr><td class="method">([^<]+)</td>(.*?)</tr>', table.group(0), re.S)
        assert {m for m, _ in cells} == {"fedprior", "polynomial"}
        for method, row in cells:
            values = dict(re.findall(r'data-column="([^"]+)" data-value="([^"]+)"', row))
            # only this role's columns, each equal to summary.csv's (one run: its value)
            assert values and all(c.endswith(f"_{role}") for c in values if c != "excluded")
            want = summary.set_index("method").loc[method]
            for column, value in values.items():
                assert float(value) == pytest.approx(float(want[column]), rel=1e-12, nan_ok=True)
    assert '<table class="summary cost"' in text  # wall time and bytes apart from the errors
    assert "Lowest new-unit RMSE" in text and "<b>fedprior</b>" in text


def test_every_unit_has_its_section_with_its_errors(mixed):
    run, page, *_ = mixed
    text = page.read_text()
    units = _sections(text, "unit")
    per_sensor = pd.concat(
        pd.read_csv(run / "runs" / f"{m}_tp0_seed0" / "per_sensor.csv")
        for m in ("fedprior", "polynomial")
    )
    assert set(units) == set(per_sensor["client"])
    for _, row in per_sensor.iterrows():
        body = units[row["client"]]
        assert f"({row['role']})" in body  # the unit's role in its summary line
        method_row = re.search(rf'<td class="method">{row["method"]}</td>(.*?)</tr>', body, re.S)
        shown = dict(re.findall(r'data-field="([^"]+)" data-value="([^"]+)"', method_row.group(1)))
        assert float(shown["test_rmse"]) == pytest.approx(row["test_rmse"], rel=1e-12)
    assert "No certificate found" in text  # a fedcal run folder: none written


def test_links_go_to_the_certificates_that_exist_and_only_those(mixed, tmp_path):
    _, _, cal, certs, certified, others = mixed
    page = tmp_path / "elsewhere" / "cal.html"  # the report in another folder than the certificates
    args = ["report", str(cal), "--html", str(page), "--certificates", str(certs)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    text = page.read_text()
    units = _sections(text, "unit")
    assert set(units) == {certified, *others}
    links = re.findall(r'<a class="certificate" href="([^"]+)">', units[certified])
    assert sorted(Path(unquote(h)).suffix for h in links) == [".html", ".pdf"]
    for href in links:  # relative to the report, to the file fedcal certificate wrote
        assert not Path(unquote(href)).is_absolute()
        target = (page.parent / unquote(href)).resolve()
        assert target.is_file() and target.parent == certs.resolve()
        assert target.stem == certified
    for unit in others:  # no certificate written: no link
        assert 'class="certificate"' not in units[unit]
    assert "1 of 3 unit(s) link their certificate" in text
    # without --certificates: certificates/ beside the report (a hand-over folder)
    build_report(cal, tmp_path / "plain.html")
    assert 'class="certificate"' not in (tmp_path / "plain.html").read_text()
    (tmp_path / "handover").mkdir()
    (tmp_path / "handover" / "certificates").symlink_to(certs, target_is_directory=True)
    build_report(cal, tmp_path / "handover" / "report.html")
    text = (tmp_path / "handover" / "report.html").read_text()
    hrefs = re.findall(r'<a class="certificate" href="([^"]+)">', text)
    assert sorted(hrefs) == [f"certificates/{certified}.html", f"certificates/{certified}.pdf"]
    assert all((tmp_path / "handover" / unquote(h)).is_file() for h in hrefs)


def test_the_config_table_holds_config_json_s_values(mixed):
    run, page, *_ = mixed
    config = json.loads((run / "config.json").read_text())
    shown = dict(re.findall(r'data-key="([^"]+)" data-value="([^"]*)"', page.read_text()))

    def leaves(value, key=""):
        if isinstance(value, dict) and value:
            for k, v in value.items():
                yield from leaves(v, f"{key}.{k}" if key else k)
        else:
            yield key, value

    want = dict(leaves(config))
    assert set(shown) == set(want)  # every setting, none invented
    for key, value in want.items():
        assert json.loads(html.unescape(shown[key])) == value, key
    assert "<pre>" not in page.read_text()  # no raw dump


def test_the_per_sensor_figure_keeps_new_and_reference_units_apart(mixed):
    """A mixed fleet's per-sensor boxes are per (method, role): each box's dots are that
    role's units' test RMSE (a box over both roles would span 0.05 to 3 hPa)."""
    from fedcal.report.figures import per_sensor_rmse
    from fedcal.report.rundir import RunDir

    run, *_ = mixed
    per_sensor = RunDir.open(run).per_sensor(0, mask=False)
    ax = per_sensor_rmse(per_sensor, ["fedprior", "polynomial"], "hPa").axes[0]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == ["fedprior\nnew", "fedprior\nref", "polynomial\nnew", "polynomial\nref"]
    dots = {c.get_gid(): sorted(c.get_offsets()[:, 1]) for c in ax.collections}
    for method in ("fedprior", "polynomial"):
        for role in ("new", "reference"):
            own = per_sensor.query("method == @method and role == @role")["test_rmse"]
            assert dots[f"{method}|ok|{role}"] == pytest.approx(sorted(own))
