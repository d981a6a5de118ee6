"""fedprior's calibrated intervals (issue 20): residual-dof noise, the design-matched
hold-out's discrepancy variance, and the decline, on planted fleets."""

from __future__ import annotations

import math

import torch

from fedcal.algorithms.fedprior import FedPrior
from fedcal.core.bayes import F64, moments, posterior
from fedcal.core.data import ClientData
from fedcal.core.task import Task
from fedcal.core.tree import expand
from fedcal.engine.evaluation import interval_metrics
from fedcal.models.basis import legendre_exponents, legendre_products
from fedcal.models.mlp import MLP
from fedcal_support.rounds import run_rounds

TEST_ROWS = 100


def grid_fleet(
    refs: int, new: int, seed: int, curvature: float = 0.0, new_levels=(3, 2), noise=(0.01,)
):
    """Units of the hierarchical model on the (1, 1) basis, + ``curvature``·g_i·P2(x1), g_i ~ N(1,
    0.3²), a term the basis lacks. Reference units: a 6 × 6 grid of inputs; new units: a
    ``new_levels`` grid (2 levels of x1 see no curvature). Test: random inputs. Unit i's noise sd:
    ``noise[i % len(noise)]``."""
    gen = torch.Generator().manual_seed(seed)
    terms = legendre_exponents(2, orders=(1, 1))
    mu = torch.tensor([0.5, 1.0, -0.3, 0.1], dtype=F64)
    sd = torch.tensor([0.2, 0.1, 0.05, 0.02], dtype=F64)

    def grid(a: int, b: int) -> torch.Tensor:
        u, v = torch.linspace(-1, 1, a, dtype=F64), torch.linspace(-1, 1, b, dtype=F64)
        return torch.cartesian_prod(u, v)

    train, test = [], []
    for i in range(refs + new):
        c = mu + sd * torch.randn(4, generator=gen, dtype=F64)
        g = 1.0 + 0.3 * torch.randn((), generator=gen, dtype=F64)
        x_tr = grid(6, 6) if i < refs else grid(*new_levels)
        x_te = 2 * torch.rand(TEST_ROWS, 2, generator=gen, dtype=F64) - 1
        for store, x in ((train, x_tr), (test, x_te)):
            p2 = 0.5 * (3 * x[:, 1] ** 2 - 1)
            y = legendre_products(x, terms) @ c + curvature * g * p2
            y = y + noise[i % len(noise)] * torch.randn(len(x), generator=gen, dtype=F64)
            store.append((x.numpy(), y.unsqueeze(-1).numpy()))
    seeds = tuple(range(refs + new))
    return ClientData.from_arrays(train, seeds, F64), ClientData.from_arrays(test, seeds, F64)


def make(**kw) -> FedPrior:
    return FedPrior(Task(MLP()), orders=(1, 1), **kw)


def coverage(alg: FedPrior, personal, test: ClientData, units: slice) -> torch.Tensor:
    pred, std = alg.predict(personal, test.x), alg.predictive_std(personal, test.x)
    one = torch.ones((), dtype=F64)
    return interval_metrics(pred, std, test.y, test.mask, one)["coverage95"][units]


def band(units: int) -> float:
    """4 binomial sd of a 95 % coverage over units × TEST_ROWS rows (chance passes 1 in 10⁴)."""
    return 4 * math.sqrt(0.95 * 0.05 / (units * TEST_ROWS))


def test_well_specified_fleet_covers_95_percent_and_needs_no_discrepancy():
    train, test = grid_fleet(30, 60, seed=0)
    alg = make(interval="calibrated")
    server, _, personal, _ = run_rounds(alg, train, 20)
    assert int(server["probe_n"]) == 6 and int(server["declined"]) == 0
    # the noise on residual degrees of freedom: 30 × (36 − 4) + 60 × (6 − ≤4) > 900 left
    assert float(server["dof"]) > 900
    assert abs(float(server["noise_var"].sqrt()) - 0.01) < 0.001
    cov = float(coverage(alg, personal, test, slice(30, 90)).mean())
    assert abs(cov - 0.95) <= band(60) + 0.01, cov


