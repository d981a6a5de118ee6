"""Exports of units calibrated from a reference-only prior (issue 33 part 3): the C header
(compiled with the system C compiler), the JSON and ONNX state ``predict``'s σ — the prior's
discrepancy model (fedcal.prior.discrepancy D2–D4) — and no σ where ``predict`` declines.

The tolerance 1e-9 relative is the brief's: the header's double evaluation of the folded
form (report.gp_export) differs from fedcal's by the rounding of a few hundred double
operations on O(1) numbers (~1e-13), far inside it; float σ: within float rounding.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from numpy.polynomial import legendre as npleg

from fedcal.report.export import to_json
from fedcal_support import cheader

COLUMNS = ["sensor_id", "frequency_hz", "temperature_c", "pressure_hpa", "direction", "split"]
INPUTS = ["frequency_hz", "temperature_c"]


@pytest.fixture(scope="module")
def units():
    """4 reference units → prior (Python API, as `fedcal run`); 3 new units at a 3x2 grid
    (σ from the discrepancy model) and one on a single plateau ("flat": σ declined)."""
    from fedcal.api import FleetPrior
    from fedcal.data.simulator import FleetSpec, simulate_fleet

    spec = FleetSpec(num_reference=4, num_new=3, train_design="3x2", test_design="random")
    frame = simulate_fleet(spec, 0).frame
    prior = FleetPrior(rounds=5).fit(frame[frame["role"] == "reference"][COLUMNS])
    new = frame[frame["role"] == "new"]
    train = new[new["split"] == "train"][COLUMNS]
    flat = train[train["sensor_id"] == train["sensor_id"].iloc[0]].copy()
    flat["sensor_id"] = "flat"
    flat["temperature_c"] = flat["temperature_c"].iloc[0]
    return prior.calibrate(pd.concat([train, flat], ignore_index=True))


def probes(units, beyond: float, rows: int = 60) -> tuple[np.ndarray, np.ndarray]:
    """Sensor indices and float32-exact raw inputs, uniform over each unit's calibrated
    span widened by ``beyond`` of it on each side (two seeds' worth of off-grid points)."""
    rng = np.random.default_rng(3)
    span = units.valid_range
    idx, xs = [], []
    for i, s in enumerate(units.sensor_ids):
        lo = np.array([span[s][c][0] for c in INPUTS])
        hi = np.array([span[s][c][1] for c in INPUTS])
        u = rng.uniform(-beyond, 1 + beyond, (rows, len(INPUTS)))
        xs.append((lo + u * (hi - lo)).astype(np.float32))
        idx += [i] * rows
    return np.array(idx), np.concatenate(xs).astype(float)


def predict_std(units, idx, x) -> np.ndarray:
    frame = pd.DataFrame({"sensor_id": [units.sensor_ids[i] for i in idx]})
    frame[INPUTS] = x
    return units.predict(frame, return_std=True)[1]


@pytest.mark.parametrize("beyond", [0.0, 0.1])
def test_the_c_header_states_predict_s_sigma_of_deployed_units(units, tmp_path, beyond):
    """In the calibrated span σ_C = predict's σ to 1e-9 relative. 10 % beyond it, rows
    past the support box add the guard's g² (the existing basis path): with the box stored
    as float (FEDCAL_BOX_T, docs/firmware.md) its tangent point moves by ≤ 2^-24 of the
    bound, so there 1e-5 (measured 2e-7); compiled with the box in double, 1e-9 too."""
    header = units.to_c_header(tmp_path / "units.h")
    text = header.read_text()
    assert units.sensor_ids == ["S004", "S005", "S006", "flat"]
    assert "#define FEDCAL_HAS_STD 1" in text and "#define FEDCAL_GP_UNITS 3" in text
    assert "fedcal_has_std[FEDCAL_NUM_SENSORS] = {1, 1, 1, 0}" in text
    assert "fedcal_gp_row[FEDCAL_NUM_SENSORS] = {0, 1, 2, -1}" in text
    idx, x = probes(units, beyond)
    got = cheader.evaluate(cheader.build(header, tmp_path / "build"), idx, x)
    exact = cheader.build(header, tmp_path / "exact", {"FEDCAL_BOX_T": "double"})
    got_exact = cheader.evaluate(exact, idx, x)
    want = predict_std(units, idx, x)
    flat = idx == 3
    assert np.isnan(want[flat]).all() and np.isnan(got[flat, 5]).all()
    assert np.isnan(got[flat, 2]).all()
    assert np.isfinite(want[~flat]).all() and (want[~flat] > 0).all()
    past = got[:, 4] == 1  # beyond the support box (the guard's flag)
    assert past[~flat].any() == (beyond > 0)  # the span lies inside the box
    inner = ~flat & ~past
    assert np.max(np.abs(got[inner, 5] / want[inner] - 1)) < 1e-9  # double σ
    assert np.max(np.abs(got_exact[~flat, 5] / want[~flat] - 1)) < 1e-9
    assert np.max(np.abs(got[~flat, 5] / want[~flat] - 1)) < 1e-5
    assert np.max(np.abs(got[inner, 2] / want[inner] - 1)) < 2**-23  # float σ: one rounding
    # the σ is design-dependent (q(x) varies): not a constant per unit
    for i in range(3):
        assert np.ptp(want[idx == i]) > 0.05 * np.min(want[idx == i])


def test_the_json_alone_rebuilds_predict_s_sigma_of_deployed_units(units):
    """A reader with the JSON and NumPy's Legendre module: σ = |y_scale| sqrt(φᵀWφ + w₀ −
    Σ_n k_n (Bφ)_n) inside the support box (g = 0 there), predict's to 1e-9."""
    doc = json.loads(to_json(units.models, valid_range=units.valid_range))
    model = doc["model"]
    assert "sigma_deployed" in model["formula"]
    terms = np.array(model["terms"])
    idx, x = probes(units, 0.0)
    want = predict_std(units, idx, x)
    for i, s in enumerate(units.sensor_ids):
        unit = model["units"][s]
        rows = idx == i
        if s == "flat":
            assert unit["has_sigma"] is False and "sigma_deployed" not in unit
            continue
        assert unit["has_sigma"] is True and "cov_factor" not in unit
        u = (x[rows] - np.array(model["x_offset"])) / np.array(model["x_scale"])
        lo = np.array([-np.inf if v is None else v for v in unit["box_lo"]])
        hi = np.array([np.inf if v is None else v for v in unit["box_hi"]])
        assert np.all((u >= lo) & (u <= hi))  # inside the box: ψ = φ, g = 0

        def one(a, v):
            return np.sqrt(2 * a + 1) * npleg.legval(v, [0] * a + [1])

        phi = np.stack([one(t[0], u[:, 0]) * one(t[1], u[:, 1]) for t in terms], 1)
        gp = unit["sigma_deployed"]
        pts, lengths = np.array(gp["points"]), np.array(gp["lengths"])
        assert pts.shape == (6, 2)  # the unit's own 3x2 design
        k = np.exp(-0.5 * (((u[:, None, :] - pts[None]) / lengths) ** 2).sum(-1))
        var = np.einsum("rt,ts,rs->r", phi, np.array(gp["quad"]), phi) + gp["const"]
        var -= (k * (phi @ np.array(gp["cross"]).T)).sum(-1)
        sigma = abs(model["y_scale"]) * np.sqrt(var)
        assert np.allclose(sigma, want[rows], rtol=1e-9, atol=0)


def test_onnx_states_predict_s_sigma_of_deployed_units(units, tmp_path):
    import onnxruntime as ort

    idx, x = probes(units, 0.1)
    want = predict_std(units, idx, x)
    for i, path in enumerate(units.to_onnx(tmp_path / "onnx")):
        session = ort.InferenceSession(str(path))
        names = [o.name for o in session.get_outputs()]
        rows = idx == i
        if units.sensor_ids[i] == "flat":
            assert "pressure_hpa_std" not in names
            continue
        assert names[1] == "pressure_hpa_std"
        std = session.run(None, {"x": x[rows]})[1][:, 0]
        assert np.allclose(std, want[rows], rtol=1e-9, atol=0)


def test_the_footprint_is_the_header_s_own_sizeof(units, tmp_path):
    """bytes_per_unit (+2: the unit's fedcal_gp_row) and the deployed block's bytes per unit
    = sizeof of one unit's rows, by the C compiler; by hand: T = 16 terms, F = 2, K = 6."""
    import subprocess

    from fedcal.report.linear_export import linear_form

    header = units.to_c_header(tmp_path / "units.h")
    main = tmp_path / "size.c"
    main.write_text(
        '#include <stdio.h>\n#include "units.h"\nint main(void) {\n'
        '  printf("%zu %zu\\n", sizeof fedcal_coef[0] + sizeof fedcal_chol[0]'
        " + sizeof fedcal_var_add[0] + sizeof fedcal_has_std[0]"
        " + sizeof fedcal_x_min[0] + sizeof fedcal_x_max[0]"
        " + sizeof fedcal_y_min[0] + sizeof fedcal_y_max[0]"
        " + sizeof fedcal_range_lo[0] + sizeof fedcal_range_hi[0]"
        " + sizeof fedcal_box_lo[0] + sizeof fedcal_box_hi[0] + sizeof fedcal_gp_row[0],"
        " sizeof fedcal_gp_quad[0] + sizeof fedcal_gp_const[0] + sizeof fedcal_gp_len[0]"
        " + sizeof fedcal_gp_points[0] + sizeof fedcal_gp_cross[0] + sizeof fedcal_gp_count[0]);\n"
        "  return fedcal_calibrate_std(0, fedcal_x_min[0]) > 0 ? 0 : 1;\n}\n"
    )
    exe = tmp_path / "size"
    cmd = [cheader.compiler(), "-std=c99", "-Wall", "-Werror", str(main), "-o", str(exe), "-lm"]
    subprocess.run(cmd, check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    unit, block = map(int, out.split())
    form = linear_form(units.models)
    assert form.terms.shape == (16, 2) and int(form.deployed.count.max()) == 6
    assert form.bytes_per_unit() == unit == 8 * 16 + 4 * (136 + 1) + 1 + 4 * 6 + 8 * 4 + 4 * 4 + 2
    assert form.deployed.bytes_per_unit() == block == 8 * (136 + 1 + 2 + 6 * 2 + 6 * 16) + 1
    doc = json.loads(to_json(units.models, valid_range=units.valid_range))
    assert doc["model"]["bytes_per_deployed_unit"] == block
    assert f"+ {block} per unit whose σ is the prior's" in header.read_text()
