"""core/identify.py: the undetermined directions of a linear fit and of a fleet prior, and the
shares that make a unit "weak" (docs/statuses.md), against values computed by hand."""

from __future__ import annotations

import torch

from fedcal.core.identify import null_projector, null_share, unlearned_directions, unlearned_share

F64 = torch.float64


def test_null_projector_and_share_by_hand():
    """Column 3 = column 1 + column 2: u = (1, 1, −1)/√3 is undetermined, P = uuᵀ. At rows
    (1, 0, 0) and (1, 1, −1): ‖Px‖² = 1/3 and 3, ‖x‖² = 1 and 3 → share (1/3 + 3)/4."""
    x = torch.tensor(
        [[1.0, 0.0, 1.0], [0.0, 1.0, 1.0], [2.0, 1.0, 3.0], [1.0, 3.0, 4.0]], dtype=F64
    )
    proj = null_projector((x.T @ x).unsqueeze(0))
    u = torch.tensor([1.0, 1.0, -1.0], dtype=F64) / 3**0.5
    torch.testing.assert_close(proj[0], torch.outer(u, u), rtol=0, atol=1e-10)
    rows = torch.tensor([[[1.0, 0.0, 0.0], [1.0, 1.0, -1.0], [5.0, 5.0, 5.0]]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third row is padding
    torch.testing.assert_close(null_share(rows, proj, mask), torch.tensor([10 / 12], dtype=F64))
    full = null_projector(torch.eye(3, dtype=F64).unsqueeze(0))  # every direction determined
    assert float(null_share(rows, full, mask)) == 0.0


def test_unlearned_directions_and_share_by_hand():
    """Support diag(3, 0.5, 5), 2 units needed: W = e₂. φ = (1, 1, 0), V = diag(0.1, 2, 1),
    σ² = 0.5: along W (φ·e₂)²·2 = 2 of φᵀVφ + σ² = 2.6."""
    w = unlearned_directions(torch.diag(torch.tensor([3.0, 0.5, 5.0], dtype=F64)), 2.0)
    assert w.shape == (3, 1) and torch.equal(
        w.abs()[:, 0], torch.tensor([0.0, 1.0, 0.0], dtype=F64)
    )
    phi = torch.tensor([[[1.0, 1.0, 0.0]]], dtype=F64)
    cov = torch.diag(torch.tensor([0.1, 2.0, 1.0], dtype=F64)).unsqueeze(0)
    share = unlearned_share(phi, cov, torch.tensor([0.5], dtype=F64), w, torch.ones(1, 1))
    torch.testing.assert_close(share, torch.tensor([2.0 / 2.6], dtype=F64))
    none = unlearned_directions(torch.eye(3, dtype=F64) * 4, 2.0)
    assert none.shape == (3, 0)


def test_unlearned_share_is_the_variance_the_unlearned_coordinates_explain():
    """W = e₂, V = [[1, −0.99], [−0.99, 1]], φ = (1, 1), σ² = 0.01: the points determine
    c₁ + c₂ (φᵀVφ = 0.02) though c₂ alone is vague. Knowing c₂ removes
    (φᵀVW)²/(WᵀVW) = 0.01² / 1 = 1e-4 of the variance (Var(c₁ | c₂) = 1 − 0.99² = 0.0199 is
    what is left of 0.02), so s = 1e-4 / 0.03; the projection (φᵀW)²(WᵀVW) = 1 would give
    33 × the whole predictive variance. A zero column in W (not full rank) changes nothing."""
    phi = torch.tensor([[[1.0, 1.0]]], dtype=F64)
    cov = torch.tensor([[[1.0, -0.99], [-0.99, 1.0]]], dtype=F64)
    noise = torch.tensor([0.01], dtype=F64)
    w = torch.tensor([[0.0], [1.0]], dtype=F64)
    share = unlearned_share(phi, cov, noise, w, torch.ones(1, 1))
    torch.testing.assert_close(share, torch.tensor([1e-4 / 0.03], dtype=F64))
    padded = torch.tensor([[0.0, 0.0], [1.0, 0.0]], dtype=F64)
    torch.testing.assert_close(unlearned_share(phi, cov, noise, padded, torch.ones(1, 1)), share)
    # every direction unlearned: all of φᵀVφ, none of σ²
    full = unlearned_share(phi, cov, noise, torch.eye(2, dtype=F64), torch.ones(1, 1))
    torch.testing.assert_close(full, torch.tensor([0.02 / 0.03], dtype=F64))


def test_a_non_finite_unit_gets_no_share_and_the_others_theirs():
    """Units 2 and 3 of 4 have a NaN covariance entry and an infinite σ²: their share is NaN
    (no ``share > t`` flag; the eigensolver raised on them), the finite units' are the by-hand
    2/2.6 of :func:`test_unlearned_directions_and_share_by_hand`."""
    w = torch.tensor([[0.0], [1.0], [0.0]], dtype=F64)
    phi = torch.tensor([[[1.0, 1.0, 0.0]]], dtype=F64).expand(4, 1, 3)
    cov = torch.diag(torch.tensor([0.1, 2.0, 1.0], dtype=F64)).repeat(4, 1, 1)
    cov[1, 0, 2] = cov[1, 2, 0] = float("nan")
    noise = torch.tensor([0.5, 0.5, float("inf"), 0.5], dtype=F64)
    share = unlearned_share(phi, cov, noise, w, torch.ones(4, 1))
    assert torch.isnan(share[1:3]).all() and not bool((share > 0.5)[1:3].any())
    torch.testing.assert_close(share[[0, 3]], torch.full((2,), 2.0 / 2.6, dtype=F64))
