"""fedcal.planning: the design criterion against a hand-computed posterior, the optimizer's
guarantees, the chamber's limits, sequential mode's stop rule, and ``fedcal plan``."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from fedcal import planning
from fedcal.cli import app
from fedcal.data.fleet import Fleet
from fedcal.data.simulator import FleetSpec, simulate_fleet
from fedcal.prior import posterior
from fedcal.prior.model import PriorModel

R3 = math.sqrt(3.0)
# Scaled mean model of the tiny prior: y = 0.9·x0 + 0.05·x1 (x0 frequency, x1 temperature).
A, B = 0.9, 0.05
SIGMA_C = np.array(
    [
        [0.010, 0.001, 0.002, 0.000],
        [0.001, 0.004, 0.000, 0.0005],
        [0.002, 0.000, 0.020, 0.001],
        [0.000, 0.0005, 0.001, 0.001],
    ]
)
NOISE = 1e-4


def tiny_prior(branch: bool = False) -> dict:
    """A fedprior prior.json on the (1, 1) Legendre basis: terms 1, P1(x0), P1(x1), P1·P1."""
    mu = [0.0, A / R3, B / R3, 0.0]
    sigma = SIGMA_C.copy()
    params = {"orders": [1, 1], "select": "none"}
    doc = {
        "kind": "fedprior",
        "terms": [[0, 0], [1, 0], [0, 1], [1, 1]],
        "noise_var": NOISE,
        "noise": "fleet",
        "method": "fedprior",
        "features": ["frequency_hz", "temperature_c"],
        "target": "pressure_hpa",
        "scaler": {
            "x_offset": [33000.0, 10.0],
            "x_scale": [5000.0, 50.0],
            "y_offset": [800.0],
            "y_scale": [800.0],
            "sources": {},
        },
        "input_range": {"frequency_hz": [28000.0, 38000.0], "temperature_c": [-40.0, 60.0]},
    }
    if branch:  # ψ = 1: h a constant offset between sweeps, correlated with the c's
        params["branch_orders"] = [0, 0]
        mu = [*mu, 0.002]
        sigma = np.zeros((5, 5))
        sigma[:4, :4] = SIGMA_C
        sigma[4, 4] = 1e-5
        sigma[4, 2] = sigma[2, 4] = 2e-5
        doc["branch_terms"] = [[0, 0]]
    doc.update(mu=mu, sigma=sigma.tolist(), method_params=params)
    return doc


CHAMBER = planning.Chamber((-40.0, 10.0, 60.0), (50.0, 800.0, 1550.0), ("up",))
CHAMBER2 = planning.Chamber((-40.0, 10.0, 60.0), (50.0, 800.0, 1550.0), ("up", "down"))


def hand_x(p, t):
    """Scaled inputs of a chamber point under the prior mean, solved by hand."""
    y, x1 = (np.asarray(p) - 800.0) / 800.0, (np.asarray(t) - 10.0) / 50.0
    return (y - B * x1) / A, x1


def hand_phi(x0, x1):
    return np.stack([np.ones_like(x0), R3 * x0, R3 * x1, 3.0 * x0 * x1], -1)


def hand_j(design: planning.Design, chamber: planning.Chamber, branch: bool) -> float:
    """J = mean over the range's grid of φᵀV_ccφ + σ² (+ E[h²] with ψ = 1), by numpy."""
    prior = tiny_prior(branch)
    sigma = np.array(prior["sigma"])
    rows = []
    for k, p, s in design.points:
        x0, x1 = hand_x(p, design.temperatures[k])
        phi = hand_phi(np.array(x0), np.array(x1))
        rows.append([*phi, 1.0 if s == "up" else -1.0] if branch else list(phi))
    phi_d = np.array(rows)
    v = np.linalg.inv(phi_d.T @ phi_d / NOISE + np.linalg.inv(sigma))
    # J = (1/|R|) ∫_R (φᵀVφ + σ² …) dP dT by Gauss–Legendre, nodes mapped onto R
    (pn, pw), (tn, tw) = (np.polynomial.legendre.leggauss(n) for n in planning.QUADRATURE)
    p_lo, p_hi, t_lo, t_hi = 50.0, 1550.0, -40.0, 60.0
    pp, tt = np.meshgrid(
        p_lo + (p_hi - p_lo) * (pn + 1) / 2, t_lo + (t_hi - t_lo) * (tn + 1) / 2, indexing="ij"
    )
    w = np.outer(pw, tw).ravel() / 4.0
    f = hand_phi(*hand_x(pp.ravel(), tt.ravel()))
    var = np.einsum("gi,ij,gj->g", f, v[:4, :4], f) + NOISE
    if branch:  # the field's unknown sweep: E_y[m_h² + V_hh] = μ_h² + Σ_hh
        var = var + prior["mu"][4] ** 2 + sigma[4, 4]
    return float(var @ w)