def test_misspecified_fleet_learns_the_discrepancy_and_coverage_recovers():
    """The new units' two levels of x1 cannot see the curvature the basis lacks; the reference
    units' 6 levels can. Without the hold-out the intervals under-cover; with it they hold."""
    train, test = grid_fleet(30, 60, seed=1, curvature=0.2)
    new = slice(30, 90)
    plain = make()
    _, _, personal, _ = run_rounds(plain, train, 20)
    before = float(coverage(plain, personal, test, new).mean())
    alg = make(interval="calibrated")
    server, _, personal, _ = run_rounds(alg, train, 20)
    after = float(coverage(alg, personal, test, new).mean())
    assert before < 0.85, before
    assert float(server["disc_var"]) > 0
    assert abs(after - 0.95) <= band(60) + 0.02, after
    # reference units get no discrepancy term (they have ≥ 2× the probe's rows)
    assert torch.all(personal["disc_var"][:30] == 0) and torch.all(personal["disc_var"][new] > 0)


def test_a_fleet_of_few_point_units_only_declines_with_its_reason():
    train, test = grid_fleet(0, 40, seed=2, curvature=0.2)
    alg = make(interval="calibrated")
    server, _, personal, _ = run_rounds(alg, train, 10)
    assert int(server["declined"]) == 2
    assert "no unit has at least twice the points of the smallest design (6 points)" in (
        alg.interval_note(server)
    )
    std = alg.predictive_std(personal, test.x)
    assert torch.isnan(std).all()
    assert torch.isnan(coverage(alg, personal, test, slice(0, 40))).all()
    # declined is not diverged: every leaf of the personal model is finite
    assert all(torch.isfinite(v).all() for v in personal.values())
    # the mean prediction is still stated
    assert torch.isfinite(alg.predict(personal, test.x)).all()


def test_noise_on_residual_degrees_of_freedom_and_the_decline_without_any():
    """σ² = Σ‖y − Φm‖² / Σ(n − tr(GV)/σ²), by hand from one round's posteriors; a fleet with
    Σ ν < 1 (every basis fits its points) keeps its σ² and declines."""
    train, _ = grid_fleet(10, 10, seed=3, curvature=0.1)
    alg = make(interval="calibrated")
    server, _, _, _ = run_rounds(alg, train, 5)
    down = expand(alg.broadcast(server), train.num_clients)
    result = alg.client_update(down, alg.client_init(down), train)
    # by hand: the posterior's fit and the trace of its hat matrix
    stats = moments(alg.design(train.x), train.y[..., 0], train.mask)
    post = posterior(stats, server["mu"], server["sigma"], down["noise_var"])
    spent = torch.einsum("cij,cij->c", stats.gram, post.cov) / server["noise_var"]
    fit = (
        (train.y[..., 0] - (alg.design(train.x) @ post.mean.unsqueeze(-1))[..., 0]) ** 2
        * train.mask
    ).sum(1)
    new = alg.server_update(server, result.reply, torch.ones(train.num_clients))
    expected = fit.sum() / (stats.n - spent).sum()
    torch.testing.assert_close(new["noise_var"], expected, rtol=1e-8, atol=0)
    # no residual degrees of freedom: the σ² is kept, and the run declines (code 1)
    reply = {**result.reply, "interval": {**result.reply["interval"]}}
    reply["interval"]["dof"] = torch.full((train.num_clients,), 0.01, dtype=F64)
    new = alg.server_update(server, reply, torch.ones(train.num_clients))
    assert int(new["declined"]) == 1
    torch.testing.assert_close(new["noise_var"], server["noise_var"])
    assert alg.interval_note(new).startswith("no interval: no unit has residual degrees")


