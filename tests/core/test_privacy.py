"""The accountant's numbers against published and closed-form values."""

from __future__ import annotations

import numpy as np
import pytest

from fedcal.core.privacy import account, epsilon_spent, noise_for_epsilon


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
