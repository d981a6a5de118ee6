"""The one-shot release of a fleet's moments (core.privacy.release_moments, staged_budget)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedcal.core.privacy import (
    StagedBudget,
    Whitening,
    composed_epsilon,
    epsilon_spent,
    release_moments,
    staged_budget,
)

F64 = torch.float64
ALPHAS = np.array([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)), dtype=float)


def _closed_form(rdp_per_alpha: float, delta: float) -> float:
    """ε of a Gaussian composition with RDP α·ρ, Balle et al. 2020's conversion minimised
    over Opacus's orders (as tests/core/test_privacy.py)."""
    a = ALPHAS
    eps = a * rdp_per_alpha + np.log((a - 1) / a) - (np.log(delta) + np.log(a)) / (a - 1)
    return float(eps.min())


@pytest.mark.parametrize("stages, count_share", [(1, 0.0), (4, 0.1), (6, 0.2)])
def test_staged_budget_spends_the_closed_form_epsilon(stages, count_share):
    """RDP of the stages and counts adds to α/2 · (Σ 1/σ_k² + S·steps/z_b²) = α/(2z²): the
    accountant's ε equals the closed form and that of one Gaussian mechanism of multiplier
    z; the shares are as stated (stage 0 ``first_share`` of the sums, the rest equal)."""
    delta = 1.0 / 2030**2
    b = staged_budget(1.0, delta, stages, first_share=0.1, count_share=count_share, steps=12)
    inv = sum(1 / s**2 for s in b.sums) + (stages * 12 / b.counts**2 if b.counts else 0.0)
    assert inv == pytest.approx(1 / b.base**2, rel=1e-12)
    assert b.spent == pytest.approx(_closed_form(inv / 2, delta), rel=1e-9)
    assert b.spent == pytest.approx(epsilon_spent(b.base, 1.0, 1, delta), rel=1e-9)
    assert b.spent == pytest.approx(composed_epsilon(b.mechanisms(), delta), rel=1e-12)
    assert 0.99 <= b.spent <= 1.0
    if stages > 1:
        rest = 1 - count_share
        assert 1 / b.sums[0] ** 2 == pytest.approx(0.1 * rest / b.base**2, rel=1e-12)
        for s in b.sums[1:]:
            assert 1 / s**2 == pytest.approx(0.9 * rest / (stages - 1) / b.base**2, rel=1e-12)


def _fleet(n: int, p: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-1, -5, p, dtype=F64)  # a spread over decades, as a fleet's
    coef = 0.3 + torch.randn(n, p, generator=g, dtype=F64) * scales
    noise = 1e-6 * (1 + torch.rand(n, generator=g, dtype=F64))
    return coef, noise


@pytest.mark.parametrize("refresh_last", [False, True])
def test_without_noise_the_release_is_the_fleets_moments(refresh_last):
    """budget None: the mean, the population covariance and the mean noise variance."""
    coef, noise = _fleet(50, 4)
    gen = torch.Generator().manual_seed(0)
    got, _ = release_moments(coef, noise, None, gen, refresh_last=refresh_last)
    assert torch.allclose(got.mean, coef.mean(0), rtol=0, atol=1e-12)
    cov = torch.cov(coef.T, correction=0)
    assert torch.allclose(got.cov, cov, rtol=1e-8, atol=1e-14)
    assert float(got.noise) == pytest.approx(float(noise.mean()), rel=1e-10)


