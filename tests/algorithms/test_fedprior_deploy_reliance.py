"""E6 of the deployment emulation (issue 33): the references learn how much of the prior their
emulated designs relied on, and a new design that leans on it further is declined (D6 of
fedcal.prior.design_span) — on the torch path and the NumPy path alike."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from fedcal.algorithms.fedprior_deploy_reliance import RELIANCE_GRID, max_reliance, reliance_sums

F64 = torch.float64
COLUMNS = ["sensor_id", "frequency_hz", "temperature_c", "pressure_hpa", "direction", "split"]


def emulation(u: list[float], rows: list[float], unit: list[int]) -> dict[str, torch.Tensor]:
    """Designs whose reliance is ``u`` (V = u·I/p on a p = 2 basis, M = I, σ² = 1: tr(VM) = u)
    with ``rows`` held-out rows each, of reference ``unit``."""
    cov = torch.stack([torch.eye(2, dtype=F64) * v / 2 for v in u])
    held = torch.zeros(len(u), int(max(rows)), dtype=F64)
    for b, r in enumerate(rows):
        held[b, : int(r)] = 1.0
    return {
        "cov": cov,
        "noise": torch.ones(len(u), dtype=F64),
        "held": held,
        "unit": torch.tensor(unit),
    }


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        # rows at u ≥ level: 400 up to 1, 200 up to 10, 100 up to 100: 256 reached up to 1
        ([200.0, 100.0, 100.0], 1.0),
        # 300 up to 10 (the u = 10 and u = 100 designs): up to 10
        ([100.0, 200.0, 100.0], 10.0),
        # 300 held-out rows at u = 100 alone
        ([100.0, 100.0, 300.0], 100.0),
    ],
)
def test_max_reliance_is_the_largest_level_held_by_a_knot_s_rows(rows, expected):
    em = emulation([1.0, 10.0, 100.0], rows, [0, 1, 1])
    sums = reliance_sums(em, torch.eye(2, dtype=F64), units=3)
    assert sums.shape == (3, len(RELIANCE_GRID)) and float(sums[2].sum()) == 0.0  # unit 2: none
    # the uploads are per unit: unit 0's one design, unit 1's two
    at = int(torch.searchsorted(RELIANCE_GRID, torch.tensor(5.0, dtype=F64)))
    assert sums[:, at].tolist() == [0.0, rows[1] + rows[2], 0.0]
    assert max_reliance(sums) == pytest.approx(expected, rel=1e-9)
    # fewer held-out rows in all than a knot needs: the largest level any design reached
    few = reliance_sums(emulation([1.0, 10.0], [50.0, 50.0], [0, 1]), torch.eye(2, dtype=F64), 2)
    assert max_reliance(few) == pytest.approx(10.0, rel=1e-9)


def _lhs_points(n: int = 48) -> tuple[tuple[float, float, str], ...]:
    """A Latin hypercube over fedcal's calibrated box: every point its own temperature."""
    rng = np.random.default_rng(7)
    p = 50 + 1500 * (rng.permutation(n) + rng.random(n)) / n
    t = -40 + 100 * (rng.permutation(n) + rng.random(n)) / n
    return tuple((float(a), float(b), "up") for a, b in zip(p, t, strict=True))


def _fleet(references: str, design: str):
    from fedcal.data.simulator import FleetSpec, simulate_fleet

    kw = {"reference_design": "points", "design_points": _lhs_points()} if references else {}
    spec = FleetSpec(num_reference=6, num_new=3, train_design=design, test_design="random", **kw)
    return simulate_fleet(spec, 0).frame


@pytest.fixture(scope="module", params=["lhs", ""], ids=["no plateaus", "campaign"])
def fitted(request):
    """6 reference units (a 48-point Latin hypercube, or fedcal's campaign) → the prior, and
    3 new units at 3x2 and 3 at 6x4 (one file)."""
    from fedcal.api import FleetPrior

    frame = _fleet(request.param, "3x2")
    prior = FleetPrior(rounds=5).fit(frame[frame["role"] == "reference"][COLUMNS])
    parts = []
    for design in ("3x2", "6x4"):
        f = _fleet(request.param, design)
        new = f[(f["role"] == "new") & (f["split"] == "train")][COLUMNS]
        parts.append(new.assign(sensor_id=design + "-" + new["sensor_id"]))
    return request.param, prior, pd.concat(parts, ignore_index=True)


def test_a_plateau_design_is_declined_where_the_references_have_no_plateaus(fitted):
    """References without plateaus emulate a 3x2 by their six nearest rows, at six
    temperatures: those designs leave the prior far less than a real 3x2 (two temperatures),
    so a 3x2 unit is declined with D6's reason; a 6x4 is not (its reliance is within what
    the emulation tested). Campaign references emulate the 3x2 itself: nothing declined."""
    lhs, prior, new = fitted
    doc = prior.model_.discrepancy
    assert np.isfinite(doc["max_reliance"]) and doc["max_reliance"] > 0
    from fedcal.calibrated import sensor_ids

    units = prior.calibrate(new)
    why = dict(zip(sensor_ids(units.result), units.reasons, strict=True))
    small = [w for k, w in why.items() if k.startswith("3x2")]
    large = [w for k, w in why.items() if k.startswith("6x4")]
    assert len(small) == len(large) == 3
    assert large == ["", "", ""]
    if lhs:
        assert all(w.startswith("no σ: the design leaves the prior ") for w in small), small
    else:
        assert small == ["", "", ""]


def test_the_numpy_and_torch_paths_decline_alike(fitted):
    from fedcal.calibration import calibrate
    from fedcal.data.loader import load_fleet
    from fedcal.prior import posterior
    from fedcal.prior.calibrate_dir import declined_note

    lhs, prior, new = fitted
    model = prior.model_
    fleet = load_fleet(
        new,
        features=list(model.features),
        target=model.target,
        test_fraction=0.0,
        min_train_points=1,
        min_test_points=0,
    )
    torch_path = calibrate(model, fleet, "new.csv")
    x, y, mask, branch = posterior.padded_rows(model, fleet)
    numpy_path = posterior.calibrate_units(model, x, y, mask, branch)
    assert tuple(numpy_path.reasons) == torch_path.reasons
    declined = torch_path.personal["declined"].numpy() > 0
    assert (np.asarray(numpy_path.declined) == declined).all()
    # calibrate's one-line note (its console table and summary.csv) carries D6's reason
    note = declined_note(model, numpy_path.declined, numpy_path.reasons)
    assert note.startswith("no σ: the design leaves the prior ") if lhs else note == ""
    assert "\n" not in note
