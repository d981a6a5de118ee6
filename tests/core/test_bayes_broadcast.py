"""One prior for every client is factored once: the same numbers as factoring it per client,
within rounding (the same bits at small p; ~1e-12 apart at p = 35)."""

from __future__ import annotations

import pytest
import torch

from fedcal.core.bayes import Moments, posterior, posterior_moments

F64 = torch.float64


def cohort(c: int, p: int, seed: int) -> Moments:
    gen = torch.Generator().manual_seed(seed)
    phi = torch.randn(c, 9, p, generator=gen, dtype=F64)
    y = torch.randn(c, 9, generator=gen, dtype=F64)
    n = torch.full((c,), 9.0, dtype=F64)
    return Moments(phi.transpose(1, 2) @ phi, (phi * y.unsqueeze(-1)).sum(1), (y * y).sum(1), n)


@pytest.mark.parametrize("jitter", [False, True])
def test_a_broadcast_prior_gives_the_per_client_bits(jitter):
    c, p = 7, 4
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(p, p, generator=gen, dtype=F64)
    sigma = a @ a.T + 0.1 * torch.eye(p, dtype=F64)
    if jitter:  # rank one less than p: safe_cholesky's jitter (reported per client)
        sigma = a[:, :-1] @ a[:, :-1].T
    mu = torch.randn(p, generator=gen, dtype=F64)
    m, noise = cohort(c, p, 2), torch.full((c,), 0.3, dtype=F64)
    per_client = posterior(m, mu, sigma.expand(c, p, p).clone(), noise)  # c factorizations
    for shared in (sigma, sigma.unsqueeze(0).expand(c, p, p)):  # 2-D, or a broadcast view
        once = posterior(m, mu, shared, noise)
        for name, a_, b_ in zip(once._fields, once, per_client, strict=True):
            assert torch.equal(a_, b_), name
        mean, cov = posterior_moments(m, mu, shared, noise)
        assert torch.equal(mean, per_client.mean) and torch.equal(cov, per_client.cov)
    assert bool((per_client.jitter > 0).all()) == jitter


def test_a_broadcast_prior_is_within_rounding_of_per_client_at_p35():
    """At p = 35 the factorization of one Σ and of a batch of its copies round differently
    (~1e-12 apart here): the broadcast posterior equals the per-client one within 1e-9
    relative to each output's scale, not to the bit."""
    c, p = 257, 35
    gen = torch.Generator().manual_seed(c)
    a = torch.randn(p, p, generator=gen, dtype=F64)
    sigma = a @ a.T + 0.1 * torch.eye(p, dtype=F64)
    mu = torch.randn(p, generator=gen, dtype=F64)
    m, noise = cohort(c, p, 3), torch.full((c,), 0.3, dtype=F64)
    per_client = posterior(m, mu, sigma.expand(c, p, p).clone(), noise)
    once = posterior(m, mu, sigma.unsqueeze(0).expand(c, p, p), noise)
    for name, a_, b_ in zip(once._fields, once, per_client, strict=True):
        scale = float(b_.abs().max()) + 1.0
        assert float((a_ - b_).abs().max()) <= 1e-9 * scale, name
