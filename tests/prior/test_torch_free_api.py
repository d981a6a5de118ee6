"""Issue 35.1: the Python API's calibrate of a covered prior is the NumPy posterior.

``FleetPrior.load(prior).calibrate(data)`` of fedprior, fedprior_branch, fedprior_fixed,
fedprior_sensor and of a reference-only prior (its deployment discrepancy model, one unit
declined with its reason) runs in a child process whose ``sys.meta_path`` refuses torch
(:data:`tests.prior.test_torch_free.BLOCK`), and so does everything a user does with the
result — ``predict`` (mean, σ, the 95 % half-width, in range), ``coefficients``,
``declined``/``reasons``/``declined_note``, ``save``, ``to_c_header`` and
``CalibratedUnits.load`` of the saved folder; no torch module is loaded. A variant the NumPy
path does not cover is refused there in one line naming it and ``fedcal[neural]``.

Where torch is installed, the child's values are compared with the torch path's — the same
API surface over FedPrior's posterior, ``CalibratedUnits(prior, fleet,
fedcal.calibration.calibrate(prior, fleet))``, what ``FleetPrior.calibrate`` returned before
— with a tolerance derived from the arithmetic (tests/test_plan_numpy.py's): both paths
factor A = I + LᵀGL/σ_i² per unit and solve with it by different routines, so they agree to
the backward error p·ε·κ(A) relative (κ(A) computed here for every unit; with per-unit noise
plus the rounding σ_i²'s fixed point carries, tests/prior/test_posterior.py ``_noise_bound``).
Declines, reasons and the declined note are equal; the saved folder is held to
tests/prior/test_torch_free.py's ``_compare_calibrated``.

CI (.ci/run) runs this file in the clean core environment too (``FEDCAL_STATION_DIR``: the
priors trained by the full environment); the comparisons are skipped there.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fedcal.data.loader import load_fleet
from fedcal.prior import posterior
from fedcal.prior.find import find_prior
from fedcal.prior.model import PriorModel
from fedcal.report.served import torch_available
from tests.prior.test_torch_free import (
    COLS,
    METHODS,
    _child,
    _compare_calibrated,
    make_prior,
    station_root,
)
from tests.prior.test_torch_free_deployed import DECLINED, REASON, make_reference_prior

EPS = np.finfo(np.float64).eps
OUTPUTS = ("mean", "std", "half", "inside")

API = """
import json
import numpy as np
import pandas as pd
from fedcal import CalibratedUnits, FleetPrior

prior, data, readings, out = sys.argv[1:5]
units = FleetPrior.load(prior, method=sys.argv[5]).calibrate(data)
frame = pd.read_csv(readings)
mean, std, half, inside = units.predict(
    frame, return_std=True, return_interval=True, return_range=True
)
np.savez(out + ".npz", mean=mean, std=std, half=half, inside=inside)
units.coefficients.to_csv(out + "_coef.csv", index=False)
units.save(out)
units.to_c_header(out + ".h")
back = CalibratedUnits.load(out)
mean2, std2 = back.predict(frame, return_std=True)
declined = units.declined
print(json.dumps({
    "form": type(units.result).__name__,
    "declined": None if declined is None else declined.tolist(),
    "reasons": list(units.reasons), "note": units.declined_note,
    "loaded_equal": bool(np.array_equal(mean2, mean) and np.array_equal(std2, std, True)),
    "loaded_form": type(back.result).__name__,
    "coef_equal": bool(back.coefficients.equals(units.coefficients)),
    "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch"),
}))
"""


def _trained(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(the fedprior family's run folder, its new units, the reference-only run folder's
    prior with its new units) — the priors of test_torch_free*.py (CI: trained beforehand)."""
    root = station_root(tmp_path_factory, "api_free", make_prior)
    ref = station_root(tmp_path_factory, "api_free_ref", make_reference_prior)
    return root, ref


@pytest.fixture(scope="module")
def priors(tmp_path_factory):
    """{name: (prior folder or file, method, new units' file)} and a scratch folder."""
    root, ref = _trained(tmp_path_factory)
    cases = {m: (root / "fleet_run", m, root / "new_units.csv") for m in METHODS}
    cases["reference_only"] = (ref / "ref_run", "fedprior", ref / "ref_new_units.csv")
    return cases, tmp_path_factory.mktemp("api_free_out")


def _readings(new_file: Path, scratch: Path) -> Path:
    frame = pd.read_csv(new_file)
    readings = scratch / f"{new_file.stem}_readings.csv"
    frame[frame["split"] == "test"][COLS[:3]].to_csv(readings, index=False)
    return readings


