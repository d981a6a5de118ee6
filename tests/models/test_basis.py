"""The basis model: its fixed terms, its backward pass, its span, and the algorithm contract."""

import math

import numpy as np
import pytest
import torch
from numpy.polynomial import legendre as npleg

from fedcal.algorithms.fedavg import FedAvg
from fedcal.algorithms.fedgmi import FedGMI
from fedcal.algorithms.local import LocalOnly
from fedcal.core.data import client_round_seed
from fedcal.core.local import value_and_grad
from fedcal.core.task import Task
from fedcal.core.tree import expand, flatten, gather
from fedcal.engine.simulation import prepare
from fedcal.models import FAMILIES, build_model
from fedcal.models.basis import Basis, legendre, orders_by_size, whitened

F64 = torch.float64


def test_legendre_hand_values():
    """P_0..P_3 at x = 0.5: 1, 0.5, (3·0.25 − 1)/2 = −0.125, (5·0.125 − 3·0.5)/2 = −0.4375;
    normalized by √(2n+1). At ±1, P_n = (±1)^n."""
    x = torch.tensor([0.5, 1.0, -1.0], dtype=F64)
    got = torch.stack(legendre(x, 3))  # (order + 1, points)
    raw = torch.tensor(
        [[1.0, 1.0, 1.0], [0.5, 1.0, -1.0], [-0.125, 1.0, 1.0], [-0.4375, 1.0, -1.0]], dtype=F64
    )
    norm = torch.tensor([1.0, math.sqrt(3), math.sqrt(5), math.sqrt(7)], dtype=F64)
    assert torch.allclose(got, raw * norm.unsqueeze(1), atol=1e-15)


def test_normalized_legendre_is_orthonormal_on_uniform_measure():
    """(1/2)∫_{-1}^{1} P̃_m P̃_n dx = δ_mn, by 20-point Gauss–Legendre quadrature (exact here)."""
    nodes, weights = npleg.leggauss(20)
    vals = torch.stack(legendre(torch.as_tensor(nodes), 6))  # (7, 20)
    gram = (vals * torch.as_tensor(weights) / 2) @ vals.T
    assert torch.allclose(gram, torch.eye(7, dtype=F64), atol=1e-13)


