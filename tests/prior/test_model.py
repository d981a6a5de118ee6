"""The fitted fleet prior as a value: its file round-trips, old files are read, bad ones refused."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from fedcal.core.runfiles import RunFileError
from fedcal.prior.model import FORMAT_VERSION, PriorModel


def v1_doc() -> dict:
    """A prior.json as fedcal wrote it before format_version (main's layout): 3 terms +
    1 direction term, a calibrated interval, a BIC selection record."""
    return {
        "kind": "fedprior",
        "terms": [[0, 0], [1, 0], [0, 1]],
        "term_names": ["1", "P1(frequency_hz)", "P1(temperature_c)"],
        "mu": [0.1, 1.0, -0.25, 0.0],
        "sigma": [
            [0.04, 0.001, 0.0, 0.0],
            [0.001, 0.09, 0.002, 0.0],
            [0.0, 0.002, 0.01, 0.0],
            [0.0, 0.0, 0.0, 0.0001],
        ],
        "noise_var": 2.5e-05,
        "noise": "sensor",
        "noise_prior_points": 4.0,
        "identification": {
            "informed_units": [0.5, 12.0, 12.0, 16.0],
            "weak_terms": ["b·1"],
            "weak_directions": 1,
        },
        "interval": {
            "rule": "calibrated",
            "discrepancy_var": 1e-06,
            "probe_rows": 6.0,
            "residual_dof": 30.0,
            "declined": 0,
            "reason": "",
            "discrepancy_var_own": None,
        },
        "branch_terms": [[0, 0]],
        "branch_term_names": ["b·1"],
        "selection": {
            "rule": "bic",
            "chosen": {"orders": [1, 1]},
            "candidates": [{"orders": [1, 1]}, {"orders": [2, 1]}],
            "scores": [-10.5, float("nan")],
        },
        "method": "fedprior_branch",
        "method_params": {"orders": [2, 1], "noise": "sensor"},
        "features": ["frequency_hz", "temperature_c"],
        "target": "pressure_hpa",
        "sensor_column": "sensor_id",
        "scaler": {
            "x_offset": [30000.0, 20.0],
            "x_scale": [2000.0, 30.0],
            "y_offset": [800.0],
            "y_scale": [500.0],
            "sources": {},
        },
        "input_range": {"frequency_hz": [28000.0, 32000.0], "temperature_c": [-10.0, 50.0]},
        "num_units": 16,
    }


def _dense(diagonal: float, off: float, p: int = 4) -> list[list[float]]:
    """A p×p SPD matrix: ``diagonal`` on it, ``off`` elsewhere (eigenvalues d − o, d + (p−1)o)."""
    return [[diagonal if i == j else off for j in range(p)] for i in range(p)]


def write(tmp_path, doc: dict, name: str = "prior.json"):
    path = tmp_path / name
    path.write_text(json.dumps(doc, indent=1))
    return path


def test_an_old_file_is_read_and_saved_with_its_version_every_number_unchanged(tmp_path):
    doc = v1_doc()
    model = PriorModel.load(write(tmp_path, doc))
    assert model.provenance.format_version == 1 and model.method == "fedprior_branch"
    assert model.basis.terms == ((0, 0), (1, 0), (0, 1)) and model.basis.branch_terms == ((0, 0),)
    assert model.basis.names() == ["1", "P1(frequency_hz)", "P1(temperature_c)", "b·1"]
    np.testing.assert_array_equal(model.covariance, np.array(doc["sigma"]))
    assert model.interval.probe_rows == 6.0 and model.interval.has_own
    assert model.selection.chosen == {"orders": [1, 1]}
    saved = json.loads(model.save(tmp_path / "again.json").read_text())
    assert saved.pop("format_version") == FORMAT_VERSION
    assert saved.pop("basis_family") == "legendre"
    # the rest is the old file, key for key and bit for bit (NaN written as NaN)
    assert json.dumps(saved) == json.dumps(doc)
    assert PriorModel.load(tmp_path / "again.json") == model
    with pytest.raises(AttributeError):  # a value: frozen
        model.target = "x"  # type: ignore[misc]
    with pytest.raises(ValueError):  # its arrays are read-only
        model.mean[0] = 1.0


def test_a_newer_format_is_refused_with_how_to_retrain(tmp_path):
    path = write(tmp_path, {**v1_doc(), "format_version": FORMAT_VERSION + 1})
    with pytest.raises(RunFileError) as err:
        PriorModel.load(path)
    text = str(err.value)
    assert "\n" not in text and str(path) in text and "format_version 3" in text
    assert "re-train the prior" in text and "fedcal run" in text


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda d: d.update(noise_var=-1e-4), "noise_var"),  # a negative variance
        (lambda d: d["interval"].update(discrepancy_var=-1e-6), "interval.discrepancy_var"),
        (lambda d: d["sigma"][1].__setitem__(1, -0.09), "sigma"),  # Σ not positive definite
        (lambda d: d["sigma"][0].__setitem__(1, 0.5), "sigma"),  # not symmetric
        (lambda d: d["mu"].append(0.0), "mu"),  # 5 means for 4 terms
        (lambda d: d["mu"].__setitem__(0, float("inf")), "mu"),
        (lambda d: d.update(noise_gamma=[0.1]), "noise_gamma"),  # one γ for 2 inputs
        (lambda d: d.update(noise_student=2), "noise_student"),
        (lambda d: d.update(branch_pinned=[[3, 0]]), "branch_pinned"),
        (lambda d: d["interval"].update(weak_projector=[[1.0]]), "interval.weak_projector"),
        (lambda d: d.update(basis_family="chebyshev"), "basis_family"),
        (lambda d: d.update(surprise={"a": 1}), "surprise"),  # known parts only
        (lambda d: d.update(format_version="2"), "format_version"),
        (lambda d: d.update(drift={"q": 0.1, "time_scale": 1.0, "seen": [[1.0]]}), "drift.seen"),
        (lambda d: d.update(drift={"q": -0.1, "time_scale": 1.0, "seen": [[1.0]]}), "drift.q"),
        # issue 35: magnitudes no prior in scaled units holds (calibrate served them before)
        (lambda d: d.update(mu=[1e300] * 4), "mu.0"),
        (lambda d: d["mu"].__setitem__(2, -2e6), "mu.2"),
        (lambda d: d.update(sigma=[[v * 1e300 for v in r] for r in d["sigma"]]), "sigma: an entry"),
        (lambda d: d.update(sigma=_dense(0.9e8, 0.8e8)), "sigma: an eigenvalue"),  # 3.3e8
        (lambda d: d.update(noise_var=1e308), "noise_var"),
        (lambda d: d.update(noise_gamma=[1e300, 0.0]), "noise_gamma.0"),
        (lambda d: d.update(noise_prior_points=-1.0), "noise_prior_points"),
        (lambda d: d["interval"].update(discrepancy_var=1e308), "interval.discrepancy_var"),
        (lambda d: d["interval"].update(discrepancy_var=float("inf")), "interval.discrepancy_var"),
        (lambda d: d["interval"].update(discrepancy_var_own=1e308), "interval.discrepancy_var_own"),
        (lambda d: d["interval"].update(probe_rows=-7), "interval.probe_rows"),
        (lambda d: d["interval"].update(probe_rows=6.5), "interval.probe_rows"),
        (lambda d: d["interval"].update(probe_rows=float("nan")), "interval.probe_rows"),
        (lambda d: d.update(identification=5), "identification: expected an object, got 5"),
        (lambda d: d["identification"].update(informed_units=12), "identification.informed_units"),
        (
            lambda d: d["identification"].update(weak_directions=-1),
            "identification.weak_directions",
        ),
        (lambda d: d["identification"].update(weak_terms=[3]), "identification.weak_terms.0"),
        (lambda d: d["identification"].update(extra=1), "identification.extra"),
    ],
)
def test_a_tampered_file_is_refused_in_one_line_naming_the_field(tmp_path, change, field):
    doc = v1_doc()
    change(doc)
    path = write(tmp_path, doc)
    with pytest.raises(RunFileError) as err:
        PriorModel.load(path)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"{path}: {field}"), text


def test_the_discrepancy_part_is_carried_through_load_and_save(tmp_path):
    from fedcal.prior.discrepancy import Discrepancy  # sigma's part: validated, carried

    part = Discrepancy(
        beta=0.5,
        amplitude=1e-6,
        lengths=(0.05, 0.05),
        kappa=1.1,
        nu0=math.inf,
        box_lo=(-1.0, -1.0),
        box_hi=(1.0, 1.0),
        min_points=6,
        max_points=64,
        min_levels=(2, 2),
        min_span=(0.3, 0.3),
    ).to_dict()
    model = PriorModel.load(write(tmp_path, {**v1_doc(), "discrepancy": part}))
    assert model.discrepancy == part
    assert json.loads(model.save(tmp_path / "b.json").read_text())["discrepancy"] == part


def test_a_declined_interval_keeps_its_nan(tmp_path):
    doc = v1_doc()
    doc["interval"].update(discrepancy_var=float("nan"), declined=4, reason="why")
    model = PriorModel.load(write(tmp_path, doc))
    assert math.isnan(model.interval.discrepancy_var) and model.interval.declined == 4
    assert PriorModel.load(model.save(tmp_path / "c.json")) == model


def test_the_largest_honest_magnitudes_load(tmp_path):
    """The bounds leave room for every honest prior: the gas network's Σ reaches an eigenvalue
    of 1.2e5 (45 terms of 8 correlated inputs), its |μ| 7.5; a probe of 0 rows (none);
    σ², τ² at their observed largest (0.3, 0.02) — and at the bounds themselves."""
    from fedcal.core.runfiles import MAX_MEAN, MAX_VARIANCE

    for sigma, mu, noise, tau in [
        (_dense(1.2e5, 0.0), -7.5, 0.3, 0.02),
        (_dense(MAX_VARIANCE / 4, MAX_VARIANCE / 4 - 1.0), MAX_MEAN, MAX_VARIANCE, MAX_VARIANCE),
    ]:
        doc = v1_doc()
        doc.update(sigma=sigma, noise_var=noise)
        doc["mu"][1] = mu
        doc["interval"].update(discrepancy_var=tau, probe_rows=0.0)
        model = PriorModel.load(write(tmp_path, doc))
        assert model.mean[1] == mu and model.noise.variance == noise
        assert model.interval.discrepancy_var == tau and model.interval.probe_rows == 0.0
