"""DP noise a party who knows the run's seed cannot reproduce (and so cannot subtract)."""

from __future__ import annotations

from dataclasses import replace

import torch

from fedcal.build import build_policy
from fedcal.config import default_config
from fedcal.core.aggregation import aggregate

from .test_aggregation import SERVER, MeanAlg, rows

F64 = torch.float64


def _noisy_mean(policy, round_seed: int) -> torch.Tensor:
    replies = rows([3.0, 4.0], [0.0, 1.0], [0.0, 0.0])  # clipped to C = 1: (0.6, 0.8), (0, 1)
    new, _, _ = aggregate(MeanAlg(task=None), SERVER, SERVER, replies, torch.ones(3), policy, 42)
    return new["model"]["w"]


def _from_round_seed(policy) -> torch.Tensor:
    # What anyone holding the run's seed (a Flower site gets it in the handshake) computes.
    z = torch.randn(2, generator=torch.Generator().manual_seed(42), dtype=F64)
    return (torch.tensor([0.6, 1.8], dtype=F64) + policy.dp_noise_multiplier * z) / 3


def test_configured_dp_noise_is_not_the_run_seeds():
    cfg = default_config()
    cfg = replace(cfg, privacy=replace(cfg.privacy, epsilon=4.0, clip=1.0))
    policy, spent = build_policy(cfg)
    assert spent["noise"] == "secret"
    a, b = _noisy_mean(policy, 42), _noisy_mean(build_policy(cfg)[0], 42)
    assert not torch.allclose(a, _from_round_seed(policy))  # before: equal
    assert not torch.equal(a, b)  # a fresh secret per policy
    assert torch.equal(a, _noisy_mean(policy, 42))  # one policy: one run's draws
    # Declared reproducible (studies, tests): the run's seed draws it, and the record says so.
    seeded = replace(cfg, privacy=replace(cfg.privacy, noise="seeded"))
    policy, spent = build_policy(seeded)
    assert spent["noise"] == "seeded"
    assert torch.allclose(_noisy_mean(policy, 42), _from_round_seed(policy))
