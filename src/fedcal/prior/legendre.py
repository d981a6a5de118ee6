"""The fleet prior's basis in NumPy: normalized Legendre products and the extrapolation guard.

    P̃_n(x) = √(2n+1)·P_n(x)  (Bonnet: (n+1)P_{n+1} = (2n+1)xP_n − nP_{n−1}),
    φ_k(x) = Π_j P̃_{a_kj}(x_j),
    ψ(x) = φ(x̄) + J_φ(x̄)(x − x̄),  x̄ = clamp(x, lo, hi)   (the guard beyond the support box).

One formula: these are :data:`fedcal.models.families.LEGENDRE`'s, which the torch path
(:mod:`fedcal.models.basis`) calls too; here their inputs are float64 NumPy arrays, so the
closed-form path (calibrate, plan, predict, the exports) needs no torch. The same operations
in the same order: equal to the torch functions to the bit (tests/prior/test_posterior.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedcal.models.families import LEGENDRE, legendre, legendre_derivatives

__all__ = ["legendre", "legendre_derivatives", "legendre_products", "linearized_products"]

Terms = Sequence[Sequence[int]]


def legendre_products(x: np.ndarray, terms: Terms) -> np.ndarray:
    """φ(x): (..., rows, inputs) → (..., rows, terms), float64 (module docstring)."""
    return LEGENDRE.products(np.asarray(x, dtype=np.float64), terms)


def linearized_products(
    x: np.ndarray, terms: Terms, lo: np.ndarray, hi: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(ψ(x), outside): φ inside the box [lo, hi], its tangent plane at the nearest point of
    the box beyond it (module docstring); ``lo``/``hi`` broadcast against x's leading axes."""
    return LEGENDRE.linearized(np.asarray(x, dtype=np.float64), terms, lo, hi)
