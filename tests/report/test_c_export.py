"""C export of every linear-in-basis model, compiled with the system C compiler.

A fedprior run on a small mixed fleet (fully calibrated reference units + new
units with a 3x2 design), the calibrate output of new units against its prior,
and the polynomial/fedpoly/leastsq references: each exported header is compiled
(gcc/cc, -Wall -Wextra -Werror; no compiler is a failure, not a skip) and every
unit is evaluated at off-grid points inside its calibrated span and 10 % beyond,
against ``fedcal predict``.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from numpy.polynomial import legendre as npleg
from typer.testing import CliRunner

from fedcal.cli import app
from fedcal.data.simulator import FleetSpec, simulate_fleet
from fedcal.models.basis import linearized_products
from fedcal.report.export import load_models, range_bounds, to_c_header, to_json
from fedcal.report.linear_export import linear_form
from fedcal.report.rundir import predictive_std, read_valid_ranges
from fedcal_support import cheader

runner = CliRunner(env={"COLUMNS": "200"})
METHODS = ["fedprior", "fedprior_branch", "polynomial", "fedpoly_p3", "leastsq"]
COLS = ["sensor_id", "frequency_hz", "temperature_c", "pressure_hpa", "split", "direction"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(run directory of the fleet, directory of the calibrate output, new units' file)."""
    root = tmp_path_factory.mktemp("cexport")
    spec = FleetSpec(num_reference=6, num_new=4, train_design="3x2", test_design="random")
    data = root / "fleet.csv"
    simulate_fleet(spec, seed=1).frame.to_csv(data, index=False)
    cfg = root / "c.toml"
    cfg.write_text("[engine]\nrounds = 20\neval_every = 20\n")
    run = root / "run"
    args = ["run", "--data", str(data), "--methods", ",".join(METHODS), "--seeds", "1"]
    result = runner.invoke(app, [*args, "--config", str(cfg), "--out", str(run), "--quiet"])
    assert result.exit_code == 0, result.output
    new = simulate_fleet(FleetSpec(num_sensors=3, train_design="3x2", test_design="random"), 7)
    frame = new.frame.assign(sensor_id="NEW-" + new.frame["sensor_id"])
    new_file = root / "new_units.csv"
    frame[COLS[:-1]].to_csv(new_file, index=False)
    cal = root / "cal"
    args = ["calibrate", "--prior", str(run), "--data", str(new_file), "--out", str(cal)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return run, cal, new_file


def probes(ranges: dict, sensors: list[str], rows: int = 60) -> tuple[np.ndarray, np.ndarray]:
    """Sensor indices and float32-exact raw inputs: off-grid, in the span and 10 % beyond."""
    rng = np.random.default_rng(5)
    idx, xs = [], []
    for i, s in enumerate(sensors):
        lo = np.array([ranges[s]["frequency_hz"][0], ranges[s]["temperature_c"][0]])
        hi = np.array([ranges[s]["frequency_hz"][1], ranges[s]["temperature_c"][1]])
        xs.append((lo + rng.uniform(-0.1, 1.1, (rows, 2)) * (hi - lo)).astype(np.float32))
        idx += [i] * rows
    return np.array(idx), np.concatenate(xs).astype(float)


def predict_cli(run, method, sensors, idx, x, tmp_path, digits: int = 9) -> pd.DataFrame:
    """``fedcal predict`` on the probe rows (written with ``digits`` significant digits):
    its output file."""
    frame = pd.DataFrame(
        {
            "sensor_id": [sensors[i] for i in idx],
            "frequency_hz": x[:, 0],
            "temperature_c": x[:, 1],
        }
    )
    inp, out = tmp_path / "readings.csv", tmp_path / "calibrated.csv"
    frame.to_csv(inp, index=False, float_format=f"%.{digits}g")
    args = ["predict", str(run), "--method", method, "--data", str(inp), "--out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return pd.read_csv(out)


def beyond_support(fleet, sensors, idx, x) -> np.ndarray:
    """The method's own guard decision per row, as ``CalibratedFleet.predict`` evaluates it
    (the run's parameters; the scaled inputs in the run's dtype)."""
    out = np.zeros(len(x), bool)
    for i, s in enumerate(sensors):
        rows = idx == i
        params = {k: v.unsqueeze(0) for k, v in fleet.params[s].items()}
        dtype = next(iter(params.values())).dtype
        z = torch.as_tensor(fleet.scaler.x(x[rows]), dtype=dtype).unsqueeze(0)
        out[rows] = fleet.algorithm.beyond_support(params, z)[0].numpy()
    return out


def export_and_compare(run, method, tmp_path):
    header = tmp_path / "cal.h"
    args = ["export", str(run), "--method", method, "--format", "c", "--out", str(header)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    fleet = load_models(run, method, algorithm=True)  # the method's own (torch) evaluation
    ranges = read_valid_ranges(run, method)
    sensors = sorted(fleet.params)
    idx, x = probes(ranges, sensors)
    got = cheader.evaluate(cheader.build(header, tmp_path / "build"), idx, x)
    written = predict_cli(run, method, sensors, idx, x, tmp_path)
    want = written["pressure_hpa_calibrated"].to_numpy()
    assert np.isfinite(want).all()
    # double output: equal to predict within 1e-4 hPa (measured: ~1e-12)
    assert np.max(np.abs(got[:, 0] - want)) < 1e-4
    # float output (the MLP header's API): predict rounded to float, ≤ half an ulp + 1e-4
    half_ulp = np.spacing(np.abs(want).astype(np.float32)).astype(float) / 2
    assert np.all(np.abs(got[:, 1] - want) <= half_ulp + 1e-4)
    # the range guard: fedcal predict's in_range (the span widened by 5 % of it per side)
    inside = written["in_range"].to_numpy()
    assert 0 < inside.sum() < len(x)  # both cases are exercised
    assert np.array_equal(got[:, 3], inside.astype(float))
    # the extrapolation guard's flag: the method's own beyond_support (-1: no guard)
    form = linear_form(fleet, method)
    assert (form.box_lo is None) == (fleet.algorithm.beyond_support is None)
    if form.box_lo is None:
        assert np.all(got[:, 4] == -1)
    else:
        assert np.array_equal(got[:, 4], beyond_support(fleet, sensors, idx, x).astype(float))
    return fleet, sensors, idx, x, got, result.output, header


@pytest.mark.parametrize("method", ["fedprior", "fedprior_branch"])
def test_fedprior_header_equals_predict_and_its_sigma(runs, tmp_path, method):
    run, _, _ = runs
    fleet, sensors, idx, x, got, output, header = export_and_compare(run, method, tmp_path)
    for i, s in enumerate(sensors):
        rows = idx == i
        want = predictive_std(fleet, s, x[rows]).ravel()
        assert np.max(np.abs(got[rows, 2] / want - 1)) < 0.01
    text = header.read_text()
    assert "fedcal_calibrate_std" in text and "#define FEDCAL_HAS_STD 1" in text
    assert "footprint:" in output and "bytes of constants per unit" in output


def test_the_branch_header_averages_the_branches_and_widens_sigma(runs, tmp_path):
    """fedprior_branch's C σ includes the direction term: wider than φᵀVφ + σ² alone."""
    run, _, _ = runs
    fleet, sensors, idx, x, got, _, _ = export_and_compare(run, "fedprior_branch", tmp_path)
    alg = fleet.algorithm
    assert alg.branch_terms  # the variant has a direction term
    for i, s in enumerate(sensors):
        rows = idx == i
        p = fleet.params[s]
        z = torch.as_tensor(fleet.scaler.x(x[rows]), dtype=torch.float64).unsqueeze(0)
        phi = alg.variance_design(z)[0, :, : len(alg.terms)]
        c = p["cov"][: len(alg.terms), : len(alg.terms)]
        without = ((phi @ c) * phi).sum(-1) + p["noise_var"]
        sigma_c = got[rows, 2] / abs(float(fleet.scaler.y_scale[0]))
        assert np.all(sigma_c**2 > without.numpy() * (1 + 1e-6))
        # the mean is ψᵀm_c, the branch average (no h), ψ = φ guarded beyond the unit's box
        box = p["box"].to(torch.float64)
        psi, _ = linearized_products(z, alg.terms, box[0], box[1])
        mean = (psi[0] @ p["coef"][: len(alg.terms)].double()).numpy()
        assert np.allclose(got[rows, 0], fleet.scaler.y_inverse(mean[:, None])[:, 0], atol=1e-6)


@pytest.mark.parametrize("method", ["polynomial", "fedpoly_p3", "leastsq"])
def test_reference_headers_equal_predict(runs, tmp_path, method):
    run, _, _ = runs
    *_, got, _, header = export_and_compare(run, method, tmp_path)
    assert np.isnan(got[:, 2]).all()  # no predictive σ for these methods
    assert "fedcal_calibrate_std" not in header.read_text()


def test_calibrate_output_exports_to_c(runs, tmp_path):
    _, cal, _ = runs
    fleet, sensors, idx, x, got, _, _ = export_and_compare(cal, "fedprior", tmp_path)
    assert sensors == ["NEW-S000", "NEW-S001", "NEW-S002"]
    for i, s in enumerate(sensors):
        rows = idx == i
        want = predictive_std(fleet, s, x[rows]).ravel()
        assert np.max(np.abs(got[rows, 2] / want - 1)) < 0.01


def test_footprint_is_the_header_s_own_sizeof(runs, tmp_path):
    """The printed bytes per unit = sizeof of one unit's rows of the header's tables."""
    run, _, _ = runs
    fleet = load_models(run, "fedprior_branch")
    header = tmp_path / "cal.h"
    ranges = read_valid_ranges(run, "fedprior_branch")
    header.write_text(to_c_header(fleet, valid_range=ranges, method="fedprior_branch"))
    main = tmp_path / "size.c"
    main.write_text(
        '#include <stdio.h>\n#include "cal.h"\nint main(void) {\n'
        '  printf("%zu %d\\n", sizeof fedcal_coef[0] + sizeof fedcal_chol[0]'
        " + sizeof fedcal_var_add[0] + sizeof fedcal_has_std[0]"
        " + sizeof fedcal_x_min[0] + sizeof fedcal_x_max[0]"
        " + sizeof fedcal_y_min[0] + sizeof fedcal_y_max[0]"
        " + sizeof fedcal_range_lo[0] + sizeof fedcal_range_hi[0]"
        " + sizeof fedcal_box_lo[0] + sizeof fedcal_box_hi[0], FEDCAL_NUM_TERMS);\n"
        "  return fedcal_calibrate(0, fedcal_x_min[0]) > 0 ? 0 : 0;\n}\n"
    )
    import subprocess

    exe = tmp_path / "size"
    cmd = [cheader.compiler(), "-std=c99", "-Wall", "-Werror", str(main), "-o", str(exe), "-lm"]
    subprocess.run(cmd, check=True)
    size, terms = map(
        int, subprocess.run([str(exe)], capture_output=True, text=True).stdout.split()
    )
    from fedcal.report.linear_export import linear_form

    form = linear_form(fleet, "fedprior_branch")
    assert form.bytes_per_unit() == size
    # by hand: T double coefficients, T(T+1)/2 + 1 float factor entries, 2·2 + 2 float ranges,
    # 2·2 double in-range bounds, the guard's support box: 2·2 floats, the has-σ flag: 1 byte
    assert size == 8 * terms + 4 * (terms * (terms + 1) // 2 + 1) + 4 * 6 + 8 * 4 + 4 * 4 + 1
    # the polynomial's guard box is the same for every unit (|u_j| <= 1.1): none per unit
    poly_fleet = load_models(run, "polynomial")
    poly = linear_form(poly_fleet, "polynomial")
    assert poly.bytes_per_unit() == 8 * len(poly.terms) + 8 * 4 + 4 * 6 + 8 * 4
    assert "#define FEDCAL_BOX_UNITS 1\n" in to_c_header(poly_fleet, method="polynomial")


def test_json_names_the_family_and_rebuilds_predictions(runs):
    """A reader with only the JSON (and NumPy's Legendre module) gets predict's ŷ and σ,
    beyond each unit's support box too (the extrapolation guard's tangent plane)."""
    run, _, _ = runs
    for method in ("fedprior_branch", "polynomial", "leastsq"):
        fleet = load_models(run, method)
        doc = json.loads(to_json(fleet, method=method))
        model = doc["model"]
        assert doc["family"] == model["family"] == "linear_basis" and model["method"] == method
        terms = np.array(model["terms"])
        s = sorted(fleet.params)[1]
        unit = model["units"][s]
        x = np.array(
            [[33_500.0, -5.0], [36_000.0, 30.0], [34_200.0, 55.0], [39_000.0, 80.0],
             [29_000.0, -40.0], [35_000.0, 95.0]]
        )  # fmt: skip
        u = (x - np.array(model["x_offset"])) / np.array(model["x_scale"])
        if "u_lo" in unit:
            lo, hi = np.array(unit["u_lo"]), np.array(unit["u_hi"])
            u = 2 * (u - lo) / (hi - lo) - 1
        if model["basis"] == "legendre":

            def one(a, v, der=0):
                return np.sqrt(2 * a + 1) * npleg.legval(v, npleg.legder([0] * a + [1], der))
        else:

            def one(a, v, der=0):
                assert der == 0  # leastsq has no guard
                return v**a

        def basis(v, terms=terms, one=one):
            return np.stack([one(t[0], v[:, 0]) * one(t[1], v[:, 1]) for t in terms], 1)

        phi = basis(u)
        psi = phi
        if method != "leastsq":  # fedprior and the polynomial carry the guard's box
            lo = np.array([-np.inf if v is None else v for v in unit["box_lo"]])
            hi = np.array([np.inf if v is None else v for v in unit["box_hi"]])
            ub = np.clip(u, lo, hi)
            beyond = (ub != u).any(1)
            assert beyond.any() and not beyond.all()  # both cases are exercised
            d = u - ub
            slope = np.stack(
                [
                    one(t[0], ub[:, 0], 1) * one(t[1], ub[:, 1]) * d[:, 0]
                    + one(t[0], ub[:, 0]) * one(t[1], ub[:, 1], 1) * d[:, 1]
                    for t in terms
                ],
                1,
            )
            psi = basis(ub) + slope
        else:
            assert "box_lo" not in unit
        coef = np.array(unit["coef"])
        y = model["y_offset"] + model["y_scale"] * psi @ coef
        assert np.allclose(y, fleet.predict(s, x)[:, 0], rtol=0, atol=1e-8)
        if method.startswith("fedprior"):
            w = phi @ np.array(unit["cov_factor"])
            g = (phi - psi) @ coef
            sigma = abs(model["y_scale"]) * np.sqrt((w * w).sum(1) + unit["var_add"] + g * g)
            assert np.allclose(sigma, predictive_std(fleet, s, x).ravel(), rtol=1e-9)
            assert np.all(g[~beyond] == 0) and np.all(np.abs(g[beyond]) > 0)
        else:
            assert "cov_factor" not in unit
    # fedprior's JSON used to say "mlp" (the task's unused model settings)
    assert json.loads(to_json(load_models(run, "fedprior")))["family"] == "linear_basis"


def test_export_refuses_a_sigma_it_cannot_reproduce(runs, monkeypatch):
    """A variance term outside variance_form (a second formula) stops the export."""
    run, _, _ = runs
    fleet = load_models(run, "fedprior")
    cls = type(fleet.algorithm)
    original = cls.predictive_std

    def widened(self, params, x):
        return original(self, params, x) * 1.01

    monkeypatch.setattr(cls, "predictive_std", widened)
    with pytest.raises(ValueError, match="predictive_std"):
        to_c_header(fleet, method="fedprior")


def test_onnx_of_the_branch_variant_equals_predict_and_sigma_beyond_the_box(runs, tmp_path):
    import onnxruntime as ort

    from fedcal.report.onnx_export import to_onnx

    run, _, _ = runs
    fleet = load_models(run, "fedprior_branch")
    x = np.array([[33_500.0, -5.0], [36_000.0, 30.0], [39_000.0, 80.0], [29_000.0, -40.0]])
    s = sorted(fleet.params)[-1]  # a new unit
    # the last two rows are beyond its support box: the traced graph must hold the guard
    params = {k: v.double() for k, v in fleet.params[s].items()}
    z = torch.as_tensor(fleet.scaler.x(x), dtype=torch.float64).unsqueeze(0)
    beyond = fleet.algorithm.beyond_support({k: v[None] for k, v in params.items()}, z)[0]
    assert beyond.tolist() == [False, False, True, True]
    session = ort.InferenceSession(to_onnx(fleet, s), providers=["CPUExecutionProvider"])
    names = ["pressure_hpa", "pressure_hpa_std", "beyond_support"]  # no valid range given
    assert [o.name for o in session.get_outputs()] == names
    y, std, flag = session.run(None, {"x": x})
    assert flag.tolist() == [False, False, True, True]
    assert np.allclose(y[:, 0], fleet.predict(s, x)[:, 0], rtol=1e-12, atol=1e-9)
    assert np.allclose(std.ravel(), predictive_std(fleet, s, x).ravel(), rtol=1e-9)


def test_a_nan_unit_is_nan_in_c_too(runs, tmp_path):
    """A unit whose coefficients are NaN (a refused fit) is NaN in predict and in C."""
    from dataclasses import replace

    run, _, _ = runs
    models = load_models(run, "polynomial")
    bad = sorted(models.params)[1]
    params = dict(models.params)
    params[bad] = {**params[bad], "coef": torch.full_like(params[bad]["coef"], float("nan"))}
    models = replace(models, params=params)
    header = tmp_path / "cal.h"
    ranges = read_valid_ranges(run, "polynomial")
    header.write_text(to_c_header(models, valid_range=ranges, method="polynomial"))
    x = np.array([[33_500.0, 10.0], [34_000.0, 30.0]], np.float32).astype(float)
    idx = np.array([1, 1, 0, 0])
    got = cheader.evaluate(cheader.build(header, tmp_path / "b"), idx, np.vstack([x, x]))
    assert np.isnan(models.predict(bad, x)).all() and np.isnan(got[:2, :2]).all()
    good = sorted(models.params)[0]
    assert np.allclose(got[2:, 0], models.predict(good, x)[:, 0], rtol=0, atol=1e-9)


def support_box(fleet, sensor: str) -> np.ndarray:
    """The unit's extrapolation-guard box (2, F) in scaled inputs."""
    params = fleet.params[sensor]
    if "box" in params:  # fedprior: the unit's box (2, F) in scaled inputs
        return params["box"].double().numpy()
    # polynomial: |u| ≤ 1 + 2·RANGE_MARGIN in the unit's own span lo..hi
    lo, hi = params["lo"].double().numpy(), params["hi"].double().numpy()
    return lo + (np.array([[-0.1], [2.1]]) / 2) * (hi - lo)


def edge_rows(fleet, sensor: str, span: dict) -> np.ndarray:
    """Raw inputs probing both flags' edges for ``sensor`` (rows, 2), float64.

    Inside (the span's middle); exactly on ``fedcal predict``'s in-range bounds (lo − 5 % w,
    hi + 5 % w: inside, ≤) and one ulp outward (outside); far beyond; and around each
    finite side of the unit's support box (raw value of the box's edge, with relative steps
    of ±1e-12 … ±1e-6, so that rounding to the run's dtype falls on both sides of it).
    """
    from fedcal.report.export import range_bounds

    lower, upper = range_bounds(span, fleet.features)
    mid = (lower + upper) / 2
    rows = [mid, mid + 1.5 * (upper - mid), mid - 1.5 * (upper - mid)]
    for j in range(2):
        for edge, out in ((lower[j], -np.inf), (upper[j], np.inf)):
            for v in (edge, np.nextafter(edge, out)):
                rows.append(np.where(np.arange(2) == j, v, mid))
    raw = support_box(fleet, sensor) * fleet.scaler.x_scale + fleet.scaler.x_offset  # (2, F)
    steps = np.concatenate([[0.0], np.outer([1, -1], 10.0 ** -np.arange(6, 13)).ravel()])
    for j in range(2):
        for edge in raw[:, j][np.isfinite(raw[:, j])]:
            for step in steps:
                rows.append(np.where(np.arange(2) == j, edge * (1 + step), mid))
    return np.array(rows)


@pytest.mark.parametrize("method", ["fedprior", "fedprior_branch", "polynomial"])
def test_onnx_flags_equal_predict_in_range_and_the_guard(runs, tmp_path, method):
    """The ONNX in_range output is ``fedcal predict``'s in_range column and its
    beyond_support output the method's own guard decision, row for row, on rows inside,
    exactly on the edges and beyond; the value and σ outputs stay as before."""
    import onnxruntime as ort

    from fedcal.report.onnx_export import to_onnx

    run, _, _ = runs
    fleet = load_models(run, method)
    ranges = read_valid_ranges(run, method)
    s = sorted(fleet.params)[-1]  # a new unit: its support box is wider than its span
    x = edge_rows(fleet, s, ranges[s])
    frame = pd.DataFrame({"sensor_id": s, "frequency_hz": x[:, 0], "temperature_c": x[:, 1]})
    inp, out = tmp_path / "readings.csv", tmp_path / "calibrated.csv"
    frame.to_csv(inp, index=False, float_format="%.17g")
    args = ["predict", str(run), "--method", method, "--data", str(inp), "--out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    written = pd.read_csv(out)
    # the CSV carried every probe exactly (so the edge rows are on the edge)
    assert np.array_equal(written[["frequency_hz", "temperature_c"]].to_numpy(), x)
    session = ort.InferenceSession(
        to_onnx(fleet, s, method, ranges[s]), providers=["CPUExecutionProvider"]
    )
    names = ["pressure_hpa", "pressure_hpa_std", "in_range", "beyond_support"]
    if method == "polynomial":
        names.remove("pressure_hpa_std")
    assert [o.name for o in session.get_outputs()] == names
    got = dict(zip(names, session.run(None, {"x": x}), strict=True))
    assert got["in_range"].dtype == bool and got["in_range"].shape == (len(x),)
    assert got["in_range"].tolist() == written["in_range"].tolist()
    # hand-known: the middle, the four bounds themselves are inside; far and one ulp out not
    assert got["in_range"][:11].tolist() == [True, False, False] + [True, False] * 4
    # the guard as fedcal's predict evaluates it (run's parameters, inputs in its dtype)
    params = {k: v.unsqueeze(0) for k, v in fleet.params[s].items()}
    dtype = next(iter(params.values())).dtype
    z = torch.as_tensor(fleet.scaler.x(x), dtype=dtype).unsqueeze(0)
    want = fleet.algorithm.beyond_support(params, z)[0].numpy()
    assert got["beyond_support"].tolist() == want.tolist()
    near_box = want[11:]  # both decisions occur around the box's edges
    assert near_box.any() and not near_box.all()
    if method != "polynomial":  # the box is the guard's, not the in-range span
        assert (got["beyond_support"] != ~got["in_range"]).any()
    assert np.allclose(got["pressure_hpa"][:, 0], fleet.predict(s, x)[:, 0], rtol=1e-12)
    if "pressure_hpa_std" in got:
        sd = predictive_std(fleet, s, x).ravel()
        assert np.allclose(got["pressure_hpa_std"].ravel(), sd, rtol=1e-9)


def float_edge_rows(fleet, sensor: str, span: dict) -> tuple[np.ndarray, np.ndarray]:
    """(rows (n, 2) of float32 values as float64, z distance of each row to the support box's
    nearest edge (inf: not a box row)): the C header's inputs are float.

    The span's middle; each input halfway into the 5 % margin on each side (inside predict's
    bounds, outside the raw span: the old header's 0); the float32 values nearest each of
    predict's four in-range bounds, 3 ulps each way; and the raw value of each finite side of
    the unit's support box in float32, 4 ulps each way.
    """
    lower, upper = range_bounds(span, fleet.features)
    lo = np.array([span[c][0] for c in fleet.features])
    hi = np.array([span[c][1] for c in fleet.features])
    mid = (lower + upper) / 2
    f32 = np.float32

    def ulps(v: float, k: int) -> list[float]:
        centre = f32(v)
        out = [centre]
        for direction in (np.inf, -np.inf):
            w = centre
            for _ in range(k):
                w = np.nextafter(w, f32(direction))
                out.append(w)
        return [float(w) for w in out]

    rows = [mid]
    for j in range(2):
        margin = 0.05 * (hi[j] - lo[j])
        for v in (lo[j] - margin / 2, hi[j] + margin / 2):
            rows.append(np.where(np.arange(2) == j, v, mid))
    for j in range(2):  # rows 5 + 14 j … 5 + 14 j + 13: around input j's two bounds
        for edge in (lower[j], upper[j]):
            for v in ulps(edge, 3):
                rows.append(np.where(np.arange(2) == j, v, mid))
    box_rows = len(rows)
    params = fleet.params[sensor]
    if "box" not in params and "lo" not in params:  # no extrapolation guard: no box rows
        return np.array(rows, np.float32).astype(float), np.full(box_rows, np.inf)
    box = support_box(fleet, sensor)
    raw = box * fleet.scaler.x_scale + fleet.scaler.x_offset  # (2, F)
    for j in range(2):
        for edge in raw[:, j][np.isfinite(raw[:, j])]:
            for v in ulps(edge, 4):
                rows.append(np.where(np.arange(2) == j, v, mid))
    x = np.array(rows, np.float32).astype(float)
    z = fleet.scaler.x(x)
    if "box" not in params:  # the polynomial's own coordinates u and its box ±1.1
        p_lo, p_hi = params["lo"].double().numpy(), params["hi"].double().numpy()
        z = 2 * (z - p_lo) / (p_hi - p_lo) - 1
        box = np.array([[-1.1], [1.1]]) * np.ones((1, 2))
    gap = np.min(np.abs(z[:, None, :] - box[None]), axis=(1, 2))
    gap[:box_rows] = np.inf
    return x, gap


@pytest.mark.parametrize("method", ["fedprior", "polynomial", "leastsq"])
def test_c_flags_equal_predict_at_the_edges(runs, tmp_path, method):
    """The header's ``fedcal_in_range`` is ``fedcal predict``'s in_range (with its 5 %
    margin), and ``fedcal_beyond_support`` the method's own guard decision, row for row on
    float inputs at and around every bound (a NaN input is out of range, as in predict)."""
    from fedcal.report.export import in_range

    run, _, _ = runs
    fleet = load_models(run, method, algorithm=True)  # the method's own (torch) evaluation
    ranges = read_valid_ranges(run, method)
    sensors = sorted(fleet.params)
    s = sensors[-1]  # a new unit: its support box is wider than its span
    x, gap = float_edge_rows(fleet, s, ranges[s])
    header = tmp_path / "cal.h"
    header.write_text(to_c_header(fleet, valid_range=ranges, method=method))
    idx = np.full(len(x), len(sensors) - 1)
    got = cheader.evaluate(cheader.build(header, tmp_path / "b"), idx, x)
    # 17 digits: predict reads the float inputs exactly (so the edge rows are on the edge)
    written = predict_cli(run, method, sensors, idx, x, tmp_path, digits=17)
    assert np.array_equal(written[["frequency_hz", "temperature_c"]].to_numpy(), x)
    want = written["in_range"].to_numpy()
    assert np.array_equal(got[:, 3], want.astype(float))
    # hand-known: the middle and the margin (outside the raw span) are in range; around each
    # bound, the float32 values beyond it are out, the rest in (both occur at every bound)
    assert want[:5].all()
    lower, upper = range_bounds(ranges[s], fleet.features)
    for j in range(2):
        around = slice(5 + 14 * j, 5 + 14 * (j + 1))
        v = x[around, j]
        assert np.array_equal(want[around], (v >= lower[j]) & (v <= upper[j]))
        assert want[around].any() and not want[around].all()
    nan_row = np.array([[np.nan, x[0, 1]]])
    nan_got = cheader.evaluate(cheader.build(header, tmp_path / "b"), idx[:1], nan_row)
    assert nan_got[0, 3] == 0 and not in_range(nan_row, ranges[s], fleet.features)[0]
    if method == "leastsq":  # no extrapolation guard: no function, the driver's -1
        assert "fedcal_beyond_support" not in header.read_text() and np.all(got[:, 4] == -1)
        return
    guard = beyond_support(fleet, sensors, idx, x)
    near = np.isfinite(gap)
    assert guard[near].any() and not guard[near].all()
    # with the box stored in double the flag is fedcal's bit for bit
    exact = cheader.build(header, tmp_path / "d", {"FEDCAL_BOX_T": "double"})
    assert np.array_equal(cheader.evaluate(exact, idx, x)[:, 4], guard.astype(float))
    # the default float box (docs/firmware.md) moves the edge by its rounding only: a row
    # may differ only within one float ulp of the box side (the polynomial's box is double)
    differ = got[:, 4] != guard
    if method == "polynomial":
        assert not differ.any()
    else:
        box = np.abs(fleet.params[s]["box"].double().numpy())
        assert np.all(gap[differ] <= np.spacing(box.max().astype(np.float32)))


def full_precision_probes(ranges: dict, sensors: list[str], rows: int = 40):
    """Sensor indices and raw inputs in float64 that a float cannot hold (a frequency
    counter's readings), inside each unit's calibrated span."""
    rng = np.random.default_rng(11)
    idx, xs = [], []
    for i, s in enumerate(sensors):
        lo = np.array([ranges[s]["frequency_hz"][0], ranges[s]["temperature_c"][0]])
        hi = np.array([ranges[s]["frequency_hz"][1], ranges[s]["temperature_c"][1]])
        xs.append(lo + rng.uniform(0.0, 1.0, (rows, 2)) * (hi - lo))
        idx += [i] * rows
    return np.array(idx), np.concatenate(xs)


@pytest.mark.parametrize("method", ["fedprior", "polynomial", "leastsq"])
def test_double_readings_equal_predict_and_find_unit_by_id(runs, tmp_path, method):
    """The ``_f64`` functions take the readings in double: at full-precision frequencies
    the header's value is ``fedcal predict``'s (readings written with 17 digits) within
    1e-9 relative (issue 37.5; the float entry points round the reading first: measured
    ~1e-3 hPa, docs/firmware.md); σ within the float factor's 1 %; the two flags are
    predict's in_range and the method's own beyond_support. ``fedcal_find_unit`` finds
    every unit by its id and -1 for an unknown id; ``fedcal_unit_coef`` is that unit's
    coefficient row, NULL for an unknown id."""
    run, _, _ = runs
    header = tmp_path / "cal.h"
    args = ["export", str(run), "--method", method, "--format", "c", "--out", str(header)]
    assert runner.invoke(app, args).exit_code == 0
    fleet = load_models(run, method)
    sensors = sorted(fleet.params)
    idx, x = full_precision_probes(read_valid_ranges(run, method), sensors)
    assert not np.array_equal(x.astype(np.float32).astype(float), x)  # not float-exact
    got = cheader.evaluate(cheader.build(header, tmp_path / "build"), idx, x)
    written = predict_cli(run, method, sensors, idx, x, tmp_path, digits=17)
    want = written["pressure_hpa_calibrated"].to_numpy()
    assert np.max(np.abs(got[:, 6] / want - 1)) <= 1e-9
    assert np.array_equal(got[:, 8], written["in_range"].to_numpy().astype(float))
    if fleet.algorithm.beyond_support is not None:
        assert np.array_equal(got[:, 9], beyond_support(fleet, sensors, idx, x).astype(float))
    if method == "fedprior":
        for i, s in enumerate(sensors):
            rows = idx == i
            sigma = predictive_std(fleet, s, x[rows]).ravel()
            assert np.max(np.abs(got[rows, 7] / sigma - 1)) < 0.01
    found = cheader.find_units(header, tmp_path / "find", [*reversed(sensors), "NOPE", ""])
    assert [k for k, _, _ in found] == [*reversed(range(len(sensors))), -1, -1]
    assert [name for _, _, name in found[: len(sensors)]] == list(reversed(sensors))
    assert all(same for _, same, _ in found)


def test_mlp_header_finds_a_unit_by_id(compare_run, tmp_path):
    """The MLP header has ``fedcal_find_unit`` too (index by id string, -1 if unknown)."""
    _, run, _, _ = compare_run
    header = tmp_path / "mlp.h"
    args = ["export", str(run), "--method", "fedgmi", "--train-points", "12"]
    args += ["--format", "c", "--out", str(header)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    sensors = sorted(load_models(run, "fedgmi", train_points=12).params)
    found = cheader.find_units(header, tmp_path / "find", [sensors[-1], sensors[0], "x"])
    assert [(k, name) for k, _, name in found] == [
        (len(sensors) - 1, sensors[-1]),
        (0, sensors[0]),
        (-1, "-"),
    ]
