"""The accountant's numbers against published and closed-form values."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from fedcal.core.privacy import (
    NOISE_MARGIN,
    AdaptiveClip,
    Statistic,
    account,
    account_adaptive,
    clip_statistics,
    composed_epsilon,
    epsilon_spent,
    noise_for_epsilon,
    noise_std,
    private_bounds,
    private_sums,
    project_sums,
    psd_projection,
    quantile_step,
)


def test_published_value_of_opacus_rdp_accountant():
    # Opacus's own documented case (tests/accountants_test.py): σ = 1.5, q = 0.04,
    # 90 epochs = 2250 steps, δ = 1e-5 → ε = 7.32911117143.
    assert epsilon_spent(1.5, 0.04, int(90 / 0.04), 1e-5) == pytest.approx(7.32911117143, 1e-9)


def test_published_noise_multiplier_for_a_target_epsilon():
    # Opacus's documented case: ε = 8, δ = 1e-5, q = 0.04, 2000 steps → σ = 1.3562.
    sigma = noise_for_epsilon(8.0, 1e-5, 0.04, 2000)
    assert sigma == pytest.approx(1.3562, abs=2e-3)


def test_full_participation_is_the_gaussian_mechanism_in_closed_form():
    """q = 1: RDP of T Gaussian mechanisms is T·α/(2σ²) (Mironov 2017, Prop. 7); ε from
    the conversion of Balle et al. 2020, Thm. 21, minimised over Opacus's orders::

        ε(α) = T α / (2σ²) + log((α − 1)/α) − (log δ + log α)/(α − 1)
    """
    sigma, rounds, delta = 4.0, 50, 1e-5
    alphas = np.array([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)), dtype=float)
    eps = (
        rounds * alphas / (2 * sigma**2)
        + np.log((alphas - 1) / alphas)
        - (np.log(delta) + np.log(alphas)) / (alphas - 1)
    )
    assert epsilon_spent(sigma, 1.0, rounds, delta) == pytest.approx(eps.min(), rel=1e-9)


@pytest.mark.parametrize("target", [1.0, 4.0, 8.0])
def test_noise_for_a_target_spends_at_most_the_target(target):
    spent = account(target, 1e-5, 1.0, 50)
    assert target * 0.99 <= spent.epsilon <= target
    assert not spent.poisson_assumed
    # Less noise would overspend.
    assert epsilon_spent(spent.noise_multiplier * 0.98, 1.0, 50, 1e-5) > target


def test_partial_participation_is_flagged_and_cheaper():
    full, part = account(4.0, 1e-5, 1.0, 50), account(4.0, 1e-5, 0.25, 50)
    assert part.poisson_assumed and part.noise_multiplier < full.noise_multiplier


def test_bad_targets_are_refused():
    with pytest.raises(ValueError, match="epsilon"):
        noise_for_epsilon(0.0, 1e-5, 1.0, 10)
    with pytest.raises(ValueError, match="delta"):
        noise_for_epsilon(1.0, 1.5, 1.0, 10)


# ---- client-level DP for sums of statistics (core.privacy.private_sums) -------------

F64 = torch.float64


def _cohort(clients: int = 6, p: int = 3, seed: int = 0):
    """Statistics of a cohort, as a "sum" algorithm uploads them, and their declaration."""
    gen = torch.Generator().manual_seed(seed)
    mean = torch.randn(clients, p, generator=gen, dtype=F64)
    a = torch.randn(clients, p, p, generator=gen, dtype=F64)
    cov = a @ a.transpose(1, 2) / p
    second = mean.unsqueeze(-1) * mean.unsqueeze(-2) + cov
    gram = a.transpose(1, 2) @ a
    rss = torch.rand(clients, generator=gen, dtype=F64) + 0.1
    b = torch.randn(p, p, generator=gen, dtype=F64)
    chol = torch.linalg.cholesky(b @ b.T + torch.eye(p, dtype=F64))
    center = torch.randn(p, generator=gen, dtype=F64)
    replies = {"mean": mean, "second": second, "gram": gram, "rss": rss}

    def declare(bound: float = 1e9, **kw) -> dict[str, Statistic]:
        return {
            "mean": Statistic(bound, "vector", torch.linalg.inv(chol), center),
            "second": Statistic(
                bound, "second_moment", torch.linalg.inv(chol), center, first="mean", **kw
            ),
            "gram": Statistic(bound, "psd", chol.T, **kw),
            "rss": Statistic(bound, "positive", torch.tensor(4.0, dtype=F64), minimum=0.01),
        }

    return replies, declare, chol, center


def test_without_noise_or_clipping_the_private_sums_are_the_plain_sums():
    replies, declare, _, _ = _cohort()
    sums, metrics = private_sums(replies, declare(), 0.0, torch.Generator().manual_seed(0))
    for key, leaf in replies.items():
        torch.testing.assert_close(sums[key], leaf.sum(0), rtol=1e-10, atol=1e-10)
    assert metrics["dp_clipped_statistics"] == 0


def test_each_statistic_is_clipped_to_its_own_bound_in_its_own_coordinates():
    replies, declare, chol, center = _cohort()
    declared = declare(bound=1.5)
    declared["rss"] = Statistic(1e9, "positive")  # far above: must pass bit for bit
    clipped, hits = clip_statistics(replies, declared)
    for key in ("mean", "second", "gram"):
        norms = clipped[key].reshape(6, -1).norm(dim=1)
        assert (norms <= 1.5 * (1 + 1e-12)).all()
    torch.testing.assert_close(clipped["rss"], replies["rss"], rtol=0, atol=0)
    # The mean is taken about its center and whitened: L⁻¹(m − c), then scaled to the bound.
    z = (replies["mean"] - center) @ torch.linalg.inv(chol).T
    norm = z.norm(dim=1, keepdim=True)
    expected = torch.where(norm > 1.5, z * 1.5 / norm, z)
    torch.testing.assert_close(clipped["mean"], expected, rtol=1e-12, atol=1e-12)
    # hits: per client, how many of its statistics were over their bound.
    raw, none = clip_statistics(replies, declare(bound=1e12))
    assert int(none.sum()) == 0
    over = sum((raw[k].reshape(6, -1).norm(dim=1) > 1.5).long() for k in ("mean", "second", "gram"))
    assert torch.equal(hits, over) and int(hits.sum()) > 0


def test_noise_is_calibrated_to_the_joint_sensitivity_of_the_normalized_reply():
    """With L statistics each clipped to B_l, the reply over (B_l) has norm ≤ √L: the sum
    of leaf l gets N(0, (σ √L B_l)²) per coordinate (hand-computed, then measured)."""
    declared = {"a": Statistic(2.0), "b": Statistic(0.5), "c": Statistic(10.0)}
    stds = noise_std(declared, 1.5)
    assert stds == pytest.approx(
        {"a": 1.5 * 3**0.5 * 2.0, "b": 1.5 * 3**0.5 * 0.5, "c": 1.5 * 3**0.5 * 10.0}
    )
    replies = {k: torch.zeros(4, 500, dtype=F64) for k in declared}
    sums, _ = private_sums(replies, declared, 1.5, torch.Generator().manual_seed(1))
    for key, std in stds.items():
        assert float(sums[key].std()) == pytest.approx(std, rel=0.08)
        assert abs(float(sums[key].mean())) < 4 * std / 500**0.5


def test_the_noise_is_seeded():
    replies, declare, _, _ = _cohort()
    one, _ = private_sums(replies, declare(3.0), 2.0, torch.Generator().manual_seed(7))
    two, _ = private_sums(replies, declare(3.0), 2.0, torch.Generator().manual_seed(7))
    for key in one:
        assert torch.equal(one[key], two[key])


@pytest.mark.parametrize("seed", range(5))
def test_projected_noisy_sums_are_valid(seed):
    """Noise far above the signal: PSD sums stay PSD, positive sums ≥ minimum × count, and a
    second moment sum stays ⪰ (first-moment sum)(…)ᵀ / count in its coordinates."""
    replies, declare, chol, center = _cohort(seed=seed)
    declared = declare(bound=2.0)
    sums, _ = private_sums(replies, declared, 50.0, torch.Generator().manual_seed(seed))
    k = 6
    assert torch.linalg.eigvalsh(sums["gram"]).min() >= -1e-9 * sums["gram"].abs().max()
    assert float(sums["rss"]) >= 0.01 * k / 4.0 * (1 - 1e-12)
    w = torch.linalg.inv(chol)
    d = w @ (sums["mean"] - k * center)
    outer = torch.outer(center, sums["mean"])
    centred = sums["second"] - outer - outer.T + k * torch.outer(center, center)
    t = w @ centred @ w.T - torch.outer(d, d) / k
    assert torch.linalg.eigvalsh(0.5 * (t + t.T)).min() >= -1e-9 * t.abs().max()
    torch.testing.assert_close(sums["second"], sums["second"].T)


def test_noise_floor_and_ceiling_of_a_projection():
    replies, declare, chol, _ = _cohort()
    declared = declare(bound=2.0, noise_floor=True)
    stds = noise_std(declared, 3.0)
    sums, _ = private_sums(replies, declared, 3.0, torch.Generator().manual_seed(3))
    floor = NOISE_MARGIN * stds["gram"] * (2 * 3) ** 0.5  # margin × s √(2p), p = 3
    vals = torch.linalg.eigvalsh(chol.T @ sums["gram"] @ chol)
    assert vals.min() >= floor * (1 - 1e-9)
    assert torch.allclose(
        psd_projection(torch.diag(torch.tensor([-1.0, 0.5, 9.0], dtype=F64)), 0.0, 2.0),
        torch.diag(torch.tensor([0.0, 0.5, 2.0], dtype=F64)),
    )


def test_unresolved_eigenvalues_take_the_declared_value():
    """Below the noise floor an eigenvalue is not raised to the floor but set to ``below``
    (e.g. a prior's vague start); the ceiling still applies."""
    m = torch.diag(torch.tensor([-1.0, 0.5, 9.0, 30.0], dtype=F64))
    out = psd_projection(m, floor=1.0, ceiling=20.0, below=7.0)
    torch.testing.assert_close(out, torch.diag(torch.tensor([7.0, 7.0, 9.0, 20.0], dtype=F64)))


def test_a_ratio_caps_one_sum_by_another():
    """low × n ≤ rss ≤ high × n after projection (σ² = Σrss/Σn within them), whatever the noise."""
    replies = {
        "rss": torch.full((4,), 5.0, dtype=F64),
        "n": torch.full((4,), 10.0, dtype=F64),
    }
    declared = {
        "rss": Statistic(100.0, "positive", minimum=0.01, ratio=("n", 0.05, 0.2)),
        "n": Statistic(20.0, "positive", minimum=1.0),
    }
    plain, _ = private_sums(replies, declared, 0.0, torch.Generator().manual_seed(0))
    assert float(plain["rss"]) == pytest.approx(0.2 * 40.0)  # 20 capped at 0.2 × 40
    for seed in range(20):
        noisy, _ = private_sums(replies, declared, 3.0, torch.Generator().manual_seed(seed))
        assert float(noisy["rss"]) <= 0.2 * float(noisy["n"]) * (1 + 1e-12)
        assert float(noisy["rss"]) >= 0.05 * float(noisy["n"]) * (1 - 1e-12)
        assert float(noisy["n"]) >= 4.0 and float(noisy["rss"]) >= 0.0


def test_an_undeclared_statistic_is_refused():
    replies, declare, _, _ = _cohort()
    declared = declare()
    del declared["rss"]
    with pytest.raises(ValueError, match="rss"):
        private_sums(replies, declared, 1.0, torch.Generator().manual_seed(0))


# ---- adaptive clipping (Andrew et al. 2021) ------------------------------------------------


def test_quantile_step_is_the_geometric_update():
    # C ← C exp(−η (b̄ − γ)): 2 · exp(−1.5 · (0.7 − 0.5)) = 2 e^−0.3.
    assert quantile_step(2.0, 0.7, 0.5, 1.5) == pytest.approx(2.0 * math.exp(-0.3), rel=1e-12)
    assert quantile_step(2.0, 0.5, 0.5, 9.0) == 2.0  # at the target quantile: unchanged


def test_noiseless_private_bounds_follow_the_hand_computed_steps():
    """Norms 1, 2, 3, 4; γ = ½, η = 2, start 8, no count noise. Step 1: all 4 under 8,
    b̄ = 1 > γ: η/(1 − γ) = 4, C = 8 e^(−4·½) = 8e⁻². Step 2: one under 1.083, b̄ = ¼ <
    γ: direction flips, η = 1, η/γ = 2, C = 8e⁻² · e^(2·¼). Step 3: still one under
    (1.785): same direction, C = 8e⁻² · e^½ · e^½ = 8e⁻¹. Step 4: two under 2.943, b̄ = ½:
    C stays. The bound never exceeds its start."""
    norms = {"a": torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)}
    clip = AdaptiveClip(quantile=0.5, count_multiplier=0.0, rate=2.0)
    gen = torch.Generator().manual_seed(0)
    for steps, want in [(1, 8 * math.exp(-2)), (2, 8 * math.exp(-1.5)), (3, 8 * math.exp(-1))]:
        got = private_bounds(norms, {"a": 8.0}, replace(clip, steps=steps), gen)["a"]
        assert got == pytest.approx(want, rel=1e-12)
    got = private_bounds(norms, {"a": 8.0}, replace(clip, steps=4), gen)["a"]
    assert got == pytest.approx(8 * math.exp(-1), rel=1e-12)
    low = private_bounds(norms, {"a": 0.1}, replace(clip, steps=5), gen)["a"]
    assert low == pytest.approx(0.1)  # raising is capped at the (declared) start


