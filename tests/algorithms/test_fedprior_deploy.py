"""The reference units' design emulation (issue 33, fedprior_deploy E2–E4), checked by hand,
and the deployment path end to end: prior from reference units → calibrate → predict."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from fedcal.algorithms import fedprior_deploy as deploy
from fedcal.algorithms import fedprior_deploy_kappa as knots
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
    # a 2-point design sits below the first knot (6 points): all its weight is that knot's
    assert sums["held"][0].tolist() == [4.0] + [0.0] * (len(knots.KNOTS) - 1)
    assert float(sums["logn"][0, 0]) == pytest.approx(4.0 * math.log(2.0), rel=1e-12)
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
    assert float(sums["score"][0, 0, inf, g1]) == pytest.approx(want, rel=1e-12)
    # pass 1 (E3): at β, a² of the grid the same density with κ = 1
    b = int(torch.argmin((deploy.BETA_GRID - beta).abs()))
    a = int(torch.argmin((deploy.AMP_GRID * sn - amp).abs()))
    beta_g, amp_g = float(deploy.BETA_GRID[b]), float(deploy.AMP_GRID[a]) * sn
    hyper = deploy.hyper_sums(em, sn, units=1)
    vg = beta_g * vc + sn + amp_g
    want = sum(-0.5 * (math.log(2 * math.pi * vg) + c * Z**2 * v / vg) for c in needed)
    assert float(hyper[0, b, a, 0]) == pytest.approx(want, rel=1e-12)


def test_the_mean_per_unit_scale_of_the_emulated_designs_by_hand():
    # E4c: two 2-point designs of one unit (below the first knot: all weight on it), A = 0,
    # Z_D = [1, 1]ᵀ, Σ = 1, x_D = (−1, −1), (1, 1), ℓ = 1: C = β11ᵀ + a²K + σ²I with
    # K's off-diagonal e⁻⁴. r = (0.1, −0.1) lies on C's eigenvector (1, −1), eigenvalue
    # a²(1 − e⁻⁴) + σ², so d² = 0.02 / that; r = (0.3, 0.3) on (1, 1), eigenvalue
    # 2β + a²(1 + e⁻⁴) + σ², d² = 0.18 / that. s² = (ν₀ + d²)/(ν₀ + 2) per ν₀ (D4).
    beta, amp, vc, sn = 0.5, 0.25, 2.0, 0.75
    one, two = (two_point_emulation([1.0, 2.0], vc, sn) for _ in range(2))
    two["resid"] = torch.tensor([[0.3, 0.3]], dtype=F64)
    em = {k: torch.cat([one[k], two[k]]) for k in one}
    em["sigma"], em["unit"] = one["sigma"], torch.tensor([0, 0])
    e4 = math.exp(-4.0)
    d2 = [0.02 / (amp * (1 - e4) + sn), 0.18 / (2 * beta + amp * (1 + e4) + sn)]
    sums = deploy.scale_sums(em, beta, amp, torch.ones(2, dtype=F64), units=1)
    assert sums["designs"][0].tolist() == [2.0] + [0.0] * (len(knots.KNOTS) - 1)
    for g, nu0 in enumerate(knots.NU_GRID):
        s2 = [1.0, 1.0] if math.isinf(nu0) else [(nu0 + d) / (nu0 + 2) for d in d2]
        assert float(sums["s2"][0, 0, g]) == pytest.approx(sum(s2), rel=1e-12), nu0
        assert float(sums["s2"][0, 1:, g].abs().sum()) == 0.0
    # the server's record: 4 held rows are fewer than a knot needs, so one pooled mean
    pick = knots.choose(sums)
    nu0 = knots.NU_GRID[pick.nu]
    want = 1.0 if math.isinf(nu0) else sum((nu0 + d) / (nu0 + 2) for d in d2) / 2
    assert pick.knots == () and pick.scales == pytest.approx((want,), rel=1e-12)


def test_the_mean_scale_is_recorded_per_knot_for_the_chosen_nu0():
    # designs of 6, 12, 24, 48 points (two each, each on a knot), v = 1, Z_D = 0 and
    # r = c_n on every point: d² = c_n² n, s² = (ν₀ + c_n² n)/(ν₀ + n) at each knot for
    # the ν₀ the log score chooses (planted: the first of the grid's)
    sizes = [6, 12, 24, 48]
    c = {6: 2.0, 12: 1.5, 24: 1.0, 48: 0.5}
    em = sized_emulation(sizes * 2, lambda n: 0.9)
    em["resid"] = em["km"] * torch.tensor([c[n] for n in sizes * 2], dtype=F64).unsqueeze(-1)
    sums = deploy.scale_sums(em, 1.0, 1e-300, torch.ones(2, dtype=F64), units=len(sizes) * 2)
    score = torch.zeros_like(sums["score"])
    score[:, :, 0] = 1.0  # ν₀ = NU_GRID[0] scores best
    pick = knots.choose({**sums, "score": score})
    nu0 = knots.NU_GRID[pick.nu]
    assert pick.nu == 0 and [n for n, _ in pick.knots] == pytest.approx(sizes, rel=1e-9)
    want = [(nu0 + c[n] ** 2 * n) / (nu0 + n) for n in sizes]
    assert pick.scales == pytest.approx(want, rel=1e-12)


def test_kappa_is_the_smallest_that_covers_95_percent_pooled():
    # 100 held rows: row k comes inside at κ = 0.5 + k/100; 95 % inside from κ = 1.44 + ε.
    # 100 rows are fewer than a knot needs (MIN_KNOT_HELD): one κ for every size, no knots
    needed = [(0.5 + k / 100) ** 2 for k in range(100)]
    em = two_point_emulation([c * Z**2 * 1.0 for c in needed], 0.0, 1.0)
    sums = deploy.scale_sums(em, 1.0, 1e-300, torch.ones(2, dtype=F64), units=1)
    pick = knots.choose(sums)
    assert pick.nu >= 0 and pick.knots == ()
    assert 1.44 - 0.03 < pick.kappa < 1.45 + 0.03  # within the grid's 2.3 % step


def sized_emulation(sizes: list[int], planted, rows: int = 300) -> dict[str, torch.Tensor]:
    """One pseudo-unit per size n, v = 1 on ``rows`` held rows (A = 0: q = 1; Z_D = 0 and
    r = 1: d² = n, so s_i² = 1 for every ν₀), errors |e_j| = planted(n)·1.96·(j + ½)/285:
    exactly 285 of 300 (95 %) inside ±1.96·κ at κ = planted(n)."""
    b, nmax = len(sizes), max(sizes)
    t = (torch.arange(rows, dtype=F64) + 0.5) / (0.95 * rows)
    km = torch.stack([(torch.arange(nmax) < n).to(F64) for n in sizes])
    return {
        "family": torch.zeros(b, dtype=torch.long),
        "unit": torch.arange(b),
        "held": torch.ones(b, rows, dtype=F64),
        "err2": torch.stack([(planted(n) * Z * t).square() for n in sizes]),
        "vc": torch.zeros(b, rows, dtype=F64),
        "sn": torch.ones(b, rows, dtype=F64),
        "x": torch.zeros(b, rows, 2, dtype=F64),
        "phi": torch.ones(b, rows, 1, dtype=F64),
        "xd": torch.linspace(-1, 1, nmax, dtype=F64).reshape(1, -1, 1).expand(b, -1, 2).clone(),
        "km": km,
        "a": torch.zeros(b, nmax, 1, dtype=F64),
        "zd": torch.zeros(b, nmax, 1, dtype=F64),
        "sigma": torch.ones(1, 1, dtype=F64),
        "noise": torch.ones(b, dtype=F64),
        "resid": km.clone(),
        "dof": km.sum(1),
    }


def test_a_planted_kappa_of_the_design_size_is_recovered():
    # κ(n) = 0.8·(n/6)^0.3 planted on designs of 6, 12, 24, 48 points (each on a knot):
    # each knot recovers its κ to the grid's interpolation (the share is linear in κ
    # between grid points only approximately: ±1 % here), at the design's own size, and
    # the model's κ(n) between knots is the log-log interpolation
    from fedcal.prior.discrepancy import interval_factor, kappa_at

    def planted(n: int) -> float:
        return 0.8 * (n / 6) ** 0.3

    sizes = [6, 12, 24, 48]
    em = sized_emulation(sizes * 2, planted)
    sums = deploy.scale_sums(em, 1.0, 1e-300, torch.ones(2, dtype=F64), units=len(sizes) * 2)
    pick = knots.choose(sums)
    assert [n for n, _ in pick.knots] == pytest.approx(sizes, rel=1e-9)
    nu0 = knots.NU_GRID[pick.nu]
    for n, kappa in pick.knots:  # the stated scale κ²(t/1.96)² at s² = 1 is the planted κ²
        tf = float(interval_factor(nu0, torch.tensor([n], dtype=F64))[0])
        assert kappa * math.sqrt(tf) == pytest.approx(planted(n), rel=0.01), n
    model = _model_with(pick)
    if math.isinf(nu0):  # between knots, log κ linear in log n: 0.8·(n/6)^0.3 exactly
        for n in (8.0, 17.0, 36.0):
            got = float(kappa_at(model, torch.tensor([n], dtype=F64))[0])
            assert got == pytest.approx(planted(n), rel=0.01)
    # beyond the knots κ is the end knot's (no extrapolation; design_reason declines there)
    ends = kappa_at(model, torch.tensor([2.0, 60.0], dtype=F64)).tolist()
    assert ends == pytest.approx([pick.knots[0][1], pick.knots[-1][1]], rel=1e-12)


def _model_with(pick):
    from fedcal.prior.discrepancy import Discrepancy

    return Discrepancy(
        beta=1.0,
        amplitude=1e-9,
        lengths=(0.05, 0.05),
        kappa=pick.kappa,
        nu0=knots.NU_GRID[pick.nu],
        box_lo=(-1.0, -1.0),
        box_hi=(1.0, 1.0),
        min_points=6,
        max_points=48,
        min_levels=(2, 2),
        min_span=(0.5, 0.5),
        kappa_points=pick.knots,
    )


def test_a_design_between_two_knots_is_shared_by_them_in_log_n():
    w = knots.knot_weights(torch.tensor([6.0, 4.0, 10.0, 100.0, 36.0**0.5 * 8**0.5]))
    assert w.sum(1).tolist() == pytest.approx([1.0] * 5, rel=1e-12)
    assert w[0, 0] == 1.0 and w[1, 0] == 1.0 and w[3, -1] == 1.0  # on / below / beyond
    i12 = knots.KNOTS.index(12.0)
    share = math.log(12 / 10) / math.log(12 / 8)  # 10 points: between the 8 and 12 knots
    assert float(w[2, i12 - 1]) == pytest.approx(share, rel=1e-12)
    assert float(w[2, i12]) == pytest.approx(1 - share, rel=1e-12)


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
    assert "level(s) of temperature_c" in units.reasons[-1]
    assert all(r == "" for r in units.reasons[:-1])


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
    # a² within the file's absolute bound but beyond 1e10 × this prior's σ²: not learned here
    noise = model.noise.variance
    assert 1e10 * noise < 1e9
    big = dataclasses.replace(
        prior.model_, discrepancy={**prior.model_.discrepancy, "amplitude": 1e9}
    )
    with pytest.raises(ValueError, match=r"^prior.json: discrepancy.amplitude: .* noise variance"):
        calibrate(big, fleet, "new.csv")
    # and the file: loading it is refused, in one line naming the file and the field
    doc = prior.model_.to_dict()
    doc["discrepancy"] = {**doc["discrepancy"], "lengths": [0.05, -1.0]}
    path = tmp_path / "prior.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError) as err:
        PriorModel.load(path)
    assert "discrepancy.lengths" in str(err.value) and "\n" not in str(err.value)


def _reference_data(prior):
    """The prior's algorithm, its server state, and the reference fleet as the run's
    ClientData (scaled), from ``deployment``'s campaign units."""
    from fedcal.api import FleetPrior  # noqa: F401  (the fixture's prior)
    from fedcal.calibration import prior_algorithm, prior_server
    from fedcal.core.data import ClientData
    from fedcal.data.loader import load_fleet
    from fedcal.data.simulator import FleetSpec, simulate_fleet

    model = prior.model_
    frame = simulate_fleet(FleetSpec(num_reference=4, num_new=0), 0).frame
    fleet = load_fleet(
        frame[frame["split"] == "train"],
        features=list(model.features),
        target=model.target,
        test_fraction=0.0,
        min_train_points=1,
        min_test_points=0,
    )
    arrays = [(model.scaler.x(x), model.scaler.y(y)) for x, y in fleet.arrays("train")]
    data = ClientData.from_arrays(arrays, dtype=F64, branch=fleet.branch_signs("train"))
    return prior_algorithm(model), prior_server(model), data