@pytest.mark.parametrize("branch", [False, True])
def test_criterion_equals_hand_computed_posterior(branch):
    chamber = CHAMBER2 if branch else CHAMBER
    plan = planning.planner(PriorModel.from_dict(tiny_prior(branch)), chamber)
    # Every design of 2 points on the tiny candidate set (1 or 2 plateaus).
    designs = []
    for (t1, p1, s1), (t2, p2, s2) in itertools.combinations(
        itertools.product(chamber.temperatures, chamber.pressures, chamber.directions), 2
    ):
        temps = tuple(dict.fromkeys((t1, t2)))
        pts = ((0, p1, s1), (temps.index(t2), p2, s2))
        designs.append(planning.Design(temps, pts))
    got = planning.criterion(plan, designs)
    want = np.array([hand_j(d, chamber, branch) for d in designs])
    np.testing.assert_allclose(got, want, rtol=1e-9)
    # and the expected RMS σ is its root in hPa
    e = planning.evaluate(plan, designs[0])
    assert e.rms == pytest.approx(math.sqrt(want[0]) * 800.0, rel=1e-9)


def test_features_invert_the_prior_mean():
    plan = planning.planner(PriorModel.from_dict(tiny_prior()), CHAMBER)
    p, t = np.array([50.0, 640.0, 1550.0]), np.array([-40.0, 0.0, 60.0])
    x = planning.features(plan, p, t)
    x0, x1 = hand_x(p, t)
    np.testing.assert_allclose(x[:, 0], x0, atol=1e-12)
    np.testing.assert_allclose(x[:, 1], x1, atol=1e-15)


def test_optimizer_reaches_the_brute_force_optimum_and_respects_limits():
    plan = planning.planner(PriorModel.from_dict(tiny_prior()), CHAMBER)
    k, n = 2, 3
    best = math.inf
    for temps in itertools.permutations(CHAMBER.temperatures, k):
        for pts in itertools.product(range(k), CHAMBER.pressures, repeat=n):
            plateau = pts[0::2]
            if set(plateau) != set(range(k)):
                continue
            d = planning.Design(
                temps, tuple((pl, p, "up") for pl, p in zip(pts[0::2], pts[1::2], strict=True))
            )
            best = min(best, hand_j(d, CHAMBER, False))
    result = planning.optimize(plan, k, n)
    d = result.design
    assert d.plateaus == k and d.size == n
    assert set(d.temperatures) <= set(CHAMBER.temperatures)
    assert {kk for kk, _, _ in d.points} == set(range(k))
    assert all(p in CHAMBER.pressures and s == "up" for _, p, s in d.points)
    got = float(planning.criterion(plan, [d])[0])
    assert got == pytest.approx(best, rel=1e-9)
    frame = d.frame()
    assert list(frame.columns) == ["pressure_hpa", "temperature_c", "direction"]
    assert frame["temperature_c"].between(-40.0, 60.0).all()


def test_optimizer_never_returns_a_worse_design_than_its_start():
    plan = planning.planner(PriorModel.from_dict(tiny_prior(True)), CHAMBER2)
    bad = planning.Design((10.0, 60.0), ((0, 800.0, "up"), (0, 800.0, "up"), (1, 800.0, "up")))
    start_j = float(planning.criterion(plan, [bad])[0])
    result = planning.optimize(plan, 2, 3, start=bad)
    assert result.start == bad
    assert float(planning.criterion(plan, [result.design])[0]) <= start_j
    # exchange from an optimum stays there (no move is accepted unless it improves J)
    _, j = planning.exchange(plan, result.design)
    assert j == pytest.approx(float(planning.criterion(plan, [result.design])[0]), rel=1e-12)
    assert j <= start_j


