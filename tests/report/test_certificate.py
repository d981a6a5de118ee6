"""`fedcal certificate`: a calibration certificate per unit, checked against hand computations.

Two calibrate outputs of the same new units (3x2 design, 6 points each): one against a
prior whose fleet holds units of that design (U stated), one against a prior of a fleet of
3x2 units only (no unit with more points: the model error between the points cannot be
learned, the interval is declined, and no U may be stated).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import zlib

import numpy as np
import pandas as pd
import pytest
from numpy.polynomial import legendre
from typer.testing import CliRunner

from fedcal import CalibratedUnits, FleetPrior
from fedcal.cli import DECISION_RULES, app
from fedcal.data.simulator import FleetSpec, simulate_fleet
from fedcal.report.certificate import RULES, CalibrationRun, build_certificate, conformity
from fedcal.report.certificate_html import to_html
from fedcal.report.certificate_pdf import to_pdf

runner = CliRunner(env={"COLUMNS": "200"})
REFERENCE = "Druck PACE 5000 s/n 4711, certificate DKD-123"


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("certificate")
    spec = FleetSpec(num_reference=6, num_new=4, train_design="3x2", test_design="random")
    frame = simulate_fleet(spec, seed=0).frame
    new = frame[frame.sensor_id > "S007"]
    stated = FleetPrior(rounds=10).fit(frame[frame.sensor_id <= "S007"])
    stated.calibrate(new).save(root / "cal")
    few = simulate_fleet(FleetSpec(num_sensors=8, train_design="3x2"), seed=5).frame
    declined = FleetPrior(rounds=10).fit(few)
    declined.calibrate(new).save(root / "declined")
    data = new.assign(reference_id=np.where(new.sensor_id == "S008", "REF-A", "REF-B"))
    data.to_csv(root / "new.csv", index=False)
    return root, new


def _hand_phi(z: np.ndarray, terms: list[list[int]]) -> np.ndarray:
    """φ_k(z) = Π_j √(2a+1)·P_a(z_j) with numpy's Legendre series, independently of fedcal."""
    cols = []
    for orders in terms:
        col = np.ones(len(z))
        for j, a in enumerate(orders):
            col *= math.sqrt(2 * a + 1) * legendre.legval(z[:, j], [0] * a + [1])
        cols.append(col)
    return np.stack(cols, 1)


def pdf_text(blob: bytes) -> str:
    """The text of a PDF drawn with the standard fonts: its (…) Tj strings, in order."""
    out = []
    for stream in re.findall(rb"stream\r?\n(.*?)\r?\nendstream", blob, re.S):
        try:
            content = zlib.decompress(stream)
        except zlib.error:
            continue
        for s in re.findall(rb"\(((?:\\.|[^\\)])*)\)\s*Tj", content):
            s = re.sub(rb"\\([()\\])", rb"\1", s)
            out.append(s.decode("latin-1"))
    return "\n".join(out)


def test_u_is_twice_the_sigma_predict_states_and_the_hand_computed_one(outputs):
    root, _ = outputs
    run = CalibrationRun.open(root / "cal")
    cert = build_certificate(run, "S008")
    pts = cert.points
    # by `predict`: U = 2σ exactly, at every calibration point
    readings = pts[["frequency_hz", "temperature_c"]].assign(sensor_id="S008")
    _, sd = CalibratedUnits.load(root / "cal").predict(readings, return_std=True)
    assert np.array_equal(pts["U"].to_numpy(), 2.0 * sd)
    # by hand: σ² = y_scale²·(φᵀVφ + σ_i² + τ_i²) with V, σ_i², τ_i² read from the model file
    params = run.models.params["S008"]
    prior = json.loads((root / "cal" / "runs" / "fedprior_tp0_seed0" / "prior.json").read_text())
    s = prior["scaler"]  # the file's numbers, read here without fedcal
    z = (readings[["frequency_hz", "temperature_c"]].to_numpy() - s["x_offset"]) / s["x_scale"]
    phi = _hand_phi(z, prior["terms"])
    cov = np.asarray(params["cov"], dtype=np.float64)
    extra = sum(float(v) for k, v in params.items() if k.endswith("_var"))
    sigma = s["y_scale"][0] * np.sqrt(np.einsum("ij,jk,ik->i", phi, cov, phi) + extra)
    assert np.allclose(pts["U"], 2.0 * sigma, rtol=1e-9, atol=0)
    # over the valid range: U = 2σ of `predict` on the guard's grid, its max the stated one
    grid = cert.grid.assign(sensor_id="S008")
    _, sd_grid = CalibratedUnits.load(root / "cal").predict(grid, return_std=True)
    assert np.array_equal(cert.grid["U"].to_numpy(), 2.0 * sd_grid)
    assert cert.u_max == 2.0 * sd_grid.max() and len(grid) > 100
    span = run.ranges["S008"]
    for f in ("frequency_hz", "temperature_c", "pressure_hpa"):  # inside the range guard
        lo, hi = span[f]
        values = grid["calibrated" if f == "pressure_hpa" else f]
        assert values.min() >= lo - 0.05 * (hi - lo) - 1e-9
        assert values.max() <= hi + 0.05 * (hi - lo) + 1e-9
    assert grid["temperature_c"].min() == pytest.approx(
        span["temperature_c"][0] - 0.05 * 100.27, abs=0.1
    )
    # as found: the prior mean μ's prediction − reference, by hand
    mu = np.asarray(prior["mu"])[: len(prior["terms"])]
    found = s["y_offset"][0] + s["y_scale"][0] * phi @ mu
    assert np.allclose(pts["as_found_error"], found - pts["reference"], rtol=0, atol=1e-9)
    assert np.allclose(pts["error"], pts["calibrated"] - pts["reference"])