def test_a_unit_of_33_to_64_points_gets_the_learned_sigma_from_a_reference_only_prior(
    deployment,
):
    # A prior of reference units only has no probe: fedprior's I2/I4 learned nothing for
    # any small design, so an 8x5 (40-point) unit must take the discrepancy model (a² > 0),
    # not I4's τ² learned by 384-point units on their own rows (issue 33, review fix 1).
    from fedcal.data.simulator import FleetSpec, simulate_fleet

    prior, _, _ = deployment
    columns = ["sensor_id", "frequency_hz", "temperature_c", "pressure_hpa", "direction", "split"]
    spec = FleetSpec(num_reference=4, num_new=2, train_design="8x5", test_design="random")
    frame = simulate_fleet(spec, 0).frame
    new = frame[(frame["role"] == "new") & (frame["split"] == "train")][columns]
    assert set(new.groupby("sensor_id").size()) == {40}
    units = prior.calibrate(new)
    assert prior.model_.discrepancy["max_points"] >= 40
    assert (units.params["gp_amp"] > 0).all()
    assert all(r == "" for r in units.reasons)


def test_a_unit_larger_than_the_largest_emulated_design_is_declined_with_its_reason(
    deployment,
):
    # the campaign units emulate up to their max-grid (10×6 = 60 points): a 64-point unit
    # (8×8) would take κ(n) extrapolated, so it gets no σ and says why (issue 33, session 12)
    from fedcal.data.simulator import FleetSpec, simulate_fleet

    prior, _, _ = deployment
    largest = prior.model_.discrepancy["max_points"]
    assert largest == 60 and prior.model_.discrepancy["kappa_points"][-1][0] <= largest
    columns = ["sensor_id", "frequency_hz", "temperature_c", "pressure_hpa", "direction", "split"]
    spec = FleetSpec(num_reference=4, num_new=1, train_design="8x8", test_design="random")
    frame = simulate_fleet(spec, 0).frame
    new = frame[(frame["role"] == "new") & (frame["split"] == "train")][columns]
    units = prior.calibrate(new)
    assert units.reasons == (
        "no σ: 64 points, more than the largest design the reference units emulated (60), "
        "so how far its error exceeds the model's was not learned",
    )
    test = frame[(frame["role"] == "new") & (frame["split"] == "test")]
    _, std = units.predict(test[columns[:3]], return_std=True)
    assert np.isnan(std).all()


