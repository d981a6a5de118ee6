"""``reused_designs``: a design formed once per input tensor, terms and box, the same bits."""

from __future__ import annotations

import numpy as np
import torch

from fedcal.models import families
from fedcal.models.basis import legendre_products, linearized_products
from fedcal.models.families import reused_designs

TERMS = [(0, 0), (1, 0), (0, 1), (2, 1)]


def test_products_are_formed_once_per_tensor_and_equal_the_fresh_ones(monkeypatch):
    x = torch.linspace(-1.0, 1.0, 12, dtype=torch.float32).reshape(2, 3, 2)
    fresh = legendre_products(x, TERMS)
    calls = []
    form = families.BasisFamily._products
    monkeypatch.setattr(families.BasisFamily, "_products", lambda *a: calls.append(1) or form(*a))
    with reused_designs():
        first = legendre_products(x, TERMS)
        again = legendre_products(x, TERMS)
        assert again is first and len(calls) == 1  # the second call formed nothing
        assert torch.equal(first, fresh)  # the same bits as outside
        # other terms, another tensor of equal values, or x modified: formed again
        legendre_products(x, TERMS[:2])
        legendre_products(x.clone(), TERMS)
        assert len(calls) == 3
        x.mul_(0.5)
        halved = legendre_products(x, TERMS)
        assert len(calls) == 4 and torch.equal(halved, form(families.LEGENDRE, x, TERMS))
    legendre_products(x, TERMS)  # outside: nothing kept
    assert len(calls) == 5 and families._DESIGNS.get() is None


def test_linearized_is_reused_only_for_an_equal_box():
    x = torch.tensor([[[-2.0, 0.0], [0.5, 0.5], [3.0, -0.2]]], dtype=torch.float64)
    lo = torch.tensor([[[-1.0, -1.0]]], dtype=torch.float64)
    hi = torch.tensor([[[1.0, 1.0]]], dtype=torch.float64)
    fresh = linearized_products(x, TERMS, lo, hi)
    with reused_designs():
        psi, out = linearized_products(x, TERMS, lo, hi)
        # an equal box in other tensors (fedprior slices its box anew each call): reused
        assert linearized_products(x, TERMS, lo.clone(), hi.clone())[0] is psi
        wider = linearized_products(x, TERMS, lo, 2 * hi)
        signed = torch.tensor([[[-1.0, -0.0]]], dtype=torch.float64)  # equal to (−1, 0)
        zero = torch.tensor([[[-1.0, 0.0]]], dtype=torch.float64)
        first = linearized_products(x, TERMS, signed, hi)[0]
        assert linearized_products(x, TERMS, zero, hi)[0] is not first  # −0 is not +0
    assert torch.equal(psi, fresh[0]) and torch.equal(out, fresh[1])
    assert out.tolist() == [[True, False, True]]  # rows 1 and 3 beyond the box
    assert wider[1].tolist() == [[True, False, True]] and not torch.equal(wider[0], psi)
    # x₁ = 3 against hi = 1: ψ of (1, 1)·(x₂ = −0.2) continued along the tangent: for the
    # term (1, 0) P̃₁(x) = √3 x, so ψ = √3 (1 + (3 − 1)) = 3√3
    assert torch.isclose(psi[0, 2, 1], torch.tensor(3.0 * 3.0**0.5, dtype=torch.float64))


def test_numpy_inputs_are_never_kept():
    x = np.linspace(-1.0, 1.0, 6).reshape(3, 2)
    with reused_designs():
        a = families.LEGENDRE.products(x, TERMS)
        b = families.LEGENDRE.products(x, TERMS)
    assert a is not b and np.array_equal(a, b)


def test_inference_tensors_are_formed_each_time():
    """An inference-mode tensor has no version counter (an in-place change is invisible)."""
    with torch.inference_mode():
        x = torch.linspace(-1.0, 1.0, 6, dtype=torch.float64).reshape(1, 3, 2)
    with reused_designs():
        a, b = legendre_products(x, TERMS), legendre_products(x, TERMS)
    assert a is not b and torch.equal(a, b)


def test_products_equal_the_product_started_from_one_to_the_bit():
    """φ_k = Π_j p_{a_kj}(x_j) formed from its first factor equals 1·p·p… (the former form)
    bit for bit, −0, ∞ and NaN readings included, for a tensor and a NumPy array."""
    terms = [(0, 0), (1, 0), (0, 1), (2, 1), (4, 3), (0, 4)]
    x = torch.randn(5, 7, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x[0, 0] = torch.tensor([-0.0, float("nan")])
    x[0, 1] = torch.tensor([float("inf"), 0.0])
    for arr, xp, as_int in ((x, torch, torch.int64), (x.numpy(), np, np.int64)):
        want, got = _both_forms(arr, xp, terms)
        assert (got.view(as_int) == want.view(as_int)).all()


def _both_forms(arr, xp, terms):
    """(the former 1·p·p… form, ``products``) of ``arr`` (NaN readings: no warnings)."""
    with np.errstate(invalid="ignore"):
        values = [families.LEGENDRE.values(arr[..., j], 4) for j in range(2)]
        cols = []
        for term in terms:
            col = xp.ones_like(arr[..., 0])
            for j, a in enumerate(term):
                col = col * values[j][a] if a else col
            cols.append(col)
        return xp.stack(cols, -1), families.LEGENDRE.products(arr, terms)


def test_rows_inside_the_box_share_their_own_design_with_the_sigma():
    """Nothing clamped (a unit's train rows, inside its own box): the guard's design is x's
    own, the one ``legendre_products(x)`` (the σ's design) then reuses — formed once, not
    again from the clamped copy — and it equals the clamped copy's design to the bit. A
    −0 reading clamped to a +0 edge is not the same bits: its design is the clamped one."""
    x = torch.tensor([[[-0.5, 0.25], [0.75, -1.0]]], dtype=torch.float32)
    lo = torch.tensor([[[-1.0, -1.0]]], dtype=torch.float64)
    hi = torch.tensor([[[1.0, 1.0]]], dtype=torch.float64)
    clamped = legendre_products(torch.maximum(torch.minimum(x.double(), hi), lo), TERMS)
    with reused_designs():
        psi, out = linearized_products(x, TERMS, lo, hi)
        assert legendre_products(x, TERMS) is psi and not out.any()
    assert torch.equal(psi, clamped)
    # a zero reading at a zero edge, of either sign: the design of the clamped copy, sign
    # of zero included (whichever the clamp keeps, the guard's design has its bits)
    terms = [(1, 0), (1, 1)]
    for value in (-0.0, 0.0):
        for edge in (-0.0, 0.0):
            x0 = torch.tensor([[[value, 0.5]]], dtype=torch.float64)
            at = torch.tensor([[[edge, -1.0]]], dtype=torch.float64)  # x₁'s edge at ±0
            for box in ((at, hi), (lo, torch.tensor([[[edge, 1.0]]], dtype=torch.float64))):
                want = legendre_products(torch.maximum(torch.minimum(x0, box[1]), box[0]), terms)
                with reused_designs():
                    psi, out = linearized_products(x0, terms, *box)
                assert not out.any() and torch.equal(psi, want)
                assert torch.equal(torch.signbit(psi), torch.signbit(want))