def test_a_later_unit_gets_the_federation_s_sigma_from_the_exported_state():
    """What prior.json stores rebuilds the same σ for the same unit (calibrate's path)."""
    train, test = grid_fleet(30, 20, seed=4, curvature=0.2)
    alg = make(interval="calibrated")
    server, _, personal, _ = run_rounds(alg, train, 15)
    doc = alg.export_state(server)["interval"]
    stored = {k: server[k] for k in ("mu", "sigma", "noise_var")}
    stored.update(
        disc_var=torch.tensor(doc["discrepancy_var"], dtype=F64),
        probe_n=torch.tensor(doc["probe_rows"], dtype=F64),
        declined=torch.tensor(float(doc["declined"]), dtype=F64),
    )
    down = expand(alg.broadcast(stored), train.num_clients)
    again = alg.personalize(down, alg.client_init(down), train)
    torch.testing.assert_close(
        alg.predictive_std(again, test.x), alg.predictive_std(personal, test.x), rtol=1e-12, atol=0
    )
    # a unit smaller than the fleet's smallest design: no interval
    small = ClientData.from_arrays([(test.x[0, :3].numpy(), test.y[0, :3].numpy())], (0,), F64)
    one = alg.personalize(expand(alg.broadcast(stored), 1), alg.client_init(down), small)
    assert float(one["declined"][0]) == 1.0


def test_rich_units_own_row_hold_out_lifts_their_coverage_to_95_percent():
    """I4. A fleet σ² pooled over rich units whose noise differs ten-fold (0.003 / 0.03) is
    too narrow for the noisy half and too wide for the quiet half: their mean coverage falls
    below 95 % (Jensen). Holding out their own rows in 5 folds learns the τ² that restores
    it; the probe's class (the new units) keeps its τ², and the fits are unchanged."""
    train, test = grid_fleet(30, 10, seed=0, noise=(0.003, 0.03))
    rich, new = slice(0, 30), slice(30, 40)
    plain = make(interval="calibrated")
    _, _, before_p, _ = run_rounds(plain, train, 20)
    before = float(coverage(plain, before_p, test, rich).mean())
    alg = make(interval="calibrated", own_folds=5)
    server, _, personal, _ = run_rounds(alg, train, 20)
    after = float(coverage(alg, personal, test, rich).mean())
    assert before < 0.95 - band(30), before
    assert abs(after - 0.95) <= band(30) + 0.01, after
    own = float(server["disc_own"])
    assert own > 0 and torch.all(personal["disc_var"][rich] == own)
    assert torch.all(personal["disc_var"][new] == server["disc_var"])
    assert torch.equal(personal["coef"], before_p["coef"])
    assert torch.all(before_p["disc_var"][rich] == 0) and not torch.any(personal["declined"] > 0)
    # prior.json carries it: the same units rebuilt from the exported state get the same σ
    doc = alg.export_state(server)["interval"]
    assert doc["discrepancy_var_own"] == own
    stored = {k: server[k] for k in ("mu", "sigma", "noise_var")}
    stored.update(
        disc_var=torch.tensor(doc["discrepancy_var"], dtype=F64),
        probe_n=torch.tensor(doc["probe_rows"], dtype=F64),
        declined=torch.tensor(float(doc["declined"]), dtype=F64),
        disc_own=torch.tensor(doc["discrepancy_var_own"], dtype=F64),
    )
    down = expand(alg.broadcast(stored), train.num_clients)
    again = alg.personalize(down, alg.client_init(down), train)
    torch.testing.assert_close(
        alg.predictive_std(again, test.x), alg.predictive_std(personal, test.x), rtol=1e-12, atol=0
    )