def test_noisy_private_bounds_find_the_quantile_of_a_large_cohort():
    """10,000 norms uniform on [0, 1], γ = 0.9, count noise multiplier 20 (std 20·√2/2 on
    a count of 10,000: 0.14 % of the cohort): the bound lands at the 0.9-quantile, from a
    start 1,000× too high, for each of two statistics at once."""
    gen = torch.Generator().manual_seed(4)
    norms = {
        "u": torch.rand(10_000, generator=gen, dtype=torch.float64),
        "v": 1e-3 * torch.rand(10_000, generator=gen, dtype=torch.float64),
    }
    clip = AdaptiveClip(quantile=0.9, count_multiplier=20.0, steps=16)
    got = private_bounds(norms, {"u": 1000.0, "v": 1.0}, clip, gen)
    assert got["u"] == pytest.approx(0.9, abs=0.02)
    assert got["v"] == pytest.approx(0.9e-3, abs=2e-5)


def test_composed_epsilon_is_rdp_composition_in_closed_form():
    """(σ₁, 1, T₁) then (σ₂, 1, T₂): RDP α/2 · (T₁/σ₁² + T₂/σ₂²), the conversion as in the
    closed-form test above; and one Gaussian mechanism split in two is the same ε."""
    (s1, t1), (s2, t2), delta = (3.0, 10), (30.0, 120), 1e-6
    alphas = np.array([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)), dtype=float)
    rdp = alphas / 2 * (t1 / s1**2 + t2 / s2**2)
    eps = rdp + np.log((alphas - 1) / alphas) - (np.log(delta) + np.log(alphas)) / (alphas - 1)
    assert composed_epsilon([(s1, 1.0, t1), (s2, 1.0, t2)], delta) == pytest.approx(eps.min())
    # T/z² = T/σ₁² + T·k/σ₂² with z = (1/σ₁² + k/σ₂²)^(−½): the same ε as one mechanism.
    z = (1 / s1**2 + 12 / s2**2) ** -0.5
    assert composed_epsilon([(s1, 1.0, 10), (s2, 1.0, 120)], delta) == pytest.approx(
        epsilon_spent(z, 1.0, 10, delta), rel=1e-9
    )


