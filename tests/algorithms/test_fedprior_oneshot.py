"""The fleet prior released once (fedcal.algorithms.fedprior_oneshot): the units' own fits."""

from __future__ import annotations

import pytest
import torch

from fedcal.algorithms.fedprior_oneshot import local_fits, oneshot_prior
from fedcal.core.bayes import F64

from .test_fedprior import make, planted_fleet


def test_local_fits_are_each_units_least_squares_and_skip_few_point_units():
    """Units with ≥ min_rows rows: ĉ_i the least-squares fit (noise-free data: the planted
    c_i to rounding), σ_i² the residual variance on n − p degrees of freedom; units with
    fewer rows contribute nothing."""
    data, _, _, _, coef = planted_fleet(6, [40, 3, 40, 50, 5, 40], seed=3, noise=0.0)
    alg = make()
    got, noise, used, _ = local_fits(alg, data, min_rows=10)
    assert used.tolist() == [True, False, True, True, False, True]
    torch.testing.assert_close(got, coef[used], rtol=0, atol=1e-10)
    assert float(noise.max()) < 1e-12  # rounding of yᵀy − ĉᵀΦᵀy
    noisy, _, _, _, _ = planted_fleet(3, 30, seed=4, noise=0.1)
    fit, s2, _, _ = local_fits(alg, noisy, min_rows=10)
    x, y = noisy.x[0].to(F64), noisy.y[0, :, 0].to(F64)
    phi = alg.design(x.unsqueeze(0))[0]
    ls = torch.linalg.lstsq(phi, y).solution
    torch.testing.assert_close(fit[0], ls, rtol=1e-9, atol=1e-12)
    assert float(s2[0]) == pytest.approx(float(((y - phi @ ls) ** 2).sum()) / (30 - 4), rel=1e-9)
    with pytest.raises(ValueError, match="min_rows = 4"):
        local_fits(alg, data, min_rows=4)


def test_oneshot_prior_without_noise_is_the_fits_moments():
    """budget None: μ the fits' mean, Σ their population covariance, σ² their mean σ_i²."""
    data, _, _, _, _ = planted_fleet(40, 30, seed=5, noise=0.01)
    alg = make()
    down, metrics = oneshot_prior(alg, data, None, torch.Generator().manual_seed(0))
    coef, s2, _, _ = local_fits(alg, data, 8)
    torch.testing.assert_close(down["mu"], coef.mean(0), rtol=0, atol=1e-12)
    torch.testing.assert_close(down["sigma"], torch.cov(coef.T, correction=0), rtol=1e-8, atol=0)
    assert float(down["noise_var"]) == pytest.approx(float(s2.mean()), rel=1e-10)
    assert metrics["oneshot_units"] == 40


def test_a_unit_whose_rows_do_not_identify_its_fit_is_skipped_and_counted():
    """Unit 1's 40 rows all at one (P, T) point: enough rows, a rank-1 Gram (any coefficients
    fit it). It is skipped and counted (``oneshot_unidentified``); the others are their
    least-squares fits (noise-free: the planted c_i)."""
    from dataclasses import replace

    data, _, _, _, coef = planted_fleet(4, 40, seed=6, noise=0.0)
    x = data.x.clone()
    x[1] = x[1, 0]
    one_point = replace(data, x=x)
    alg = make()
    got, _, used, skipped = local_fits(alg, one_point, min_rows=10)
    assert used.tolist() == [True, False, True, True] and skipped == 1
    torch.testing.assert_close(got, coef[used], rtol=0, atol=1e-10)
    _, metrics = oneshot_prior(alg, one_point, None, torch.Generator().manual_seed(0), 10)
    assert metrics["oneshot_units"] == 3 and metrics["oneshot_unidentified"] == 1
    _, _, used, skipped = local_fits(alg, data, min_rows=10)  # the original: all identified
    assert bool(used.all()) and skipped == 0
