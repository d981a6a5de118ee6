"""fedprior's time-respecting choice, simple candidates and no-harm fall-back (issue 34)."""

from __future__ import annotations

import numpy as np
import torch

from fedcal.algorithms.fedprior import FedPrior
from fedcal.algorithms.fedprior_choice import FOLDS, ridge_solve, subset
from fedcal.core.bayes import F64
from fedcal.core.data import ClientData
from fedcal.core.task import Task
from fedcal.core.tree import expand
from fedcal.models.basis import legendre_products
from fedcal.models.mlp import MLP
from fedcal_support.rounds import run_rounds


def make(**kw) -> FedPrior:
    return FedPrior(Task(MLP(in_features=1)), **{"basis": "total", "degree": 2, **kw})


def curved_past(units: int = 16, rows: int = 80, seed: int = 0):
    """Lines y = a_i + b_i x whose first half of the span also carries a curvature
    c·P̃₂(x) that is gone later (a seasonal error); test rows after the span."""
    rng = np.random.default_rng(seed)
    train, test, t_train, t_test = [], [], [], []
    for _ in range(units):
        a, b = rng.normal(0.0, 0.3), rng.normal(1.0, 0.2)
        t = np.sort(rng.uniform(0.0, 1.0, rows))
        x = rng.uniform(-1, 1, rows)
        curve = np.where(t < 0.5, 0.4 * 0.5 * (3 * x**2 - 1), 0.0)
        y = a + b * x + curve + 0.05 * rng.standard_normal(rows)
        xt = rng.uniform(-1, 1, 40)
        yt = a + b * xt + 0.05 * rng.standard_normal(40)
        train.append((x[:, None], y[:, None]))
        test.append((xt[:, None], yt[:, None]))
        t_train.append(t)
        t_test.append(np.sort(rng.uniform(1.0, 1.3, 40)))
    seeds = tuple(range(units))
    return (
        ClientData.from_arrays(train, seeds, F64, time=t_train),
        ClientData.from_arrays(test, seeds, F64, time=t_test),
    )


def rmse(alg: FedPrior, personal, data: ClientData) -> float:
    pred = alg.predict(personal, data.x)[..., 0]
    err = (pred - data.y[..., 0]) ** 2 * data.mask
    return float((err.sum() / data.mask.sum()).sqrt())


def test_forward_choice_differs_from_bic_and_predicts_the_future_better():
    train, test = curved_past()
    bic = make(select="bic", choose="off")
    fwd = make(select="bic", choose="auto")
    r_bic, r_fwd = run_rounds(bic, train, 10), run_rounds(fwd, train, 10)
    # candidates: degree 0, 1, 2. In sample the past curvature pays (BIC keeps degree 2);
    # fitted on each unit's earlier rows, the curvature mispredicts its later rows.
    assert bic.candidates[int(r_bic.server["choice"])] == {"degree": 2}
    assert fwd.candidates[int(r_fwd.server["choice"])] == {"degree": 1}
    assert rmse(fwd, r_fwd.personal, test) < 0.8 * rmse(bic, r_bic.personal, test)
    record = fwd.export_state(r_fwd.server)["selection"]
    assert record["rule"] == "forward"
    assert record["forward"]["ranked"][0]["candidate"] == str({"degree": 1})
    assert record["forward"]["units_scored"] == 16.0
    assert "fallback" not in r_bic.personal  # choose = "off": fedprior as before


def test_folds_score_later_rows_than_they_fit():
    train, _ = curved_past(units=3, rows=50)
    alg = make(choose="auto")
    folds = alg.time_choice.folds(train)
    assert len(folds) == FOLDS
    t = train.time
    for fit, scored in folds:
        assert bool((fit * scored == 0).all())
        last_fit = torch.where(fit > 0, t, -np.inf).amax(1)
        first_scored = torch.where(scored > 0, t, np.inf).amin(1)
        assert bool((last_fit < first_scored).all())
    # the scored rows of the two folds: ranks [⌊n/2⌋, ⌊3n/4⌋) and [⌊3n/4⌋, n) in time order
    rank = torch.argsort(torch.argsort(torch.where(train.mask > 0, t, np.inf), dim=1), dim=1)
    real = train.mask > 0
    assert bool(((folds[0][1] > 0) == ((rank >= 25) & (rank < 37) & real)).all())
    assert bool(((folds[1][1] > 0) == ((rank >= 37) & real)).all())
    part = subset(train, folds[0][0])
    assert torch.equal(part.count, folds[0][0].sum(1).long())