def test_the_oracle_releases_noise_at_its_sensitivity():
    """Whitened by the truth, every unit at the mean (z = 0: nothing clipped): the released
    mean is μ + L·e with e ~ N(0, (σ √L_leaves √(2p) / N)²) per coordinate (the mean leaf's
    bound √(2p), three leaves: mean, second moment, noise). 400 draws: the std within 10 %."""
    n, p, sigma = 20, 3, 2.0
    mu = torch.tensor([1.0, -2.0, 0.5], dtype=F64)
    cov = torch.diag(torch.tensor([4.0, 1.0, 0.25], dtype=F64))
    coef = mu.expand(n, p).clone()
    noise = torch.full((n,), 0.01, dtype=F64)
    truth = Whitening(mu, cov, torch.tensor(0.01, dtype=F64))
    budget = StagedBudget(1.0, 1e-5, (sigma,), 0.0, 1, sigma, 1.0)
    gen = torch.Generator().manual_seed(3)
    draws = []
    for _ in range(400):
        got, _ = release_moments(coef, noise, budget, gen, quantile=0.0, whiten=truth)
        draws.append((got.mean - mu) / cov.diagonal().sqrt())  # back in whitened units
    std = torch.stack(draws).std(0)
    want = sigma * math.sqrt(3) * math.sqrt(2 * p) / n
    assert torch.allclose(std, torch.full((p,), want, dtype=F64), rtol=0.1)


@pytest.mark.parametrize("stages, refresh_last", [(2, False), (4, False), (4, True)])
def test_a_noisy_release_is_positive_definite_and_finite(stages, refresh_last):
    """A tiny fleet at ε = 0.5: the noise swamps the moments, the release is still a
    symmetric positive-definite covariance (eigenvalues ≥ the floor) and σ² > 0."""
    coef, noise = _fleet(30, 5, seed=1)
    budget = staged_budget(0.5, 1e-3, stages, count_share=0.1)
    got, metrics = release_moments(
        coef, noise, budget, torch.Generator().manual_seed(1), refresh_last=refresh_last
    )
    assert torch.isfinite(got.cov).all() and torch.isfinite(got.mean).all()
    assert torch.equal(got.cov, got.cov.T)
    assert float(torch.linalg.eigvalsh(got.cov).min()) >= 1e-12 * (1 - 1e-6)
    assert float(got.noise) > 0
    assert any(k.startswith(f"stage{stages - 1}/") for k in metrics)


def test_default_delta_is_one_over_the_units_squared():
    """[privacy] delta omitted: δ = min(1/N², 1e-5) for the run's N units, recorded
    (privacy.json) with its rule and accounted (σ is the accountant's at that δ); set: the
    value set; N not known before the run (a Flower server): the fixed 1e-5, said so."""
    from dataclasses import replace

    from fedcal.build import build_policy
    from fedcal.config import load_config
    from fedcal.core.privacy import account

    cfg = load_config("default")
    cfg = replace(cfg, privacy=replace(cfg.privacy, epsilon=1.0, clip=1.0, noise="seeded"))
    assert cfg.privacy.delta is None
    rounds = cfg.engine.rounds
    _, record = build_policy(cfg, 2030)
    assert record["delta"] == 1.0 / 2030**2 and record["delta_rule"] == "1/N^2, N = 2030 units"
    want = account(1.0, 1.0 / 2030**2, cfg.engine.participation, rounds)
    assert record["noise_multiplier"] == pytest.approx(want.noise_multiplier, rel=1e-12)
    _, fixed = build_policy(replace(cfg, privacy=replace(cfg.privacy, delta=1e-3)), 2030)
    assert fixed["delta"] == 1e-3 and fixed["delta_rule"] == "set in [privacy] delta"
    _, small = build_policy(cfg, 300)  # 1/300² > 1e-5: capped
    assert small["delta"] == 1e-5 and "N = 300 units" in small["delta_rule"]
    _, unknown = build_policy(cfg)
    assert unknown["delta"] == 1e-5 and "not known" in unknown["delta_rule"]


def test_adaptive_clipping_without_a_count_budget_is_refused():
    """quantile > 0 with budget.counts = 0 would release the clip counts without noise and
    outside ε: refused; quantile 0 (declared bounds) at the same budget runs."""
    coef, noise = _fleet(30, 3)
    budget = staged_budget(1.0, 1e-5, 3, count_share=0.0)
    with pytest.raises(ValueError, match="count_share > 0"):
        release_moments(coef, noise, budget, torch.Generator().manual_seed(0), quantile=0.9)
    got, _ = release_moments(coef, noise, budget, torch.Generator().manual_seed(0), quantile=0.0)
    assert got.cov is not None