def test_html_and_pdf_state_every_field(outputs):
    root, _ = outputs
    run = CalibrationRun.open(root / "cal")
    cert = build_certificate(run, "S008", REFERENCE, spec=10.0, issued_on="2026-12-07")
    page = to_html(cert, "9.9")
    blob = to_pdf(cert, "9.9")
    text = pdf_text(blob)
    prior_file = root / "cal" / "runs" / "fedprior_tp0_seed0" / "prior.json"
    sha = hashlib.sha256(prior_file.read_bytes()).hexdigest()
    units = pd.read_csv(root / "cal" / "units.csv").set_index("sensor_id")
    plateau = f"{cert.plateaus[0]:.2f} °C"
    must = [
        cert.certificate_id,
        "S008",
        "2026-12-07",  # issue
        run.written,  # calibration
        sha,
        str(run.prior.num_units),
        REFERENCE,
        units.loc["S008", "status"],
        f"{cert.u_max:.4g}",
        "k = 2",
        plateau,
        f"{cert.points['U'].iloc[0]:.4g}",
        f"{cert.points['error'].iloc[0]:.4g}",
        f"{cert.coefficients['P1(frequency_hz)']:.10g}",
        f"{cert.guard['frequency_hz'][0]:.7g}",
        "No drift model",
        "Decision rule: guard-banded acceptance",
        "conforms",
        "Authorized by",
    ]
    for field in must:
        assert field in page, field
        assert field in text, field  # the PDF states the same (° is Latin-1)
    assert blob.startswith(b"%PDF-") and blob.rstrip().endswith(b"%%EOF")
    assert f"Calibration certificate {cert.certificate_id}".encode() in blob  # its Title
    assert page.count('<section id="') == 10 and "data:image/png;base64," in page