def test_no_discrepancy_is_learned_with_per_sensor_noise(deployment):
    # κ learned under the fleet σ² would be applied under each unit's σ_i² (review fix 2)
    import dataclasses

    prior, _, _ = deployment
    alg, server, data = _reference_data(prior)
    assert alg.deploy == "learn" and alg.noise == "fleet"
    assert alg.deploy_state(server, data) is not None  # the control: learned with one σ²
    sensor = dataclasses.replace(alg, noise="sensor")
    assert sensor.deploy_state(server, data) is None


def test_leave_one_out_mean_is_the_gls_refit_without_the_unit_in_a_mixed_fleet(deployment):
    # 4 campaign units (384 points) and 4 units of 6 points: removing unit i must remove its
    # GLS weight, so μ_(−i) is m_step's solve without i's terms, shifted by the full solve's
    # own step (exactly μ − (G − G_i)⁺R_i at the fixed point): checked against m_step.
    from fedcal.core.bayes import m_step, moments, posterior
    from fedcal.core.data import ClientData

    prior, _, _ = deployment
    alg, server, big = _reference_data(prior)
    rows = [(big.x[i, :6].numpy(), big.y[i, :6].numpy()) for i in range(4)]
    full = [
        (big.x[i, : int(big.count[i])].numpy(), big.y[i, : int(big.count[i])].numpy())
        for i in range(4)
    ]
    data = ClientData.from_arrays(full + rows, dtype=F64)
    n = data.num_clients
    down = {
        k: v.unsqueeze(0).expand(n, *v.shape)
        for k, v in alg.broadcast(server).items()
        if k != "cand"
    }
    refs = torch.tensor([0, 2, 5])
    loo = deploy._leave_one_out(alg, down, data, refs)
    z = alg.design(data.x.to(F64), None).to(F64)
    post = posterior(
        moments(z, data.y[..., 0].to(F64), data.mask.to(F64)),
        down["mu"][0].to(F64),
        down["sigma"][0].to(F64),
        down["noise_var"].to(F64),
    )
    mu = down["mu"][0].to(F64)
    ones = torch.ones(n, dtype=F64)

    def solve(units: torch.Tensor) -> torch.Tensor:
        g, r = post.gls_gram[units].sum(0), post.gls_rhs[units].sum(0)
        s2 = post.mean[units]
        return m_step(g, r, s2.sum(0), s2.T @ s2, ones[units].sum(), mu, alg.mean_scale)[0]

    base = solve(torch.arange(n))
    worst = 0.0
    for k, i in enumerate(refs.tolist()):
        exact = mu + solve(torch.tensor([j for j in range(n) if j != i])) - base
        scale = float((exact - mu).abs().max())
        assert scale > 0
        # both solve (G − G_i + I/s²) by eigenvalues: they agree to the solve's rounding,
        # ε·cond·(|μ| + the shift) (cond of the campaign units' GLS gram: ~1e7 here)
        keep = [j for j in range(n) if j != i]
        gram = post.gls_gram[keep].sum(0) + torch.eye(mu.shape[0], dtype=F64) / alg.mean_scale**2
        cond = float(torch.linalg.cond(gram))
        tol = 16 * torch.finfo(F64).eps * cond * (float(mu.abs().max()) + scale)
        diff = float((loo["mu"][k] - exact).abs().max())
        assert diff <= tol, (i, diff, tol, cond)
        assert tol < 0.05 * scale  # the check is tighter than the shift it checks
        # the equal-weight rule μ − (m_i − μ)/(N − 1) misses it by far more
        old = mu - (post.mean[i] - mu) / (n - 1)
        worst = max(worst, float((old - exact).abs().max()) / tol)
    assert worst > 10  # measured 18 here (4 campaign units of 8: near-equal weights)


def test_a_fleet_with_few_point_units_learns_no_discrepancy(deployment):
    # its few-point units give I2 its τ²; removing one of its references would change Σ
    # and the identified directions, which the leave-one-out does not follow (review fix 3)
    from fedcal.core.data import ClientData

    prior, _, _ = deployment
    alg, server, big = _reference_data(prior)
    units = [
        (big.x[i, : int(big.count[i])].numpy(), big.y[i, : int(big.count[i])].numpy())
        for i in range(4)
    ]
    assert alg.deploy_state(server, ClientData.from_arrays(units, dtype=F64)) is not None
    few = [(big.x[0, :32].numpy(), big.y[0, :32].numpy())]  # probe_rows = 32 rows
    assert alg.deploy_state(server, ClientData.from_arrays(units + few, dtype=F64)) is None
