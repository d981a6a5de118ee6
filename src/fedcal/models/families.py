"""Basis families: the one-input functions whose products over the inputs form a basis.

A family (:class:`BasisFamily`) is its values p_0 … p_n, their derivatives, what p_n is (the
JSON export) and its C form (the C header), or none. Families are registered by name in
:data:`FAMILIES` (:func:`register_family`; :func:`basis_family` looks one up or names the
known ones in one line): the shipped ``legendre`` (normalized Legendre polynomials, what
fedprior, the polynomial and fedpoly use) and ``monomial`` (x^n, leastsq's default). A new
family is one module that calls :func:`register_family` when imported
(tests/models/test_basis_registry.py registers a Chebyshev toy and runs it through leastsq).
This module imports nothing of fedcal; :mod:`fedcal.models.basis` re-exports its names.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a family is evaluated: the registry itself
    from torch import Tensor  # is read torch-free (prior.json's check on a calibration station)


def legendre(x: Tensor, order: int) -> list[Tensor]:
    """Normalized Legendre values √(2n+1)·P_n(x) for n = 0..order (each shaped like x).

    Bonnet's recurrence (n+1)·P_{n+1} = (2n+1)·x·P_n − n·P_{n−1}, then the
    normalization that gives unit mean square on [-1, 1].
    """
    import torch

    values = [torch.ones_like(x)]
    if order >= 1:
        values.append(x)
    for n in range(1, order):
        values.append(((2 * n + 1) * x * values[n] - n * values[n - 1]) / (n + 1))
    return [math.sqrt(2 * n + 1) * v for n, v in enumerate(values)]


def legendre_derivatives(x: Tensor, order: int) -> list[Tensor]:
    """d/dx √(2n+1)·P_n(x) for n = 0..order: P'_{n+1} = P'_{n−1} + (2n+1)·P_n (P'_0 = 0)."""
    import torch

    values = legendre(x, order)  # normalized: P_n = values[n] / √(2n+1)
    plain = [v / math.sqrt(2 * n + 1) for n, v in enumerate(values)]
    ders = [torch.zeros_like(x)]
    if order >= 1:
        ders.append(torch.ones_like(x))
    for n in range(1, order):
        ders.append(ders[n - 1] + (2 * n + 1) * plain[n])
    return [math.sqrt(2 * n + 1) * d for n, d in enumerate(ders)]


@dataclass(frozen=True)
class BasisFamily:
    """A family of one-input functions p_0 … p_n whose products over the inputs are a basis.

    ``values(x, order)`` / ``derivatives(x, order)``: [p_0(x) … p_order(x)] and their
    derivatives (each shaped like x); :meth:`products` forms the product terms
    φ_k(x) = Π_j p_{a_kj}(x_j) of exponent tuples (float64). ``normalization`` says what
    p_n is (the JSON export); ``c_lines(order)`` is the C99 body of
    ``fedcal_basis_1d(u, p, dp)`` (p[n] and, when dp is not NULL, dp[n] for n ≤
    FEDCAL_MAX_ORDER) for the C header, or None: the family has no C form and the C export
    refuses it in one line (JSON and ONNX still carry it). A new family is one module that
    calls :func:`register_family` when imported.
    """

    name: str
    values: Callable[[Tensor, int], list[Tensor]]
    derivatives: Callable[[Tensor, int], list[Tensor]]
    normalization: str
    c_lines: Callable[[int], list[str]] | None = None
    # the products in one closed form, where the family has one (monomials: x^e)
    design: Callable[[Tensor, Tensor | Sequence[Sequence[int]]], Tensor] | None = None

    def products(self, x: Tensor, exponents: Tensor | Sequence[Sequence[int]]) -> Tensor:
        """φ_k(x) = Π_j p_{a_kj}(x_j) for each exponent tuple: (..., rows, F) → (..., rows, T),
        float64."""
        import torch

        if self.design is not None:
            return self.design(x, exponents)
        if isinstance(exponents, torch.Tensor):
            exponents = [tuple(int(a) for a in row) for row in exponents.tolist()]
        x = x.to(torch.float64)
        if not exponents:
            return x.new_zeros(*x.shape[:-1], 0)
        tops = [max(t[j] for t in exponents) for j in range(x.shape[-1])]
        values = [self.values(x[..., j], tops[j]) for j in range(x.shape[-1])]
        cols = []
        for term in exponents:
            col = torch.ones_like(x[..., 0])
            for j, a in enumerate(term):
                if a:
                    col = col * values[j][a]
            cols.append(col)
        return torch.stack(cols, dim=-1)


FAMILIES: dict[str, BasisFamily] = {}


def register_family(family: BasisFamily) -> BasisFamily:
    """Add ``family`` to :data:`FAMILIES` under its name (a name taken by another is refused)."""
    known = FAMILIES.get(family.name)
    if known is not None and known is not family:
        raise ValueError(f"a basis family named {family.name!r} is already registered")
    FAMILIES[family.name] = family
    return family


def basis_family(name: str) -> BasisFamily:
    """The registered family ``name``, or a one-line ValueError naming the known ones."""
    try:
        return FAMILIES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown basis family {name!r}; known: {', '.join(sorted(FAMILIES))}"
        ) from None


