"""count_within: the hold-out's coverage counts by bisection equal the dense (rows × τ) count."""

from __future__ import annotations

import torch

from fedcal.algorithms.fedprior_interval import TAU_GRID
from fedcal.core.bayes import count_within

Z = 1.959964


def _dense(err2, var, grid, weight):
    within = err2.unsqueeze(-1) <= Z**2 * (var.unsqueeze(-1) + grid)
    return (within.to(torch.float64) * weight.unsqueeze(-1)).sum(1)


def test_equals_the_dense_count_to_the_bit():
    g = torch.Generator().manual_seed(0)
    c, r = 40, 60
    scale = 10.0 ** torch.randint(-14, 3, (c, r), generator=g)
    err2 = torch.rand(c, r, generator=g, dtype=torch.float64) * scale
    var = torch.rand(c, r, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(
        -14, 1, (c, r), generator=g
    )
    err2[0, :5] = float("nan")  # a NaN row is within no τ
    var[1, :3] = float("nan")
    err2[2, :2], var[2, :2] = 0.0, 0.0  # within every τ, the first (0) included
    held = (torch.rand(c, r, generator=g) < 0.6).to(torch.float64)
    fast = count_within(err2, var, TAU_GRID, held, Z)
    assert torch.equal(fast, _dense(err2, var, TAU_GRID, held))
    # Non-trivial: counts grow with τ, and some rows only enter at a large τ.
    assert (fast[:, 1:] >= fast[:, :-1]).all() and (fast[:, -1] > fast[:, 0]).any()


def test_hand_computed_rows():
    grid = torch.tensor([0.0, 1.0, 4.0], dtype=torch.float64)
    # z = 1: row 1 within every τ (0.5 ≤ 1 + 0), row 2 from τ = 4 (4 > 1 + 1, 4 ≤ 1 + 4),
    # row 3 never (100 > 5), row 4 weight 0.
    err2 = torch.tensor([[0.5, 4.0, 100.0, 0.0]], dtype=torch.float64)
    var = torch.tensor([[1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    weight = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    out = count_within(err2, var, grid, weight, 1.0)
    assert out.tolist() == [[1.0, 1.0, 2.0]]
