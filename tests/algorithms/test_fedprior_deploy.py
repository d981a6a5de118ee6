"""The reference units' design emulation (issue 33, fedprior_deploy E2–E4), checked by hand,
and the deployment path end to end: prior from reference units → calibrate → predict."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from fedcal.algorithms import fedprior_deploy as deploy
from fedcal.core.bayes import F64

Z = 1.959964


def plateau_unit() -> tuple[np.ndarray, np.ndarray]:
    """3 plateaus (T = −1, 0, 1), each an up sweep over 5 pressures then the down sweep;
    the response input reads p + 0.1·T. Row 10k + j: plateau k, up, pressure j."""
    rows, up = [], []
    for t in (-1.0, 0.0, 1.0):
        for p in (0.0, 0.25, 0.5, 0.75, 1.0):
            rows.append((p + 0.1 * t, t))
            up.append(True)
        for p in (1.0, 0.75, 0.5, 0.25, 0.0):
            rows.append((p + 0.1 * t, t))
            up.append(False)
    return np.array(rows), np.array(up)


def test_a_grid_design_is_the_nearest_ascending_rows_on_the_nearest_plateaus():
    x, up = plateau_unit()
    designs = deploy.unit_designs(x, up, seed=0)
    grids = {
        deploy.FAMILIES[f]: rows.tolist()
        for f, rows in designs
        if deploy.FAMILIES[f] in deploy.GRIDS
    }
    # 3x2: plateaus at the span's ends (k = 0, 2), pressures 0, ½, 1 of each up sweep
    assert grids["3x2"] == [0, 2, 4, 20, 22, 24]
    # 4x3: all three plateaus, pressures 0, ⅓, ⅔, 1 → the nearest of 0, .25, .5, .75, 1
    assert grids["4x3"] == [0, 1, 3, 4, 10, 11, 13, 14, 20, 21, 23, 24]
    # without directions every row may be taken; the down sweep's rows are never preferred
    random = [rows for f, rows in designs if deploy.FAMILIES[f] not in deploy.GRIDS]
    assert len(random) == 2 * deploy.DRAWS and all(up[r].all() for r in random)
    assert all(len(np.unique(x[r, 1])) in (2, 3) for r in random)


def two_point_emulation(err2: list[float], vc: float, sn: float) -> dict[str, torch.Tensor]:
    """One reference unit, one 2-point design (family 0) kept, ``err2`` on its held-out rows;
    A = 0, so q = 1 − 0 + 0 = 1 exactly and v = β v_c + σ² + a²."""
    held = len(err2)
    rows = 2 + held
    t = lambda v: torch.tensor(v, dtype=F64)  # noqa: E731
    return {
        "family": torch.tensor([0]),
        "unit": torch.tensor([0]),
        "held": t([[0.0, 0.0] + [1.0] * held]),
        "err2": t([[0.0, 0.0, *err2]]),
        "vc": torch.full((1, rows), vc, dtype=F64),
        "sn": torch.full((1, rows), sn, dtype=F64),
        "x": torch.zeros(1, rows, 2, dtype=F64),
        "phi": torch.ones(1, rows, 1, dtype=F64),
        "xd": t([[[-1.0, -1.0], [1.0, 1.0]]]),
        "km": torch.ones(1, 2, dtype=F64),
        "a": torch.zeros(1, 2, 1, dtype=F64),
        "zd": t([[[1.0], [1.0]]]),
        "sigma": t([[[1.0]]]),
        "noise": t([sn]),
        "resid": t([[0.1, -0.1]]),
        "dof": t([2.0]),
    }


def test_the_emulation_counts_of_a_two_point_design_by_hand():
    beta, amp, vc, sn = 0.5, 0.25, 2.0, 0.75  # v = 0.5·2 + 0.75 + 0.25 = 2
    v = beta * vc + sn + amp
    needed = [0.64, 1.0, 2.25, 6.25]  # κ² at which each held row comes inside
    em = two_point_emulation([c * Z**2 * v for c in needed], vc, sn)
    sums = deploy.scale_sums(em, beta, amp, torch.ones(2, dtype=F64), units=1)
    assert sums["held"][0].tolist() == [4.0, 0.0, 0.0, 0.0, 0.0]
    inf = deploy.NU_GRID.index(math.inf)
    for g, kappa in enumerate(deploy.KAPPA_GRID.tolist()):
        by_hand = sum(kappa**2 >= c * (1 + 1e-12) for c in needed)
        if any(abs(kappa**2 - c) < 1e-9 for c in needed):
            continue  # on a boundary: rounding decides
        assert float(sums["inside"][0, 0, inf, g]) == by_hand, kappa
    # the Gaussian log score at κ = 1 by hand: Σ −½(log 2πv + e²/v)
    g1 = int(torch.argmin((deploy.KAPPA_GRID - 1.0).abs()))
    k2 = float(deploy.KAPPA_GRID[g1]) ** 2
    want = sum(-0.5 * (math.log(2 * math.pi * k2 * v) + c * Z**2 / k2) for c in needed)
    assert float(sums["score"][0, inf, g1]) == pytest.approx(want, rel=1e-12)
    # pass 1 (E3): at β, a² of the grid the same density with κ = 1
    b = int(torch.argmin((deploy.BETA_GRID - beta).abs()))
    a = int(torch.argmin((deploy.AMP_GRID * sn - amp).abs()))
    beta_g, amp_g = float(deploy.BETA_GRID[b]), float(deploy.AMP_GRID[a]) * sn
    hyper = deploy.hyper_sums(em, sn, units=1)
    vg = beta_g * vc + sn + amp_g
    want = sum(-0.5 * (math.log(2 * math.pi * vg) + c * Z**2 * v / vg) for c in needed)
    assert float(hyper[0, b, a, 0]) == pytest.approx(want, rel=1e-12)


def test_kappa_is_the_smallest_that_covers_95_percent_pooled():
    # 100 held rows: row k comes inside at κ = 0.5 + k/100; 95 % inside from κ = 1.44 + ε
    needed = [(0.5 + k / 100) ** 2 for k in range(100)]
    em = two_point_emulation([c * Z**2 * 1.0 for c in needed], 0.0, 1.0)
    sums = deploy.scale_sums(em, 1.0, 1e-300, torch.ones(2, dtype=F64), units=1)
    n, kappa, family = deploy.choose(sums)
    assert deploy.NU_GRID[n] in deploy.NU_GRID
    assert 1.44 - 0.03 < kappa < 1.45 + 0.03  # within the grid's 2.3 % step
    assert family[0] == pytest.approx(0.95, abs=0.02)


@pytest.fixture(scope="module")
def deployment():
    """4 reference units (the 384-point campaign) → the prior through the Python API (what
    `fedcal run` does), and new units of fedcal's simulator at a 3x2 grid and on one plateau."""
    from fedcal.api import FleetPrior
    from fedcal.data.simulator import FleetSpec, simulate_fleet

    columns = ["sensor_id", "frequency_hz", "temperature_c", "pressure_hpa", "direction", "split"]
    spec = FleetSpec(num_reference=4, num_new=3, train_design="3x2", test_design="random")
    frame = simulate_fleet(spec, 0).frame
    prior = FleetPrior(rounds=5).fit(frame[frame["role"] == "reference"][columns])
    new = frame[frame["role"] == "new"]
    return prior, new[new["split"] == "train"][columns], new[new["split"] == "test"]