def test_a_declined_unit_s_certificate_states_no_number(outputs):
    root, _ = outputs
    run = CalibrationRun.open(root / "declined")
    assert run.units["sigma_mean"].isna().all()  # the prior declined these units' interval
    cert = build_certificate(run, "S009", spec=0.1)
    assert cert.grid is None and cert.points["U"].isna().all()
    assert "no interval" in cert.declined
    assert cert.conformity.verdict == "not stated"
    page, text = to_html(cert), pdf_text(to_pdf(cert))
    for doc in (page, text):
        assert "No uncertainty could be stated for this unit" in doc
        assert "U over the valid range" not in doc and "conforms" not in doc
    # `fedcal predict` serves the declined units too: their σ column is empty (NaN), not refused
    readings = root / "readings.csv"
    outputs[1][["sensor_id", "frequency_hz", "temperature_c"]].to_csv(readings, index=False)
    pred = root / "pred_declined.csv"
    args = ["predict", str(root / "declined"), "--data", str(readings), "--out", str(pred)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert pd.read_csv(pred)["pressure_hpa_std"].isna().all()
    cells = re.findall(r'<td class="num">([^<]*)</td></tr>', page)  # the U column: last
    assert cells and set(cells) == {"—"}
    assert "data:image/png" not in page  # no figure of a U that is not stated


def test_conformity_by_hand_on_both_sides_of_the_specification():
    error, u_pts, u_range = np.array([0.01, -0.02]), np.array([0.05, 0.05]), np.array([0.06])
    # guarded: worst |e| + U = 0.07, worst U(x) = 0.06
    assert conformity(error, u_pts, u_range, 0.0701, "guarded").verdict == "conforms"
    assert conformity(error, u_pts, u_range, 0.0699, "guarded").verdict == "not shown to conform"
    assert conformity(error, u_pts, u_range, 0.0599, "simple").verdict == "does not conform"
    assert conformity(error, u_pts, u_range, 0.0601, "simple").verdict == "conforms"  # 0.02 ≤ S
    far = conformity(np.array([0.5]), np.array([0.05]), u_range, 0.3, "guarded")
    assert far.verdict == "does not conform"  # |e| − U = 0.45 > S
    nan = conformity(error, np.array([np.nan, 0.05]), u_range, 1.0, "guarded")
    assert nan.verdict == "not stated"
    assert tuple(RULES) == DECISION_RULES  # the CLI's choices are the rules


def test_a_unit_s_conformity_flips_at_its_hand_computed_threshold(outputs):
    root, _ = outputs
    run = CalibrationRun.open(root / "cal")
    cert = build_certificate(run, "S009")
    pts = cert.points
    guarded = max(float((pts["error"].abs() + pts["U"]).max()), cert.u_max)
    simple = max(float(pts["error"].abs().max()), cert.u_max)
    for rule, threshold in (("guarded", guarded), ("simple", simple)):
        above = build_certificate(run, "S009", spec=threshold * 1.001, rule=rule)
        below = build_certificate(run, "S009", spec=threshold * 0.999, rule=rule)
        assert above.conformity.verdict == "conforms"
        assert below.conformity.verdict != "conforms"


def test_the_command_writes_both_files_per_unit_with_references_from_the_data(outputs, tmp_path):
    root, _ = outputs
    out = tmp_path / "certs"
    args = ["certificate", str(root / "cal"), "--out", str(out), "--spec", "100"]
    args += ["--reference-column", "reference_id", "--data", str(root / "new.csv")]
    result = runner.invoke(app, [*args, "--issued", "2026-12-07"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == [
        "S008.html", "S008.pdf", "S009.html", "S009.pdf"
    ]  # fmt: skip
    assert "REF-A" in (out / "S008.html").read_text()
    assert "REF-B" in pdf_text((out / "S009.pdf").read_bytes())
    assert "conforms" in result.output
    bad = runner.invoke(app, ["certificate", str(root / "cal"), "--out", str(tmp_path / "x"),
                              "--issued", "07.12.2026"])  # fmt: skip
    assert bad.exit_code == 2 and bad.output.startswith("error:")
    (tmp_path / "empty").mkdir()
    not_cal = runner.invoke(app, ["certificate", str(tmp_path / "empty"), "--out", str(out)])
    assert not_cal.exit_code == 2 and "not a `fedcal calibrate` output" in not_cal.output
    unstated = runner.invoke(app, ["certificate", str(root / "cal"), "--out", str(tmp_path / "z")])
    assert "Reference instrument" in (tmp_path / "z" / "S008.html").read_text()
    assert "not stated" in (tmp_path / "z" / "S008.html").read_text()
    assert unstated.exit_code == 0


def test_a_failed_unit_s_certificate_certifies_nothing(outputs, tmp_path):
    import shutil

    root, _ = outputs
    copy = tmp_path / "cal"
    shutil.copytree(root / "cal", copy)
    units = pd.read_csv(copy / "units.csv", dtype={"sensor_id": str})
    units.loc[units.sensor_id == "S008", "status"] = "failed"
    units.to_csv(copy / "units.csv", index=False)
    cert = build_certificate(CalibrationRun.open(copy), "S008", spec=1.0)
    assert cert.grid is None and not len(cert.points)
    assert cert.conformity.verdict == "not stated"
    page = to_html(cert)
    assert "nothing is certified" in page and "No uncertainty could be stated" in page
    assert "calibration failed" in page and "<th>U, k = 2" not in page


def test_a_drift_prior_s_certificate_says_when_to_recalibrate(tmp_path):
    from fedcal.data.field import TIME_COLUMN, FieldSpec, field_frame

    frame = field_frame(FieldSpec(num_sensors=5, days=120), seed=1)
    frame.to_csv(tmp_path / "net.csv", index=False)
    (tmp_path / "run.toml").write_text("[engine]\nrounds = 5\neval_every = 5\n")
    args = ["run", "--data", str(tmp_path / "net.csv"), "--features", "pm25_raw,rh", "--quiet"]
    args += ["--target", "pm25_ref", "--time-column", TIME_COLUMN, "--split-by", "time"]
    args += ["--methods", "fedprior_drift", "--seeds", "1", "--config", str(tmp_path / "run.toml")]
    assert runner.invoke(app, [*args, "--out", str(tmp_path / "run")]).exit_code == 0
    new = frame[frame["sensor_id"].isin(["S00", "S01"])].groupby("sensor_id").head(40)
    new.to_csv(tmp_path / "new.csv", index=False)
    args = ["calibrate", "--prior", str(tmp_path / "run"), "--method", "fedprior_drift"]
    args += ["--data", str(tmp_path / "new.csv"), "--time-column", TIME_COLUMN]
    assert runner.invoke(app, [*args, "--out", str(tmp_path / "new")]).exit_code == 0
    at = pd.read_csv(tmp_path / "new" / "units.csv").set_index("sensor_id")["recalibrate_at"]
    run = CalibrationRun.open(tmp_path / "new")
    cert = build_certificate(run, "S00")
    assert cert.recalibrate_at == at["S00"] and cert.symbol == "unit not stated"  # not "ref"
    assert f"Recalibrate at time {at['S00']:.6g}" in to_html(cert)
    assert build_certificate(run, "S00", symbol="µg/m³").symbol == "µg/m³"
    assert "U over the valid range, largest (µg/m³)" in to_html(
        build_certificate(run, "S00", symbol="µg/m³")
    )