def test_tau_of_takes_the_smallest_covering_grid_value_interpolated():
    """tau_of: share per τ² of the grid → the first τ² reaching the target, linear between
    its grid neighbours (hand-computed); NaN when none reaches it; 0 when τ² = 0 covers."""
    from fedcal.algorithms.fedprior_interval import TAU_GRID

    alg = make(interval="calibrated")
    share = torch.zeros_like(TAU_GRID)
    share[10:] = 0.96
    share[9] = 0.90
    tau = float(alg.calibrated.tau_of(share))
    g9, g10 = float(TAU_GRID[9]), float(TAU_GRID[10])
    assert math.isclose(tau, g9 + (0.95 - 0.90) / (0.96 - 0.90) * (g10 - g9), rel_tol=1e-12)
    assert math.isnan(float(alg.calibrated.tau_of(torch.full_like(TAU_GRID, 0.9))))
    assert float(alg.calibrated.tau_of(torch.full_like(TAU_GRID, 0.95))) == 0.0


def test_own_folds_needs_two_folds_and_is_inert_with_the_posterior_interval():
    """own_folds = 1 is refused; own_folds with interval = "posterior" (the shipped 5 under a
    study that switches the interval off, e.g. client-level DP) is that interval exactly."""
    import pytest

    from fedcal.core.algorithm import SettingError

    with pytest.raises(SettingError, match="own_folds"):
        make(own_folds=1, interval="calibrated")
    assert make(own_folds=2, interval="calibrated").own_folds == 2
    train, _ = grid_fleet(6, 4, seed=3)
    runs = [run_rounds(make(own_folds=f), train, 3) for f in (0, 5)]
    assert "disc_own" not in runs[1][0] and "disc_var" not in runs[1][2]
    for key in ("coef", "cov", "noise_var"):
        assert torch.equal(runs[0][2][key], runs[1][2][key])


def test_the_note_names_both_declines_when_the_probe_and_the_own_rows_find_no_tau():
    """Code 3 (the probe's class: no τ² covers) with I4's τ²_own NaN too: every unit states
    no interval, and the note says why for both classes (review2: it named the rich only)."""
    alg = make(interval="calibrated", own_folds=3)
    server = {
        "declined": torch.tensor(3.0, dtype=F64),
        "disc_own": torch.tensor(math.nan, dtype=F64),
        "probe_n": torch.tensor(6.0, dtype=F64),
        "dof": torch.tensor(40.0, dtype=F64),
    }
    note = alg.interval_note(server)
    assert "did not cover 95 % of the held-out points" in note
    assert "95 % of their own held-out rows" in note
    only_rich = {**server, "declined": torch.tensor(0.0, dtype=F64)}
    assert alg.interval_note(only_rich).startswith("no interval for units with at least twice")
    assert alg.interval_note({**only_rich, "disc_own": torch.tensor(0.1, dtype=F64)}) == ""


def _own_counts_reference(alg, down, state, design, x, y, mask, able, weights):
    """I4's counts as first built: F fits of every unit, each predicting every row."""
    from fedcal.algorithms.fedprior_interval import TAU_GRID
    from fedcal.algorithms.fedprior_interval_parts import kept_moments

    inside = torch.zeros(mask.shape[0], TAU_GRID.shape[0], dtype=F64)
    held = torch.zeros(mask.shape[0], dtype=F64)
    fold = torch.remainder(mask.cumsum(1) - 1, alg.own_folds)
    for k in range(alg.own_folds):
        part = mask * (fold == k).to(F64) * able.unsqueeze(1)
        fold_held = part if weights is None else part * weights[1]
        w = None if weights is None else weights[0]
        stats = kept_moments(design, y, mask - part, w)
        inside += alg.calibrated._fit_count(down, state, stats, x, y, fold_held)
        held += fold_held.sum(1)
    return inside, held


