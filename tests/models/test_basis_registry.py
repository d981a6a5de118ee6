"""The basis family is a registered object: a new family is one module that registers itself.

The toy family below is such a module (here, a test): the Chebyshev polynomials of the
first kind, T_0 = 1, T_1 = x, T_{n+1} = 2x·T_n − T_{n−1}, with no C form. Registered, it
runs through leastsq's fit and predict, spans what the shipped families span, and the C
exporter refuses it in one line; the JSON form carries its normalization.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcal.algorithms.leastsq import LeastSquares, total_degree_exponents
from fedcal.core.algorithm import SettingError
from fedcal.core.data import ClientData
from fedcal.core.task import Task
from fedcal.core.tree import expand
from fedcal.models import basis
from fedcal.models.basis import (
    FAMILIES,
    LEGENDRE,
    MONOMIAL,
    BasisFamily,
    basis_family,
    legendre_products,
    register_family,
)
from fedcal.models.mlp import MLP
from fedcal.report.linear_c import c_header
from fedcal.report.linear_export import LinearForm

F64 = torch.float64


def chebyshev(x: torch.Tensor, order: int) -> list[torch.Tensor]:
    values = [torch.ones_like(x), x][: order + 1]
    for _ in range(2, order + 1):
        values.append(2 * x * values[-1] - values[-2])
    return values


def chebyshev_derivatives(x: torch.Tensor, order: int) -> list[torch.Tensor]:
    # T_n' = n U_{n-1}; U_0 = 1, U_1 = 2x, U_{n+1} = 2x U_n − U_{n−1}
    u = [torch.ones_like(x), 2 * x]
    for _ in range(2, order):
        u.append(2 * x * u[-1] - u[-2])
    return [torch.zeros_like(x), *(n * u[n - 1] for n in range(1, order + 1))]


TOY = BasisFamily("chebyshev_toy", chebyshev, chebyshev_derivatives, "T_n(u), Chebyshev")


@pytest.fixture
def toy(monkeypatch):
    """The toy family registered for one test (the registry is restored afterwards)."""
    monkeypatch.delitem(basis.FAMILIES, TOY.name, raising=False)  # removed again afterwards
    assert register_family(TOY) is TOY and basis_family(TOY.name) is TOY
    assert register_family(TOY) is TOY  # registering the same object twice is harmless
    yield TOY
    basis.FAMILIES.pop(TOY.name, None)


def test_the_shipped_families_are_registered_and_legendre_products_is_legendre() -> None:
    assert FAMILIES["legendre"] is LEGENDRE and FAMILIES["monomial"] is MONOMIAL
    x = torch.tensor([[0.3, -0.7]], dtype=F64)
    got = legendre_products(x, [(0, 0), (1, 0), (2, 1)])[0]
    # √3·x, √5·(3x²−1)/2 · √3·y, by hand
    want = [1.0, 3**0.5 * 0.3, 5**0.5 * (3 * 0.09 - 1) / 2 * 3**0.5 * -0.7]
    assert torch.allclose(got, torch.tensor(want, dtype=F64), rtol=1e-15, atol=1e-15)
    with pytest.raises(ValueError, match="unknown basis family 'cheb'; known: legendre, mono"):
        basis_family("cheb")
    with pytest.raises(ValueError, match="already registered"):
        register_family(BasisFamily("legendre", chebyshev, chebyshev_derivatives, ""))


def test_the_toy_family_by_hand(toy) -> None:
    x = torch.tensor([0.5, -0.25], dtype=F64)
    t = toy.values(x, 3)
    assert torch.allclose(t[3], 4 * x**3 - 3 * x)  # T_3 = 4x³ − 3x
    d = toy.derivatives(x, 3)
    assert torch.allclose(d[3], 12 * x**2 - 3) and torch.allclose(d[2], 4 * x)
    phi = toy.products(x.reshape(1, 2), [(0, 0), (2, 1)])[0]
    assert torch.allclose(phi, torch.tensor([1.0, (2 * 0.25 - 1) * -0.25], dtype=F64))


def cohort(rows: list[int], seed: int = 0) -> tuple[ClientData, torch.Tensor]:
    """3-input units whose targets are each a planted quadratic (monomial coefficients)."""
    gen = torch.Generator().manual_seed(seed)
    n, r = len(rows), max(rows)
    x = 2 * torch.rand(n, r, 3, generator=gen, dtype=F64) - 1
    coef = torch.randn(n, 10, generator=gen, dtype=F64)
    y = (MONOMIAL.products(x, total_degree_exponents(3, 2)) * coef.unsqueeze(1)).sum(-1)
    count = torch.tensor(rows)
    mask = torch.arange(r) < count.unsqueeze(1)
    return ClientData(x, y.unsqueeze(-1), count, tuple(range(n))), mask


def fit_predict(alg: LeastSquares, data: ClientData, x: torch.Tensor) -> torch.Tensor:
    n = data.num_clients
    server = alg.server_init({})
    down = expand(alg.broadcast(server), n)
    result = alg.client_update(down, alg.client_init(down), data)
    server = alg.server_update(server, result.reply, data.count)
    personal = alg.personalize(expand(alg.broadcast(server), n), result.state, data)
    return alg.predict(personal, x)[..., 0]


@pytest.mark.parametrize("pooled", [False, True])
def test_a_registered_family_runs_through_fit_and_predict(toy, pooled) -> None:
    """Total degree 2 in any of the three families spans the same quadratics: the fitted
    predictions agree (the per-sensor fit recovers each planted surface exactly)."""
    data, mask = cohort([14, 20, 17])
    test = 2 * torch.rand(3, 9, 3, generator=torch.Generator().manual_seed(5), dtype=F64) - 1
    task = Task(MLP(in_features=3))
    got = {
        family: fit_predict(
            LeastSquares(task, ridge=1e-13, pooled=pooled, family=family), data, test
        )
        for family in ("monomial", "legendre", TOY.name)
    }
    assert torch.allclose(got[TOY.name], got["monomial"], atol=1e-7)
    assert torch.allclose(got["legendre"], got["monomial"], atol=1e-7)
    if not pooled:
        train = fit_predict(LeastSquares(task, ridge=1e-13, family=TOY.name), data, data.x)
        assert torch.allclose(train[mask], data.y[..., 0][mask], atol=1e-7)


def test_an_unknown_family_is_refused_in_one_line() -> None:
    with pytest.raises(SettingError, match="unknown basis family 'toy'; known: legendre"):
        LeastSquares(Task(MLP(in_features=3)), family="toy")


def _form(family: str) -> LinearForm:
    terms = total_degree_exponents(2, 2).numpy()
    return LinearForm(
        method="leastsq",
        basis=family,
        terms=terms,
        coef=np.zeros((1, len(terms))),
        lo=None,
        hi=None,
        factor=None,
        add_var=None,
        sensors=("A",),
    )


def test_the_c_export_refuses_a_family_without_a_c_form(toy) -> None:
    with pytest.raises(
        ValueError,
        match=r"C export: the basis family 'chebyshev_toy' of "
        r"leastsq has no C form \(fedcal.models.basis.BasisFamily.c_lines\)",
    ):
        c_header(None, _form(TOY.name), "FEDCAL_H", [])
    form = _form(TOY.name)  # the NumPy form (JSON, check_form) reads the family's values
    phi = form.features(np.array([[0.5, -0.5]]), 0)
    assert np.allclose(phi[0], [1, 0.5, -0.5, -0.5, -0.25, -0.5])  # T_2(±½) = −½


def test_the_shipped_families_c_forms_are_the_recurrences_written_once() -> None:
    lines = LEGENDRE.c_lines(3)
    assert lines[0].startswith("static const double fedcal_norm[FEDCAL_MAX_ORDER + 1] = {")
    assert f"{7**0.5:.17e}" in lines[0]  # √(2·3+1)
    assert any("p[n] = p[n - 1] * u" in line for line in MONOMIAL.c_lines(3))