def _fleet(new_file: Path, prior: PriorModel):
    return load_fleet(
        new_file, prior.features, prior.target, test_fraction=0.0, min_train_points=1,
        min_test_points=0,
    )  # fmt: skip


def solve_bound(prior: PriorModel, fleet, noise_var: np.ndarray) -> float:
    """p·ε·κ(A) over the units, A = I + LᵀGL/σ_i² of each unit's rows (module docstring)."""
    x, _, mask, branch = posterior.padded_rows(prior, fleet)
    z = posterior.design(prior, x, branch) * mask[..., None]
    chol = np.linalg.cholesky(prior.covariance)
    gram = np.swapaxes(z, 1, 2) @ z
    a = np.eye(len(chol)) + chol.T @ gram @ chol / noise_var[:, None, None]
    return float(len(chol) * EPS * np.linalg.cond(a).max())


def noise_bound(prior: PriorModel, fleet, noise_var: np.ndarray) -> float:
    """The relative rounding of a unit's own σ_i² (tests/prior/test_posterior.py
    ``_noise_bound``: 4pε·yᵀy/(ν σ_i²)); 0 with the fleet's σ²."""
    if prior.noise.kind != "sensor":
        return 0.0
    nu = prior.provenance.method_params.get("noise_prior_points", posterior.NOISE_PRIOR_POINTS)
    _, y, mask, _ = posterior.padded_rows(prior, fleet)
    p = len(prior.basis.terms) + len(prior.basis.branch_terms)
    return float((4 * p * EPS * ((y * mask) ** 2).sum(1) / (nu * noise_var)).max())


def _torch_units(prior_path: Path, method: str, new_file: Path):
    """The torch path's units: FedPrior's posterior behind the same API (module docstring)."""
    from fedcal import calibration
    from fedcal.api import CalibratedUnits

    prior = PriorModel.load(find_prior(prior_path, method))
    fleet = _fleet(new_file, prior)
    return CalibratedUnits(prior, fleet, calibration.calibrate(prior, fleet, str(new_file)))


def _gap(ours: np.ndarray, theirs: np.ndarray, what: str) -> float:
    """max |ours − theirs| (NaN where both are NaN: equal; NaN on one side: a failure)."""
    ours, theirs = np.asarray(ours, float), np.asarray(theirs, float)
    assert ours.shape == theirs.shape and (np.isnan(ours) == np.isnan(theirs)).all(), what
    return float(np.nanmax(np.abs(ours - theirs))) if np.isfinite(theirs).any() else 0.0


@pytest.mark.parametrize("case", [*METHODS, "reference_only"])
def test_the_api_calibrates_a_covered_prior_without_torch(priors, case):
    """FleetPrior.calibrate and every use of its result with torch blocked: the NumPy form
    (a Station), no torch module loaded, the saved folder loaded back bit for bit; where
    torch is installed, the torch path's numbers within p·ε·κ(A) (module docstring), the
    same declines, reasons and note, the saved folder within test_torch_free's tolerances."""
    cases, scratch = priors
    prior_path, method, new_file = cases[case]
    readings = _readings(new_file, scratch)
    out = scratch / f"np_{case}"
    res = _child(API, str(prior_path), str(new_file), str(readings), str(out), method)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["torch"] == [] and got["form"] == "Station" == got["loaded_form"], got
    assert got["loaded_equal"] and got["coef_equal"], got
    if case == "reference_only":  # the 6x1 unit: declined with its reason (issue 33)
        assert got["note"].startswith(REASON) and got["reasons"][-1].startswith(REASON)
        ids = pd.read_csv(out / "coefficients.csv")["sensor_id"].tolist()
        assert got["declined"] == [s == DECLINED for s in ids]
    if not torch_available():
        return  # the core environment: nothing to compare with (module docstring)
    ref = _torch_units(prior_path, method, new_file)
    assert type(ref.result).__name__ == "Calibration"
    assert got["declined"] == (None if ref.declined is None else ref.declined.tolist())
    assert got["reasons"] == list(ref.reasons) and got["note"] == ref.declined_note
    frame = pd.read_csv(readings)
    theirs = dict(zip(OUTPUTS, ref.predict(frame, True, True, True), strict=True))
    ours = np.load(f"{out}.npz")
    noise = ref.params["noise_var"]
    tol = solve_bound(ref.prior, ref.fleet, noise) + noise_bound(ref.prior, ref.fleet, noise)
    assert tol < 1e-4, tol  # not vacuous (κ(A) ≈ 1e7–1e8 on these 6-point units: ~1e-7)
    scale = float(pd.read_csv(new_file)["pressure_hpa"].abs().max())  # the target's scale
    gaps = {}
    for key in ("mean", "std", "half"):  # in the target's unit: relative to the target's scale
        gaps[key] = _gap(ours[key], theirs[key], key) / scale
        assert gaps[key] <= tol, f"{case} {key}: {gaps[key]:.3g} > {tol:.3g} (× {scale:.4g})"
    assert np.array_equal(ours["inside"], theirs["inside"])  # the saved ranges: the same rows
    a, b = pd.read_csv(f"{out}_coef.csv"), ref.coefficients
    assert list(a.columns) == list(b.columns) and a["sensor_id"].equals(b["sensor_id"])
    for col in a.columns[1:]:
        gaps[col] = _gap(a[col], b[col], col) / max(float(np.abs(b[col]).max()), EPS)
        assert gaps[col] <= tol, (case, col, gaps[col], tol)
    served = max(gaps[k] for k in ("mean", "std", "half"))
    table = max(v for k, v in gaps.items() if k not in ("mean", "std", "half"))
    print(f"\n{case}: bound {tol:.3g}; relative gap, served {served:.3g}, table {table:.3g}")
    torch_out = scratch / f"torch_{case}"
    ref.save(torch_out)
    _compare_calibrated(out, torch_out, method, scale)


