"""Short co-locations in fedprior_drift (issue 26, fedprior_short S1–S4) on a planted fleet."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedcal.algorithms.fedprior_drift import FedPriorDrift
from fedcal.algorithms.fedprior_short import TEMPER_GRID
from fedcal.core.bayes import F64
from fedcal.core.data import ClientData
from fedcal.core.task import Task
from fedcal.models.mlp import MLP
from fedcal_support.rounds import run_rounds

LONG, SHORT = 12, 6


def seasonal(seed: int = 0):
    """y = a_i + b_i x + 0.5 sin(2πt) + noise: a seasonal term the linear basis lacks, shared
    by the fleet. Long units are calibrated over a whole cycle (t in [0, 1], 40 rows), short
    ones over t in [0.2, 0.28] (8 rows, one season: the term is ≈ +0.48 there, which their
    own intercept takes up); every unit is tested over the next cycle, t in (1, 2]."""
    rng = np.random.default_rng(seed)
    train, test, t_train, t_test = [], [], [], []
    for i in range(LONG + SHORT):
        a, b = 0.2 + 0.05 * rng.standard_normal(), 1.0 + 0.05 * rng.standard_normal()
        rows = 40 if i < LONG else 8
        t = np.sort(rng.uniform(0, 1, rows) if i < LONG else rng.uniform(0.2, 0.28, rows))
        tf = np.sort(rng.uniform(1, 2, 30))
        for store, times, tt in ((train, t, t_train), (test, tf, t_test)):
            x = rng.uniform(-1, 1, len(times))
            y = a + b * x + 0.5 * np.sin(2 * math.pi * times) + 0.05 * rng.standard_normal(len(x))
            store.append((x[:, None], y[:, None]))
            tt.append(times)
    seeds = tuple(range(LONG + SHORT))
    return (
        ClientData.from_arrays(train, seeds, F64, time=t_train),
        ClientData.from_arrays(test, seeds, F64, time=t_test),
    )


def fit(short: str):
    train, test = seasonal()
    alg = FedPriorDrift(
        Task(MLP(in_features=1)),
        basis="total",
        degree=1,
        interval="calibrated",
        short_colocation=short,
        choose="off",  # the short step's own effect (the no-harm fall-back: fedprior_choice)
    )
    run = run_rounds(alg, train, 5)
    pred = alg.predict(run.personal, test.x)[..., 0]
    std = alg.predictive_std_timed(run.personal, test)[..., 0]
    err = (pred - test.y[..., 0]).abs()
    m = test.mask > 0
    rmse = torch.stack([err[i][m[i]].pow(2).mean().sqrt() for i in range(len(err))])
    cover = torch.stack(
        [(err[i] <= 1.959964 * std[i])[m[i]].to(F64).mean() for i in range(len(err))]
    )
    return alg, run, rmse, cover


@pytest.fixture(scope="module")
def both():
    return fit("holdout"), fit("off")


def test_the_fleet_learns_how_much_a_short_unit_borrows(both):
    (_, run, rmse, cover), (_, run_off, rmse_off, _) = both
    short = run.server["drift"]["short"]
    # S1: the window is the shortest calibration span (a short unit's, ≤ 0.08)
    train = seasonal()[0]
    spans = [
        float(t[: int(n)].max() - t[: int(n)].min())
        for t, n in zip(train.time, train.count, strict=True)
    ]
    assert float(short["window"]) == pytest.approx(min(spans))
    # S3: the long units' emulations show that a one-season fit's own rows weigh less
    # than 1; the long units are not in the class
    assert float(short["held"]) > 0 and float(short["temper"]) < 1.0
    assert float(short["temper"]) in TEMPER_GRID.tolist() and float(short["q"]) >= 0
    assert not math.isnan(float(short["tau"]))
    # S4: the short units predict their future better and state intervals that hold;
    # the long units' predictions are unchanged
    s = slice(LONG, None)
    assert float(rmse[s].mean()) < 0.95 * float(rmse_off[s].mean())
    assert float(cover[s].mean()) >= 0.9  # τ²_s and the walk at q_s: the interval holds
    torch.testing.assert_close(rmse[:LONG], rmse_off[:LONG], rtol=0, atol=0)
    rate = run.personal["drift_rate"]
    scale = run.server["drift"]["scale"]
    q = run.server["drift"]["q"]
    assert torch.all(rate[s] == (q + short["q"]) / scale)  # the short class ages at q + q_s
    assert torch.all(rate[:LONG] == run.server["drift"]["q"] / scale)  # the others at q
    assert (
        "short" not in run_off.server["drift"]
        or float(run_off.server["drift"]["short"]["held"]) == 0
    )


def test_without_a_short_class_nothing_changes():
    """Equal spans (every unit over t in [0, 1]): no unit has twice the shortest span, no
    emulation runs, and the run is the one without the step."""
    train, _ = seasonal()
    t = [np.linspace(0, 1, int(n)) for n in train.count]
    x = [train.x[i, : int(n)].numpy() for i, n in enumerate(train.count)]
    y = [train.y[i, : int(n)].numpy() for i, n in enumerate(train.count)]
    same = ClientData.from_arrays(list(zip(x, y, strict=True)), train.seeds, F64, time=t)
    outs = []
    for short in ("holdout", "off"):
        alg = FedPriorDrift(
            Task(MLP(in_features=1)), basis="total", degree=1, short_colocation=short
        )
        outs.append(run_rounds(alg, same, 4))
    assert float(outs[0].server["drift"]["short"]["held"]) == 0
    for key in ("coef", "cov", "drift_rate"):
        torch.testing.assert_close(outs[0].personal[key], outs[1].personal[key], rtol=0, atol=0)


def test_a_unit_without_row_times_is_not_put_in_the_short_class(both):
    """``fedcal calibrate`` without a time column: every span would read 0, so every unit
    (a year-long one too) would join the short class and take its weight w*, q_s and τ²_s.
    Without times no unit is short: the personal model equals the one of the step off."""
    (alg, run, _, _), _ = both
    from fedcal.core.tree import expand

    train, _ = seasonal()
    untimed = ClientData(train.x, train.y, train.count, train.seeds)
    down = expand(alg.broadcast(run.server), untimed.num_clients)
    assert not bool(alg.short.short_class(down, untimed).any())
    assert bool(alg.short.short_class(down, train)[LONG:].all())  # with times: the short ones
    off = FedPriorDrift(
        Task(MLP(in_features=1)),
        basis="total",
        degree=1,
        interval="calibrated",
        short_colocation="off",
    )
    state = alg.client_init(down)
    got = alg.personalize(down, state, untimed)
    want = off.personalize(down, state, untimed)
    torch.testing.assert_close(got["coef"], want["coef"], rtol=0, atol=0)


def test_own_folds_with_the_short_step_is_refused():
    from fedcal.core.algorithm import SettingError

    with pytest.raises(SettingError, match="own_folds: 5 with short_colocation"):
        FedPriorDrift(
            Task(MLP(in_features=1)), basis="total", degree=1, interval="calibrated", own_folds=5
        )
    FedPriorDrift(  # the step off, or I4 off: accepted
        Task(MLP(in_features=1)),
        basis="total",
        degree=1,
        interval="calibrated",
        own_folds=5,
        short_colocation="off",
    )


def test_bound_short_sse_clips_each_units_gains_over_w_1():
    """Hand-computed: 3 units, 2 columns (w, then w = 1). Per-row max(sse(w), sse(1)):
    [2, 2], [2, 2], [100, 1] -> median s = [2, 2] (a unit that held nothing out is not in
    it); clip 10: each gain over its own w = 1 entry within ± 10 · h_i · 2; the w = 1 entry
    itself dropped (0)."""
    from fedcal.algorithms.fedprior_drift_checks import bound_short_sse

    sse = torch.tensor([[1.0, 2.0], [4.0, 2.0], [100.0, 1.0], [-5.0, 7.0]], dtype=F64)
    held = torch.tensor([1.0, 2.0, 1.0, 0.0], dtype=F64)
    got = bound_short_sse(sse, held, 10.0)
    # unit 2: gain 99 > 10 · 1 · 2 = 20 -> 20; unit 3: gain 0 - 7, bound 0 -> 0
    want = torch.tensor([[-1.0, 0.0], [2.0, 0.0], [20.0, 0.0], [0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_unit_forging_its_emulated_errors_no_longer_moves_w_star():
    """60 honest long units whose emulated error per row is 1 + |k - 3|/2 at the k-th w
    (least at w = 1/16), and one forger uploading 1e9 at every w but w = 0 and none there
    (the server cannot recompute S2's sums). Unbounded it moves the fleet's w* to 0; with its
    gains over w = 1 clipped to 20 · h · s_w (bound_short_sse, the server's step) w* stays
    the honest fleet's: 60·250 + (1e9 - 20·100·3) > 60·100 + 1e9."""
    from fedcal.algorithms.fedprior_drift_checks import bound_short_sse
    from fedcal.algorithms.fedprior_drift_walk import DRIFT_GRID
    from fedcal.algorithms.fedprior_interval import TAU_GRID

    alg = FedPriorDrift(Task(MLP(in_features=1)), basis="total", degree=1)
    assert alg.short_sse_clip == 20.0
    units, h = 61, 100.0
    k = torch.arange(len(TEMPER_GRID), dtype=F64)
    sse = ((1.0 + 0.5 * (k - 3).abs()) * h).repeat(units, 1)
    held = torch.full((units,), h, dtype=F64)
    old = {**alg.short.init(), "window": torch.tensor(1.0, dtype=F64)}

    def w_star(errors: torch.Tensor) -> float:
        n = len(errors)
        sums = {
            "sse": errors,
            "score": torch.zeros(n, len(TEMPER_GRID), len(DRIFT_GRID), dtype=F64),
            "inside": held[:n].unsqueeze(1).expand(-1, len(TAU_GRID)).clone(),
            "held": held[:n],
        }
        ones = torch.ones(n, dtype=F64)
        return float(alg.short.update(old, ones, sums, ones)["temper"])

    honest = float(TEMPER_GRID[3])
    assert w_star(sse) == honest
    torch.testing.assert_close(bound_short_sse(sse, held, 20.0), sse - sse[:, -1:], rtol=0, atol=0)
    forged = sse.clone()
    forged[-1] = 1e9
    forged[-1, 0] = 0.0
    assert w_star(forged) == 0.0  # the forgery works without the bound
    assert w_star(bound_short_sse(forged, held, alg.short_sse_clip)) == honest
    for big in (1e18, 1e20, 1e300):  # review B: the same huge value at every w (no gain)
        offset = sse.clone()
        offset[-1] = big
        if big >= 1e20:  # summed raw: every column tied (the honest margins ~1e4), w = 1
            assert w_star(offset) == 1.0
        assert w_star(bound_short_sse(offset, held, alg.short_sse_clip)) == honest


@pytest.mark.parametrize("offset", [-1e20, -1e300])
def test_a_huge_common_offset_in_one_unit_s_short_scores_does_not_move_q_s(offset):
    """Review B: 60 honest long units whose score at every w is 0.1 · h · min(k, 5) at the
    k-th q_s (the fleet's gain 3,000 nats at k = 5 beats ½ drift_test), one forger uploading
    the same huge negative score at every (w, q_s): zero gains, so nothing to clip, but
    summed raw the offset ties every column and q_s* = 0. On the clipped gains
    (bound_future_scores, the server's step) q_s* is the honest fleet's."""
    from fedcal.algorithms.fedprior_drift_checks import bound_future_scores
    from fedcal.algorithms.fedprior_drift_walk import DRIFT_GRID
    from fedcal.algorithms.fedprior_interval import TAU_GRID

    alg = FedPriorDrift(Task(MLP(in_features=1)), basis="total", degree=1)
    units, h = 61, 100.0
    w_n, q_n = len(TEMPER_GRID), len(DRIFT_GRID)
    gain = 0.1 * h * torch.arange(q_n, dtype=F64).clamp_max(5.0)
    score = gain.expand(units, w_n, q_n).clone()
    score[-1] = offset
    held = torch.full((units,), h, dtype=F64)
    old = {**alg.short.init(), "window": torch.tensor(1.0, dtype=F64)}
    sse = (h * (1.0 + torch.arange(w_n, dtype=F64))).repeat(units, 1)  # w* = 0

    def q_star(scores: torch.Tensor) -> float:
        sums = {
            "sse": sse,
            "score": scores,
            "inside": held.unsqueeze(1).expand(-1, len(TAU_GRID)).clone(),
            "held": held,
        }
        ones = torch.ones(units, dtype=F64)
        return float(alg.short.update(old, ones, sums, ones)["q"])

    assert q_star(score) == 0.0  # summed raw: the offset swallows the honest gain
    rows = torch.full((units * w_n,), 4 * h, dtype=F64)
    clipped = bound_future_scores(score.reshape(-1, q_n), rows, alg.drift_score_clip)
    assert q_star(clipped.reshape(units, w_n, q_n)) == float(DRIFT_GRID[5])
    honest = bound_future_scores(score[:-1].reshape(-1, q_n), rows[:-w_n], 3.0)
    torch.testing.assert_close(clipped.reshape(units, w_n, q_n)[:-1].reshape(-1, q_n), honest)


def test_the_emulations_hold_out_what_they_say(both):
    """S2's designs on the same broadcast: "future" predicts each window's later rows of the
    last quarter; "span" every row outside each window (before it too: more rows); "far"
    the first window's only (fewer). Every held-out row is a long unit's."""
    import dataclasses

    from fedcal.core.tree import expand

    (alg, run, _, _), _ = both
    train, _ = seasonal()
    down = expand(alg.broadcast(run.server), train.num_clients)
    held = {
        mode: dataclasses.replace(alg, short_emulation=mode).short.holdout(
            down, run.states, train, alg.drift.walk.drift_cov(down)
        )["held"]
        for mode in ("future", "span", "far")
    }
    assert torch.all(held["span"][:LONG] > held["future"][:LONG])
    assert torch.all(held["far"][:LONG] < held["future"][:LONG])
    assert torch.all(held["far"][:LONG] > 0)
    for h in held.values():
        assert torch.all(h[LONG:] == 0)
    # "span": each of the 4 windows holds out every row but its own
    n = train.count[:LONG].to(F64)
    assert torch.all(held["span"][:LONG] <= 4 * n) and torch.all(held["span"][:LONG] > 3 * n - 40)
