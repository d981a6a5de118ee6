"""A unit's MLP numbers do not depend on the cohort it is computed in (issue 36, part 5).

ATen's element-wise kernels run whole SIMD vectors and a scalar tail, and σ's vector and
scalar exp differ by an ulp: a unit alone (a Flower site of one sensor) and the same unit in
the fleet got different bits, which fedgmi_bayes's head posterior amplified to 1.2e-8
(tests/engine/test_flower_wire.py). These tests compare a unit alone with the same unit in
cohorts of 2–7, bit for bit, through every path that evaluates σ.
"""

from __future__ import annotations

import pytest
import torch

from fedcal.core.data import ClientData, minibatches
from fedcal.core.tree import expand
from fedcal.models.mlp import ACTIVATIONS, LANES, MLP, _tanh, sigmoid_lanes


def _cohort(c: int, rows: int, seed: int = 0) -> ClientData:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(c, rows, 2, generator=g, dtype=torch.float64)
    y = torch.randn(c, rows, 1, generator=g, dtype=torch.float64)
    return ClientData(x, y, torch.full((c,), rows), tuple(range(100, 100 + c)))


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("c", [2, 3, 5, 7])
@pytest.mark.parametrize("rows", [3, 7, 13])
def test_one_unit_trains_to_the_same_bits_alone_and_in_a_cohort(c, rows, activation) -> None:
    model = MLP(in_features=2, hidden=(6, 5), activation=activation)
    params = model.init(torch.Generator().manual_seed(4), torch.float64)
    data = _cohort(c, rows)
    body = ["l0.weight", "l0.bias", "l1.weight", "l1.bias"]
    together, _ = model.sgd_train(expand(params, c), minibatches(data, 2, 4), 0.1, body)
    for i in (0, c - 1):  # the first unit, and the last (the one in the cohort's tail)
        alone_data = data.select(torch.tensor([i]))
        alone, _ = model.sgd_train(expand(params, 1), minibatches(alone_data, 2, 4), 0.1, body)
        for k in body:
            assert torch.equal(alone[k][0], together[k][i]), (i, k)
        # the forward pass without autograd (features of the head: fedgmi_bayes's Φ)
        feats = model.head_input(expand(params, c), data.x)[i]
        assert torch.equal(model.head_input(expand(params, 1), alone_data.x)[0], feats)


def test_sigmoid_lanes_is_sigma_and_position_free() -> None:
    z = torch.linspace(-30, 30, 3 * LANES + 5, dtype=torch.float64)
    assert torch.allclose(sigmoid_lanes(z), torch.sigmoid(z), rtol=0, atol=4e-16)
    for start in range(0, 40, 3):  # any element gives the same bits wherever it sits
        assert torch.equal(sigmoid_lanes(z[start:])[0], sigmoid_lanes(z[start : start + 1])[0])
    w = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    assert torch.allclose(_tanh(w), torch.tanh(w), rtol=0, atol=1e-15)
    _tanh(w).sum().backward()  # differentiable (the autograd path of other methods)
    assert torch.allclose(w.grad, 1 - torch.tanh(w.detach()) ** 2, rtol=0, atol=1e-14)


def test_silu_through_lanes_is_silu_and_its_derivative() -> None:
    """The lane-padded silu is torch's silu to rounding; its derivative is autograd's.
    Tolerance: each side is a few roundings of O(1) factors (σ's exp ≤ 1 ulp, a product,
    a sum), so 8 ulps of the value, relative and absolute (near silu' = 0, z ≈ −1.28)."""
    from fedcal.models.mlp import DERIVATIVES

    tol = 8 * torch.finfo(torch.float64).eps

    z = torch.linspace(-30, 30, 2 * LANES + 3, dtype=torch.float64, requires_grad=True)
    h = ACTIVATIONS["silu"](z)
    ref = torch.nn.functional.silu(z.detach())
    assert torch.allclose(h.detach(), ref, rtol=tol, atol=tol)
    (grad,) = torch.autograd.grad(torch.nn.functional.silu(z).sum(), z)
    got = DERIVATIVES["silu"](z.detach(), h.detach())
    assert torch.allclose(got, grad, rtol=tol, atol=tol)
    for start in range(0, 40, 3):  # position-free, as sigmoid_lanes
        one = ACTIVATIONS["silu"](z.detach()[start : start + 1])[0]
        assert torch.equal(ACTIVATIONS["silu"](z.detach()[start:])[0], one)
