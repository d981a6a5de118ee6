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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch is imported where a family is evaluated on a tensor: the registry
    from torch import Tensor  # is read torch-free (prior.json's check on a calibration station)

Array = Any  # a NumPy array or a torch tensor: the formulas below serve both (namespace())


def namespace(x: Array) -> Any:
    """The array module of ``x``: torch for a tensor (imported only then), else NumPy.

    One formula serves both paths: a NumPy array (the calibration station, the exports'
    checks: no torch) and a tensor (training, ONNX tracing) go through the same operations
    in the same order, so the two paths agree to the bit at float64.
    """
    if type(x).__module__.split(".")[0] == "torch":
        import torch

        return torch
    return np


def as_float64(x: Array) -> Array:
    """``x`` as float64 in its own array module (a list or a number: NumPy)."""
    xp = namespace(x)
    return x.to(xp.float64) if xp is not np else np.asarray(x, dtype=np.float64)


#: Within :func:`reused_designs`: the designs formed so far, by input tensor and terms.
_DESIGNS: ContextVar[dict | None] = ContextVar("fedcal_designs", default=None)


@contextmanager
def reused_designs() -> Iterator[None]:
    """Within: :meth:`BasisFamily.products` and :meth:`BasisFamily.linearized` of the same
    input tensor (the same object, not modified since), terms and box return the design
    formed the first time, not a new one (the same operations on the same values: the same
    bits). The evaluation scores one set of rows by its prediction, σ, interval and guard
    (:func:`fedcal.engine.evaluation.errors`), each of which forms the same design; the
    designs are dropped on leaving. A caller must not modify a returned design in place."""
    token = _DESIGNS.set({})
    try:
        yield
    finally:
        _DESIGNS.reset(token)


def _reused(kind: str, x: Array, exponents: Any, bounds: tuple, form: Callable[[], Any]) -> Any:
    """``form()``, or within :func:`reused_designs` the value it gave for this very ``x``
    (identity and version), ``exponents`` and ``bounds`` of the same bits (the box, cloned)."""
    cache = _DESIGNS.get()
    if cache is None or namespace(x) is np:
        return form()
    import torch

    if torch.jit.is_tracing() or x.is_inference():  # a traced graph records operations;
        return form()  # an inference tensor has no version to tell a modified one
    terms = exponents.tolist() if isinstance(exponents, torch.Tensor) else exponents
    key = (kind, id(x), x._version, tuple(tuple(int(a) for a in t) for t in terms))
    hit = cache.get(key)
    if hit is not None and hit[0] is x and all(map(_same_bits, hit[1], bounds)):
        return hit[2]
    out = form()
    cache[key] = (x, tuple(b.clone() for b in bounds), out)  # x held: its id is not reused
    return out


def _same_bits(a: Tensor, b: Tensor) -> bool:
    """Equal tensors, −0 apart from +0 (a box's zero sign reaches the clamped design)."""
    import torch

    return torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))