def test_no_harm_falls_back_to_the_units_own_line():
    """A prior that fits unit 0 (y = x) and not unit 1 (y = 2 − 3x), held tight (Σ = 1e-6 I,
    as a prior learned on another fleet): unit 1's posterior stays near the prior and
    mispredicts its own later rows; it ships its own least-squares line, unit 0 the prior."""
    rng = np.random.default_rng(0)
    alg = make(degree=1)
    rows, xs, ys = 40, [], []
    for a, b in ((0.0, 1.0), (2.0, -3.0)):
        x = rng.uniform(-1, 1, rows)
        xs.append(x)
        ys.append(a + b * x + 0.05 * rng.standard_normal(rows))
    t = [np.arange(rows, dtype=float)] * 2
    data = ClientData.from_arrays(
        [(x[:, None], y[:, None]) for x, y in zip(xs, ys, strict=True)], (0, 1), F64, time=t
    )
    server = alg.server_init({})
    server["mu"] = torch.tensor([0.0, 1.0 / np.sqrt(3.0)], dtype=F64)  # y = x (P̃₁ = √3 x)
    server["sigma"] = 1e-6 * torch.eye(2, dtype=F64)
    server["noise_var"] = torch.tensor(0.05**2, dtype=F64)
    down = expand(alg.broadcast(server), 2)
    personal = alg.personalize(down, alg.client_init(down), data)
    assert personal["fallback"].tolist() == [0.0, 1.0]  # prior; own linear
    grid = torch.linspace(-1, 1, 9, dtype=F64).reshape(1, -1, 1).expand(2, -1, -1)
    pred = alg.predict(personal, grid)[..., 0]
    own = np.polyfit(xs[1], ys[1], 1)  # hand reference: its line on all its rows
    assert np.allclose(pred[1].numpy(), np.polyval(own, grid[1, :, 0].numpy()), atol=1e-8)
    assert torch.allclose(pred[0], grid[0, :, 0], atol=1e-3)  # the prior's line
    # its σ² states at least the error it made on its own later rows
    assert float(personal["noise_var"][1]) >= float(personal["val_mse"][1]) - 1e-12
    assert float(personal["val_mse"][1]) < 0.01  # own line's validation MSE (noise 0.05²)


def test_implausible_unit_is_weak_not_ok():
    rng = np.random.default_rng(3)
    train, times = [], []
    for i in range(12):
        x = rng.uniform(-1, 1, 60)
        noise = 2.0 if i == 5 else 0.05  # 40× the fleet's: a channel that calibrates nothing
        # unit 7: a wet site, 10× the others' range and errors (not implausible)
        scale = 10.0 if i == 7 else 1.0
        y = scale * (x + noise * rng.standard_normal(60))
        train.append((x[:, None], y[:, None]))
        times.append(np.arange(60, dtype=float))
    data = ClientData.from_arrays(train, tuple(range(12)), F64, time=times)
    alg = make(degree=1, noise="sensor")
    run = run_rounds(alg, data, 8)
    flags = alg.client_status(run.server, run.personal, data.x, data.mask)
    assert bool(flags["weak"][5])
    assert int(flags["weak"].sum()) == 1  # not the wet site


def test_raw_reading_and_pooled_line_from_sums():
    alg = make(degree=2, raw_input=0, raw_map=(0.3, 2.0))
    x = torch.linspace(-1, 1, 7, dtype=F64).reshape(1, -1, 1)
    phi = legendre_products(x, alg.terms)
    assert torch.allclose((phi * alg.time_choice.raw_coef).sum(-1), 0.3 + 2.0 * x[..., 0])
    # the pooled line on all rows is the least-squares line through every unit's fitted
    # values ŷ = φᵀm_i at its rows, stacked (numpy reference; from screened uploads only)
    train, _ = curved_past(units=5, rows=30)
    down = expand(alg.broadcast(alg.server_init({})), 5)
    state = alg.client_init(down)
    phi = legendre_products(train.x.to(F64), alg.terms) * train.mask.unsqueeze(-1)
    gram = phi.transpose(1, 2) @ phi
    mean = torch.randn(5, len(alg.terms), dtype=F64, generator=torch.Generator().manual_seed(0))
    up = alg.time_choice.uploads(alg, down, state, train, gram, mean)
    out = alg.time_choice.update(up, torch.arange(5), gram, True)
    real = train.mask > 0
    xs = train.x[..., 0][real].numpy()
    fitted = (phi * mean.unsqueeze(1)).sum(-1)[real].numpy()
    design = np.column_stack([np.ones_like(xs), np.sqrt(3) * xs])
    ref = np.linalg.lstsq(design, fitted, rcond=None)[0]
    assert np.allclose(out["pooled_all"].numpy(), ref, atol=1e-7)
    # each fold's pooled line: the least-squares line of the fold's fit rows stacked
    for k, (fit, _) in enumerate(alg.time_choice.folds(train)):
        keep = (fit > 0).numpy()
        xk, yk = train.x[..., 0].numpy()[keep], train.y[..., 0].numpy()[keep]
        dk = np.column_stack([np.ones_like(xk), np.sqrt(3) * xk])
        ref = np.linalg.lstsq(dk, yk, rcond=None)[0]
        assert np.allclose(out["pooled_fold"][k].numpy(), ref, atol=1e-7)


