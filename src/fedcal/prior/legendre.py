"""The fleet prior's basis in NumPy: normalized Legendre products and the extrapolation guard.

The same functions as :mod:`fedcal.models.basis` (``legendre``, ``legendre_products``,
``legendre_derivatives``, ``linearized_products``), the same operations in the same order on
float64 arrays, so the closed-form path (calibrate, plan, predict, the exports) needs no
torch. Equal to the torch functions within rounding (tests/prior/test_posterior.py).

    P̃_n(x) = √(2n+1)·P_n(x)  (Bonnet: (n+1)P_{n+1} = (2n+1)xP_n − nP_{n−1}),
    φ_k(x) = Π_j P̃_{a_kj}(x_j),
    ψ(x) = φ(x̄) + J_φ(x̄)(x − x̄),  x̄ = clamp(x, lo, hi)   (the guard beyond the support box).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

Terms = Sequence[Sequence[int]]


def legendre(x: np.ndarray, order: int) -> list[np.ndarray]:
    """√(2n+1)·P_n(x) for n = 0..order, each shaped like ``x`` (Bonnet's recurrence)."""
    values = [np.ones_like(x)]
    if order >= 1:
        values.append(x)
    for n in range(1, order):
        values.append(((2 * n + 1) * x * values[n] - n * values[n - 1]) / (n + 1))
    return [math.sqrt(2 * n + 1) * v for n, v in enumerate(values)]


def legendre_derivatives(x: np.ndarray, order: int) -> list[np.ndarray]:
    """d/dx √(2n+1)·P_n(x), n = 0..order: P'_{n+1} = P'_{n−1} + (2n+1)·P_n (P'_0 = 0)."""
    values = legendre(x, order)
    plain = [v / math.sqrt(2 * n + 1) for n, v in enumerate(values)]
    ders = [np.zeros_like(x)]
    if order >= 1:
        ders.append(np.ones_like(x))
    for n in range(1, order):
        ders.append(ders[n - 1] + (2 * n + 1) * plain[n])
    return [math.sqrt(2 * n + 1) * d for n, d in enumerate(ders)]


def legendre_products(x: np.ndarray, terms: Terms) -> np.ndarray:
    """φ(x): (..., rows, inputs) → (..., rows, terms), float64 (module docstring)."""
    x = np.asarray(x, dtype=np.float64)
    if not terms:
        return np.zeros((*x.shape[:-1], 0))
    tops = [max(t[j] for t in terms) for j in range(x.shape[-1])]
    values = [legendre(x[..., j], tops[j]) for j in range(x.shape[-1])]
    cols = []
    for term in terms:
        col = np.ones_like(x[..., 0])
        for j, a in enumerate(term):
            if a:
                col = col * values[j][a]
        cols.append(col)
    return np.stack(cols, axis=-1)


def linearized_products(
    x: np.ndarray, terms: Terms, lo: np.ndarray, hi: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(ψ(x), outside): φ inside the box [lo, hi], its tangent plane at the nearest point of
    the box beyond it (module docstring); ``lo``/``hi`` broadcast against x's leading axes."""
    x = np.asarray(x, dtype=np.float64)
    inner = np.maximum(np.minimum(x, hi), lo)
    step = x - inner
    outside = (step != 0).any(-1)
    phi = legendre_products(inner, terms)
    if not outside.any() or not terms:
        return phi, outside
    tops = [max(t[j] for t in terms) for j in range(x.shape[-1])]
    values = [legendre(inner[..., j], tops[j]) for j in range(x.shape[-1])]
    ders = [legendre_derivatives(inner[..., j], tops[j]) for j in range(x.shape[-1])]
    cols = []
    for term in terms:
        slope = np.zeros_like(inner[..., 0])
        for j, a in enumerate(term):
            if not a:
                continue
            part = ders[j][a] * step[..., j]
            for k, b in enumerate(term):
                if k != j and b:
                    part = part * values[k][b]
            slope = slope + part
        cols.append(slope)
    return phi + np.stack(cols, axis=-1), outside
