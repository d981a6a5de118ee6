"""The 95 % interval of a prediction made without knowing a binary sign (fedprior_branch's
sweep direction): ½N(m, s²) + ½N(−m, s²), against hand values and scipy."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.optimize import brentq
from scipy.stats import norm

from fedcal.core.bayes import mixture_halfwidth, mixture_mass
from fedcal.engine.evaluation import interval_metrics

F64 = torch.float64


def reference(m: float, s: float, level: float = 0.95) -> float:
    def mass(w: float) -> float:
        a = norm.cdf((w - m) / s) - norm.cdf((-w - m) / s)
        return 0.5 * (a + norm.cdf((w + m) / s) - norm.cdf((-w + m) / s))

    return brentq(lambda w: mass(w) - level, 0.0, abs(m) + 10 * s, xtol=1e-14)


def test_mixture_halfwidth_by_hand_and_against_scipy():
    m = torch.tensor([0.0, 10.0, 1.0, -1.0, 0.3, float("nan")], dtype=F64)
    s = torch.tensor([2.0, 1.0, 1.0, 1.0, 0.05, 1.0], dtype=F64)
    w = mixture_halfwidth(m, s)
    assert float(w[0]) == pytest.approx(1.959964 * 2.0, rel=1e-6)  # m = 0: the Gaussian's
    # m ≫ s: each component's far tail is empty, P(|e| ≤ w) = Φ(w − m) = 0.95
    assert float(w[1]) == pytest.approx(10.0 + norm.ppf(0.95), rel=1e-9)
    for i in (2, 3, 4):
        assert float(w[i]) == pytest.approx(reference(float(m[i]), float(s[i])), rel=1e-9)
    assert math.isnan(float(w[5]))
    # always within the Gaussian of the same variance's 1.96·√(m² + s²) (m ≠ 0: narrower)
    assert (w[1:5] < 1.959964 * (m[1:5] ** 2 + s[1:5] ** 2).sqrt()).all()
    # the mass at the half-width is the level
    np.testing.assert_allclose(mixture_mass(w[:5], m[:5], s[:5]).numpy(), 0.95, rtol=1e-12)


def test_coverage_counts_against_the_stated_halfwidth():
    pred = torch.zeros(1, 4, 1, dtype=F64)
    y = torch.tensor([[[0.5], [1.5], [2.5], [-1.0]]], dtype=F64)
    std = torch.ones(1, 4, 1, dtype=F64)  # ±1.96: rows 0, 3 inside (and 1: 1.5 ≤ 1.96)
    mask = torch.ones(1, 4)
    scale = torch.tensor(1.0, dtype=F64)
    assert float(interval_metrics(pred, std, y, mask, scale)["coverage95"][0]) == 0.75
    half = torch.full((1, 4, 1), 1.2, dtype=F64)  # a narrower stated interval: rows 0, 3
    got = interval_metrics(pred, std, y, mask, scale, half)
    assert float(got["coverage95"][0]) == 0.5 and float(got["pred_sd"][0]) == 1.0
