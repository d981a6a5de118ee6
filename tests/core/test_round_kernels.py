"""Issue 36.1's cheaper forms of a round's per-unit work give the bits (or the verdicts) of the
forms they replace: finite rows by their sums, the Cholesky verdict's shift on the diagonal,
½(a + aᵀ) in the sum's buffer, safe_cholesky told its input is symmetric, eigenvalues of
every matrix at once, the candidates' priors factored once (repeated_factor)."""

from __future__ import annotations

import math

import pytest
import torch

from fedcal.core import bayes, robust
from fedcal.core.bayes import Moments, posterior, repeated_factor, safe_cholesky
from fedcal.core.measures import finite_each, finite_rows

F64 = torch.float64
BIG = 1e308  # two of them overflow a sum: the rows whose sum is not finite are read entry-wise


def test_finite_each_is_isfinite_all_on_every_kind_of_row():
    inf, nan = math.inf, math.nan
    rows = torch.tensor(
        [[1.0, 2.0], [inf, 1.0], [nan, 0.0], [BIG, BIG], [-inf, inf], [-BIG, -BIG], [0.0, -0.0]],
        dtype=F64,
    )
    want = [True, False, False, True, False, True, True]
    assert finite_each(rows).tolist() == want
    assert torch.equal(finite_each(rows), torch.isfinite(rows).all(1))
    assert finite_each(torch.zeros(3, 0, dtype=F64)).tolist() == [True] * 3  # no entries
    tree = {"a": rows, "b": {"c": torch.ones(7, 2, 2, dtype=torch.float32)}}
    assert finite_rows(tree).tolist() == want


def _old_factors(a, shift):
    shift = torch.as_tensor(shift, dtype=F64).reshape(-1, 1, 1)
    return torch.linalg.cholesky_ex(a + shift * torch.eye(a.shape[-1], dtype=F64)).info == 0


def test_the_diagonal_shift_gives_the_verdicts_of_adding_shift_times_identity():
    """λ_min of each matrix is set to a value around the shift: the verdicts flip there, as
    with a + shift·I (a scalar shift and one per matrix; −0.0 entries; a non-finite shift)."""
    gen = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(9, 5, 5, generator=gen, dtype=F64))
    vals = torch.rand(9, 5, generator=gen, dtype=F64) + 0.5
    vals[:, 0] = torch.tensor([-0.3, -0.2, -0.1 + 1e-15, -0.1, -0.1 - 1e-15, 0.0, 0.1, -1.0, 2.0])
    a = bayes.sym((q * vals.unsqueeze(-2)) @ q.transpose(-2, -1))
    a[0, 0, 1] = a[0, 1, 0] = -0.0
    for shift in (0.1, torch.full((9,), 0.1, dtype=F64), torch.linspace(0, 1, 9, dtype=F64)):
        assert torch.equal(robust._factors(a, shift), _old_factors(a, shift))
    assert torch.equal(robust._factors(a, math.inf), _old_factors(a, math.inf))


def test_sym_and_a_symmetric_safe_cholesky_keep_the_bits():
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(6, 7, 7, generator=gen, dtype=F64)
    s = bayes.sym(a)
    assert torch.equal(s, 0.5 * (a + a.transpose(-2, -1)))
    spd = s @ s.transpose(-2, -1) + torch.eye(7, dtype=F64)
    spd[-1] = s[-1]  # indefinite: the jitter path
    spd = bayes.sym(spd)
    for got, want in zip(safe_cholesky(spd, symmetric=True), safe_cholesky(spd), strict=True):
        assert torch.equal(got, want)


def test_eigenvalues_of_every_matrix_at_once_are_the_masked_ones():
    gen = torch.Generator().manual_seed(2)
    a = bayes.sym(torch.randn(5, 6, 6, generator=gen, dtype=F64))
    vals = robust._eigvalsh(a)  # all finite: one call, no copy
    for i in range(5):
        assert torch.equal(vals[i], torch.linalg.eigvalsh(a[i : i + 1])[0])
    a[2, 1, 3] = math.nan
    masked = robust._eigvalsh(a)
    assert bool(masked[2].isnan().all()) and torch.equal(masked[[0, 1, 3, 4]], vals[[0, 1, 3, 4]])


@pytest.mark.parametrize(("k", "p"), [(1, 4), (3, 4), (4, 20), (2, 35)])
def test_repeated_factor_gives_the_posterior_of_factoring_every_row(k, p):
    """c clients × k priors (client-major rows, as the candidates' E-step lays them out):
    the k factors repeated give the bits of factoring all c·k copies, jitter included."""
    c = 5
    gen = torch.Generator().manual_seed(10 * k + p)
    a = torch.randn(k, p, p, generator=gen, dtype=F64)
    sigmas = a @ a.transpose(-2, -1) + 0.1 * torch.eye(p, dtype=F64)
    sigmas[0] = a[0, :, :1] @ a[0, :, :1].T  # rank 1: safe_cholesky's jitter
    phi = torch.randn(c * k, 9, p, generator=gen, dtype=F64)
    y = torch.randn(c * k, 9, generator=gen, dtype=F64)
    m = Moments(
        phi.mT @ phi, (phi * y.unsqueeze(-1)).sum(1), (y * y).sum(1), torch.full((c * k,), 9.0)
    )
    mu = torch.randn(c * k, p, generator=gen, dtype=F64)
    noise = torch.rand(c * k, generator=gen, dtype=F64) + 0.1
    rows = sigmas.unsqueeze(0).expand(c, k, p, p).reshape(-1, p, p)
    want = posterior(m, mu, rows, noise)
    got = posterior(m, mu, None, noise, repeated_factor(sigmas, c))
    for name, x, w in zip(got._fields, got, want, strict=True):
        assert torch.equal(x, w), name
    assert float(want.jitter[0]) > 0 and float(want.jitter[k]) > 0
