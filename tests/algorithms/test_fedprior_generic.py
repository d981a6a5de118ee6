"""fedprior on generic features (issue 26): never a crash, bounded basis, guarded extrapolation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcal.algorithms.fedprior import FedPrior
from fedcal.core import bayes
from fedcal.core.bayes import F64, JITTERS, safe_cholesky
from fedcal.core.data import ClientData
from fedcal.core.task import Task
from fedcal.models.basis import MAX_TERMS, legendre_exponents, legendre_products
from fedcal.models.mlp import MLP
from fedcal_support.rounds import run_rounds


def collinear_fleet(num_inputs: int, units: int = 10, rows: int = 400, seed: int = 0):
    """Every input a copy of one column but the last (8 inputs) or all (2 inputs), and no
    noise: the Gram of any polynomial basis is singular and σ² → 0 (what made Cholesky
    fail on a real hourly network)."""
    rng = np.random.default_rng(seed)
    arrays = []
    for i in range(units):
        base = rng.uniform(-1, 1, rows)
        cols = [base] * num_inputs if num_inputs == 2 else [base] * (num_inputs - 1)
        if num_inputs != 2:
            cols = [*cols, rng.uniform(-1, 1, rows)]
        x = np.stack(cols, 1)
        y = (1 + 0.1 * i) * base + 0.3 * x[:, -1] ** 2
        arrays.append((x, y[:, None]))
    return ClientData.from_arrays(arrays, tuple(range(units)), F64)


@pytest.mark.parametrize(
    ("num_inputs", "params", "needs_help"),
    [
        # The barometer's tensor on 2 generic inputs: whether its Cholesky needs a jitter
        # depends on the last bits of the sums (it did with lane-split sums, not with
        # running sums), so only the report is checked there, not that help was needed.
        (2, {"orders": (4, 3), "select": "bic"}, False),
        (2, {"basis": "total", "degree": 2}, True),
        (8, {"basis": "total", "degree": 2, "select": "bic"}, True),
        (8, {"basis": "total", "degree": 2, "noise": "sensor"}, True),
    ],
)
def test_a_near_singular_gram_neither_crashes_nor_hides_the_jitter(
    num_inputs, params, needs_help, monkeypatch
):
    used_in_posterior: list[float] = []
    real = bayes.safe_cholesky

    def recording(a, **options):  # options: safe_cholesky's own (symmetric=)
        chol, used = real(a, **options)
        used_in_posterior.append(float(used.max()) if used.numel() else 0.0)
        return chol, used

    monkeypatch.setattr(bayes, "safe_cholesky", recording)  # what _whitened factors
    data = collinear_fleet(num_inputs)
    alg = FedPrior(Task(MLP(in_features=num_inputs)), **params)
    _, _, personal, metrics = run_rounds(alg, data, 8)
    jitter = torch.stack([m["jitter"] for m in metrics])
    # Never invented: a reported jitter is one a factorization used (and where the Gram
    # is singular whatever the rounding, help was needed and is reported).
    assert float(jitter.max()) <= max(used_in_posterior)
    if needs_help:
        assert float(jitter.max()) > 0  # the factorization needed help, and says so
    assert set(jitter.unique().tolist()) <= {0.0, 1.0, *JITTERS}
    pred = alg.predict(personal, data.x)
    assert torch.isfinite(pred).all()
    # The fit is still the planted surface (exact data): within 1 % of the target's scale.
    err = (pred - data.y).abs().max()
    assert float(err) < 0.01 * float(data.y.abs().max())


def test_safe_cholesky_is_plain_cholesky_when_that_works_and_floors_otherwise():
    a = torch.tensor([[4.0, 2.0], [2.0, 3.0]], dtype=F64).expand(2, 2, 2).clone()
    chol, used = safe_cholesky(a)
    torch.testing.assert_close(chol, torch.linalg.cholesky(a), rtol=0, atol=0)
    assert used.tolist() == [0.0, 0.0]
    a[1] = torch.tensor([[1.0, 1.0], [1.0, 1.0 - 1e-9]], dtype=F64)  # indefinite by 1e-9
    chol, used = safe_cholesky(a)
    assert used[0] == 0 and used[1] > 0
    rebuilt = chol[1] @ chol[1].T
    assert torch.allclose(rebuilt, a[1], atol=1e-6 * 1.01)  # a jitter ≤ 1e-6 of the diagonal
    nan = torch.full((1, 2, 2), torch.nan, dtype=F64)
    assert torch.isnan(safe_cholesky(nan)[0]).all()  # a diverged matrix stays NaN


def test_a_basis_larger_than_the_limit_is_refused_in_one_line_before_any_allocation():
    with pytest.raises(ValueError, match=r"390,625 terms") as err:
        legendre_exponents(8, orders=[4] * 8)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="terms"):
        FedPrior(Task(MLP(in_features=8)), basis="tensor", orders=(4,) * 8)
    assert len(legendre_exponents(8, degree=4)) == 495 <= MAX_TERMS  # C(12, 4)


def test_extrapolation_is_linearized_flagged_and_widens_sigma():
    """Units calibrated on x ∈ [-1, 1] of a quadratic fleet; a test input at x = 20 lies
    far beyond the support: the prediction continues along the tangent at the box's edge
    (bounded by the value there plus slope × distance), the row is flagged, and σ grows."""
    gen = torch.Generator().manual_seed(3)
    arrays = []
    for i in range(12):
        x = 2 * torch.rand(60, 1, generator=gen, dtype=F64) - 1
        y = (1 + 0.05 * i) * x + 0.5 * x**2 + 0.01 * torch.randn(60, 1, generator=gen, dtype=F64)
        arrays.append((x.numpy(), y.numpy()))
    data = ClientData.from_arrays(arrays, tuple(range(12)), F64)
    alg = FedPrior(Task(MLP(in_features=1)), basis="total", degree=2)
    _, _, personal, _ = run_rounds(alg, data, 20)
    box = personal["box"]
    assert float(box[:, 0].max()) < -0.99 and float(box[:, 1].min()) > 0.99  # own range ⊂ box
    far = torch.tensor([[0.5], [20.0]], dtype=F64).expand(12, 2, 1)
    pred = alg.predict(personal, far)[..., 0]
    beyond = alg.beyond_support(personal, far)
    assert beyond[:, 0].eq(False).all() and beyond[:, 1].all()
    # Hand-computed bound: the tangent of y = a x + 0.5 x² at the box edge b is
    # y(b) + (a + b)(20 − b); the raw quadratic at 20 would be ≈ 200 + 20a.
    edge = box[:, 1, 0]
    a = 1 + 0.05 * torch.arange(12, dtype=F64)
    tangent = a * edge + 0.5 * edge**2 + (a + edge) * (20 - edge)
    torch.testing.assert_close(pred[:, 1], tangent, rtol=0.02, atol=0.05)
    assert float(pred[:, 1].max()) < 0.5 * float((20 * a + 200).min())
    std = alg.predictive_std(personal, far)[..., 0]
    quad = legendre_products(far, alg.terms) @ personal["coef"].unsqueeze(-1)
    gap = (quad[:, 1, 0] - pred[:, 1]).abs()
    assert (std[:, 1] >= gap * 0.999).all()  # the model-form term: at least the gap
    assert (std[:, 0] < 0.1).all()  # inside: unchanged, small


def test_the_barometer_orders_apply_to_the_barometer_only():
    """[methods.fedprior] orders = [4, 3] are the barometer's surface: on any other named
    features 'auto' becomes the total-degree basis (BIC over degrees 0..2), unless the
    user asks for the tensor."""
    from fedcal.build import build_algorithm, method_settings
    from fedcal.config import load_config, override

    base = load_config(None)
    generic = override(base, {"data": {"features": ["pm25_raw", "rh"], "target": "pm25_ref"}})
    for cfg, want in ((base, "auto"), (generic, "total")):
        _, values = method_settings("fedprior", cfg)
        assert values.get("basis", "auto") == want
    alg = build_algorithm("fedprior", generic, Task(MLP(in_features=2)))
    assert alg.terms == legendre_exponents(2, degree=2)
    assert [c["degree"] for c in alg.candidates] == [0, 1, 2]
    tensor = override(generic, {"methods": {"fedprior": {"basis": "tensor"}}})
    assert build_algorithm("fedprior", tensor, Task(MLP(in_features=2))).terms == (
        legendre_exponents(2, orders=(4, 3))
    )


def test_the_run_states_the_jitter_in_one_line():
    import pandas as pd

    from fedcal.experiment import jitter_note

    jitter = pd.Series([0.0, 1e-10, 0.0, 1e-8])
    note = jitter_note(jitter, float(jitter.max()))
    assert "relative jitter up to 1e-08" in note and "2 unit-round(s)" in note
    assert "\n" not in note
    assert "eigenvalue floor" in jitter_note(pd.Series([1.0]), 1.0)
