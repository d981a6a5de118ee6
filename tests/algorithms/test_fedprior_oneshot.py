"""The fleet prior released once (fedcal.algorithms.fedprior_oneshot): the units' own fits."""

from __future__ import annotations

import pytest
import torch

from fedcal.algorithms.fedprior_oneshot import local_fits, oneshot_prior, prediction_coordinates
from fedcal.core.bayes import F64
from fedcal.core.privacy import staged_budget

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


def _campaign(alg):
    """A public design: the basis on a 5 × 3 grid over [0, 1] × [−1, 1] (not orthonormal)."""
    axes = [torch.linspace(0.0, 1.0, 5, dtype=F64), torch.linspace(-1.0, 1.0, 3, dtype=F64)]
    points = torch.stack([g.flatten() for g in torch.meshgrid(*axes, indexing="ij")], -1)
    return alg.design(points.unsqueeze(0))[0]


def test_prediction_coordinates_measure_predictions_over_the_design():
    """RᵀR = ΦᵀΦ / m, R upper triangular, so ‖R c‖² is the mean squared prediction φ(x)ᵀc
    over the design's m points; a design that cannot determine the terms is refused: one
    point four times (no Cholesky factor), and 11 points on the 12-term (3, 2) basis, whose
    rank-11 Gram float64 can factor (λ_max / λ_min above ``MAX_CONDITION``)."""
    alg = make()
    phi = _campaign(alg)
    r = prediction_coordinates(phi.T @ phi, phi.shape[0])
    torch.testing.assert_close(r.T @ r, phi.T @ phi / 15, rtol=0, atol=1e-13)
    assert torch.equal(r, torch.triu(r))
    c = torch.tensor([0.3, -1.2, 0.7, 2.0], dtype=F64)
    assert float((r @ c).square().sum()) == pytest.approx(float((phi @ c).square().mean()), 1e-12)
    one = phi[:1].expand(4, -1)  # one point four times: rank 1
    with pytest.raises(ValueError, match="singular"):
        prediction_coordinates(one.T @ one, 4)
    wide = make(orders=(3, 2))
    pts = 2 * torch.rand(11, 2, generator=torch.Generator().manual_seed(10), dtype=F64) - 1
    eleven = wide.design(pts.unsqueeze(0))[0]
    assert eleven.shape == (11, 12) and int(torch.linalg.matrix_rank(eleven)) == 11
    # this draw's Gram does factor: only the eigenvalue ratio can refuse it
    assert int(torch.linalg.cholesky_ex(eleven.T @ eleven / 11).info) == 0
    with pytest.raises(ValueError, match=r"singular \(Cholesky info 0, eigenvalue ratio"):
        prediction_coordinates(eleven.T @ eleven, 11)


def test_a_release_in_prediction_coordinates_maps_back_exactly():
    """No noise: the release on u = R ĉ, mapped back (R⁻¹ μ_u, R⁻¹ Σ_u R⁻ᵀ), is the fits'
    own mean and covariance (to 1e-10), the same as the release in ĉ's coordinates. With
    noise, R = I is the release in ĉ's coordinates draw for draw (the same budget, bounds
    and noise), and any R gives a positive-definite Σ (eigenvalues ≥ the floor)."""
    data, _, _, _, _ = planted_fleet(40, 30, seed=5, noise=0.01)
    alg = make()
    phi = _campaign(alg)
    r = prediction_coordinates(phi.T @ phi, phi.shape[0])
    gen = torch.Generator()
    down, _ = oneshot_prior(alg, data, None, gen.manual_seed(0), coordinates=r)
    coef, s2, _, _ = local_fits(alg, data, 8)
    torch.testing.assert_close(down["mu"], coef.mean(0), rtol=0, atol=1e-10)
    torch.testing.assert_close(down["sigma"], torch.cov(coef.T, correction=0), rtol=0, atol=1e-10)
    assert float(down["noise_var"]) == pytest.approx(float(s2.mean()), rel=1e-10)
    budget = staged_budget(1.0, 1e-4, 3, count_share=0.1)
    plain, m0 = oneshot_prior(alg, data, budget, gen.manual_seed(1))
    eye, m1 = oneshot_prior(alg, data, budget, gen.manual_seed(1), coordinates=torch.eye(4))
    torch.testing.assert_close(eye["mu"], plain["mu"], rtol=0, atol=1e-12)
    torch.testing.assert_close(eye["sigma"], plain["sigma"], rtol=1e-9, atol=1e-15)
    assert m0 == m1
    noisy, _ = oneshot_prior(alg, data, budget, gen.manual_seed(1), coordinates=r)
    assert torch.isfinite(noisy["sigma"]).all() and torch.equal(noisy["sigma"], noisy["sigma"].T)
    assert float(torch.linalg.eigvalsh(noisy["sigma"]).min()) >= alg.floor * (1 - 1e-6)
    with pytest.raises(ValueError, match=r"shape \(3, 3\), expected \(4, 4\)"):
        oneshot_prior(alg, data, None, gen, coordinates=torch.eye(3))


def test_keys_make_the_scaled_release_independent_of_the_units_order():
    """scales=True with one key per unit (few-point units too, which contribute nothing):
    the fleet's units permuted with their keys give the same released prior (the same
    generator: μ, Σ, σ² identical; the public box to rounding of its sums); a key list of
    the wrong length is refused."""
    data, _, _, _, _ = planted_fleet(40, [30] * 36 + [3] * 4, seed=7, noise=0.01)
    alg = make()
    ids = [f"unit-{i}" for i in range(40)]
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(2))
    budget = staged_budget(4.0, 1e-4, 3, count_share=0.1)
    gen = torch.Generator()
    a, ma = oneshot_prior(alg, data, budget, gen.manual_seed(3), scales=True, keys=ids)
    shuffled = [ids[i] for i in perm]
    b, mb = oneshot_prior(
        alg, data.select(perm), budget, gen.manual_seed(3), scales=True, keys=shuffled
    )
    for key in ("mu", "sigma", "noise_var"):
        assert torch.equal(a[key], b[key]), key
    torch.testing.assert_close(a["box"], b["box"], rtol=1e-12, atol=1e-12)
    assert ma == mb and ma["oneshot_units"] == 36 and ma["scales/keyed"] == 1.0
    with pytest.raises(ValueError, match="oneshot keys: 39 for 40 units"):
        oneshot_prior(alg, data, budget, gen, scales=True, keys=ids[1:])