def test_the_deployment_path_states_a_sigma_and_declines_an_unspanned_design(deployment):
    prior, train, test = deployment
    doc = prior.model_.discrepancy
    assert doc["units"] == 4 and doc["min_levels"][1] == 2
    one = train[train["sensor_id"] == train["sensor_id"].iloc[0]].copy()
    one["sensor_id"] = "flat"
    one["temperature_c"] = one["temperature_c"].iloc[0]  # every point on one plateau
    units = prior.calibrate(pd.concat([train, one], ignore_index=True))
    rows = pd.concat(
        [test, test[test["sensor_id"] == test["sensor_id"].iloc[0]].assign(sensor_id="flat")]
    )
    _, std = units.predict(rows[["sensor_id", "frequency_hz", "temperature_c"]], return_std=True)
    flat = (rows["sensor_id"] == "flat").to_numpy()
    assert np.isfinite(std[~flat]).all() and (std[~flat] > 0).all()
    assert np.isnan(std[flat]).all()
    assert "level(s) of temperature_c" in units.result.reasons[-1]
    assert all(r == "" for r in units.result.reasons[:-1])


def test_a_bad_discrepancy_in_the_prior_file_is_refused(deployment, tmp_path):
    import dataclasses
    import json

    from fedcal.calibration import calibrate
    from fedcal.data.loader import load_fleet
    from fedcal.prior.model import PriorModel

    prior, train, _ = deployment
    bad = {**prior.model_.discrepancy, "amplitude": -1.0}
    model = dataclasses.replace(prior.model_, discrepancy=bad)
    fleet = load_fleet(
        train,
        features=list(model.features),
        target=model.target,
        test_fraction=0.0,
        min_train_points=1,
        min_test_points=0,
    )
    with pytest.raises(ValueError, match=r"^prior.json: discrepancy.amplitude: expected a finite"):
        calibrate(model, fleet, "new.csv")
    # and the file: loading it is refused, in one line naming the file and the field
    doc = prior.model_.to_dict()
    doc["discrepancy"] = {**doc["discrepancy"], "lengths": [0.05, -1.0]}
    path = tmp_path / "prior.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError) as err:
        PriorModel.load(path)
    assert "discrepancy.lengths" in str(err.value) and "\n" not in str(err.value)
