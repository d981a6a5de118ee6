"""SQUAREM on the fleet prior's EM (fedprior_accel, A1–A4): the same fixed point, sooner.

Tolerances. On a planted fleet whose EM converges linearly (10 units of 8 points, a
bilinear basis) plain EM's iterates settle at ~1e-12 relative of their 400-round limit (the
E-step's rounding: measured 5e-13–3e-12 from round 40 on); 1e-9 is 300× that and 1e6 below
the distance either method still has after 10 rounds (3e-3–3e-2), so it separates "reached the
fixed point" from "on the way". The extrapolation of a geometric sequence is exact in exact
arithmetic (SqS3 with α = −1/(1 − ρ)); here through a matrix log/exp of Σ, hence 1e-12.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fedcal.algorithms.fedprior import FedPrior
from fedcal.algorithms.fedprior_accel import accelerated, squarem_point
from fedcal.algorithms.fedprior_rounds import RoundSchedule
from fedcal.core.task import Task
from fedcal.core.tree import expand
from fedcal.models.mlp import MLP

from .test_fedprior import planted_fleet

F64 = torch.float64
KEYS = ("mu", "sigma", "noise_var")


def _run(alg: FedPrior, data, rounds: int):
    """The engine's loop at its plainest with its round hooks; each round's server after
    the update and the fleet's log-likelihood of that round's broadcast."""
    n = data.num_clients
    server = alg.server_init({})
    states = alg.client_init(expand(alg.broadcast(server), n))
    out = []
    for t in range(rounds):
        server = alg.before_round(server, t, rounds, n)
        result = alg.client_update(expand(alg.broadcast(server), n), states, data)
        states = result.state
        before = server
        server = alg.server_update(server, result.reply, data.count)
        out.append((before, server, float(result.metrics["loglik"].sum())))
    return server, out


def _dist(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).norm() / b[k].norm()) for k in KEYS)


@pytest.fixture(scope="module")
def fleet():
    train, *_ = planted_fleet(10, 8, seed=1, orders=(1, 1), noise=0.02)
    base = FedPrior(Task(MLP()), orders=(1, 1))
    return base, dataclasses.replace(base, accelerate="squarem"), train


def test_squarem_reaches_the_plain_em_fixed_point_sooner(fleet):
    base, fast, train = fleet
    limit, _ = _run(base, train, 400)
    _, plain = _run(base, train, 60)
    _, accel = _run(fast, train, 60)
    assert _dist(accel[-1][1], limit) <= 1e-9  # the same fixed point
    assert _dist(plain[-1][1], limit) <= 1e-9
    # on the way: after 20 rounds SQUAREM is much nearer (measured 5.5e-8 against 2.5e-5)
    assert _dist(accel[19][1], limit) < 0.1 * _dist(plain[19][1], limit)


def test_a_bad_extrapolation_falls_back_and_kept_likelihood_never_decreases(fleet):
    """A3: a round at θ' whose fleet likelihood is below ℓ(θ1) is undone (θ2 broadcast
    next, α_max divided by 4); the reference likelihood of the kept iterates never decreases."""
    _, fast, train = fleet
    _, rounds = _run(fast, train, 30)
    rejected = 0
    for before, after, ll in rounds:
        if int(before.get("accel_phase", 0)) != 2:
            continue
        if ll < float(before["accel_ll"]):  # θ' lowered the likelihood: the plain θ2 instead
            rejected += 1
            for k in KEYS:
                assert torch.equal(after[k], before["accel_back"][k])
            assert int(after["accel_phase"]) == 0
            assert float(after["accel_step"]) == max(1.0, float(before["accel_step"]) / 4)
        else:  # kept: θ' is the next cycle's start and its ℓ the new reference
            assert int(after["accel_phase"]) == 1
            assert float(after["accel_ll"]) == ll >= float(before["accel_ll"])
    assert rejected >= 1  # measured: round 5 of this fleet (ℓ 31.0 against 37.8)


def test_the_extrapolation_of_a_geometric_sequence_is_its_limit():
    """SqS3 by hand: μ_t = μ* + c ρᵗ (ρ = ½), Σ and σ² fixed: r = c(ρ − 1), v = c(ρ − 1)²,
    α = −‖r‖/‖v‖ = −2, u' = u0 − 2αr + α²v = μ* (exact); α_max = 1 gives θ2."""
    limit, c = torch.tensor([0.3, -0.2], dtype=F64), torch.tensor([1.0, 2.0], dtype=F64)
    sigma = torch.tensor([[2.0, 0.5], [0.5, 1.0]], dtype=F64)
    thetas = [
        {"mu": limit + c * 0.5**t, "sigma": sigma, "noise_var": torch.tensor(0.1, dtype=F64)}
        for t in range(3)
    ]
    point, alpha = squarem_point(*thetas, step_max=4.0, floor=1e-12)
    assert alpha == pytest.approx(-2.0, rel=1e-12)
    assert torch.allclose(point["mu"], limit, rtol=0, atol=1e-12)
    assert torch.allclose(point["sigma"], sigma, rtol=1e-12, atol=0)
    assert float(point["noise_var"]) == pytest.approx(0.1, rel=1e-12)
    plain, alpha = squarem_point(*thetas, step_max=1.0, floor=1e-12)
    assert alpha == -1.0
    assert torch.allclose(plain["mu"], thetas[2]["mu"], rtol=0, atol=1e-12)