def _legendre_c(order: int) -> list[str]:
    """The C form of the normalized Legendre values (Bonnet) and their derivatives."""
    norms = ", ".join(f"{math.sqrt(2 * n + 1):.17e}" for n in range(order + 1))
    return [
        f"static const double fedcal_norm[FEDCAL_MAX_ORDER + 1] = {{{norms}}};",
        "/* p[n] = sqrt(2n+1) P_n(u), Bonnet: (n+1) P_{n+1} = (2n+1) u P_n - n P_{n-1}.",
        " * dp[n] = d p[n]/du (when dp is not NULL). Differentiating Bonnet:",
        " *   (n+1) P'_{n+1} = (2n+1) (P_n + u P'_n) - n P'_{n-1},",
        " * and u P'_n - P'_{n-1} = n P_n (from the generating function",
        " * (1 - 2ut + t^2)^(-1/2) = sum_n P_n(u) t^n), so (n+1) P'_{n+1} =",
        " * (2n+1)(n+1) P_n + (n+1) P'_{n-1}, i.e.",
        " *   P'_{n+1} = P'_{n-1} + (2n+1) P_n,   P'_0 = 0, P'_1 = 1;",
        " * the normalization is a constant factor: dp[n] = sqrt(2n+1) P'_n(u). */",
        "static inline void fedcal_basis_1d(FEDCAL_BASIS_T u, FEDCAL_BASIS_T *p,"
        " FEDCAL_BASIS_T *dp) {",
        "    p[0] = (FEDCAL_BASIS_T)1;",
        "    if (dp) dp[0] = (FEDCAL_BASIS_T)0;",
        "    if (FEDCAL_MAX_ORDER >= 1) {",
        "        p[1] = u;",
        "        if (dp) dp[1] = (FEDCAL_BASIS_T)1;",
        "    }",
        "    for (int n = 1; n < FEDCAL_MAX_ORDER; ++n) {",
        "        p[n + 1] = ((FEDCAL_BASIS_T)(2 * n + 1) * u * p[n]"
        " - (FEDCAL_BASIS_T)n * p[n - 1]) / (FEDCAL_BASIS_T)(n + 1);",
        "        if (dp) dp[n + 1] = dp[n - 1] + (FEDCAL_BASIS_T)(2 * n + 1) * p[n];",
        "    }",
        "    for (int n = 0; n <= FEDCAL_MAX_ORDER; ++n) {",
        "        p[n] *= (FEDCAL_BASIS_T)fedcal_norm[n];",
        "        if (dp) dp[n] *= (FEDCAL_BASIS_T)fedcal_norm[n];",
        "    }",
        "}",
    ]


def monomials(x: Tensor, order: int) -> list[Tensor]:
    """x^n for n = 0..order."""
    import torch

    values = [torch.ones_like(x)]
    for _ in range(order):
        values.append(values[-1] * x)
    return values


def monomial_derivatives(x: Tensor, order: int) -> list[Tensor]:
    """d/dx x^n = n·x^(n−1) for n = 0..order."""
    import torch

    values = monomials(x, max(order - 1, 0))
    return [torch.zeros_like(x), *(n * values[n - 1] for n in range(1, order + 1))]


def monomial_products(x: Tensor, exponents: Tensor | Sequence[Sequence[int]]) -> Tensor:
    """x^e for each exponent row: (..., rows, F) → (..., rows, terms), float64."""
    import torch

    e = torch.as_tensor(exponents, dtype=torch.float64).reshape(-1, x.shape[-1])
    return x.to(torch.float64).unsqueeze(-2).pow(e).prod(-1)


def _monomial_c(order: int) -> list[str]:
    return [
        "/* p[n] = u^n (no extrapolation guard: dp is never used). */",
        "static inline void fedcal_basis_1d(FEDCAL_BASIS_T u, FEDCAL_BASIS_T *p,"
        " FEDCAL_BASIS_T *dp) {",
        "    (void)dp;",
        "    p[0] = (FEDCAL_BASIS_T)1;",
        "    for (int n = 1; n <= FEDCAL_MAX_ORDER; ++n) p[n] = p[n - 1] * u;",
        "}",
    ]


LEGENDRE = register_family(
    BasisFamily(
        "legendre",
        legendre,
        legendre_derivatives,
        "P~n(u) = sqrt(2n+1) * P_n(u), P_n the Legendre polynomials",
        _legendre_c,
    )
)
MONOMIAL = register_family(
    BasisFamily("monomial", monomials, monomial_derivatives, "u^n", _monomial_c, monomial_products)
)