def test_own_fold_counts_equal_every_unit_fitted_on_every_row():
    """I4's cheaper counts (only the units that hold out, the folds in one batch, each fit
    predicting its own fold's rows) equal the first implementation's to the bit: uneven
    folds (36 rows in 5 or 3), padded few-point units, with and without robust row weights
    and outliers excluded (N5)."""
    train, _ = grid_fleet(6, 4, seed=3, curvature=0.2, noise=(0.003, 0.03))
    x, y, mask = train.x.to(F64), train.y[..., 0].to(F64), train.mask.to(F64)
    gen = torch.Generator().manual_seed(0)
    robust = (
        0.5 + torch.rand(mask.shape, generator=gen, dtype=F64),
        (torch.rand(mask.shape, generator=gen) > 0.1).to(F64),
    )
    for folds in (5, 3):
        alg = make(interval="calibrated", own_folds=folds)
        server, states, _, _ = run_rounds(alg, train, 3)
        down = expand(alg.broadcast(server), train.num_clients)
        probe = down["probe_n"].to(F64)
        able = ((train.count.to(F64) >= 2 * probe) & (probe > 0)).to(F64)
        assert able.tolist() == [1.0] * 6 + [0.0] * 4
        design = alg.design(x)
        for weights in (None, robust):
            args = (down, states, design, x, y, mask, able, weights)
            inside, held = alg.calibrated._own_counts(*args)
            ref_inside, ref_held = _own_counts_reference(alg, *args)
            assert torch.equal(held, ref_held) and torch.equal(inside, ref_inside)
            # not a trivial equality: some rows are outside at τ² = 0, all inside at the top
            assert bool((inside[:6, 0] < held[:6]).any()) and torch.equal(inside[:, -1], held)
            assert float(held[:6].sum()) > 0 and float(held[6:].abs().sum()) == 0


def test_weak_directions_decline_only_the_units_whose_variance_they_carry():
    """Two inputs that read the same (x2 = x1 + 1e-3 noise, as a second optical channel) on a
    total-degree-2 basis: no unit's points determine the products of their difference, so
    the basis has weakly identified directions W. The fleet's units stay on that line and
    barely project on W: each gets an interval (before: every unit declined, code 5). A unit
    used off the line (x2 = −x1), whose coefficients the fleet's prior alone sets (V = Σ:
    vague along W), is declined; on the line the same prior is not."""
    gen = torch.Generator().manual_seed(5)
    train, test = [], []
    for i in range(12):
        x1 = 2 * torch.rand(60, generator=gen, dtype=F64) - 1
        x = torch.stack([x1, x1 + 1e-3 * torch.randn(60, generator=gen, dtype=F64)], 1)
        y = (0.3 + 0.1 * i / 12) + (1.0 + 0.05 * i / 12) * x1 + 0.2 * x1**2
        y = y + 0.02 * torch.randn(60, generator=gen, dtype=F64)
        rows = 12 if i % 2 else 40  # the 12-row units: the probe's design (I2)
        train.append((x[:rows].numpy(), y[:rows].unsqueeze(-1).numpy()))
        test.append((x[40:].numpy(), y[40:].unsqueeze(-1).numpy()))
    seeds = tuple(range(12))
    train_d = ClientData.from_arrays(train, seeds, F64)
    test_d = ClientData.from_arrays(test, seeds, F64)
    alg = FedPrior(Task(MLP()), basis="total", degree=2, interval="calibrated")
    server, _, personal, _ = run_rounds(alg, train_d, 15)
    assert alg.prior_status.identification(server)["weak_directions"] >= 1
    assert bool((server["weak_proj"] != 0).any()) and int(server["declined"]) != 5
    assert personal["declined"].eq(0).all()
    assert torch.isfinite(alg.predictive_std(personal, test_d.x)).all()
    assert "directions the fleet's points do not identify" in alg.interval_note(server)
    down = alg.broadcast(server)
    prior_cov = server["sigma"].expand(2, -1, -1)
    rows = [[[0.4, -0.4], [0.6, -0.6]], [[0.4, 0.4], [0.6, 0.6]]]  # off the line, on it
    used = ClientData.from_arrays(
        [(torch.tensor(r, dtype=F64).numpy(), torch.zeros(2, 1).numpy()) for r in rows], (0, 1), F64
    )
    weak = alg.weak_units(down, prior_cov, server["noise_var"], used)
    assert weak.tolist() == [True, False]