def test_one_stage_without_a_preconditioner_is_refused():
    """Stage 0 releases the mean only: one stage and no ``whiten`` would give no covariance."""
    coef, noise = _fleet(30, 3)
    budget = staged_budget(1.0, 1e-5, 1)
    with pytest.raises(ValueError, match="1 stage needs whiten="):
        release_moments(coef, noise, budget, torch.Generator().manual_seed(0), quantile=0.0)


@pytest.mark.parametrize("scale", [10.0, 0.1])
def test_stage_zero_clips_at_two_root_p_in_the_start_units(scale):
    """Stage 0's mean leaf is c / s; its declared bound is 2√p (‖c‖ ≤ 2√p s). Units at
    ‖c‖ = 3√p s are all clipped and units at ‖c‖ = √p s none, whatever s (the bound was
    2√p s on c / s: at s = 10 nothing was clipped, at s = 0.1 everything)."""
    n, p = 20, 2
    noise = torch.full((n,), 0.01, dtype=F64)  # log σ² at the start's: never clipped
    budget = StagedBudget(1.0, 1e-5, (1.0, 1.0), 0.0, 1, 1.0, 1.0)
    for factor, clipped in [(3.0, n), (1.0, 0)]:
        coef = torch.full((n, p), factor * scale, dtype=F64)  # ‖c‖ = factor √p s
        _, m = release_moments(
            coef, noise, budget, torch.Generator().manual_seed(0), scale, 0.1, quantile=0.0
        )
        assert m["stage0/dp_clipped_statistics"] == clipped


def test_without_noise_the_release_with_scales_is_the_fleets_moments():
    """scales=True, no noise: stage 1 only preconditions; the release is the fits' own
    mean and population covariance (to rounding) whatever its scales and medians."""
    coef, noise = _fleet(64, 5, seed=3)
    got, _ = release_moments(coef, noise, None, torch.Generator().manual_seed(0), scales=True)
    torch.testing.assert_close(got.mean, coef.mean(0), rtol=0, atol=1e-12)
    torch.testing.assert_close(got.cov, torch.cov(coef.T, correction=0), rtol=1e-8, atol=1e-22)
    assert float(got.noise) == pytest.approx(float(noise.mean()), rel=1e-10)


def test_the_scale_stage_resolves_each_coordinate_relative_to_its_own_spread():
    """Five coordinates with standard deviations 1e-1 … 1e-9 (sixteen decades of variance)
    and means 0.3 + 1e-3: stage 1's scales are each within a factor 2 of the coordinate's
    variance and its median within half its std, where one bound for all (the second
    moment's absolute noise, ≈ σ·B/N ≈ 1e-4 here) would hide the last four."""
    from fedcal.core.dp_release import _scale_stage

    g = torch.Generator().manual_seed(7)
    sd = torch.logspace(-1, -9, 5, dtype=F64)
    coef = 0.3 + 1e-3 + torch.randn(4000, 5, generator=g, dtype=F64) * sd
    budget = staged_budget(4.0, 1e-6, 3, count_share=0.1, steps=40)
    start = Whitening(torch.full((5,), 0.3, dtype=F64), None, torch.tensor(1e-12, dtype=F64))
    got, _ = _scale_stage(coef, start, 0.01, budget.sums[1], budget, g)
    ratio = got.cov.diagonal() / sd**2
    assert bool((ratio > 0.5).all() and (ratio < 2.0).all()), ratio
    assert torch.equal(got.cov, torch.diag(got.cov.diagonal()))
    med = coef.median(0).values
    assert bool(((got.mean - med).abs() < 0.5 * sd).all()), (got.mean - med) / sd
    with pytest.raises(ValueError, match="scales need stage 0"):
        release_moments(coef, coef[:, 0].abs(), budget, g, whiten=start, scales=True)


