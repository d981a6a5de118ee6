"""fedcal_support/direction_reference.py (studies/fewpoint_direction.py): its EM is fedprior's;
its prediction is the branch mixture."""

from __future__ import annotations

import numpy as np
import torch

from fedcal.algorithms.fedprior import FedPrior
from fedcal.core.bayes import F64, moments, posterior, predictive_var
from fedcal.core.data import ClientData
from fedcal.core.task import Task
from fedcal.models.mlp import MLP
from fedcal_support import direction_reference
from fedcal_support.rounds import run_rounds


def bench():
    return direction_reference


def planted(seed: int = 0, units: int = 12, rows: int = 30, offset: float = 0.05):
    """Units y = φᵀc_i + d·h_i + noise: half calibrated both ways, half ascending only."""
    rng = np.random.default_rng(seed)
    b = bench()
    x = torch.as_tensor(rng.uniform(-1, 1, (units, rows, 2)))
    phi, _ = b.bases(x, None)
    coef = torch.as_tensor(rng.normal(0, 1, (units, phi.shape[-1])) * 0.3)
    h = torch.as_tensor(offset + 0.01 * rng.standard_normal(units))
    d = torch.where(torch.as_tensor(rng.uniform(size=(units, rows))) < 0.5, 1.0, -1.0).to(F64)
    d[units // 2 :] = 1.0  # the new units: ascending only
    y = (phi * coef.unsqueeze(1)).sum(-1) + d * h.unsqueeze(1)
    y = y + 0.002 * torch.as_tensor(rng.standard_normal((units, rows)))
    return x, y, d, coef, h


def test_without_direction_term_the_em_is_fedpriors():
    x, y, _, _, _ = planted()
    b = bench()
    phi, _ = b.bases(x, None)
    mask = torch.ones(y.shape, dtype=torch.bool)
    mu, sigma, noise, _ = b.fit_prior(phi, y, mask, rounds=8)
    alg = FedPrior(Task(MLP()), orders=b.PHI_ORDERS)
    data = ClientData.from_arrays(
        [(x[i].numpy(), y[i, :, None].numpy()) for i in range(len(x))], dtype=F64
    )
    server = run_rounds(alg, data, 8).server
    torch.testing.assert_close(mu, server["mu"], rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(sigma, server["sigma"], rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(noise, server["noise_var"], rtol=1e-9, atol=0.0)


def test_direction_term_learns_the_planted_offset_and_debiases_one_way_units():
    x, y, d, coef, h = planted()
    b = bench()
    phi, psi = b.bases(x, (0, 0))
    mask = torch.ones(y.shape, dtype=torch.bool)
    mu, sigma, noise, _ = b.fit_prior(b.features(phi, psi, d), y, mask, rounds=50)
    assert abs(float(mu[-1]) - float(h.mean())) < 0.01  # fleet mean offset 0.05 ± spread
    assert float(noise) ** 0.5 < 0.004  # the offset is no longer in the noise (σ = 0.002)
    new = slice(6, None)
    truth = (phi * coef.unsqueeze(1)).sum(-1)  # the branch average
    pred, _, _ = b.predict(mu, sigma, noise, (b.features(phi, psi, d), y, mask), phi, psi, d)
    mu0, sigma0, noise0, _ = b.fit_prior(phi, y, mask, rounds=50)
    empty = phi[..., :0]
    pred0, _, _ = b.predict(mu0, sigma0, noise0, (phi, y, mask), phi, empty, d)
    err = (pred - truth)[new].pow(2).mean().sqrt()
    err0 = (pred0 - truth)[new].pow(2).mean().sqrt()
    assert err0 > 0.03  # fedprior's one-way units carry the ascending branch's offset
    assert err < 0.3 * err0


def test_prediction_is_the_mixture_of_the_two_branches():
    """Mean and variance = those of ½ N(m₊, v₊) + ½ N(m₋, v₋), the branches' predictives."""
    x, y, d, _, _ = planted(seed=1)
    b = bench()
    phi, psi = b.bases(x, (2, 0))
    mask = torch.ones(y.shape, dtype=torch.bool)
    train = (b.features(phi, psi, d), y, mask)
    mu, sigma, noise, _ = b.fit_prior(*train, rounds=5)
    pred, var, known = b.predict(mu, sigma, noise, train, phi, psi, d)
    post = posterior(moments(*train), mu, sigma, noise.expand(len(y)))
    branch = {}
    for sign in (1.0, -1.0):
        f = b.features(phi, psi, torch.full_like(d, sign))
        branch[sign] = ((f * post.mean.unsqueeze(1)).sum(-1), predictive_var(f, post.cov, noise))
    (m_up, v_up), (m_down, v_down) = branch[1.0], branch[-1.0]
    torch.testing.assert_close(pred, 0.5 * (m_up + m_down))
    torch.testing.assert_close(var, 0.5 * (v_up + v_down) + 0.25 * (m_up - m_down) ** 2)
    torch.testing.assert_close(known, torch.where(d > 0, m_up, m_down))