@pytest.mark.parametrize("target", [1.0, 8.0])
def test_adaptive_accounting_spends_at_most_the_target(target):
    """The sums' σ and the counts' z_b split one budget: their composed ε (Opacus's
    history of both) is the target, the counts take the stated share of 1/z², and the
    sums' σ is that of the plain run over √(1 − share)."""
    plain = account(target, 1e-6, 1.0, 6)
    spent = account_adaptive(target, 1e-6, 1.0, 6, steps=12, share=0.1)
    both = [(spent.noise_multiplier, 1.0, 6), (spent.count_multiplier, 1.0, 72)]
    assert composed_epsilon(both, 1e-6) == pytest.approx(spent.epsilon, rel=1e-12)
    assert target * 0.99 <= spent.epsilon <= target
    assert spent.noise_multiplier == pytest.approx(plain.noise_multiplier / 0.9**0.5, rel=1e-3)
    share = 12 / spent.count_multiplier**2 * plain.noise_multiplier**2
    assert share == pytest.approx(0.1, rel=1e-3)
    with pytest.raises(ValueError, match="quantile_share"):
        account_adaptive(target, 1e-6, 1.0, 6, steps=12, share=1.0)


def test_adaptive_private_sums_noise_the_adapted_bounds():
    """With adaptive clipping the sums' noise is σ √L × the adapted bound (reported as
    dp_bound/<statistic>), not the declared one (100× larger), and the bound lands at the
    quantile: about 1 % of clients clipped at γ = 0.99."""
    scale = torch.linspace(0.5, 1.0, 400, dtype=torch.float64).unsqueeze(1)
    x = scale * torch.tensor([[0.6, 0.8, 0.0]], dtype=torch.float64)  # norms 0.5 .. 1
    declared = {"x": Statistic(100.0)}
    clip = AdaptiveClip(quantile=0.99, count_multiplier=1e-9, steps=30)
    gen = torch.Generator().manual_seed(1)
    _, metrics = private_sums({"x": x}, declared, 1e-12, gen, adaptive=clip)
    assert metrics["dp_bound/x"] == pytest.approx(0.995, abs=0.003)
    assert 1 <= metrics["dp_clipped_statistics"] <= 6
    draws = []
    for seed in range(100):
        g = torch.Generator().manual_seed(seed)
        sums, metrics = private_sums({"x": x}, declared, 1.0, g, adaptive=clip)
        clipped, _ = clip_statistics({"x": x}, {"x": Statistic(metrics["dp_bound/x"])})
        draws.append((sums["x"] - clipped["x"].sum(0)) / metrics["dp_bound/x"])
    assert torch.stack(draws).std().item() == pytest.approx(1.0, rel=0.1)  # σ √L = 1


