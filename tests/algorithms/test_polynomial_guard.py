"""The per-sensor polynomial on many inputs and beyond its data (issue 26)."""

from __future__ import annotations

import pytest
import torch

from fedcal.algorithms.polynomial import PolynomialCalibration
from fedcal.core.data import ClientData
from fedcal.core.task import Task
from fedcal.models.basis import MAX_TERMS
from fedcal.models.mlp import MLP

F64 = torch.float64


def test_an_order_4_tensor_over_8_inputs_is_reduced_in_one_line_and_runs():
    """5^8 = 390,625 terms (a 19.5 TB design on a real network) → the largest orders are
    lowered until the basis fits MAX_TERMS: (2, 1, …, 1) = 3·2^7 = 384 terms."""
    alg = PolynomialCalibration(Task(MLP(in_features=8, hidden=(3,))))
    assert alg.top_orders == (2, 1, 1, 1, 1, 1, 1, 1)  # ties: the first-named input keeps most
    assert len(alg.exponents) == 384 <= MAX_TERMS
    assert "390,625 terms" in alg.note and "\n" not in alg.note
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(2, 300, 8, generator=gen, dtype=F64) * 2 - 1
    y = (x.sum(-1, keepdim=True) + 0.5 * x[..., :1] * x[..., 1:2]).to(F64)
    fit = alg.fit(ClientData(x, y, torch.full((2,), 300), (1, 2)))
    assert fit["refused"].tolist() == [0.0, 0.0]  # 300 points ≥ 256 coefficients: fitted
    params = {k: fit[k] for k in ("coef", "orders", "lo", "hi")}
    assert torch.allclose(alg.predict(params, x), y, atol=1e-8)
    assert PolynomialCalibration(Task(MLP(in_features=2, hidden=(3,)))).note == ""


def test_more_inputs_than_the_smallest_tensor_allows_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"2\^9 coefficients") as err:
        PolynomialCalibration(Task(MLP(in_features=9, hidden=(3,))))
    assert "\n" not in str(err.value)


def test_beyond_the_calibrated_box_the_surface_is_linearized_and_flagged():
    """A cubic fitted on x ∈ [-1, 1]: at x = 10 the raw cubic gives ≈ 1000, the guarded
    prediction its tangent at the box's edge (plus the 5 % margin), hand-computed."""
    x = torch.linspace(-1, 1, 40, dtype=F64).reshape(1, 40, 1)
    y = x**3
    alg = PolynomialCalibration(Task(MLP(in_features=1, hidden=(3,))), max_orders=(3,))
    fit = alg.fit(ClientData(x, y, torch.tensor([40]), (1,)))
    params = {k: fit[k] for k in ("coef", "orders", "lo", "hi")}
    probe = torch.tensor([[[0.5], [1.05], [10.0]]], dtype=F64)
    pred = alg.predict(params, probe)[0, :, 0]
    edge = 1.1  # 1 + 2·5 % of the span [-1, 1] in the unit interval
    assert pred[0].item() == pytest.approx(0.125, abs=1e-9)
    assert pred[1].item() == pytest.approx(1.05**3, abs=1e-9)  # inside the margin: the cubic
    assert pred[2].item() == pytest.approx(edge**3 + 3 * edge**2 * (10 - edge), rel=1e-9)
    assert alg.beyond_support(params, probe)[0].tolist() == [False, False, True]