def test_the_fallback_by_hand():
    """A3 on hand-made servers: ℓ(θ') below the reference → θ2; at or above → kept."""
    theta = {"mu": torch.zeros(2, dtype=F64), "sigma": torch.eye(2, dtype=F64)}
    theta["noise_var"] = torch.tensor(1.0, dtype=F64)
    back = {k: v + 1 for k, v in theta.items()}
    old = {**theta, "accel_phase": torch.tensor(2.0, dtype=F64), "accel_back": back}
    old.update(accel_step=torch.tensor(4.0, dtype=F64), accel_ll=torch.tensor(5.0, dtype=F64))
    new = {k: 2 * v + 3 for k, v in theta.items()}  # F(θ')
    low = accelerated(old, new, torch.tensor(4.9, dtype=F64), 1e-12)
    assert all(torch.equal(low[k], back[k]) for k in KEYS)
    assert (float(low["accel_phase"]), float(low["accel_step"])) == (0.0, 1.0)
    kept = accelerated(old, new, torch.tensor(5.0, dtype=F64), 1e-12)
    assert all(torch.equal(kept[k], new[k]) for k in KEYS)
    assert all(torch.equal(kept["accel_from"][k], theta[k]) for k in KEYS)
    assert (float(kept["accel_phase"]), float(kept["accel_step"])) == (1.0, 4.0)


def test_the_last_round_starts_from_a_plain_iterate():
    """A4: the update of the round before the engine's last one does not extrapolate (the
    flag its ``before`` set): the last round broadcasts θ2 = F(θ1)."""
    schedule = RoundSchedule(0, "final", 0.0, False, accelerate="squarem")
    theta0 = {"mu": torch.zeros(2, dtype=F64), "sigma": torch.eye(2, dtype=F64)}
    theta0["noise_var"] = torch.tensor(1.0, dtype=F64)
    theta1 = {k: 0.5 * v for k, v in theta0.items()}
    theta1["mu"] = torch.tensor([1.0, 1.0], dtype=F64)
    theta2 = {k: 0.5 * v for k, v in theta1.items()}
    theta2["mu"] = torch.tensor([1.5, 1.5], dtype=F64)
    server = {**schedule.init(), **theta1, "accel_phase": torch.tensor(1.0, dtype=F64)}
    server.update(accel_from=theta0, accel_ll=torch.tensor(0.0, dtype=F64))
    server["accel_step"] = torch.tensor(4.0, dtype=F64)
    ll, n = torch.tensor(1.0, dtype=F64), torch.tensor(5.0, dtype=F64)
    middle = schedule.after(schedule.before(server, 3, 10, 5), dict(theta2), n, ll)
    assert float(middle["accel_phase"]) == 2.0  # extrapolated: μ beyond θ2 (toward 2)
    assert float(middle["mu"][0]) > 1.5
    last = schedule.after(schedule.before(server, 8, 10, 5), dict(theta2), n, ll)
    assert all(torch.equal(last[k], theta2[k]) for k in KEYS)
    assert float(last["accel_phase"]) == 0.0


def test_off_by_default_and_no_extra_upload(fleet):
    base, fast, train = fleet
    assert base.accelerate == "off"
    n = train.num_clients
    server = base.server_init({})
    states = base.client_init(expand(base.broadcast(server), n))
    reply = base.client_update(expand(base.broadcast(server), n), states, train).reply
    assert "loglik" not in reply
    reply = fast.client_update(expand(fast.broadcast(server), n), states, train).reply
    assert reply["loglik"].shape == (n,)


def test_client_level_dp_refuses_squarem_in_one_line(fleet):
    """ℓ_i has no declared bound (fedprior_dp): DP refuses SQUAREM by name, up front (before,
    it failed in the DP stage with "statistics ['loglik'] have no declared bound"); off is
    declared as before."""
    base, fast, _ = fleet
    with pytest.raises(ValueError, match="covers accelerate = 'off' only"):
        fast.dp_statistics(fast.broadcast(fast.server_init({})))
    declared = base.dp_statistics(base.broadcast(base.server_init({})))
    assert {"mean", "second", "rss", "n", "gram"} <= set(declared)