def test_relevant_refines_only_the_block_above_the_noise_level():
    """relevant = 1, no noise: the coordinates whose variance is at least σ̂² (the noise,
    1e-6·1.5 here: the first two of 1e-2 … 1e-10) get the fits' own mean and covariance,
    the others are uncorrelated with them (the scale stage's diagonal)."""
    coef, noise = _fleet(64, 5, seed=4)
    got, metrics = release_moments(
        coef, noise, None, torch.Generator().manual_seed(0), scales=True, relevant=1.0
    )
    keep = [0, 1]
    assert metrics["scales/refined"] == 2
    torch.testing.assert_close(got.mean[keep], coef.mean(0)[keep], rtol=0, atol=1e-12)
    want = torch.cov(coef.T, correction=0)[keep][:, keep]
    torch.testing.assert_close(got.cov[keep][:, keep], want, rtol=1e-8, atol=0)
    assert float(got.cov[keep][:, 2:].abs().max()) == 0.0
    assert torch.equal(got.cov[2:, 2:], torch.diag(got.cov.diagonal()[2:]))


def test_the_scaled_release_follows_the_keys_not_the_rows_order():
    """scales=True with keys: the rows permuted together with their keys give the identical
    release (same generator: same hash key, same path, same sums). Without keys (positions,
    under which the scale stage's ε holds for no neighbouring relation) a noisy scaled
    release is refused, a release without noise is the fits' moments in any order. Keys not
    one per unit, or repeating, are refused."""
    coef, noise = _fleet(300, 4, seed=5)
    ids = [f"S{i:04d}" for i in range(300)]
    perm = torch.randperm(300, generator=torch.Generator().manual_seed(9))
    budget = staged_budget(4.0, 1e-5, 3, count_share=0.1)
    gen = torch.Generator()
    a, ma = release_moments(coef, noise, budget, gen.manual_seed(2), scales=True, keys=ids)
    b, mb = release_moments(
        coef[perm],
        noise[perm],
        budget,
        gen.manual_seed(2),
        scales=True,
        keys=[ids[i] for i in perm],
    )
    assert torch.equal(a.mean, b.mean) and torch.equal(a.cov, b.cov)
    assert torch.equal(a.noise, b.noise) and ma == mb and ma["scales/keyed"] == 1.0
    with pytest.raises(ValueError, match="a noisy release with scales needs keys="):
        release_moments(coef[perm], noise[perm], budget, gen.manual_seed(2), scales=True)
    c, mc = release_moments(coef[perm], noise[perm], None, gen.manual_seed(2), scales=True)
    torch.testing.assert_close(c.mean, coef.mean(0), rtol=0, atol=1e-12)
    assert mc["scales/keyed"] == 0.0
    with pytest.raises(ValueError, match="299 keys for 300 units"):
        release_moments(coef, noise, budget, gen, scales=True, keys=ids[1:])
    with pytest.raises(ValueError, match="unit key 'S0001' repeats"):
        release_moments(coef, noise, budget, gen, scales=True, keys=["S0001", *ids[1:]])


def _scale_var(coef, noise0, sigma=0.0, seed=0):
    """The scale stage's variances v on ``coef`` in its rows' order (no median noise)."""
    from fedcal.core.dp_release import _scale_stage

    budget = StagedBudget(1.0, 1e-5, (1.0, 1.0, 1.0), 0.0, 1, 1.0, 1.0)
    start = Whitening(coef.mean(0), None, torch.tensor(noise0, dtype=F64))
    got, _ = _scale_stage(coef, start, 0.0, sigma, budget, torch.Generator().manual_seed(seed))
    return got.cov.diagonal()


def _log_scale_sum(coef, noise0, sigma=0.0, seed=0):
    """The scale stage's released ℓ-sum S, read back from v = σ₀² exp(S/(N−1) − E[log χ²₁])."""
    from fedcal.core.privacy import LOG_CHI2_1

    n = coef.shape[0]
    return (n - 1) * ((_scale_var(coef, noise0, sigma, seed) / noise0).log() + LOG_CHI2_1)


