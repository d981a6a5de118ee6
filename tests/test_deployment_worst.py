"""studies/deployment_worst.py and deployment_scored.py: the arithmetic of the worst-unit
limit and of the per-direction shares, by hand."""

from __future__ import annotations

import numpy as np
import pytest

from studies import deployment_worst as dw


def test_the_factor_a_unit_needs_is_its_order_statistic():
    ratios = np.array([0.9, 0.1, 0.5, 0.3, 0.7, 0.2, 0.4, 0.6, 0.8, 1.0])  # |e|/(1.96σ)
    assert dw.needed(ratios, 0.7) == 0.7  # 7 of 10 inside at f = 0.7
    assert dw.needed(ratios, 0.95) == 1.0  # ⌈9.5⌉ = 10th
    assert dw.needed(ratios, 0.05) == 0.1


def test_a_factor_per_group_lifts_the_worst_unit_only_as_far_as_the_mean_cap_allows():
    """Unit A: 100 ratios (k + ½)/100; unit B: 30 ratios 4·(k + ½)/30 (four times harder).
    One factor for both: B at 28/30 puts A at 1, mean 0.9667 ≤ 0.97; B at 29/30 would make
    the mean 0.983. A factor each: A at 0.97 and B at 29/30, mean 0.9683."""
    a = (np.arange(100) + 0.5) / 100
    b = 4 * (np.arange(30) + 0.5) / 30
    worst, mean = dw.best_worst([a, b], np.array([0, 0]))
    assert worst == pytest.approx(28 / 30) and mean == pytest.approx((1 + 28 / 30) / 2)
    worst, mean = dw.best_worst([a, b], np.array([0, 1]))
    assert worst == pytest.approx(29 / 30) and mean == pytest.approx((0.97 + 29 / 30) / 2)


def test_tertile_bins_and_rank_correlation():
    assert dw.tertiles(np.arange(1.0, 10.0)).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert dw.spearman(np.array([1.0, 2, 3, 4]), np.array([10.0, 40, 90, 160])) == 1.0
    assert dw.spearman(np.array([1.0, 2, 3]), np.array([3.0, 2, 1])) == -1.0


def test_the_scored_shares_per_sweep_direction_by_hand():
    """studies/deployment_scored.py: 2 ascending rows (one inside ±1.96σ), 3 descending
    (two inside): coverage 3/5, per direction 1/2 and 2/3, balanced (1/2 + 2/3)/2."""
    import pandas as pd

    from studies import deployment_scored as sc

    class Units:
        def predict(self, x, return_std):
            return np.zeros(len(x)), np.ones(len(x))

    frame = pd.DataFrame(
        {
            "sensor_id": ["a"] * 5,
            "frequency_hz": 1.0,
            "temperature_c": 0.0,
            "pressure_hpa": [1.9, 2.0, -1.0, 1.95, 3.0],
            "direction": ["up", "up", "down", "down", "down"],
        }
    )
    got = sc.scored(Units(), frame)
    assert got["down share"] == pytest.approx(0.6)
    assert got["cov up"] == pytest.approx(0.5) and got["cov down"] == pytest.approx(2 / 3)
    assert got["cov"] == pytest.approx(0.6)
    assert got["cov balanced"] == pytest.approx((0.5 + 2 / 3) / 2)