def test_sigma_scaled_by_the_units_own_future():
    """The noise grows in time (0.05 in the first half of each unit's span, 0.15 after and in
    use): the in-sample σ understates the future; scaled by how the early fits' σ matched
    the later rows (50 scored rows a unit: the quantile's shrinkage to 1 weighs 20), the 95 %
    intervals cover the future rows near 95 %."""
    rng = np.random.default_rng(5)
    train, test, t_train, t_test = [], [], [], []
    for _ in range(20):
        t = np.sort(rng.uniform(0, 1, 200))
        x = rng.uniform(-1, 1, 200)
        y = x + np.where(t < 0.5, 0.05, 0.15) * rng.standard_normal(200)
        xt = rng.uniform(-1, 1, 60)
        train.append((x[:, None], y[:, None]))
        test.append((xt[:, None], (xt + 0.15 * rng.standard_normal(60))[:, None]))
        t_train.append(t)
        t_test.append(np.sort(rng.uniform(1, 1.3, 60)))
    seeds = tuple(range(20))
    data = ClientData.from_arrays(train, seeds, F64, time=t_train)
    future = ClientData.from_arrays(test, seeds, F64, time=t_test)

    def cover(alg):
        personal = run_rounds(alg, data, 8).personal
        half = 1.959964 * alg.predictive_std(personal, future.x)
        inside = ((alg.predict(personal, future.x) - future.y).abs() <= half)[..., 0]
        return float((inside * future.mask).sum() / future.mask.sum()), personal

    off, _ = cover(make(degree=1))
    on, personal = cover(make(degree=1, choice_sigma="scale"))
    # σ from all rows, √((0.05² + 0.15²)/2) = 0.112: P(|z| < 1.96 · 0.112 / 0.15) = 0.856
    # (1,200 future rows: binomial SE 0.010)
    assert abs(off - 0.856) < 0.04
    assert 0.90 <= on <= 0.98
    # the fit on the first ¾ states σ ≈ √((2 · 0.05² + 0.15²)/3) = 0.096 for rows at 0.15:
    # r ≈ (0.15 / 0.096)² = 2.4, shrunk with 50 rows against 20 pseudo-rows: √r̃ ≈ 1.4
    assert 1.15 < float(personal["sigma_scale"].median()) < 1.7


def test_a_unit_whose_rows_share_one_time_is_scored_and_a_tiny_one_is_not():
    """Review B: one time stamp for every calibration row gave a span of 0, folds fitted on
    0 rows and a NaN reply refused every round. Folds by rank: ties in row order."""
    rng = np.random.default_rng(0)
    train, times = [], []
    for i in range(8):
        rows = 3 if i == 1 else 40  # unit 1: 3 rows, folds fit 1 and 2 < 2 + 1: unscored
        x = rng.uniform(-1, 1, rows)
        y = (0.5 + 1.5 * x if i == 0 else x) + 0.05 * rng.standard_normal(rows)
        train.append((x[:, None], y[:, None]))
        times.append(np.zeros(rows) if i == 0 else np.arange(float(rows)))
    data = ClientData.from_arrays(train, tuple(range(8)), F64, time=times)
    alg = make(degree=1, raw_input=0, raw_map=(0.0, 1.0))
    (fit0, sc0), (fit1, sc1) = alg.time_choice.folds(data)
    assert [int(fit0[0].sum()), int(sc0[0].sum()), int(fit1[0].sum()), int(sc1[0].sum())] == [
        20,
        10,
        30,
        10,
    ]
    assert float(sc0[0] @ fit0[0]) == 0 and bool((fit0[0][:20] == 1).all())  # row order
    assert float(sc0[1].sum() + sc1[1].sum()) == 0
    run = run_rounds(alg, data, 6)
    line = ridge_solve(torch.zeros(2, 2, dtype=F64), torch.zeros(2, dtype=F64))
    assert torch.equal(line, torch.zeros(2, dtype=F64))  # no rows: the line 0, not NaN
    assert bool(torch.isfinite(run.server["forward_scores"]).all())
    # every unit but the tiny one; unit 0 (another line) with its outlier weight in (0, 1)
    assert 6.0 < float(run.server["forward_scored"]) < 7.0
    pred = alg.predict(run.personal, data.x)[..., 0]
    err = float(((pred[0] - data.y[0, :, 0]) ** 2).mean().sqrt())
    assert err < 0.1  # its own line (noise 0.05), not a refused unit's prior mean
