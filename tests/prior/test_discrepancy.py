"""The prior's discrepancy model as a value (issue 33): its file, its variance, its span."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from fedcal.prior.design_span import design_reason
from fedcal.prior.discrepancy import (
    Discrepancy,
    DiscrepancyError,
    expected_scale,
    interval_factor,
    kappa_at,
    mean_scale_at,
    prior_distance,
    smoother_q,
    unit_scale,
)

F64 = torch.float64


def model(**kw) -> Discrepancy:
    args = dict(
        beta=0.5,
        amplitude=2e-9,
        lengths=(0.05, 0.05),
        kappa=1.1,
        nu0=math.inf,
        box_lo=(-1.0, -1.0),
        box_hi=(1.0, 1.0),
        min_points=6,
        max_points=64,
        min_levels=(2, 2),
        min_span=(0.5, 0.4),
        coverage=(("3x2", 7560.0, 0.95),),
        units=20,
    )
    return Discrepancy(**{**args, **kw})


@pytest.mark.parametrize("nu0", [math.inf, 8.0])
def test_round_trip_through_strict_json(nu0):
    m = model(
        nu0=nu0,
        kappa_points=((6.0, 0.9), (24.0, 1.2), (60.0, 1.3)),
        max_reliance=12.5,
        mean_scale2=(3.5, 2.0, 1.25),
    )
    text = json.dumps(m.to_dict(), allow_nan=False)  # strict JSON: ∞ is written as null
    assert Discrepancy.from_dict(json.loads(text)) == m


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("amplitude", -1e-9, "discrepancy.amplitude"),
        ("beta", float("nan"), "discrepancy.beta"),
        ("lengths", [0.1, float("inf")], "discrepancy.lengths"),
        ("lengths", [0.1, -0.2], "discrepancy.lengths"),
        ("kappa", "1.1", "discrepancy.kappa"),
        ("version", 99, "discrepancy.version"),
        ("box_lo", [-1.0], "discrepancy.box_lo"),
        # beyond what the references' grids can learn (review fix 5): was an OverflowError,
        # a LinAlgError, or accepted
        ("kappa", 1e200, "discrepancy.kappa"),
        ("kappa", 0.1, "discrepancy.kappa"),
        ("beta", 100.0, "discrepancy.beta"),
        ("beta", 1e-5, "discrepancy.beta"),
        ("amplitude", 1e308, "discrepancy.amplitude"),
        ("lengths", [1e-300, 0.05], "discrepancy.lengths"),
        ("lengths", [0.05, 1e6], "discrepancy.lengths"),
        ("max_points", 10**9, "discrepancy.max_points"),
        ("units", -1, "discrepancy.units"),
        ("coverage", [{"family": "3x2", "held": 10.0, "coverage": 1.5}], "discrepancy.coverage"),
        ("coverage", [{"family": "3x2", "held": -1.0, "coverage": 0.9}], "discrepancy.coverage"),
        ("coverage", [{"family": 7, "held": 10.0, "coverage": 0.9}], "discrepancy.coverage"),
        ("level_tol", 5.0, "discrepancy.level_tol"),
        # κ(n)'s knots (session 12): sizes ascending within max_points, κ in its range
        ("kappa_points", [[12.0, 1.0], [6.0, 1.1]], "discrepancy.kappa_points"),
        ("kappa_points", [[6.0, 1.0], [80.0, 1.1]], "discrepancy.kappa_points"),
        ("kappa_points", [[6.0, 50.0]], "discrepancy.kappa_points"),
        ("kappa_points", [[6.0, 1.0, 2.0]], "discrepancy.kappa_points"),
        ("kappa_points", [[6.0, "1"]], "discrepancy.kappa_points"),
        ("kappa_points", 1.0, "discrepancy.kappa_points"),
        # D6's u_ref (fedcal.prior.design_span): a positive number or null (∞)
        ("max_reliance", -1.0, "discrepancy.max_reliance"),
        ("max_reliance", 0.0, "discrepancy.max_reliance"),
        ("max_reliance", "3", "discrepancy.max_reliance"),
        # E[s²] per knot (E4c): one per knot of kappa_points (model(): none, so at most one)
        ("mean_scale2", [1.0, 2.0], "discrepancy.mean_scale2"),
        ("mean_scale2", [0.0], "discrepancy.mean_scale2"),
        ("mean_scale2", [-2.0], "discrepancy.mean_scale2"),
        ("mean_scale2", [float("inf")], "discrepancy.mean_scale2"),
        ("mean_scale2", ["2"], "discrepancy.mean_scale2"),
        ("mean_scale2", 2.0, "discrepancy.mean_scale2"),
    ],
)
def test_a_bad_field_is_refused_in_one_line_naming_it(field, value, says):
    raw = model().to_dict()
    raw[field] = value
    with pytest.raises(DiscrepancyError) as err:
        Discrepancy.from_dict(raw, "run/prior.json")
    text = str(err.value)
    assert "\n" not in text and text.startswith("run/prior.json: ") and says in text


def test_q_of_a_two_point_design_by_hand():
    # basis φ = [1], design x = −1, +1, smoother A = [½, ½] (the average), ℓ = 1:
    # q(x) = 1 − 2 gᵀk_D(x) + gᵀK g with g = (½, ½)
    x = torch.tensor([[[0.0], [1.0]]], dtype=F64)
    phi = torch.ones(1, 2, 1, dtype=F64)
    xd = torch.tensor([[[-1.0], [1.0]]], dtype=F64)
    a = torch.tensor([[[0.5], [0.5]]], dtype=F64)
    q = smoother_q(x, phi, xd, torch.ones(1, 2), a, torch.ones(1, dtype=F64))
    e = math.exp
    at0 = 1 - 2 * (0.5 * e(-0.5) + 0.5 * e(-0.5)) + 0.25 * (2 + 2 * e(-2))
    at1 = 1 - 2 * (0.5 * e(-2) + 0.5) + 0.25 * (2 + 2 * e(-2))
    assert q[0].tolist() == pytest.approx([at0, at1], rel=1e-12)
    # a padding row of the design changes nothing
    xd3 = torch.cat([xd, torch.full((1, 1, 1), 9.0, dtype=F64)], 1)
    a3 = torch.cat([a, torch.full((1, 1, 1), 7.0, dtype=F64)], 1)
    q3 = smoother_q(x, phi, xd3, torch.tensor([[1.0, 1.0, 0.0]]), a3, torch.ones(1, dtype=F64))
    assert torch.allclose(q3, q, rtol=1e-14, atol=0)


def test_prior_distance_is_the_whitened_residual():
    rng = np.random.default_rng(0)
    z = rng.standard_normal((1, 5, 3))
    s = np.diag([2.0, 1.0, 0.5])
    xd = rng.uniform(-1, 1, (1, 5, 2))
    r = rng.standard_normal((1, 5))
    amp, ell, noise = 0.3, 0.4, 0.1
    k = np.exp(-0.5 * ((xd[0, :, None] - xd[0, None]) ** 2).sum(-1) / ell**2)
    c = z[0] @ s @ z[0].T + amp * k + noise * np.eye(5)
    want = r[0] @ np.linalg.solve(c, r[0])
    t = lambda a: torch.tensor(a, dtype=F64)  # noqa: E731
    got = prior_distance(t(z), t(s), t([noise]), t(xd), torch.ones(1, 5), amp, t([ell, ell]), t(r))
    assert float(got[0]) == pytest.approx(want, rel=1e-10)


def test_a_planted_unit_scale_is_recovered():
    # residuals r ~ N(0, s²C) with s² = 4 on n = 400 rows: d²/n → s², and the posterior
    # (ν₀ + d²)/(ν₀ + n) with ν₀ = 8 is within 4 standard errors (s²√(2/n) = 0.28) of it
    rng = np.random.default_rng(1)
    n, planted = 400, 4.0
    z = rng.standard_normal((3, n, 2))
    s = np.diag([1.0, 0.5])
    noise = 0.2
    c = np.einsum("inp,pq,imq->inm", z, s, z) + noise * np.eye(n)
    r = np.stack([np.linalg.cholesky(ci) @ rng.standard_normal(n) for ci in c]) * np.sqrt(planted)
    t = lambda a: torch.tensor(a, dtype=F64)  # noqa: E731
    d2 = prior_distance(
        t(z),
        t(s),
        t([noise] * 3),
        t(np.zeros((3, n, 2))),
        torch.ones(3, n),
        1e-300,
        t([1.0, 1.0]),
        t(r),
    )
    got = unit_scale(8.0, torch.full((3,), float(n), dtype=F64), d2 / n)
    assert torch.all((got - planted).abs() < 4 * planted * math.sqrt(2 / n))
    assert torch.all(unit_scale(math.inf, torch.full((3,), 6.0), d2 / n) == 1.0)
    # ±1.96 σ is the Student-t's 95 % interval: t_{0.975, 4} = 2.776
    assert float(interval_factor(2.0, torch.tensor([2.0]))[0]) == pytest.approx(
        (2.776445 / 1.959964) ** 2, rel=1e-5
    )


def test_a_design_the_references_did_not_span_is_declined_with_its_reason():
    m = model()
    grid = torch.tensor(
        [[p, t] for t in (-1.0, 1.0) for p in (-1.0, 0.0, 1.0)], dtype=F64
    ).unsqueeze(0)
    one_plateau = grid.clone()
    one_plateau[..., 1] = 0.3  # every point on one temperature plateau
    narrow = grid.clone()
    narrow[..., 1] = torch.where(grid[..., 1] > 0, 0.2, 0.0)  # 10 % of the span
    few = grid[:, :4]
    x = torch.cat([grid, one_plateau, narrow, torch.cat([few, few[:, :2]], 1)])
    mask = torch.ones(4, 6)
    mask[3, 4:] = 0
    why = design_reason(m, x, mask, ["frequency_hz", "temperature_c"])
    assert why[0] == ""
    assert "1 level(s) of temperature_c" in why[1] and "at least 2" in why[1]
    assert "temperature_c spans 10 %" in why[2]
    assert "4 points, fewer than" in why[3]
    # more points than the largest design emulated (max_points): declined, κ(n) not learned
    small = model(min_points=4, max_points=5)
    assert design_reason(small, x[:1], mask[:1], ["f", "t"]) == [
        "no σ: 6 points, more than the largest design the reference units emulated (5), "
        "so how far its error exceeds the model's was not learned"
    ]


def test_kappa_of_the_design_size_by_hand():
    # knots (6, 1), (24, 2): log κ linear in log n, so κ(12) = 2^(log 2 / log 4) = √2;
    # constant beyond the ends; a record without knots: its one κ at every size
    m = model(kappa_points=((6.0, 1.0), (24.0, 2.0)))
    n = torch.tensor([3.0, 6.0, 12.0, 24.0, 40.0], dtype=F64)
    assert kappa_at(m, n).tolist() == pytest.approx([1.0, 1.0, math.sqrt(2), 2.0, 2.0], rel=1e-12)
    assert kappa_at(model(), n).tolist() == [1.1] * 5
    old = model().to_dict()
    del old["kappa_points"]  # a file written before the knots loads with one κ
    assert Discrepancy.from_dict(old).kappa_points == ()


def test_a_knot_count_mismatch_of_mean_scale2_is_refused():
    raw = model(kappa_points=((6.0, 1.0), (24.0, 2.0))).to_dict()
    raw["mean_scale2"] = [2.0]  # two knots, one value
    with pytest.raises(DiscrepancyError, match=r"^run/prior.json: discrepancy.mean_scale2: "):
        Discrepancy.from_dict(raw, "run/prior.json")


def test_the_mean_scale_of_the_design_size_by_hand():
    # E[s²] at knots (6, 4), (24, 1): log-linear in log n as κ(n), so E[s²](12) = 2; the
    # end values beyond; ν₀ = ∞ or a record without it (written before E4c): 1
    knots = ((6.0, 1.0), (24.0, 2.0))
    m = model(nu0=8.0, kappa_points=knots, mean_scale2=(4.0, 1.0))
    n = torch.tensor([3.0, 6.0, 12.0, 24.0, 40.0], dtype=F64)
    assert mean_scale_at(m, n).tolist() == pytest.approx([4.0, 4.0, 2.0, 1.0, 1.0], rel=1e-12)
    assert mean_scale_at(model(nu0=8.0, mean_scale2=(3.0,)), n).tolist() == [3.0] * 5
    assert (
        mean_scale_at(model(nu0=math.inf, kappa_points=knots, mean_scale2=(4.0, 1.0)), n).tolist()
        == [1.0] * 5
    )
    old = m.to_dict()
    del old["mean_scale2"]
    assert mean_scale_at(Discrepancy.from_dict(old), n).tolist() == [1.0] * 5


def test_the_planner_s_scale_takes_the_recorded_mean_s2():
    # a 12-point design read at the prior mean: calibrate's factor there is
    # κ² (t/1.96)² ν₀/(ν₀ + n); the planner's divides ν₀/(ν₀ + n) out and puts E[s²](12) in
    # (2 here); a unit without the model's σ (amp 0) is untouched; without the field: s² = 1
    nu0, n, factor = 8.0, 12, 0.7
    m = model(nu0=nu0, kappa_points=((6.0, 1.0), (24.0, 2.0)), mean_scale2=(4.0, 1.0))
    mask = np.ones((2, n))
    at_mean = nu0 / (nu0 + n)
    scale = np.array([factor * at_mean, 0.3])
    got = expected_scale(m, scale, np.array([1e-9, 0.0]), mask)
    assert got.tolist() == pytest.approx([factor * 2.0, 0.3], rel=1e-12)
    old = Discrepancy.from_dict({k: v for k, v in m.to_dict().items() if k != "mean_scale2"})
    assert expected_scale(old, scale, np.array([1e-9, 0.0]), mask)[0] == pytest.approx(factor)
