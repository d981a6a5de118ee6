"""D6 of the deployment model (issue 33): how much a design leaves to the prior, against what
the references' emulated designs left (fedcal.prior.design_span)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedcal.prior.design_span import (
    UNTESTED_SHARE,
    halton,
    reliance,
    reliance_gram,
    reliance_reason,
    span_reasons,
    untested_share,
)
from fedcal.prior.discrepancy import Discrepancy
from fedcal.prior.legendre import legendre_products
from tests.prior.test_discrepancy import model

TERMS = ((0, 0), (1, 0), (0, 1), (2, 0), (1, 1), (0, 2))


def test_halton_points_by_hand():
    # the radical inverse of 1, 2, 3, 4 in base 2 and base 3
    want = [[1 / 2, 1 / 3], [1 / 4, 2 / 3], [3 / 4, 1 / 9], [1 / 8, 4 / 9]]
    np.testing.assert_allclose(halton(4, 2), want, rtol=1e-15)


def test_the_untested_share_the_band_tolerates_by_hand():
    # a normal inside ±1.96/√(1+s) holds 93 % at s = (1.959964/1.811911)² − 1 (Φ⁻¹(0.965)
    # = 1.811911) and 97 % at 1 − s = (1.959964/2.170090)² (Φ⁻¹(0.985) = 2.170090)
    low = (1.959964 / 1.811911) ** 2 - 1
    high = 1 - (1.959964 / 2.170090) ** 2
    assert low == pytest.approx(0.17010, abs=1e-5) and high == pytest.approx(0.18428, abs=1e-5)
    assert pytest.approx(min(low, high), rel=1e-5) == UNTESTED_SHARE


def test_reliance_is_the_box_mean_of_the_basis_variance_in_both_array_modules():
    rng = np.random.default_rng(3)
    lo, hi = np.array([-0.8, -1.0]), np.array([0.6, 0.9])
    root = rng.standard_normal((2, len(TERMS), len(TERMS)))
    cov = root @ np.swapaxes(root, -1, -2)
    noise = np.array([0.5, 2.0])
    gram = reliance_gram(lo, hi, TERMS, points=64)
    u = reliance(cov, noise, gram)
    # by the definition: φ(x)ᵀVφ(x)/σ² averaged point by point over the 64 Halton points
    phi = legendre_products(lo + halton(64, 2) * (hi - lo), TERMS)
    by_point = [np.mean([f @ v @ f for f in phi]) / s for v, s in zip(cov, noise, strict=True)]
    assert u.tolist() == pytest.approx(by_point, rel=1e-12)
    ut = reliance(torch.as_tensor(cov), torch.as_tensor(noise), gram)  # the torch path
    assert ut.tolist() == pytest.approx(u.tolist(), rel=1e-14)


def test_the_untested_share_and_its_reason_by_hand():
    m = model(beta=0.5, amplitude=2e-9, max_reliance=4.0)
    noise = np.full(4, 1e-9)  # a²/σ² = 2
    u = np.array([10.0, 5.0, 4.9, 3.0])
    # s = max(u − 4, 0) / (0.5 u + 1 + 2)
    share = untested_share(m, u, noise)
    assert share.tolist() == pytest.approx([6 / 8, 1 / 5.5, 0.9 / 5.45, 0.0], rel=1e-12)
    why = reliance_reason(m, u, noise)
    assert why[2:] == ["", ""]  # 0.165 and 0 are within 0.170
    assert why[0] == (
        "no σ: the design leaves the prior 10 σ² of basis variance (mean over the references' "
        "range), the reference units' emulated designs at most 4 σ²: the untested part is "
        "0.75 × its stated variance, more than the 0.17 × that keeps 93–97 % coverage"
    )
    assert why[1].startswith("no σ: the design leaves the prior 5 σ²") and "\n" not in why[1]


def test_the_points_and_levels_come_first_and_an_old_record_declines_nothing_by_reliance():
    m = model(max_reliance=4.0)
    x = np.array([[[-1.0, -1.0], [0.0, -1.0], [1.0, -1.0], [-1.0, 1.0], [0.0, 1.0], [1.0, 1.0]]])
    flat = x.copy()
    flat[..., 1] = -1.0  # one temperature level
    xs, mask = np.concatenate([x, flat, x]), np.ones((3, 6))
    u, noise = np.array([100.0, 100.0, 1.0]), np.full(3, 1e-9)
    why = span_reasons(m, xs, mask, ["f", "t"], u, noise)
    assert why[0].startswith("no σ: the design leaves the prior 100 σ²")
    assert why[1].startswith("no σ: the design has 1 level(s) of t")  # D5 first
    assert why[2] == ""
    raw = m.to_dict()
    del raw["max_reliance"]  # a prior.json written before D6
    old = Discrepancy.from_dict(raw)
    assert math.isinf(old.max_reliance)
    assert reliance_reason(old, u, noise) == ["", "", ""]