def test_removing_one_unit_moves_the_scale_sum_by_at_most_the_declared_bound():
    """Add/remove neighbours: removing a unit keeps the others' order (the keyed hash of
    their ids), and moves the ℓ-sum by ≤ 3·30·√p, the noise's calibration. Coordinate 0
    is built to attain it: the interior unit's path neighbours coincide (their new term
    clips at −30), it sits far from both (two terms at +30), so Δ_0 = −90 exactly; an end
    unit far from its one neighbour moves it by −30. And the noise on the sum is that
    bound × the stage's multiplier (read back from a seeded draw)."""
    from fedcal.core.privacy import release_order

    n, p, noise0 = 12, 3, 1.0
    ids = [f"u{i}" for i in range(n)]
    order = release_order(ids, torch.Generator().manual_seed(4))
    g = torch.Generator().manual_seed(6)
    path = torch.randn(n, p, generator=g, dtype=F64)  # the units in path order
    k = 5  # interior: path neighbours 4 and 6 equal, unit 5 at 1e14 (ℓ ≈ +30 after clipping)
    path[k - 1, 0] = path[k + 1, 0]
    path[k, 0] = 1e14
    path[1, 0] = path[0, 0] + 1e14  # the end unit 0 far from its only neighbour
    coef = torch.empty_like(path)
    coef[order] = path  # back to the ids' rows
    bound = 3 * 30 * math.sqrt(p)
    full = _log_scale_sum(coef[order], noise0)
    for pos, want0 in [(k, -90.0), (0, -30.0)]:
        unit = int(order[pos])
        rest = [i for i in range(n) if i != unit]
        sub = release_order([ids[i] for i in rest], torch.Generator().manual_seed(4))
        assert [rest[i] for i in sub] == [int(i) for i in order if int(i) != unit]
        delta = _log_scale_sum(coef[rest][sub], noise0) - full
        assert float(delta.norm()) <= bound * (1 + 1e-12)
        assert float(delta[0]) == pytest.approx(want0, abs=1e-9)
        assert float(delta.abs().max()) <= (90.0 if pos == k else 30.0) + 1e-9
    sigma = 0.5
    e = torch.randn(p, generator=torch.Generator().manual_seed(8), dtype=F64)
    noisy = _log_scale_sum(coef[order], noise0, sigma, seed=8)
    torch.testing.assert_close((noisy - full) / e, torch.full((p,), sigma * bound, dtype=F64))


def test_the_hashed_order_is_not_fooled_by_lots_of_adjacent_units():
    """2,000 units in lots of 20 consecutive rows (lot spread 1, within-lot 0.1: adjacent
    rows differ by the within-lot spread only). No noise, the order's effect alone: in
    the keyed hash's order of the ids the scales are within a factor 1.5 of the fleet's
    variances; in the file's order they are far below (≈ 0.01 / 1.01 of the truth)."""
    from fedcal.core.privacy import release_order

    n, lot, p = 2000, 20, 2
    g = torch.Generator().manual_seed(11)
    lots = torch.randn(n // lot, p, generator=g, dtype=F64).repeat_interleave(lot, 0)
    coef = lots + 0.1 * torch.randn(n, p, generator=g, dtype=F64)
    ids = [f"lot{i // lot}-{i % lot}" for i in range(n)]
    truth = coef.var(0, correction=0)
    order = release_order(ids, torch.Generator().manual_seed(0))
    noise0 = float(truth.mean())
    ratio_h = _scale_var(coef[order], noise0) / truth
    ratio_p = _scale_var(coef, noise0) / truth
    assert bool(((ratio_h > 1 / 1.5) & (ratio_h < 1.5)).all()), ratio_h
    assert bool((ratio_p < 0.05).all()), ratio_p