def test_check_design_refuses_points_outside_the_chamber():
    with pytest.raises(ValueError, match="outside the chamber"):
        planning.check_design(CHAMBER, planning.Design((80.0,), ((0, 50.0, "up"),)))
    with pytest.raises(ValueError, match="not a feasible"):
        planning.check_design(CHAMBER, planning.Design((10.0,), ((0, 60.0, "up"),)))
    with pytest.raises(ValueError, match="plateau without points"):
        planning.check_design(CHAMBER, planning.Design((10.0, 60.0), ((0, 50.0, "up"),)))
    with pytest.raises(ValueError, match="2 plateaus"):
        planning.optimize(planning.planner(PriorModel.from_dict(tiny_prior()), CHAMBER), 2, 1)


def planted_unit(points: list[tuple[float, float]]) -> Fleet:
    """A unit exactly on the prior mean surface, measured at ``points`` (P, T)."""
    p = np.array([q for q, _ in points])
    t = np.array([s for _, s in points])
    x0, _ = hand_x(p, t)
    frame = pd.DataFrame(
        {
            "sensor_id": "U1",
            "frequency_hz": 33000.0 + 5000.0 * x0,
            "temperature_c": t,
            "pressure_hpa": p,
            "split": "train",
        }
    )
    return Fleet(frame=frame, meta={"source": "planted"})


def test_sequential_stop_rule_on_a_planted_unit():
    plan = planning.planner(PriorModel.from_dict(tiny_prior()), CHAMBER)
    unit = planted_unit([(50.0, -40.0), (1550.0, -40.0), (800.0, 60.0)])
    first = planning.unit_next(plan, unit, spec=1e6)
    assert first.done and first.steps == ()
    rms = first.now.rms
    # a spec just above its σ: done; just below: not done, and the next points stop at
    # the first that reaches the spec (or after --count)
    assert planning.unit_next(plan, unit, spec=rms * 1.0001).done
    step = planning.unit_next(plan, unit, spec=rms * 0.9, count=6)
    assert not step.done and step.steps
    after = [s[3] for s in step.steps]
    assert all(a > rms * 0.9 for a in after[:-1])
    assert after[-1] <= rms * 0.9 or len(after) == 6
    assert all(b <= a for a, b in zip([rms, *after[:-1]], after, strict=True))  # σ never grows
    # a point on the current plateau (at first the unit's last, 60 °C) costs no plateau
    current = 60.0
    for _, t, _, _, minutes in step.steps:
        extra = 0.0 if t == current else CHAMBER.plateau_minutes
        assert minutes == CHAMBER.point_minutes + extra
        current = t


