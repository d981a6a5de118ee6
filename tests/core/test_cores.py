"""core/cores.on_cores: a batch of small factorizations split over the threads torch may use
gives the one call's bits (each matrix by the same LAPACK routine on the same numbers), and
the fleet prior's E-step, consistency check and leave-one-out distances built on it do too."""

from __future__ import annotations

import pytest
import torch

from fedcal.core import cores
from fedcal.core.bayes import Moments, data_support, posterior
from fedcal.core.cores import MIN_BATCH, on_cores
from fedcal.core.robust import inconsistencies, loo_distances

F64 = torch.float64


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _spd(n: int, p: int = 6, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, p, p, generator=gen, dtype=F64)
    return a @ a.transpose(1, 2) / p + 0.1 * torch.eye(p, dtype=F64)


def test_every_split_call_is_the_one_call_bit_for_bit(two_threads):
    a = _spd(MIN_BATCH + 7)  # an odd length: unequal parts
    chol = torch.linalg.cholesky(a)
    rhs = torch.randn(a.shape[0], a.shape[1], 2, generator=torch.Generator().manual_seed(1))
    rhs = rhs.to(F64)
    calls = [
        (torch.linalg.cholesky_ex, (a,)),
        (torch.linalg.eigvalsh, (a,)),
        (torch.linalg.inv_ex, (a,)),
        (torch.cholesky_solve, (rhs, chol)),
        (torch.cholesky_inverse, (chol,)),
    ]
    for fn, args in calls:
        split, whole = on_cores(fn, *args), fn(*args)
        split = split if isinstance(split, tuple) else (split,)
        whole = tuple(whole) if isinstance(whole, tuple) else (whole,)
        assert len(split) == len(whole)
        assert all(torch.equal(s, w) for s, w in zip(split, whole, strict=True)), fn


def test_small_batches_single_matrices_and_one_thread_are_one_call(two_threads):
    seen: list[int] = []

    def counted(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.shape[0])
        return x * 2

    on_cores(counted, _spd(MIN_BATCH - 1))
    on_cores(counted, torch.eye(MIN_BATCH, dtype=F64))  # one matrix (2-D), however large
    assert seen == [MIN_BATCH - 1, MIN_BATCH]
    seen.clear()
    on_cores(counted, _spd(MIN_BATCH))
    assert seen == [MIN_BATCH // 2, MIN_BATCH // 2]  # both threads, contiguous halves
    torch.set_num_threads(1)
    seen.clear()
    on_cores(counted, _spd(MIN_BATCH))
    assert seen == [MIN_BATCH]


def _cohort(c: int, p: int = 6):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(c, 9, p, generator=gen, dtype=F64)
    y = x @ torch.linspace(1.0, -1.0, p, dtype=F64) + 0.1 * torch.randn(c, 9, generator=gen)
    gram = x.transpose(1, 2) @ x
    return Moments(gram, (x * y.unsqueeze(-1)).sum(1), (y * y).sum(1), torch.full((c,), 9.0))


def test_the_e_step_check_and_distances_are_the_same_on_two_threads():
    c, p = MIN_BATCH + 100, 6
    m = _cohort(c, p)
    mu, sigma = torch.zeros(p, dtype=F64), 0.5 * torch.eye(p, dtype=F64)
    noise = torch.full((c,), 0.01, dtype=F64)
    before = torch.get_num_threads()
    out = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            post = posterior(m, mu, sigma.expand(c, p, p), noise)
            stats = {
                "mean": post.mean,
                "second": post.mean.unsqueeze(-1) * post.mean.unsqueeze(-2) + post.cov,
                "gls_gram": post.gls_gram,
                "gls_rhs": post.gls_rhs,
                "rss": post.rss,
            }
            out[threads] = (
                post,
                data_support(m.gram, noise, 1.0),
                inconsistencies(stats, mu, sigma),
                loo_distances(stats["mean"], stats["second"]),
            )
    finally:
        torch.set_num_threads(before)
    one, two = out[1], out[2]
    assert all(torch.equal(a, b) for a, b in zip(one[0], two[0], strict=True))
    assert torch.equal(one[1], two[1])
    assert one[2] == two[2] and one[2].count(None) == c  # an honest cohort: no verdict
    assert torch.equal(one[3], two[3])
    assert cores._POOLS  # the two-thread runs went through the pool