def test_a_centred_psd_sum_is_projected_with_its_centre_added_back():
    """A PSD leaf declared about C (fedprior's GLS Gram and support, about I): the sum of
    k = 3 centred leaves plus 3·C must be PSD with eigenvalues ≤ 3 (maximum 1 per client);
    diag(−3.5, −1) + 3I = diag(−0.5, 2) → diag(0, 2), minus 3I: diag(−3, −1); the map back
    adds 3·C again: three leaves diag(0, ½) (centred diag(−1, −½), under the bound 2) sum
    to diag(0, 3/2) through the whole private path at zero noise."""
    stat = Statistic(2.0, "psd", center=torch.eye(2, dtype=torch.float64), maximum=1.0)
    noisy = {"g": torch.diag(torch.tensor([-3.5, -1.0], dtype=torch.float64))}
    out = project_sums(noisy, {"g": stat}, count=3)
    torch.testing.assert_close(out["g"], torch.diag(torch.tensor([-3.0, -1.0], dtype=F64)))
    leaves = torch.diag(torch.tensor([0.0, 0.5], dtype=F64)).expand(3, 2, 2)
    sums, _ = private_sums({"g": leaves}, {"g": stat}, 0.0, torch.Generator())
    torch.testing.assert_close(sums["g"], torch.diag(torch.tensor([0.0, 1.5], dtype=F64)))


def test_weights_share_the_noise_budget_by_the_joint_sensitivity():
    """Leaves w_l x_l / B_l: sensitivity √(1² + 3²) = √10; noise σ √10 B_l / w_l, i.e.
    2 · √10 · 2 / 1 and 2 · √10 · 3 / 3 at σ = 2 (unit weights: σ √2 B_l)."""
    declared = {"a": Statistic(2.0), "b": Statistic(3.0, weight=3.0)}
    stds = noise_std(declared, 2.0)
    assert stds["a"] == pytest.approx(2 * 10**0.5 * 2) and stds["b"] == pytest.approx(2 * 10**0.5)
    even = noise_std({"a": Statistic(2.0), "b": Statistic(3.0)}, 2.0)
    assert even["b"] == pytest.approx(2 * 2**0.5 * 3)