def test_cli_plan_writes_only_the_physical_columns(tmp_path):
    path = tmp_path / "prior.json"
    path.write_text(json.dumps(tiny_prior(True)))
    out = tmp_path / "design.csv"
    args = ["plan", "--prior", str(path), "--plateaus", "2", "--points", "3", "--out", str(out)]
    args += ["--pressures", "50,800,1550", "--t-step", "50", "--t-min", "-40", "--t-max", "60"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    frame = pd.read_csv(out)
    assert list(frame.columns) == ["pressure_hpa", "temperature_c", "direction"]
    assert len(frame) == 3 and frame["temperature_c"].nunique() == 2
    assert set(frame["temperature_c"]) <= {-40.0, 10.0, 60.0}
    assert set(frame["direction"]) <= {"up", "down"}


def test_cli_plan_refuses_an_out_that_is_a_file_of_the_prior_s_run_folder(tmp_path):
    """design.csv never replaces the prior it was planned from, nor a run folder's files."""
    run = tmp_path / "run"
    (run / "runs" / "fedprior_tp0_seed0").mkdir(parents=True)
    prior = run / "runs" / "fedprior_tp0_seed0" / "prior.json"
    prior.write_text(json.dumps(tiny_prior(True)))
    (run / "config.json").write_text("{}")
    before = prior.read_bytes()
    for out in (prior, run / "config.json", run / "runs" / "fedprior_tp0_seed0" / "x.csv"):
        args = ["plan", "--prior", str(prior), "--plateaus", "2", "--points", "3"]
        result = CliRunner().invoke(app, [*args, "--out", str(out), "--t-step", "50"])
        assert result.exit_code == 2, (out, result.output)
    assert prior.read_bytes() == before and (run / "config.json").read_text() == "{}"


def test_simulator_points_design_measures_the_given_points():
    pts = ((50.0, -20.0, "up"), (1550.0, -20.0, "up"), (800.0, 45.0, "down"))
    base = dict(num_reference=1, num_new=2, test_design="random")
    fleet = simulate_fleet(FleetSpec(**base, train_design="points", design_points=pts), 0)
    grid = simulate_fleet(FleetSpec(**base, train_design="3x2"), 0)
    new = fleet.frame[(fleet.frame["role"] == "new") & (fleet.frame["split"] == "train")]
    for _, rows in new.groupby("sensor_id"):
        assert rows["pressure_hpa"].tolist() == [50.0, 1550.0, 800.0]
        assert rows["direction"].tolist() == ["up", "up", "down"]
        assert np.allclose(rows["temperature_c"], [-20.0, -20.0, 45.0], atol=1.5)
    # test rows and the reference unit are the same whatever the new units' design
    for split in ("test",):
        a = fleet.frame[fleet.frame["split"] == split]
        b = grid.frame[grid.frame["split"] == split]
        np.testing.assert_array_equal(a["frequency_hz"].to_numpy(), b["frequency_hz"].to_numpy())
    ref = fleet.frame[fleet.frame["role"] == "reference"]
    np.testing.assert_array_equal(
        ref["frequency_hz"].to_numpy(),
        grid.frame[grid.frame["role"] == "reference"]["frequency_hz"].to_numpy(),
    )
    with pytest.raises(ValueError, match="design_points"):
        FleetSpec(train_design="points")
    torch.set_num_threads(1)


def test_sigma_map_is_the_predictive_sd_on_the_regular_grid():
    plan = planning.planner(PriorModel.from_dict(tiny_prior()), CHAMBER)
    d = planning.Design((-40.0, 60.0), ((0, 50.0, "up"), (1, 1550.0, "up")))
    m = planning.sigma_map(plan, d)
    assert len(m) == planning.GRID[0] * planning.GRID[1]
    phi_d = np.array(
        [
            hand_phi(*map(np.array, hand_x(50.0, -40.0))),
            hand_phi(*map(np.array, hand_x(1550.0, 60.0))),
        ]
    )
    v = np.linalg.inv(phi_d.T @ phi_d / NOISE + np.linalg.inv(SIGMA_C))
    f = hand_phi(*hand_x(m["pressure_hpa"].to_numpy(), m["temperature_c"].to_numpy()))
    want = np.sqrt(np.einsum("gi,ij,gj->g", f, v, f) + NOISE) * 800.0
    np.testing.assert_allclose(m["sigma"].to_numpy(), want, rtol=1e-9)
    assert m["temperature_c"].min() == pytest.approx(-40.0)
    assert m["pressure_hpa"].max() == pytest.approx(1550.0)


def test_criterion_includes_the_prior_s_discrepancy_variance_as_calibrate_does():
    """With a calibrated interval in prior.json, J adds τ² for designs of fewer than twice
    the probe's points (none from twice on), as fedprior's stated σ does; a design smaller
    than the probe is scored with τ² but flagged declined (the model states no σ for it)."""
    tau2, probe = 3e-4, 2
    prior = tiny_prior()
    prior["interval"] = {
        "rule": "calibrated",
        "discrepancy_var": tau2,
        "probe_rows": float(probe),
        "residual_dof": 10.0,
        "declined": 0,
        "reason": "",
    }
    plan = planning.planner(PriorModel.from_dict(prior), CHAMBER)
    two = planning.Design((-40.0, 60.0), ((0, 50.0, "up"), (1, 1550.0, "up")))
    four = planning.Design(
        (-40.0, 60.0), tuple((k, p, "up") for k in (0, 1) for p in (50.0, 1550.0))
    )
    one = planning.Design((10.0,), ((0, 800.0, "up"),))
    got = planning.criterion(plan, [one, two, four])
    want = [hand_j(one, CHAMBER, False) + tau2, hand_j(two, CHAMBER, False) + tau2]
    want.append(hand_j(four, CHAMBER, False))
    np.testing.assert_allclose(got, want, rtol=1e-9)
    assert planning.evaluate(plan, one).declined
    assert not planning.evaluate(plan, two).declined
    # the same σ a unit of that design gets from calibrate's path (its posterior's τ²)
    x, b, count = planning.pack(plan, [two])
    mean = posterior.design(plan.prior, x, b) @ plan.prior.mean
    mask = (np.arange(x.shape[1]) < count[:, None]).astype(float)
    units = posterior.calibrate_units(plan.prior, x, mean, mask, b, noise_var=NOISE)
    assert float(units.disc_var[0]) == pytest.approx(tau2)
    forecast = planning.posteriors(plan, x, b, count, planning.prior_base(plan.prior))
    np.testing.assert_allclose(
        forecast.variance(plan.field), posterior.predictive_std(units, plan.field[None]) ** 2
    )