def test_a_variant_the_numpy_path_does_not_cover_needs_torch_in_one_line(priors):
    """Noise over the inputs: without torch FleetPrior.calibrate raises an ImportError of one
    line naming the variant and ``fedcal[neural]``; with torch it takes FedPrior's path."""
    cases, scratch = priors
    run, _, new_file = cases["fedprior"]
    doc = json.loads(find_prior(run).read_text())
    shaped = scratch / "shaped_prior.json"
    PriorModel.from_dict({**doc, "noise_gamma": [0.1, 0.0]}).save(shaped)
    code = (
        "from fedcal import FleetPrior\n"
        "try:\n    FleetPrior.load(sys.argv[1]).calibrate(sys.argv[2])\n"
        "except ImportError as err:\n    print('ERROR', type(err).__name__, str(err))\n"
    )
    res = _child(code, str(shaped), str(new_file))
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ERROR NeedsTorch "), lines
    assert "noise over the inputs" in lines[0] and "pip install 'fedcal[neural]'" in lines[0]
    assert str(new_file) in lines[0]
    if torch_available():
        from fedcal import calibrated

        prior = PriorModel.load(shaped)
        result = calibrated.calibrate(prior, _fleet(new_file, prior), str(new_file))
        assert type(result).__name__ == "Calibration"


REFUSED = """
import json, warnings
import pandas as pd
from fedcal import CalibratedUnits, FleetPrior

prior, data, readings, out = sys.argv[1:5]
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    units = FleetPrior.load(prior).calibrate(data)
units.save(out)
mean, std = units.predict(pd.read_csv(readings), return_std=True)
back = CalibratedUnits.load(out)
print(json.dumps({
    "warned": [str(w.message) for w in said], "refused": units.refused,
    "loaded": back.refused, "ids": back.sensor_ids, "empty": int(pd.isna(mean).sum()),
    "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch"),
}))
"""


def test_a_unit_outside_the_prior_s_range_is_refused_alone_without_torch(tmp_path):
    """Issue 33's user path with torch blocked (tests/test_calibrate_refused.py's hand-written
    prior, no training): U2 refused alone with its reason and one warning, the others
    calibrated and served, its rows left empty, the refusal kept by a reloaded folder."""
    from tests.test_calibrate_refused import OUT, REASON, WARNING, hand_prior, new_units

    prior = hand_prior()
    prior.save(tmp_path / "prior.json")
    frame = new_units(prior)
    frame.to_csv(tmp_path / "new.csv", index=False)
    readings = frame[frame.split == "test"].drop(columns=["split", prior.target])
    readings.to_csv(tmp_path / "readings.csv", index=False)
    args = [str(tmp_path / n) for n in ("prior.json", "new.csv", "readings.csv", "out")]
    res = _child(REFUSED, *args)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["torch"] == [] and got["warned"] == [WARNING], got
    assert got["refused"] == got["loaded"] == {OUT: REASON}
    assert got["ids"] == ["U0", "U1", "U3"] and got["empty"] == 4  # U2's 4 readings
