"""Is a run's stated 95 % interval coverage off beyond chance? (issue 20, item 2)

A method that states intervals is scored on the run's test rows: each unit's coverage
c_j is the share of its test points inside its stated 95 % interval. The points of one
unit are correlated (one resonator, one calibration), so the independent observations
are the units, not the points. Over the m units judged:

    c̄ = (1/m) Σ_j c_j,    SE = s_c / √m,    s_c² = Σ_j (c_j − c̄)² / (m − 1)

(the cluster-level standard error of the mean over units: it contains the binomial
noise of each unit's few test points and the unit-to-unit spread alike). With
q = t₀.₉₉,ₘ₋₁ (Student's t, one-sided, level :data:`LEVEL` = 1 % per side):

* ``under``: c̄ + q·SE < :data:`NOMINAL` (0.95): the intervals cover fewer points than
  stated, beyond chance; they under-state the fleet's error.
* ``over``: c̄ − q·SE > :data:`OVER` (0.99): clearly more than 99 %; under Gaussian errors
  the interval is then at least ~30 % wider than needed (z₀.₉₉₅/z₀.₉₇₅ = 1.31). Over-cover
  is the conservative side, so only a large excess is flagged.
* ``low`` / ``high``: not beyond chance over units, but the mean is outside the band
  [:data:`BAND_LOW`, :data:`BAND_HIGH`] = [0.93, 0.97] the issue asks of a stated 95 %
  interval *and* off nominal beyond the binomial noise of these units' test points,
  c̄ + z₀.₉₉·SE_b < 0.95 (low) or c̄ − z₀.₉₉·SE_b > 0.95 (high), SE_b = √(0.95·0.05/Σ n_j)
  over their Σ n_j test points: a certificate is read for *these* units, and a batch of units
  unlike the fleet's reference units (e.g. with more hysteresis) can be covered 0.87 while
  the spread across units keeps it within chance (docs/crosscheck.md, fleet seed 1). The
  binomial term treats a unit's test points as independent given the unit (random chamber
  points; optimistic for time-ordered field rows, so only an indication there).
* ``ok``: none of these; ``""`` (not judged) with fewer than :data:`MIN_UNITS` (5) units that
  state an interval, or none.

The across-unit SE is floored at SE_b: with few test points a unit's coverage takes few
values (all 1.0 on 4 points each gives s_c = 0), and an SE of 0 is not evidence.

Student's t rather than the normal quantile: with 5–20 units s_c is itself uncertain
(t₀.₉₉,₄ = 3.75 against z₀.₉₉ = 2.33).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.stats import norm
from scipy.stats import t as student_t

NOMINAL = 0.95  # the stated intervals' nominal coverage
OVER = 0.99  # "over" only when clearly above this (the conservative side)
LEVEL = 0.01  # one-sided test level, per side
MIN_UNITS = 5  # fewer units: not judged
BAND_LOW, BAND_HIGH = 0.93, 0.97  # outside: "low" / "high" even when within chance
SEVERITY = ("under", "over", "low", "high", "ok")  # beyond chance over units first


@dataclass(frozen=True)
class CoverageCheck:
    """The verdict over one group of units (module doc): ``verdict`` one of :data:`SEVERITY`
    or "" (not judged); ``units`` the number judged; ``mean``, ``se`` (across units, floored
    at ``se_points``), ``quantile`` (q = t₀.₉₉,ₘ₋₁) and ``se_points`` (SE_b, the binomial
    SE of the units' pooled test points; 0 when their counts are unknown) the test's terms
    (NaN when not judged)."""

    verdict: str  # one of SEVERITY, or "" (not judged)
    units: int
    mean: float
    se: float
    quantile: float
    se_points: float = 0.0

    def message(self, who: str) -> str:
        """One line for the user: what was covered, against what, and what it means (""
        when ok or when no unit states an interval). ``who``: e.g. "new units"."""
        if self.verdict == "ok" or self.units == 0:
            return ""
        if not self.verdict:
            return (
                f"coverage not judged: {self.units} {who} state an interval (the check needs "
                f"at least {MIN_UNITS} units)"
            )
        if self.verdict in ("low", "high"):
            side = "below" if self.verdict == "low" else "above"
            return (
                f"stated 95 % intervals covered {self.mean:.3f} of the test points of the "
                f"{self.units} {who} (mean over units), {side} the 93–97 % band and off 95 % "
                f"beyond the binomial noise of their test points (SE {self.se_points:.4f}); "
                f"within chance across units (SE {self.se:.3f}): the intervals may hold for "
                f"the fleet, but not for these units"
            )
        sign, bound = ("+", self.mean + self.quantile * self.se)
        if self.verdict == "over":
            sign, bound = "−", self.mean - self.quantile * self.se
        side, limit = ("below", NOMINAL) if self.verdict == "under" else ("above", OVER)
        meaning = (
            "the intervals under-state this fleet's error"
            if self.verdict == "under"
            else "the intervals over-state this fleet's error (wider than needed)"
        )
        return (
            f"stated 95 % intervals covered {self.mean:.3f} of the test points of the "
            f"{self.units} {who} (mean over units), {side} {limit * 100:.0f} % beyond chance "
            f"(mean {sign} t·SE = {self.mean:.3f} {sign} {self.quantile:.2f}·{self.se:.3f} = "
            f"{bound:.3f}; one-sided, {LEVEL * 100:.0f} %): {meaning}"
        )


def coverage_check(
    coverages: np.ndarray | list[float], points: np.ndarray | list[int] | None = None
) -> CoverageCheck:
    """The verdict on per-unit coverages (module doc); NaN entries (units that state no
    interval) are left out. ``points``: each unit's number of test points (aligned); without
    it SE_b = 0 (as if each unit had infinitely many)."""
    c = np.asarray(coverages, dtype=float)
    keep = np.isfinite(c)
    c = c[keep]
    m = len(c)
    if m < MIN_UNITS:
        nan = math.nan
        return CoverageCheck("", m, float(c.mean()) if m else nan, nan, nan)
    total = float(np.asarray(points, dtype=float)[keep].sum()) if points is not None else math.inf
    se_b = math.sqrt(NOMINAL * (1.0 - NOMINAL) / total) if total > 0 else math.inf
    mean = float(c.mean())
    se = max(float(c.std(ddof=1) / math.sqrt(m)), se_b)
    q = float(student_t.ppf(1.0 - LEVEL, m - 1))
    z = float(norm.ppf(1.0 - LEVEL))
    verdict = "ok"
    if mean + q * se < NOMINAL:
        verdict = "under"
    elif mean - q * se > OVER:
        verdict = "over"
    elif mean < BAND_LOW and mean + z * se_b < NOMINAL:
        verdict = "low"
    elif mean > BAND_HIGH and mean - z * se_b > NOMINAL:
        verdict = "high"
    return CoverageCheck(verdict, m, mean, se, q, se_b)