def test_terms_are_products_in_documented_order():
    """orders (2, 1): terms (0,1), (1,0), (1,1), (2,0), (2,1); at (a, t) = (0.5, −0.3):
    P̃_1(t) = √3·(−0.3), P̃_1(a) = √3·0.5, P̃_2(a) = √5·(−0.125)."""
    model = Basis(poly_orders=(2, 1), hidden=())
    assert model.terms == [(0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    x = torch.tensor([[[0.5, -0.3]]], dtype=F64)
    s3, s5 = math.sqrt(3), math.sqrt(5)
    a1, a2, t1 = s3 * 0.5, s5 * -0.125, s3 * -0.3
    expected = torch.tensor([t1, a1, a1 * t1, a2, a2 * t1], dtype=F64)
    assert torch.allclose(model.polynomial_terms(x)[0, 0], expected, atol=1e-15)


def test_orders_by_size_lists_the_grid_fewest_terms_first():
    """Sizes Π(o_k + 1): (0,0) 1, (0,1) 2, (1,0) 2, (2,0) 3, (1,1) 4, (2,1) 6; ties by
    lexicographic order. From 1: (1,1) 4, (1,2) 6, (2,1) 6, (3,1) 8, (2,2) 9, (3,2) 12."""
    assert orders_by_size((2, 1)) == [(0, 0), (0, 1), (1, 0), (2, 0), (1, 1), (2, 1)]
    assert orders_by_size((3, 2), lowest=1) == [(1, 1), (1, 2), (2, 1), (3, 1), (2, 2), (3, 2)]
    assert orders_by_size((2,)) == [(0,), (1,), (2,)] and orders_by_size((0, 0)) == [(0, 0)]
    assert orders_by_size((1, 2), lowest=3) == []


def test_apply_matches_numpy_legendre_reference():
    """Head over the fixed terms + MLP features, recomputed with numpy's legval and matmuls."""
    model = Basis(poly_orders=(3, 2), hidden=(5,))
    gen = torch.Generator().manual_seed(4)
    params = {
        k: v + 0.3 * torch.randn(2, *v.shape, generator=gen, dtype=F64)
        for k, v in model.init(gen, F64).items()
    }
    x = 2 * torch.rand(2, 7, 2, generator=gen, dtype=F64) - 1
    out = model.apply(params, x)
    for c in range(2):
        xc = x[c].numpy()
        cols = []
        for i, j in model.terms:
            ci, cj = np.eye(4)[i] * math.sqrt(2 * i + 1), np.eye(3)[j] * math.sqrt(2 * j + 1)
            cols.append(npleg.legval(xc[:, 0], ci) * npleg.legval(xc[:, 1], cj))
        hidden = np.tanh(xc @ params["l0.weight"][c].numpy().T + params["l0.bias"][c].numpy())
        feats = np.concatenate([np.stack(cols, 1), hidden], 1)
        ref = feats @ params["head.weight"][c].numpy().T + params["head.bias"][c].numpy()
        assert np.allclose(out[c].numpy(), ref, atol=1e-12)


HEAD_ONLY = [None, ("head.weight", "head.bias")]
WITH_MLP = [*HEAD_ONLY, ("l0.weight",), ("l0.bias", "head.weight")]


@pytest.mark.parametrize(
    "hidden,wrt",
    [((6, 5), w) for w in WITH_MLP] + [((4,), w) for w in WITH_MLP] + [((), w) for w in HEAD_ONLY],
)
def test_hand_written_backward_equals_autograd(hidden, wrt):
    model = Basis(poly_orders=(3, 3), hidden=hidden, activation="tanh")
    task = Task(model)
    gen = torch.Generator().manual_seed(1)
    params = {
        k: v + 0.1 * torch.randn(3, *v.shape, generator=gen, dtype=F64)
        for k, v in model.init(gen, F64).items()
    }
    x = 2 * torch.rand(3, 8, 2, generator=gen, dtype=F64) - 1
    y = torch.randn(3, 8, 1, generator=gen, dtype=F64)
    w = torch.ones(3, 8, dtype=F64)
    w[1, 5:] = 0  # padding
    w[2] = 0  # a client without rows
    value, grads = model.mse_value_and_grad(params, x, y, w, wrt)
    ref_value, ref_grads = value_and_grad(lambda p: task.loss(p, x, y, w), params, wrt)
    assert torch.allclose(value, ref_value, atol=1e-14)
    assert list(grads) == list(ref_grads)
    for k in grads:
        assert torch.allclose(grads[k], ref_grads[k], atol=1e-13), k
    assert all(torch.all(g[2] == 0) for g in grads.values())


@pytest.mark.parametrize("activation", ["relu", "silu"])
def test_hand_written_backward_other_activations(activation):
    model = Basis(hidden=(5, 4), activation=activation)
    gen = torch.Generator().manual_seed(2)
    params = {
        k: v + 0.1 * torch.randn(2, *v.shape, generator=gen, dtype=F64)
        for k, v in model.init(gen, F64).items()
    }
    x = 2 * torch.rand(2, 9, 2, generator=gen, dtype=F64) - 1
    y = torch.randn(2, 9, 1, generator=gen, dtype=F64)
    w = torch.ones(2, 9, dtype=F64)
    _, grads = model.mse_value_and_grad(params, x, y, w)
    _, ref = value_and_grad(lambda p: Task(model).loss(p, x, y, w), params)
    assert all(torch.allclose(grads[k], ref[k], atol=1e-13) for k in ref)


def test_least_squares_head_reproduces_a_known_polynomial():
    """y = Σ c_ij a^i t^j (monomials, i, j ≤ 3) lies in the span of the fixed terms: with the
    MLP's output weights at zero and the head set to the least-squares coefficients, the model
    equals the polynomial at new points (exactly, up to rounding)."""
    model = Basis(poly_orders=(3, 3), hidden=(8, 8))
    gen = torch.Generator().manual_seed(0)
    coef = torch.randn(4, 4, generator=gen, dtype=F64)

    def poly(x):
        a, t = x[..., 0:1], x[..., 1:2]
        return sum(coef[i, j] * a**i * t**j for i in range(4) for j in range(4))

    x_fit = 2 * torch.rand(1, 40, 2, generator=gen, dtype=F64) - 1
    x_new = 2 * torch.rand(1, 25, 2, generator=gen, dtype=F64) - 1
    params = expand(model.init(gen, F64), 1)
    design = torch.cat([model.polynomial_terms(x_fit)[0], torch.ones(40, 1, dtype=F64)], 1)
    sol = torch.linalg.lstsq(design, poly(x_fit)[0]).solution  # (16, 1)
    n = len(model.terms)
    head = torch.zeros(1, 1, model.num_features, dtype=F64)
    head[0, 0, :n] = sol[:n, 0]
    params = {**params, "head.weight": head, "head.bias": sol[n:, 0].reshape(1, 1)}
    assert torch.allclose(model.apply(params, x_new), poly(x_new), atol=1e-11)
    # A degree the basis does not hold (a⁴) is not reproduced: the test can fail.
    quartic = x_fit[..., 0:1] ** 4
    sol4 = torch.linalg.lstsq(design, quartic[0]).solution
    assert (design @ sol4 - quartic[0]).abs().max() > 1e-3


def test_structure_init_and_split():
    model = Basis(poly_orders=(3, 3), hidden=(16, 8))
    assert len(model.terms) == 15 and model.num_features == 15 + 8
    params = model.init(torch.Generator().manual_seed(0), torch.float32)
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    assert shapes == {
        "l0.weight": (16, 2),
        "l0.bias": (16,),
        "l1.weight": (8, 16),
        "l1.bias": (8,),
        "head.weight": (1, 23),
        "head.bias": (1,),
    }
    assert all(v.dtype == torch.float32 for v in params.values())
    assert list(params) == [n for layer in model.layers() for n in layer]  # no fixed terms
    assert torch.all(params["head.weight"][:, :15] == 0)  # polynomial coefficients start at 0
    assert params["head.weight"][:, 15:].abs().max() <= 1 / math.sqrt(23)
    same = model.init(torch.Generator().manual_seed(0), torch.float32)
    other = model.init(torch.Generator().manual_seed(1), torch.float32)
    assert all(torch.equal(params[k], same[k]) for k in params)
    assert not torch.equal(params["l0.weight"], other["l0.weight"])
    task = Task(model)
    assert task.head == ("head.weight", "head.bias")
    assert task.body == ("l0.weight", "l0.bias", "l1.weight", "l1.bias")
    out = model.apply(expand(params, 3), torch.zeros(3, 5, 2))
    assert out.shape == (3, 5, 1)
    pure = Basis(hidden=())
    assert Task(pure).body == () and set(pure.init(torch.Generator(), F64)) == {
        "head.weight",
        "head.bias",
    }


def test_build_model_and_bad_settings():
    assert "basis" in FAMILIES
    model = build_model("basis", 2, 1, hidden=(4,), activation="silu", poly_orders=(4, 3))
    assert model == Basis(2, (4, 3), (4,), 1, "silu")
    assert build_model("mlp", 2, 1, hidden=[3]).hidden == (3,)  # unchanged signature
    with pytest.raises(ValueError):
        Basis(in_features=2, poly_orders=(3,))
    with pytest.raises(ValueError):
        Basis(activation="cosine")
    with pytest.raises(ValueError):
        build_model("spline", 2, 1)


@pytest.mark.parametrize("cls", [FedAvg, FedGMI, LocalOnly])
@pytest.mark.parametrize("hidden", [(5, 4), ()])
def test_cohort_equals_each_client_alone(cls, hidden, make_fleet):
    """The contract with this model inside a Task (float64)."""
    clients = 3
    fleet = prepare(make_fleet(num_clients=clients, train=[11, 6, 9]), dtype="float64")
    alg = cls(Task(Basis(hidden=hidden)), lr=0.05, local_epochs=2, batch_size=4)
    server = alg.server_init(alg.task.model.init(torch.Generator().manual_seed(0), F64))
    down = alg.broadcast(server)
    states = alg.client_init(expand(down, clients))
    seeds = tuple(client_round_seed(0, 0, c) for c in range(clients))
    data = fleet.train.with_seeds(seeds)
    together = alg.client_update(expand(down, clients), states, data)
    for c in range(clients):
        idx = torch.tensor([c])
        alone = alg.client_update(expand(down, 1), gather(states, idx), data.select(idx))
        for mine, theirs in ((together.reply, alone.reply), (together.state, alone.state)):
            fa, fb = flatten(gather(mine, idx)), flatten(theirs)
            assert fa.keys() == fb.keys()
            assert all(torch.allclose(fa[k], fb[k], rtol=0, atol=1e-10) for k in fa)
    # Training moved the model (the comparison above is not between untouched trees).
    trained = flatten(together.state or together.reply)
    start = flatten(expand(down, clients))
    assert any(not torch.allclose(trained[k], start[k]) for k in trained)


def test_whitening_hand_computed():
    """One input, order 1: the only term is √3·x. Clients x = [-1, 0] and [1]: pooled mean 0,
    variance 3·(1 + 0 + 1)/3 = 2 → φ' = √3·x/√2; at x = 1 that is √1.5."""
    model = whitened(
        Basis(1, (1,), hidden=()), [np.array([[-1.0], [0.0]]), np.array([[1.0]]), np.zeros((0, 1))]
    )
    assert model.poly_center == (0.0,) and model.poly_transform[0][0] == pytest.approx(0.5**0.5)
    x = torch.tensor([[[1.0]]], dtype=F64)
    assert model.polynomial_terms(x).item() == pytest.approx(1.5**0.5, abs=1e-15)


def test_whitened_terms_are_centred_and_decorrelated_over_the_fleet():
    """Over the pooled rows the whitened terms have mean 0 and identity covariance, whatever
    the split into clients (only per-client sums are used), and whitening twice changes
    nothing (the raw terms are used)."""
    gen = torch.Generator().manual_seed(5)
    # Clients on sub-ranges of the first input, as sensors are on the frequency scale.
    xs = [
        torch.stack(
            [
                lo + 0.6 * torch.rand(40, generator=gen, dtype=F64),
                2 * torch.rand(40, generator=gen, dtype=F64) - 1,
            ],
            1,
        )
        for lo in (-0.1, 0.0, 0.3)
    ]
    model = whitened(Basis(poly_orders=(3, 3), hidden=()), xs)
    terms = model.polynomial_terms(torch.cat(xs).unsqueeze(0))[0]
    assert torch.allclose(terms.mean(0), torch.zeros(15, dtype=F64), atol=1e-10)
    cov = terms.T @ terms / len(terms)
    assert torch.allclose(cov, torch.eye(15, dtype=F64), atol=1e-8)
    pooled = whitened(Basis(poly_orders=(3, 3), hidden=()), [torch.cat(xs)])
    assert np.allclose(pooled.poly_transform, model.poly_transform, atol=1e-9)
    assert np.allclose(whitened(model, xs).poly_transform, model.poly_transform, atol=1e-9)
    raw = Basis(poly_orders=(3, 3), hidden=()).polynomial_terms(xs[0].unsqueeze(0))[0]
    ev = torch.linalg.eigvalsh(raw.T @ raw / 40)
    assert ev.max() / ev.min() > 1e3  # what whitening is for: a badly conditioned client


def test_whitened_model_spans_the_same_polynomials():
    """The whitened basis is an invertible affine map of the raw one: a least-squares head
    still reproduces a cubic × cubic polynomial exactly."""
    gen = torch.Generator().manual_seed(6)
    coef = torch.randn(4, 4, generator=gen, dtype=F64)
    x = torch.rand(1, 50, 2, generator=gen, dtype=F64) - 0.2
    x_new = torch.rand(1, 20, 2, generator=gen, dtype=F64) - 0.2
    model = whitened(Basis(poly_orders=(3, 3), hidden=()), [x[0]])

    def poly(x):
        return sum(
            coef[i, j] * x[..., 0:1] ** i * x[..., 1:2] ** j for i in range(4) for j in range(4)
        )

    design = torch.cat([model.polynomial_terms(x)[0], torch.ones(50, 1, dtype=F64)], 1)
    sol = torch.linalg.lstsq(design, poly(x)[0]).solution
    params = {"head.weight": sol[:15].T.unsqueeze(0), "head.bias": sol[15:].T}
    assert torch.allclose(model.apply(params, x_new), poly(x_new), atol=1e-9)


def test_whitening_settings_are_checked():
    with pytest.raises(ValueError):
        Basis(poly_orders=(1, 1), hidden=(), poly_center=(0.0, 0.0, 0.0))
    with pytest.raises(ValueError):
        Basis(poly_orders=(1, 1), hidden=(), poly_center=(0.0,), poly_transform=((1.0,),))
    with pytest.raises(ValueError):
        Basis(poly_domain=((1.0, -1.0), (-1.0, 1.0)))
    with pytest.raises(ValueError):
        whitened(Basis(), [np.zeros((0, 2))])


def test_poly_domain_maps_onto_legendre_interval():
    """Domain [0, 1] for input 0: x = 0.75 ↦ u = 0.5, so the term (1, 0) is √3·0.5."""
    model = Basis(poly_orders=(1, 0), hidden=(), poly_domain=((0.0, 1.0), (-1.0, 1.0)))
    x = torch.tensor([[[0.75, 0.2]]], dtype=F64)
    assert model.polynomial_terms(x).item() == pytest.approx(3**0.5 * 0.5, abs=1e-15)


def test_numpy_and_torch_inputs_take_the_one_formula_to_the_bit():
    """The station's NumPy basis (fedcal.prior.legendre) and the torch one (models.basis) are
    one formula (families.LEGENDRE) on either array type: the same operations in the same
    order, so φ and the guarded ψ are equal to the bit, inside the box and beyond it (ψ
    there is hand-checked for one input: φ(1) + φ'(1)·(x − 1) at x = 1.5)."""
    from fedcal.models.basis import legendre_exponents, legendre_products, linearized_products
    from fedcal.prior import legendre as np_legendre

    terms = legendre_exponents(2, orders=(3, 2))
    x = np.random.default_rng(0).uniform(-1.6, 1.6, (3, 7, 2))
    lo, hi = np.full((3, 1, 2), -1.0), np.full((3, 1, 2), 1.0)
    np.testing.assert_array_equal(
        np_legendre.legendre_products(x, terms), legendre_products(torch.as_tensor(x), terms)
    )
    psi_np, out_np = np_legendre.linearized_products(x, terms, lo, hi)
    psi_t, out_t = linearized_products(torch.as_tensor(x), terms, *map(torch.as_tensor, (lo, hi)))
    np.testing.assert_array_equal(psi_np, psi_t.numpy())
    np.testing.assert_array_equal(out_np, out_t.numpy())
    assert out_np.any() and not out_np.all()
    one = np_legendre.linearized_products(np.array([[1.5]]), [(0,), (1,), (2,)], -1.0, 1.0)[0]
    # P̃_1 = √3 x (slope √3); P̃_2 = √5 (3x² − 1)/2 (value √5 and slope 3√5 at 1)
    np.testing.assert_allclose(one[0], [1.0, 1.5 * math.sqrt(3), math.sqrt(5) * 2.5], rtol=1e-15)
    assert np_legendre.legendre_products(x, []).shape == (3, 7, 0)
