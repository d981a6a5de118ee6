"""The optimizer (the package docstring): greedy construction, then a best-improvement
exchange (Fedorov 1972) from it and from the standard grid; the cheapest design meeting a
spec."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedcal.planning.chamber import Chamber, Design, check_design, grid_design, snap
from fedcal.planning.forecast import Expected, Planner, criterion, evaluate, meets
from fedcal.prior.plan import Base

MAX_PASSES = 100  # exchange passes (each applies one improving move; measured: < 20 used)


def _moves(plan: Planner, d: Design) -> list[Design]:
    """Every design one exchange away: one plateau to another free set point, or one point
    to another (plateau, pressure, direction) that leaves no plateau empty."""
    ch = plan.chamber
    out = []
    for k in range(d.plateaus):
        for t in ch.temperatures:
            if t not in d.temperatures:
                out.append(Design((*d.temperatures[:k], t, *d.temperatures[k + 1 :]), d.points))
    per = np.bincount([k for k, _, _ in d.points], minlength=d.plateaus)
    for j, (k0, p0, s0) in enumerate(d.points):
        for k in range(d.plateaus):
            if k != k0 and per[k0] == 1:
                continue
            for p in ch.pressures:
                for s in ch.directions:
                    if (k, p, s) != (k0, p0, s0):
                        pts = (*d.points[:j], (k, p, s), *d.points[j + 1 :])
                        out.append(Design(d.temperatures, pts))
    return out


def exchange(plan: Planner, start: Design, base: Base | None = None) -> tuple[Design, float]:
    """Best-improvement exchange from ``start``; never returns a worse design (package doc)."""
    best, value = start, float(criterion(plan, [start], base)[0])
    for _ in range(MAX_PASSES):
        moves = _moves(plan, best)
        if not moves:
            break
        scores = criterion(plan, moves, base)
        i = int(np.argmin(scores))
        if not float(scores[i]) < value * (1.0 - 1e-9):
            break
        best, value = moves[i], float(scores[i])
    return best, value


def greedy(plan: Planner, plateaus: int, points: int, base: Base | None = None) -> Design:
    """Add the point that lowers J most, N times; a new plateau may be opened (any free set
    point) while fewer than K are open, and must be when the remaining points require it."""
    ch = plan.chamber
    d = Design((), ())
    for step in range(points):
        must_open = points - step == plateaus - d.plateaus
        cands = []
        if not must_open:
            cands += [
                Design(d.temperatures, (*d.points, (k, p, s)))
                for k in range(d.plateaus)
                for p in ch.pressures
                for s in ch.directions
            ]
        if d.plateaus < plateaus:
            k = d.plateaus
            cands += [
                Design((*d.temperatures, t), (*d.points, (k, p, s)))
                for t in ch.temperatures
                if t not in d.temperatures
                for p in ch.pressures
                for s in ch.directions
            ]
        d = cands[int(np.argmin(criterion(plan, cands, base)))]
    return d


@dataclass(frozen=True)
class Plan:
    design: Design
    expected: Expected
    start: Design  # the standard grid (or given start) the optimizer had to beat
    start_expected: Expected


def optimize(plan: Planner, plateaus: int, points: int, start: Design | None = None) -> Plan:
    """The design of K plateaus and N points minimizing J (package doc)."""
    ch = plan.chamber
    if plateaus < 1 or points < plateaus:
        raise ValueError(f"need 1 <= plateaus <= points, got {plateaus} plateaus, {points} points")
    if plateaus > len(ch.temperatures):
        raise ValueError(f"{plateaus} plateaus but only {len(ch.temperatures)} feasible set points")
    if start is None:
        start = _even_start(ch, plateaus, points)
    check_design(ch, start, plateaus, points)
    # Exchange from the better of the two starts (greedy, the grid): J never exceeds it.
    starts = [start, greedy(plan, plateaus, points)]
    values = criterion(plan, starts)
    best = exchange(plan, starts[int(np.argmin(values))])[0]
    return Plan(best, evaluate(plan, best), start, evaluate(plan, start))


def _even_start(ch: Chamber, plateaus: int, points: int) -> Design:
    """The standard grid when N is a multiple of K; else its points shared out evenly."""
    temps = grid_design(ch, 2, plateaus).temperatures
    if len(temps) < plateaus:  # snapping merged set points: take the next free ones
        free = [t for t in ch.temperatures if t not in temps]
        temps = temps + tuple(free[: plateaus - len(temps)])
    counts = [points // plateaus + (k < points % plateaus) for k in range(plateaus)]
    pts = []
    for k, n in enumerate(counts):
        ps = snap(np.linspace(ch.pressures[0], ch.pressures[-1], n), ch.pressures)
        if n == 1:
            ps = snap(np.array([(ch.pressures[0] + ch.pressures[-1]) / 2]), ch.pressures)
        pts += [(k, p, ch.directions[0]) for p in ps]
    return Design(tuple(temps), tuple(pts))


def cheapest(plan: Planner, spec: float, max_plateaus: int = 4, max_points: int = 24) -> list[Plan]:
    """Per K ≤ ``max_plateaus``, the fewest points N ≤ ``max_points`` whose optimized design
    meets the spec (√J ≤ spec and the units' RMSE quantile ≤ spec), cheapest first.

    N is found by bisection: J of the optimized design falls with N (a design of N + 1
    points contains one of N). Returns the meeting plans sorted by chamber time.
    """
    out = []
    for k in range(1, min(max_plateaus, len(plan.chamber.temperatures)) + 1):
        lo, hi = k, max_points
        best = None
        while lo <= hi:
            n = (lo + hi) // 2
            result = optimize(plan, k, n)
            if meets(result.expected, spec):
                best, hi = result, n - 1
            else:
                lo = n + 1
        if best is not None:
            out.append(best)
    return sorted(out, key=lambda r: (r.expected.minutes, r.expected.quantile_rmse))
