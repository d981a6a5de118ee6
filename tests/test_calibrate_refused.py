"""Issue 33's user path: ``calibrate`` refuses the unit outside the prior's range, not the file.

A hand-written prior (4 Legendre terms on frequency_hz 28000…32000, temperature_c −10…50: no
training) and 4 new units at a 3×2 design with held-out test rows; unit U2's calibration
points lie at 32500…33500 Hz, beyond 32000 + 5 % of the 4000 Hz span (32200). U2 is refused
alone: no model, status ``refused`` with the wording of ``--strict``'s error; U0, U1, U3 are
calibrated exactly as if the file held only them (the same bits, both paths), and every
later step serves the refusal as it serves a training run's refused sensor: ``predict``
leaves its rows empty and names it (``--strict``: an error), ``export`` omits it and names
it, ``certificate`` writes none for it and lists it, the report shows it, a reloaded folder
keeps it. ``--strict``, or every unit outside: the whole file refused in one line, as before.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from fedcal.cli import app
from fedcal.data.loader import load_fleet
from fedcal.prior import qa, station
from fedcal.prior.model import PriorModel
from fedcal.status import Status

runner = CliRunner(env={"COLUMNS": "250"})
OUT = "U2"
SPAN = "frequency_hz spans 32500…33500, outside the prior fleet's calibrated range 28000…32000"
REASON = f"{SPAN} (±5 %): this prior cannot calibrate it"
BRIEF = "frequency_hz 32500…33500 outside 28000…32000 ±5 %"
WARNING = f"1 of 4 units refused: {OUT} ({BRIEF})"
SERVED = f"refused ({REASON})"  # CalibratedFleet.excluded's entry, as a run's refused sensor
ARRAYS = ("coef", "cov", "noise_var", "box", "disc_var", "declined")


def hand_prior() -> PriorModel:
    """fedprior on the terms 1, P1(f), P1(T), P1(f)·P1(T), per-unit noise, a calibrated
    interval: a prior.json as training writes one (tests/prior/test_model.py's layout)."""
    names = ["1", "P1(frequency_hz)", "P1(temperature_c)", "P1(frequency_hz)·P1(temperature_c)"]
    sigma = [[0.04, 0.001, 0, 0], [0.001, 0.09, 0.002, 0], [0, 0.002, 0.01, 0], [0, 0, 0, 1e-4]]
    doc = {
        "kind": "fedprior", "terms": [[0, 0], [1, 0], [0, 1], [1, 1]], "term_names": names,
        "mu": [0.1, 0.5, -0.1, 0.01], "sigma": sigma, "noise_var": 2.5e-05, "noise": "sensor",
        "noise_prior_points": 4.0,
        "interval": {"rule": "calibrated", "discrepancy_var": 1e-06, "probe_rows": 6.0,
                     "residual_dof": 30.0, "declined": 0, "reason": ""},
        "method": "fedprior",
        "method_params": {"orders": [1, 1], "noise": "sensor", "interval": "calibrated"},
        "features": ["frequency_hz", "temperature_c"], "target": "pressure_hpa",
        "sensor_column": "sensor_id",
        "scaler": {"x_offset": [30000.0, 20.0], "x_scale": [2000.0, 30.0], "y_offset": [800.0],
                   "y_scale": [500.0], "sources": {}},
        "input_range": {"frequency_hz": [28000.0, 32000.0], "temperature_c": [-10.0, 50.0]},
        "num_units": 16,
    }  # fmt: skip
    return PriorModel.from_dict(doc)


def new_units(prior: PriorModel, frequencies: dict[str, tuple] | None = None) -> pd.DataFrame:
    """4 units U0–U3 drawn from the prior: 3×2 calibration points (frequencies × 0, 40 °C;
    U2 at ``frequencies``' values) and 4 test rows each inside the range."""
    rng = np.random.default_rng(0)
    frequencies = {OUT: (32500.0, 33000.0, 33500.0), **(frequencies or {})}
    rows = []
    for i in range(4):
        c = rng.multivariate_normal(prior.mean, prior.covariance)
        levels = frequencies.get(f"U{i}", (28500.0, 30000.0, 31500.0))
        train = [(f, t) for f in levels for t in (0.0, 40.0)]
        test = zip(rng.uniform(28500, 31500, 4), rng.uniform(0, 40, 4), strict=True)
        for split, points in (("train", train), ("test", list(test))):
            for f, t in points:
                zf, zt = np.sqrt(3) * (f - 30000) / 2000, np.sqrt(3) * (t - 20) / 30
                y = 800 + 500 * (c[0] + c[1] * zf + c[2] * zt + c[3] * zf * zt)
                rows.append((f"U{i}", f, t, y + rng.normal(0, 0.5), split))
    return pd.DataFrame(rows, columns=["sensor_id", *prior.features, prior.target, "split"])


def _fleet(prior: PriorModel, frame: pd.DataFrame):
    return load_fleet(
        frame, features=prior.features, target=prior.target, test_fraction=0.0,
        min_train_points=1, min_test_points=0,
    )  # fmt: skip


def _same(a, b) -> bool:
    """Bit for bit (floats by their bytes: NaN and −0.0 included), or equal objects."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind == "f":
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return a.shape == b.shape and a.tolist() == b.tolist()


def _calibrate(path: str, prior: PriorModel, fleet, strict: bool = False):
    """(ids, model arrays, per-unit statuses/declines/reasons, refusals) of one path."""
    if path == "numpy":
        done = station.calibrate_fleet(prior, fleet, "new.csv", strict)
        u = done.units
        arrays = {k: getattr(u, k) for k in ARRAYS}
        return done.ids, arrays, {**done.checks, "reasons": u.reasons}, done.refused
    pytest.importorskip("torch")
    from fedcal import calibration
    from fedcal.calibration import unit_diagnostics

    done = calibration.calibrate(prior, fleet, "new.csv", strict)
    units, _ = unit_diagnostics(prior, done)
    arrays = {k: done.personal[k].numpy() for k in ARRAYS}
    checks = {c: units[c].to_numpy() for c in units.columns if c != "sensor_id"}
    return done.tensors.client_ids, arrays, {**checks, "reasons": done.reasons}, done.refused


@pytest.mark.parametrize("path", ["numpy", "torch"])
def test_the_others_are_calibrated_as_if_the_file_held_only_them(path):
    """Both calibrate paths: U2 refused with its reason; U0, U1, U3 bit for bit the file
    without U2 (posterior, noise, box, σ's parts, declines, QA statuses and numbers)."""
    prior, frame = hand_prior(), new_units(hand_prior())
    ids, arrays, checks, refused = _calibrate(path, prior, _fleet(prior, frame))
    alone = _calibrate(path, prior, _fleet(prior, frame[frame.sensor_id != OUT]))
    assert refused == (qa.Refusal(OUT, 6, REASON, BRIEF),) and alone[3] == ()
    assert tuple(ids) == tuple(alone[0]) == ("U0", "U1", "U3")
    for k, v in arrays.items():
        assert _same(v, alone[1][k]), k
    assert checks.keys() == alone[2].keys()
    for k, v in checks.items():
        assert _same(v, alone[2][k]), k
    assert list(checks["status"]) == ["ok"] * 3  # real calibrations, not NaN copies
    assert qa.refused_line(refused, 4) == WARNING and qa.STATUS_REFUSED == Status.REFUSED


@pytest.mark.parametrize("path", ["numpy", "torch"])
def test_strict_and_an_all_out_file_refuse_the_file_in_one_line(path):
    """``strict``: the whole-file error of before (its first unit and input); every unit
    outside: the same line, saying the others are outside too."""
    prior = hand_prior()
    frame = new_units(prior)
    with pytest.raises(ValueError) as err:
        _calibrate(path, prior, _fleet(prior, frame), strict=True)
    assert str(err.value) == f"new.csv: sensor {OUT}: {REASON}"
    hot = (32300.0, 32400.0, 32500.0)
    frame = new_units(prior, {f"U{i}": hot for i in range(4)})
    with pytest.raises(ValueError) as err:
        _calibrate(path, prior, _fleet(prior, frame))
    span = "frequency_hz spans 32300…32500, outside the prior fleet's calibrated range"
    assert str(err.value) == (
        f"new.csv: sensor U0: {span} 28000…32000 (±5 %): this prior cannot calibrate it "
        "(nor any of the file's other 3 units)"
    )


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """``fedcal calibrate`` of the file (``new``) and of the file without U2 (``alone``)."""
    root = tmp_path_factory.mktemp("outrange")
    prior = hand_prior()
    prior.save(root / "prior.json")
    frame = new_units(prior)
    frame.to_csv(root / "new.csv", index=False)
    frame[frame.sensor_id != OUT].to_csv(root / "alone.csv", index=False)
    readings = frame[frame.split == "test"].drop(columns=["split", prior.target])
    readings.to_csv(root / "readings.csv", index=False)
    said = {}
    for name in ("new", "alone"):
        args = ["calibrate", "--prior", str(root / "prior.json"), "--data"]
        result = runner.invoke(app, [*args, str(root / f"{name}.csv"), "--out", str(root / name)])
        assert result.exit_code == 0, result.output
        said[name] = " ".join(result.output.split())
    return root, said


def test_calibrate_writes_the_others_and_lists_the_refused_unit(calibrated):
    """The folder of the file: the file-without-U2's tables, then U2's row in per_sensor.csv
    and units.csv (status refused, its reason); the same models; one warning line."""
    root, said = calibrated
    new, alone = root / "new", root / "alone"
    assert f"warning {WARNING}" in said["new"] and "refused" not in said["alone"]
    assert "3 unit(s) calibrated against" in said["new"]
    for name in ("coefficients.csv", "calibration_points.csv", "runs/fedprior_tp0_seed0/"
                 "valid_range.json", "config.json"):  # fmt: skip
        assert (new / name).read_bytes() == (alone / name).read_bytes(), name
    for name in ("per_sensor.csv", "units.csv"):
        ours, theirs = (new / name).read_text(), (alone / name).read_text()
        assert ours.startswith(theirs), name  # the calibrated units' rows, value for value
    units = pd.read_csv(new / "units.csv").set_index("sensor_id")
    assert units.loc[OUT, "status"] == "refused" and units.loc[OUT, "status_reason"] == REASON
    assert units.loc[OUT, "points"] == 6 and units["status_reason"].isna().sum() == 3
    per_sensor = pd.read_csv(new / "per_sensor.csv").set_index("sensor_id")
    assert per_sensor.loc[OUT].drop("points").isna().all()  # no model: no number
    summary = pd.read_csv(new / "summary.csv")
    assert summary["refused"].tolist() == [1] and summary["refused_note"].tolist() == [WARNING]
    ours = pd.read_csv(new / "summary.csv").drop(columns=["refused", "refused_note"])
    assert ours.equals(pd.read_csv(alone / "summary.csv"))  # means over the calibrated units
    from safetensors.numpy import load_file

    model = "runs/fedprior_tp0_seed0/model.safetensors"
    a, b = load_file(new / model), load_file(alone / model)
    assert a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)


def test_predict_leaves_the_refused_unit_s_rows_empty_and_strict_refuses(calibrated, tmp_path):
    root, _ = calibrated
    args = ["predict", str(root / "new"), "--data", str(root / "readings.csv")]
    result = runner.invoke(app, [*args, "--out", str(tmp_path / "p.csv")])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert f"4 row(s) of sensor {OUT} not calibrated (left empty): no model, {SERVED}" in said
    runner.invoke(app, ["predict", str(root / "alone"), "--data", str(root / "alone.csv"),
                        "--out", str(tmp_path / "a.csv")])  # fmt: skip
    got, alone = pd.read_csv(tmp_path / "p.csv"), pd.read_csv(tmp_path / "a.csv")
    mine = got["sensor_id"] == OUT
    assert got.loc[mine, ["pressure_hpa_calibrated", "pressure_hpa_std"]].isna().all().all()
    assert not got.loc[mine, "in_range"].any()
    keys = ["sensor_id", "frequency_hz", "temperature_c"]
    merged = got[~mine].merge(alone, on=keys, suffixes=("", "_alone"))
    assert len(merged) == 12 and (merged["pressure_hpa_std"] > 0).all()
    for c in ("pressure_hpa_calibrated", "pressure_hpa_std"):
        assert _same(merged[c].to_numpy(), merged[f"{c}_alone"].to_numpy()), c
    result = runner.invoke(app, [*args, "--out", str(tmp_path / "s.csv"), "--strict"])
    assert result.exit_code != 0 and not (tmp_path / "s.csv").exists()
    line = " ".join(result.output.split())
    assert f"sensor {OUT} has no model in this run: {SERVED} (--strict)" in line


def test_export_omits_the_refused_unit_and_names_it(calibrated, tmp_path):
    root, _ = calibrated
    for fmt in ("c", "json"):
        out = tmp_path / f"cal.{fmt}"
        result = runner.invoke(app, ["export", str(root / "new"), "--format", fmt,
                                     "--out", str(out)])  # fmt: skip
        assert result.exit_code == 0, result.output
        assert f"not exported: sensor {OUT} has no model in this run: {SERVED}" in " ".join(
            result.output.split()
        )
    header = (tmp_path / "cal.c").read_text()
    assert f"/* Not exported (no model): {OUT}: {SERVED}. */\n" in header
    assert 'fedcal_sensor_ids[FEDCAL_NUM_SENSORS] = {"U0", "U1", "U3"}' in header
    doc = json.loads((tmp_path / "cal.json").read_text())
    assert sorted(doc["sensors"]) == ["U0", "U1", "U3"] and doc["excluded"] == {OUT: SERVED}
    pytest.importorskip("torch")
    from fedcal.report.export import load_models

    traced = load_models(root / "new", "fedprior", algorithm=True)  # what ONNX exports
    assert sorted(traced.params) == ["U0", "U1", "U3"] and traced.excluded == {OUT: SERVED}


def test_certificate_skips_the_refused_unit_and_lists_it(calibrated, tmp_path):
    root, _ = calibrated
    out = tmp_path / "certs"
    args = ["certificate", str(root / "new"), "--out", str(out), "--sensor", "U0"]
    result = runner.invoke(app, [*args, "--sensor", OUT])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert f"{OUT}: no certificate (refused: {REASON})" in said
    assert "wrote 1 certificate(s)" in said and "1 refused unit(s) without one" in said
    assert sorted(p.name for p in out.iterdir()) == ["U0.html", "U0.pdf"]


def test_the_report_and_a_reloaded_folder_keep_the_refusal(calibrated, tmp_path):
    from fedcal import CalibratedUnits
    from fedcal.report.html_calibration import build_calibration_report

    root, _ = calibrated
    build_calibration_report(root / "new", tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text()
    assert f"{OUT}: refused (" in page and "refused · 6 points · no model: frequency_hz" in page
    units = CalibratedUnits.load(root / "new")
    assert units.refused == {OUT: REASON} and units.sensor_ids == ["U0", "U1", "U3"]
    assert units.models.excluded == {OUT: SERVED}
    units.save(tmp_path / "again")
    assert (tmp_path / "again" / "units.csv").read_bytes() == (
        root / "new" / "units.csv"
    ).read_bytes()


def test_the_api_warns_once_and_strict_refuses(calibrated):
    from fedcal import FleetPrior
    from fedcal.api import RefusedUnitsWarning

    root, _ = calibrated
    prior = FleetPrior.load(root / "prior.json")
    with pytest.warns(
        RefusedUnitsWarning, match=f"^{WARNING}$".replace("(", r"\(").replace(")", r"\)")
    ):
        units = prior.calibrate(root / "new.csv")
    assert units.refused == {OUT: REASON} and units.fleet.num_clients == 3
    readings = pd.read_csv(root / "readings.csv")
    mean, std, inside = units.predict(readings, return_std=True, return_range=True)
    mine = (readings["sensor_id"] == OUT).to_numpy()
    assert np.isnan(mean[mine]).all() and np.isnan(std[mine]).all() and not inside[mine].any()
    assert np.isfinite(mean[~mine]).all() and (std[~mine] > 0).all() and inside[~mine].all()
    with pytest.raises(ValueError, match=f"sensor {OUT}: frequency_hz spans 32500…33500"):
        prior.calibrate(root / "new.csv", strict=True)


def test_calibrate_strict_refuses_the_file_as_before(calibrated):
    root, _ = calibrated
    data = root / "new.csv"
    args = ["calibrate", "--prior", str(root / "prior.json"), "--data", str(data)]
    result = runner.invoke(app, [*args, "--out", str(root / "strict"), "--strict"])
    assert result.exit_code != 0 and not (root / "strict").exists()
    assert f"error: {data}: sensor {OUT}: {REASON}" in " ".join(result.output.split())
