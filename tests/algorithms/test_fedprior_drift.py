"""fedprior_drift (issue 26): a fleet prior whose units' coefficients walk in time."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from fedcal.algorithms.fedprior import FedPrior
from fedcal.algorithms.fedprior_drift import NO_TIME, FedPriorDrift
from fedcal.algorithms.fedprior_drift_walk import DRIFT_GRID
from fedcal.core.bayes import F64, moments
from fedcal.core.data import ClientData
from fedcal.core.task import Task
from fedcal.core.tree import expand
from fedcal.data.loader import load_fleet
from fedcal.engine.simulation import prepare
from fedcal.models.mlp import MLP
from fedcal_support.rounds import run_rounds

MU = np.array([0.2, 1.0])
SD = 0.3  # planted Σ = SD² I (scaled units)
NOISE = 0.05


def make(cls=FedPriorDrift, **kw):
    """A linear basis; fedprior_drift with its prior fitted under the walk (the planted
    model's ECM; ``drift_prior = "static"``, the default, is tested on its own)."""
    if cls is FedPriorDrift:
        kw = {"drift_prior": "walk", **kw}
    return cls(Task(MLP(in_features=1)), **{"basis": "total", "degree": 1, **kw})


def planted(q: float, units: int = 30, rows: int = 40, future: int = 30, seed: int = 0):
    """Units whose coefficients at their last calibration time t_i are N(MU, SD² I) and walk
    from there, backward over the calibration rows (times in [0, 1]) and forward over the
    future test rows (times in (1, 1.5]), with increments N(0, q·dt·SD² I): the model of
    fedprior_drift exactly, with the walk at every row (not binned)."""
    rng = np.random.default_rng(seed)
    alg = make()
    train, test, t_train, t_test = [], [], [], []
    for _ in range(units):
        t = np.sort(rng.uniform(0, 1, rows))
        tf = np.sort(rng.uniform(1, 1.5, future))
        x = rng.uniform(-1, 1, rows + future)
        phi = alg.design(torch.tensor(x).reshape(1, -1, 1)).numpy()[0]
        c_ref = MU + SD * rng.standard_normal(2)
        coef = np.zeros((rows + future, 2))
        c, prev = c_ref.copy(), t[-1]
        for r in range(rows - 1, -1, -1):
            c = c + SD * math.sqrt(q * (prev - t[r])) * rng.standard_normal(2)
            coef[r], prev = c, t[r]
        c, prev = c_ref.copy(), t[-1]
        for r in range(future):
            c = c + SD * math.sqrt(q * (tf[r] - prev)) * rng.standard_normal(2)
            coef[rows + r], prev = c, tf[r]
        y = (phi * coef).sum(1) + NOISE * rng.standard_normal(rows + future)
        train.append((x[:rows, None], y[:rows, None]))
        test.append((x[rows:, None], y[rows:, None]))
        t_train.append(t)
        t_test.append(tf)
    seeds = tuple(range(units))
    return (
        ClientData.from_arrays(train, seeds, F64, time=t_train),
        ClientData.from_arrays(test, seeds, F64, time=t_test),
    )


def coverage(pred, std, data) -> float:
    inside = ((pred - data.y).abs() <= 1.959964 * std) & (data.mask.unsqueeze(-1) > 0)
    return float(inside.sum() / data.mask.sum())


@pytest.fixture(scope="module")
def drifting():
    train, test = planted(q=0.5)
    alg = make(choice_interval="off")  # the walk's σ alone (fedprior_forward's κ: its tests)
    return alg, train, test, run_rounds(alg, train, 12)


def test_the_planted_drift_variance_is_recovered(drifting):
    _, _, _, (server, _, personal, _) = drifting
    # Learned drift covariance per unit time, rate · Σ̂, against the planted q · SD² I: within
    # a factor 1.6 (q = 0 or the largest grid value would be 0 or 20× off).
    rate = float(personal["drift_rate"][0])
    learned = rate * torch.diagonal(server["sigma"]).sum()
    planted_trace = 0.5 * 2 * SD**2
    assert 1 / 1.6 < float(learned) / planted_trace < 1.6
    assert float(server["drift"]["q"]) > 0
    # The fleet evidence of the chosen q beats q = 0 by far more than the test's threshold.
    ll = server["drift"]["loglik"]
    assert float(ll.max() - ll[0]) > 100


def test_sigma_grows_with_time_since_calibration_as_planted(drifting):
    alg, _, test, (server, _, personal, _) = drifting
    x = test.x[:, :1].expand(-1, 4, -1)
    t_ref = personal["t_ref"].unsqueeze(1)
    at = ClientData(x, x[..., :1], torch.full((x.shape[0],), 4), test.seeds)
    dts = torch.tensor([0.0, 0.1, 0.2, 0.4], dtype=F64)
    times = ClientData(at.x, at.y, at.count, at.seeds, time=t_ref + dts)
    var = alg.predictive_std_timed(personal, times)[..., 0] ** 2
    var0 = alg.predictive_std(personal, x)[..., 0] ** 2
    torch.testing.assert_close(var[:, 0], var0[:, 0])  # at t_i: fedprior's variance form
    growth = var - var[:, :1]
    # A random walk: the variance grows linearly in t − t_i, by rate · φᵀΣφ per unit time.
    torch.testing.assert_close(growth[:, 2], 2 * growth[:, 1], rtol=1e-9, atol=1e-15)
    torch.testing.assert_close(growth[:, 3], 4 * growth[:, 1], rtol=1e-9, atol=1e-15)
    phi = alg.design(x)[:, 0]
    spread = ((phi @ server["sigma"]) * phi).sum(-1)
    want = personal["drift_rate"] * 0.1 * spread
    torch.testing.assert_close(growth[:, 1], want, rtol=1e-9, atol=1e-15)
    # ... and as planted: q · dt · SD² ‖φ‖², within the recovery's tolerance.
    planted_growth = 0.5 * 0.1 * SD**2 * (phi * phi).sum(-1)
    ratio = float(growth[:, 1].mean() / planted_growth.mean())
    assert 1 / 1.6 < ratio < 1.6


def test_future_intervals_cover_with_drift_and_not_without(drifting):
    alg, train, test, (_, _, personal, _) = drifting
    pred = alg.predict(personal, test.x)
    ours = coverage(pred, alg.predictive_std_timed(personal, test), test)
    assert 0.90 <= ours <= 0.98
    base = make(FedPrior)
    _, _, personal0, _ = run_rounds(base, train, 12)
    theirs = coverage(base.predict(personal0, test.x), base.predictive_std(personal0, test.x), test)
    # fedprior's intervals ignore the walk since calibration (measured 0.863 against 0.946)
    assert theirs < min(0.9, ours - 0.05)
    # The posterior weighs recent points more: the drift fit predicts the future better.
    err = ((pred - test.y) ** 2 * test.mask.unsqueeze(-1)).sum()
    err0 = ((base.predict(personal0, test.x) - test.y) ** 2 * test.mask.unsqueeze(-1)).sum()
    assert float(err) < 0.8 * float(err0)


def test_recalibrate_at_is_when_the_mean_sigma_reaches_the_ratio(drifting):
    alg, train, _, (_, _, personal, _) = drifting
    when = torch.as_tensor(alg.unit_columns(personal, train)["recalibrate_at"])
    assert bool((when > personal["t_ref"]).all())
    # At that time the row-averaged predictive variance over the unit's calibration inputs
    # is ratio² times its value at t_i.
    at = ClientData(
        train.x,
        train.y,
        train.count,
        train.seeds,
        time=when.unsqueeze(1).expand(-1, train.x.shape[1]),
    )
    m = train.mask
    v = ((alg.predictive_std_timed(personal, at)[..., 0] ** 2) * m).sum(1) / m.sum(1)
    v0 = ((alg.predictive_std(personal, train.x)[..., 0] ** 2) * m).sum(1) / m.sum(1)
    torch.testing.assert_close(v, alg.recalibrate_ratio**2 * v0, rtol=1e-9, atol=0)


def test_without_drift_the_estimate_is_zero_and_predictions_are_fedpriors():
    train, test = planted(q=0.0, units=20, seed=3)
    alg = make(select="bic", choice_interval="off")
    base = make(FedPrior, select="bic", choice_interval="off")
    server, _, personal, _ = run_rounds(alg, train, 10)
    _, _, personal0, _ = run_rounds(base, train, 10)
    assert float(server["drift"]["q"]) == 0.0
    assert math.isnan(float(alg.unit_columns(personal, train)["recalibrate_at"][0]))  # never
    for key in ("coef", "cov", "noise_var"):
        assert torch.equal(personal[key], personal0[key])
    assert torch.equal(alg.predict(personal, test.x), base.predict(personal0, test.x))
    assert torch.equal(
        alg.predictive_std_timed(personal, test), base.predictive_std(personal0, test.x)
    )


@pytest.mark.parametrize("bins", [1, 5])
def test_whitened_moments_equal_the_dense_covariance(bins):
    """Against R̄ = I + Z P Zᵀ/σ² built row by row: one bin (every row shares the walk at the
    rows' mean age) and one bin per row (times 0..4: the exact random walk)."""
    alg = make(drift_bins=bins)
    rng = np.random.default_rng(1)
    n = 5
    x = torch.tensor(rng.uniform(-1, 1, (1, n, 1)))
    y = torch.tensor(rng.normal(size=(1, n, 1)))
    t = torch.arange(n, dtype=F64).unsqueeze(0)
    data = ClientData(x, y, torch.tensor([n]), (0,), time=t)
    sigma = torch.tensor([[0.5, 0.1], [0.1, 0.3]], dtype=F64).unsqueeze(0)
    noise, q = torch.tensor([0.2], dtype=F64), 0.7
    down = {"sigma": sigma, "drift": {"scale": torch.tensor([1.0], dtype=F64)}}
    got, logdet = alg.drift.walk.whiten(
        alg.drift.walk.parts(down, data), torch.tensor([[q]]), noise
    )
    phi = alg.design(x)[0]
    tau = (t[0, -1] - t[0]) if bins == n else torch.full((n,), float((t[0, -1] - t[0]).mean()))
    k = torch.minimum(tau.unsqueeze(0), tau.unsqueeze(1)) * (phi @ sigma[0] @ phi.T)
    r = torch.eye(n, dtype=F64) + q * k / noise
    r_inv = torch.linalg.inv(r)
    want = moments(phi.unsqueeze(0), y[..., 0], torch.ones(1, n))
    torch.testing.assert_close(got.gram[0, 0], phi.T @ r_inv @ phi, rtol=1e-7, atol=1e-8)
    torch.testing.assert_close(got.rhs[0, 0], phi.T @ r_inv @ y[0, :, 0], rtol=1e-7, atol=1e-8)
    torch.testing.assert_close(got.yy[0, 0], y[0, :, 0] @ r_inv @ y[0, :, 0], rtol=1e-7, atol=1e-8)
    assert float(got.n[0, 0]) == float(want.n[0]) == n
    torch.testing.assert_close(logdet[0, 0], torch.logdet(r), rtol=1e-7, atol=1e-8)


def test_without_a_time_column_it_is_fedprior_exactly():
    train, test = planted(q=0.5, units=12, rows=20, future=5)
    bare, bare_test = (ClientData(d.x, d.y, d.count, d.seeds) for d in (train, test))
    alg = make(select="bic", choice_interval="off")
    base = make(FedPrior, select="bic", choice_interval="off")
    server, _, personal, _ = run_rounds(alg, bare, 6)
    server0, _, personal0, _ = run_rounds(base, bare, 6)
    assert float(server["drift"]["q"]) == 0.0 and float(server["drift"]["scale"]) == 0.0
    for key in ("mu", "sigma", "noise_var"):
        assert torch.equal(server[key], server0[key])
    for key in ("coef", "cov", "noise_var"):
        assert torch.equal(personal[key], personal0[key])
    assert torch.equal(
        alg.predictive_std_timed(personal, bare_test), base.predictive_std(personal0, test.x)
    )
    assert alg.export_state(server)["drift"]["note"] == NO_TIME


def test_a_time_split_carries_each_rows_time_into_the_tensors(tmp_path):
    rows = []
    for unit, start in (("a", 0), ("b", 5)):
        for day in range(8):
            rows.append((unit, f"2024-03-{start + day + 1:02d}T00:00:00Z", day * 0.1, 1.0 + day))
    frame = pd.DataFrame(rows, columns=["sensor_id", "time", "raw", "ref"])
    frame.to_csv(tmp_path / "f.csv", index=False)
    fleet = load_fleet(
        tmp_path / "f.csv",
        features=["raw"],
        target="ref",
        time_column="time",
        split_by="time",
        test_fraction=0.25,
    )
    tensors = prepare(fleet, dtype="float32")
    train, test = tensors.train, tensors.test
    assert train.time.dtype == F64 and test.time.dtype == F64  # seconds since 1970 need it
    day = 86400.0
    for i, start in enumerate((0, 5)):
        t0 = pd.Timestamp(f"2024-03-{start + 1:02d}", tz="UTC").timestamp()
        n_tr, n_te = int(train.count[i]), int(test.count[i])
        assert n_tr + n_te == 8 and n_te == 2  # the last quarter of its own span is test
        assert train.time[i, :n_tr].tolist() == [t0 + d * day for d in range(6)]
        assert test.time[i, :n_te].tolist() == [t0 + d * day for d in (6, 7)]


def test_calibrate_noise_fixed_point_uses_the_drift_whitened_moments():
    """`fedcal calibrate`'s own-noise fixed point (calibration.own_noise) under a drift prior
    with per-unit noise and a fixed basis equals the federation's client steps, which whiten
    the moments by the broadcast q (FedPriorDrift._client_moments), not the static ones."""
    from fedcal import calibration
    from fedcal.core.tree import expand

    train, _ = planted(q=0.5, units=6, rows=20, future=2, seed=1)
    alg = make(noise="sensor")
    server = alg.server_init({})
    sigma = SD**2 * torch.eye(2, dtype=F64)
    drift = {**server["drift"], "q": torch.tensor(0.5, dtype=F64)}
    drift["scale"] = torch.tensor(1.0, dtype=F64)
    server = {**server, "mu": torch.tensor(MU), "sigma": sigma, "drift": drift}
    server["noise_var"] = torch.tensor(NOISE**2, dtype=F64)
    down = expand(alg.broadcast(server), train.num_clients)
    state = alg.client_init(down)
    for _ in range(calibration.NOISE_ITERATIONS):
        state = alg.client_update(down, state, train).state
    fast = calibration.own_noise(alg, down, alg.client_init(down), train)
    static = FedPrior._client_moments(alg, down, train)
    assert not torch.equal(alg._client_moments(down, train).gram, static.gram)  # q whitens
    assert torch.equal(fast["noise_var"], state["noise_var"])


def test_a_downweighted_unit_s_drift_evidence_is_weighted_like_its_statistics():
    """robust = "full": a unit the M-step down-weights (issue 21) enters q's evidence with the
    same weight w_i, so a far-off unit claiming overwhelming evidence for the largest q does
    not set the fleet's drift (no drift planted: q stays 0)."""
    from fedcal.core.tree import expand

    train, _ = planted(q=0.0, units=8, rows=20, future=2, seed=2)
    alg = make()
    rounds = run_rounds(alg, train, 2)
    server = rounds.server
    assert float(server["drift"]["scale"]) > 0 and float(server["drift"]["q"]) == 0.0
    down = expand(alg.broadcast(server), 8)
    reply = alg.client_update(down, rounds.states, train).reply
    offset = torch.tensor([50.0, -50.0], dtype=F64)  # unit 0 far from the others' prior
    mean = reply["mean"].clone()
    second = reply["second"] - mean[0].outer(mean[0]) * torch.eye(8)[:, :1, None]
    mean[0] += offset
    second[0] += mean[0].outer(mean[0])
    loglik = reply["drift"]["loglik"].clone()
    loglik[0, -1] += 1e6  # and overwhelming evidence for the grid's largest q
    hostile = {**reply, "mean": mean, "second": second, "drift": {**reply["drift"]}}
    hostile["drift"]["loglik"] = loglik
    w = alg.outlier_weights(server, hostile).weights
    assert float(w[0]) < 1e-3 and bool((w[1:] == 1).all())
    new = alg.server_update(server, hostile, train.count)
    torch.testing.assert_close(new["drift"]["loglik"], (loglik * w.unsqueeze(1)).sum(0))
    assert float(new["drift"]["q"]) == 0.0


def test_evaluation_states_the_sweep_mixture_interval_at_the_rows_time():
    """With a direction term the evaluated coverage is of the interval fedprior states (the
    sweep mixture's, b = ±1 unknown) for the σ at each row's time (predictive_std_timed):
    not ±1.96 σ(t), which treats ±ψᵀm_h as Gaussian and over-covers."""
    import dataclasses

    from fedcal.core.bayes import mixture_halfwidth
    from fedcal.core.tree import expand
    from fedcal.data.scaling import Scaler
    from fedcal.engine.evaluation import errors

    train, test = planted(q=0.5, units=6, rows=20, future=20, seed=3)
    alg = make(branch_orders=(0,))
    rounds = run_rounds(alg, train, 2)
    down = expand(alg.broadcast(rounds.server), 6)
    params = alg.personalize(down, rounds.states, train)
    params["coef"] = params["coef"].clone()
    params["coef"][:, -1] = 0.3  # a direction term ψᵀm_h = 0.3 (ψ ≡ 1)
    params["drift_rate"] = torch.full((6,), 0.5)  # and a drift: σ grows after t_i
    params["cov"] = params["cov"].clone()
    params["cov"][:, -1, -1] = 1e-4  # h known: the interval's width is the shift's and σ(t)'s
    # errors spread over [0, 1]: the rows between the two intervals' edges decide
    spread = torch.linspace(0.0, 1.0, test.y.shape[1], dtype=F64).reshape(1, -1, 1)
    test = dataclasses.replace(test, y=alg.predict(params, test.x) + spread)
    std = alg.predictive_std_timed(params, test)
    shift = torch.full_like(std, 0.3, dtype=F64)
    half = mixture_halfwidth(shift, (std.to(F64) ** 2 - 0.09).clamp_min(0.0).sqrt())
    err = (alg.predict(params, test.x) - test.y).abs()
    m = test.mask.unsqueeze(-1) > 0
    want = ((err <= half) & m).sum((1, 2)) / m.sum((1, 2))
    gaussian = ((err <= 1.959964 * std) & m).sum((1, 2)) / m.sum((1, 2))
    assert not torch.equal(want, gaussian)  # the two intervals differ on these rows
    unit = Scaler(np.zeros(1), np.ones(1), np.zeros(1), np.ones(1), {})
    got = errors(alg, params, test, unit)["coverage95"]
    torch.testing.assert_close(got, want.to(got.dtype))


def test_honest_uploads_under_a_learned_drift_pass_the_consistency_check():
    """robust = "full" (the default) checks each upload (issue 21): with q > 0 the E-step's
    Gram is whitened (its constant term below the row count), which is no inconsistency;
    every honest unit passes, while a unit whose row count disagrees is still rejected."""
    from fedcal.core.tree import expand

    train, _ = planted(q=0.5, units=8, rows=20, future=2, seed=1)
    alg = make()
    rounds = run_rounds(alg, train, 3)
    assert float(rounds.server["drift"]["q"]) > 0
    down = expand(alg.broadcast(rounds.server), 8)
    reply = alg.client_update(down, rounds.states, train).reply
    assert (reply["gram"][:, 0, 0] < reply["n"] - 1).all()  # whitened
    everyone = torch.ones(8, dtype=torch.bool)
    assert alg.inconsistent_replies(rounds.server, reply, train.count, everyone) == {}
    declared = train.count.clone()
    declared[3] = 40
    bad = alg.inconsistent_replies(rounds.server, reply, declared, everyone)
    assert list(bad) == [3] and "declares 20 rows" in bad[3]


@pytest.mark.parametrize(("q", "prior"), [(0.0, "walk"), (0.5, "walk"), (0.5, "static")])
def test_a_forged_drift_evidence_row_is_rejected_and_honest_ones_pass(q, prior):
    """The drift uploads are checked against the unit's row count and its own E-step
    (fedprior_drift_checks.drift_problems): honest units pass, with the learned q = 0 or > 0; a unit
    that lowers its evidence at q = 0 (so that drift looks better), or claims at some q more
    evidence than its rows allow at the broadcast σ², is rejected with its reason."""
    from fedcal.core.tree import expand

    train, _ = planted(q=q, units=8, rows=20, future=2, seed=4)
    alg = make(drift_prior=prior)
    rounds = run_rounds(alg, train, 3)
    server = rounds.server
    assert (float(server["drift"]["q"]) > 0) == (q > 0)
    down = expand(alg.broadcast(server), 8)
    reply = alg.client_update(down, rounds.states, train).reply
    everyone = torch.ones(8, dtype=torch.bool)
    assert alg.inconsistent_replies(server, reply, train.count, everyone) == {}
    loglik = reply["drift"]["loglik"].clone()
    n = float(train.count[5])
    cap = -0.5 * n * math.log(2 * math.pi * float(server["noise_var"]))
    loglik[5, -1] = cap + 1.0  # more than 20 rows at the broadcast σ² can give
    e_step_q = 0.0 if prior == "static" else float(server["drift"]["q"])  # its E-step's q
    at = int(torch.argmin((DRIFT_GRID - e_step_q).abs()))
    loglik[2, at] += 5.0  # the evidence at its E-step's q, raised above that E-step's
    if at == 0:
        loglik[6, 0] -= 20.0  # ... and lowered (at q = 0 it must equal the E-step's)
    forged = {**reply, "drift": {**reply["drift"], "loglik": loglik}}
    bad = alg.inconsistent_replies(server, forged, train.count, everyone)
    assert sorted(bad) == ([2, 5, 6] if at == 0 else [2, 5])
    assert "above what 20 rows" in bad[5] and "disagrees with its E-step" in bad[2]
    # round 0 (no time scale yet): the grid is not evaluated and must be all zeros
    first = alg.server_init({})
    assert float(first["drift"]["scale"]) == 0
    down0 = expand(alg.broadcast(first), 8)
    reply0 = alg.client_update(down0, alg.client_init(down0), train).reply
    assert not alg.inconsistent_replies(first, reply0, train.count, everyone)


def test_future_scores_equal_the_dense_gaussian_prediction():
    """A unit's held-out score (``drift_fit = "future"``) against Gaussian conditioning done
    densely: rows at times 0..7, the last quarter of the span (t = 6, 7) held out; the past's
    posterior at t_p = 5 under y = Φc + w + ε with Cov(w_r, w_r') = q·min(τ_r, τ_r')·Σ
    (τ = 5 − t, one bin per row: the exact walk), and each held-out row scored by
    N(φᵀm, σ² + φᵀVφ + q(t − 5)φᵀΣφ), for every q of the grid."""
    alg = make(drift_bins=6)
    rng = np.random.default_rng(2)
    n = 8
    x = torch.tensor(rng.uniform(-1, 1, (1, n, 1)))
    y = torch.tensor(rng.normal(size=(1, n, 1)))
    t = torch.arange(n, dtype=F64).unsqueeze(0)
    data = ClientData(x, y, torch.tensor([n]), (0,), time=t)
    mu = torch.tensor([[0.3, -0.2]], dtype=F64)
    sigma = torch.tensor([[0.5, 0.1], [0.1, 0.3]], dtype=F64).unsqueeze(0)
    noise = torch.tensor([0.2], dtype=F64)
    down = {"mu": mu, "sigma": sigma, "noise_var": noise}
    down["drift"] = {"scale": torch.tensor([1.0], dtype=F64), "q": torch.tensor([0.0])}
    got = alg.drift.walk.future_scores(down, {"noise_var": noise}, data)[0]
    phi = alg.design(x)[0]
    past, fut = phi[:6], phi[6:]
    tau = 5.0 - t[0, :6]
    s = sigma[0]
    want = []
    for q in DRIFT_GRID.tolist():
        walk = q * torch.minimum(tau.unsqueeze(0), tau.unsqueeze(1)) * (past @ s @ past.T)
        c = noise * torch.eye(6, dtype=F64) + past @ s @ past.T + walk
        gain = s @ past.T @ torch.linalg.inv(c)
        m = mu[0] + gain @ (y[0, :6, 0] - past @ mu[0])
        v = s - gain @ past @ s
        var = noise + ((fut @ v) * fut).sum(1) + q * (t[0, 6:] - 5.0) * ((fut @ s) * fut).sum(1)
        r = y[0, 6:, 0] - fut @ m
        want.append(float((-0.5 * (torch.log(2 * math.pi * var) + r**2 / var)).sum()))
    torch.testing.assert_close(got, torch.tensor(want, dtype=F64), rtol=1e-6, atol=1e-6)
    assert float(got[0]) != float(got[-1])  # the walk changes the score


def test_the_static_prior_is_fedprior_s_fit_and_the_walk_acts_in_use():
    """``drift_prior = "static"`` (the default): μ, Σ, σ² are fedprior's bit for bit whatever
    q, and q (chosen by the units' held-out futures) acts in use only — on a planted walk it
    is learned (> 0), the posterior weighs recent points more and the intervals widen after
    t_i (measured: coverage 0.883 against fedprior's 0.604, squared error 16.5 against 31.6)."""
    train, test = planted(q=0.5, units=12, rows=30, future=20, seed=5)
    alg, base = make(drift_prior="static"), make(FedPrior)
    ours, theirs = run_rounds(alg, train, 6), run_rounds(base, train, 6)
    for key in ("mu", "sigma", "noise_var"):
        assert torch.equal(ours.server[key], theirs.server[key])
    assert float(ours.server["drift"]["q"]) > 0
    pred, pred0 = alg.predict(ours.personal, test.x), base.predict(theirs.personal, test.x)
    cov = coverage(pred, alg.predictive_std_timed(ours.personal, test), test)
    cov0 = coverage(pred0, base.predictive_std(theirs.personal, test.x), test)
    assert cov > 0.85 and cov0 < 0.7
    m = test.mask.unsqueeze(-1)
    assert float(((pred - test.y) ** 2 * m).sum()) < 0.7 * float(((pred0 - test.y) ** 2 * m).sum())


def test_bounded_future_scores_clip_each_unit_s_gain_over_q0_by_its_rows():
    """Hand-computed: the gains s(q_k) − s(0) clipped to ± c·n; s(0) itself dropped (column
    0 exactly 0). Unit 0: gains 6, −20 against ± 2·2 = 4; unit 1: 0.5, −1 within ± 20."""
    from fedcal.algorithms.fedprior_drift_checks import bound_future_scores

    future = torch.tensor([[-10.0, -4.0, -30.0], [5.0, 5.5, 4.0]], dtype=F64)
    out = bound_future_scores(future, torch.tensor([2.0, 10.0], dtype=F64), 2.0)
    expected = torch.tensor([[0.0, 4.0, -4.0], [0.0, 0.5, -1.0]], dtype=F64)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.fixture(scope="module")
def planted_round():
    """A planted walk (q = 0.5) after 3 rounds: the server, one round's honest replies and
    the server's update from them."""
    from fedcal.core.tree import expand

    train, _ = planted(q=0.5, units=16, rows=40, future=2, seed=1)
    alg = make()
    rounds = run_rounds(alg, train, 3)
    server = rounds.server
    down = expand(alg.broadcast(server), 16)
    reply = alg.client_update(down, rounds.states, train).reply
    honest = alg.server_update(server, reply, train.count)
    return alg, train, server, reply, honest


def test_a_unit_forging_its_future_scores_moves_the_fleet_by_at_most_c_per_row(planted_round):
    """Hostile site (issue 21): the future scores pass drift_problems' upper bound when a
    unit lowers every q > 0 score; summed unclipped, one unit switches the planted drift off.
    Clipped (± drift_score_clip · n_i), the drift stays learned, and the honest fleet's
    scores are the plain sums of the gains over q = 0 (no honest unit reaches the clip)."""
    alg, train, server, reply, honest = planted_round
    assert float(honest["drift"]["q"]) > 0
    fut = reply["drift"]["future"]
    torch.testing.assert_close(honest["drift"]["future"], (fut - fut[:, :1]).sum(0))
    forged = fut.clone()
    forged[3, 1:] -= 1e6  # "every drift predicts my future terribly"
    everyone = torch.ones(16, dtype=torch.bool)
    hostile = {**reply, "drift": {**reply["drift"], "future": forged}}
    assert alg.inconsistent_replies(server, hostile, train.count, everyone) == {}
    new = alg.server_update(server, hostile, train.count)
    gain = new["drift"]["future"] - new["drift"]["future"][0]
    honest_gain = honest["drift"]["future"] - honest["drift"]["future"][0]
    own = fut[3] - fut[3, 0]
    bound = alg.drift_score_clip * float(train.count[3])
    assert bool((gain >= honest_gain - own - bound - 1e-9).all())
    assert float(new["drift"]["q"]) > 0  # unclipped: Σ gains ≈ −1e6, q = 0


@pytest.mark.parametrize("offset", [-1e20, -1e300])
def test_a_huge_common_offset_in_one_unit_s_future_scores_does_not_move_q(planted_round, offset):
    """Review B: a unit uploading the same huge negative score at every q has zero gains
    (nothing to clip) and passes drift_problems (bounded from above only); summed with the
    others' scores it would swallow their margins in float64 (every column tied: q = 0). The
    server sums gains only: q and the fleet's scores are the honest fleet's without that
    unit's gains (its own are 0)."""
    alg, train, server, reply, honest = planted_round
    forged = reply["drift"]["future"].clone()
    forged[3] = offset
    everyone = torch.ones(16, dtype=torch.bool)
    hostile = {**reply, "drift": {**reply["drift"], "future": forged}}
    assert alg.inconsistent_replies(server, hostile, train.count, everyone) == {}
    raw = forged.sum(0)
    assert bool((raw == raw[0]).all())  # the raw sums: every q tied, the forger's q = 0
    new = alg.server_update(server, hostile, train.count)
    assert float(new["drift"]["q"]) == float(honest["drift"]["q"]) > 0
    fut = reply["drift"]["future"]
    others = torch.arange(16) != 3
    want = (fut - fut[:, :1])[others].sum(0)
    torch.testing.assert_close(new["drift"]["future"], want, rtol=1e-12, atol=1e-9)


def test_non_finite_short_step_uploads_are_rejected(planted_round):
    """The short step's sums (unscreened) are checked for being finite: an inf squared
    error would make every gain NaN and the fleet's w* undefined."""
    alg, train, server, reply, _ = planted_round
    everyone = torch.ones(16, dtype=torch.bool)
    for key, bad in (("sse", math.inf), ("score", math.nan), ("held", -math.inf)):
        short = {k: v.clone() for k, v in reply["drift"]["short"].items()}
        short[key].view(16, -1)[5, 0] = bad
        hostile = {**reply, "drift": {**reply["drift"], "short": short}}
        whys = alg.inconsistent_replies(server, hostile, train.count, everyone)
        assert list(whys) == [5] and "short-step sums not finite" in whys[5]


def test_one_forged_span_cannot_make_the_time_scale_arbitrarily_long():
    """Round 0 sets the fleet's time scale T from the declared spans: the plain mean on an
    honest fleet; a forged span of 1e9 counts at most drift_span_cap × the median."""
    from fedcal.algorithms.fedprior_choice_parts import fleet_time_scale
    from fedcal.core.tree import expand

    train, _ = planted(q=0.5, units=8, rows=20, future=2, seed=1)
    alg = make()
    first = alg.server_init({})
    down0 = expand(alg.broadcast(first), 8)
    reply = alg.client_update(down0, alg.client_init(down0), train).reply
    span = reply["drift"]["span"]
    honest = alg.server_update(first, reply, train.count)["drift"]["scale"]
    torch.testing.assert_close(honest, span.mean())
    forged = span.clone()
    forged[0] = 1e9
    hostile = {**reply, "drift": {**reply["drift"], "span": forged}}
    scale = float(alg.server_update(first, hostile, train.count)["drift"]["scale"])
    med = float(forged.median())
    assert scale == pytest.approx((float(span[1:].sum()) + alg.drift_span_cap * med) / 8)
    assert scale < 5 * float(honest)  # unguarded: 1.25e8
    # hand-computed: spans 1, 2, 3, 1000, median 2, cap 4: (1 + 2 + 3 + 8) / 4
    s = torch.tensor([1.0, 2.0, 3.0, 1000.0], dtype=F64)
    assert float(fleet_time_scale(s, torch.arange(4), 4.0)) == pytest.approx(3.5)


def test_evidence_mode_decides_on_clipped_gains_so_one_unit_cannot_freeze_q():
    """drift_fit = "evidence": ℓ_i(q) is checked from above only (and pinned at the E-step's
    q), so a unit setting ℓ_i = −1e20 at every other q summed raw left only the E-step's
    column finite: q frozen (here at 0, against the honest 0.178). Decided on each unit's
    clipped gains over q = 0 (± drift_score_clip · n_i), its pull is bounded and the 63
    honest units' evidence wins."""
    train, _ = planted(q=0.5, units=64, rows=40, future=2, seed=1)
    alg = make(drift_fit="evidence")
    rounds = run_rounds(alg, train, 1)
    server = rounds.server
    reply = alg.client_update(expand(alg.broadcast(server), 64), rounds.states, train).reply
    honest = float(alg.server_update(server, reply, train.count)["drift"]["q"])
    assert float(server["drift"]["q"]) == 0.0 and honest > 0.0
    loglik = reply["drift"]["loglik"].clone()
    loglik[3, 1:] = -1e20  # below the upper bound at every q but the E-step's (q = 0)
    hostile = {**reply, "drift": {**reply["drift"], "loglik": loglik}}
    assert alg.inconsistent_replies(server, hostile, train.count, torch.ones(64, dtype=bool)) == {}
    assert float(alg.server_update(server, hostile, train.count)["drift"]["q"]) == honest