def _same_array_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal arrays, −0 apart from +0 (NumPy's :func:`_same_bits`)."""
    return bool(np.array_equal(a, b) and np.array_equal(np.signbit(a), np.signbit(b)))


def any_beyond(mask: Array) -> bool:
    """Whether any row lies beyond the support box: always True while tracing (ONNX export).

    The guard's branches are skipped when no row needs them (a saving only: inside the
    box the tangent step is 0 and the model-form gap 0, so the result is the same). A
    traced graph records one path for every later input, so it must hold the guard.
    """
    xp = namespace(mask)
    return (xp is not np and xp.jit.is_tracing()) or bool(mask.any())


def legendre(x: Array, order: int) -> list[Array]:
    """Normalized Legendre values √(2n+1)·P_n(x) for n = 0..order (each shaped like x).

    Bonnet's recurrence (n+1)·P_{n+1} = (2n+1)·x·P_n − n·P_{n−1}, then the
    normalization that gives unit mean square on [-1, 1]. ``x``: a NumPy array or a tensor.
    """
    values = [namespace(x).ones_like(x)]
    if order >= 1:
        values.append(x)
    for n in range(1, order):
        values.append(((2 * n + 1) * x * values[n] - n * values[n - 1]) / (n + 1))
    return [math.sqrt(2 * n + 1) * v for n, v in enumerate(values)]


def legendre_derivatives(x: Array, order: int) -> list[Array]:
    """d/dx √(2n+1)·P_n(x) for n = 0..order: P'_{n+1} = P'_{n−1} + (2n+1)·P_n (P'_0 = 0)."""
    xp = namespace(x)
    values = legendre(x, order)  # normalized: P_n = values[n] / √(2n+1)
    plain = [v / math.sqrt(2 * n + 1) for n, v in enumerate(values)]
    ders = [xp.zeros_like(x)]
    if order >= 1:
        ders.append(xp.ones_like(x))
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
    values: Callable[[Array, int], list[Array]]
    derivatives: Callable[[Array, int], list[Array]]
    normalization: str
    c_lines: Callable[[int], list[str]] | None = None
    # the products in one closed form, where the family has one (monomials: x^e)
    design: Callable[[Tensor, Tensor | Sequence[Sequence[int]]], Tensor] | None = None

    def products(self, x: Array, exponents: Tensor | Sequence[Sequence[int]]) -> Array:
        """φ_k(x) = Π_j p_{a_kj}(x_j) for each exponent tuple: (..., rows, F) → (..., rows, T),
        float64, in ``x``'s array module (a NumPy array or a tensor)."""
        return _reused("products", x, exponents, (), lambda: self._products(x, exponents))

    def _products(self, x: Array, exponents: Tensor | Sequence[Sequence[int]]) -> Array:
        if self.design is not None:
            return self.design(x, exponents)
        if type(exponents).__module__.split(".")[0] == "torch":
            exponents = [tuple(int(a) for a in row) for row in exponents.tolist()]
        x = as_float64(x)
        xp = namespace(x)
        if not exponents:
            return x[..., :0] if xp is np else x.new_zeros(*x.shape[:-1], 0)
        tops = [max(t[j] for t in exponents) for j in range(x.shape[-1])]
        values = [self.values(x[..., j], tops[j]) for j in range(x.shape[-1])]
        cols = []
        for term in exponents:
            # Π over the inputs with a nonzero order, from the first factor itself (1·v is v
            # to the bit: no array of ones and no product with it); none: the constant 1
            factors = [values[j][a] for j, a in enumerate(term) if a]
            col = factors[0] if factors else xp.ones_like(x[..., 0])
            for factor in factors[1:]:
                col = col * factor
            cols.append(col)
        return xp.stack(cols, axis=-1)

    def linearized(
        self, x: Array, exponents: Sequence[Sequence[int]], lo: Array, hi: Array
    ) -> tuple[Array, Array]:
        """The extrapolation guard: ψ(x) = φ(x̄) + J_φ(x̄)·(x − x̄), x̄ = clamp(x, lo, hi).

        Inside the support box [lo, hi] (per input; ``lo``/``hi`` broadcast against x's
        leading axes, e.g. (clients, 1, F)) ψ = φ (:meth:`products`) exactly; beyond it
        the surface continues along its tangent plane at the nearest point of the box (a
        first-order Taylor expansion), so a degree-d polynomial grows linearly away from
        the data instead of as the d-th power. ψ is linear in the coefficients, so a
        posterior's predictive variance ψᵀVψ stays exact for the guarded prediction.
        Returns (ψ (..., rows, terms), outside (..., rows) bool), in ``x``'s array module.
        """
        form = lambda: self._linearized(x, exponents, lo, hi)  # noqa: E731
        return _reused("linearized", x, exponents, (lo, hi), form)

    def _linearized(
        self, x: Array, exponents: Sequence[Sequence[int]], lo: Array, hi: Array
    ) -> tuple[Array, Array]:
        given, x = x, as_float64(x)
        xp = namespace(x)
        if xp is not np:
            lo, hi = lo.to(x.dtype), hi.to(x.dtype)
        inner = xp.maximum(xp.minimum(x, hi), lo)
        step = x - inner
        outside = (step != 0).any(-1)
        if not any_beyond(outside):
            # Nothing clamped: x̄ is x to the bit (its zeros' signs too), so the design is
            # x's own — the one the σ's design of the same rows reuses, not a second one
            # formed from the clamped copy (issue 36.1: the train rows are always inside).
            same = _same_bits(inner, x) if xp is not np else _same_array_bits(inner, x)
            return self.products(given if same else inner, exponents), outside
        phi = self.products(inner, exponents)
        if not exponents:
            return phi, outside
        num_inputs = x.shape[-1]
        tops = [max(t[j] for t in exponents) for j in range(num_inputs)]
        values = [self.values(inner[..., j], tops[j]) for j in range(num_inputs)]
        ders = [self.derivatives(inner[..., j], tops[j]) for j in range(num_inputs)]
        cols = []
        for term in exponents:
            slope = xp.zeros_like(inner[..., 0])
            for j, a in enumerate(term):
                if not a:
                    continue
                part = ders[j][a] * step[..., j]
                for k, b in enumerate(term):
                    if k != j and b:
                        part = part * values[k][b]
                slope = slope + part
            cols.append(slope)
        return phi + xp.stack(cols, axis=-1), outside


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
