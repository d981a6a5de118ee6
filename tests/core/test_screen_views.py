"""Screening uploads that grow with a unit's inputs or rows (issue 20 item 3).

A planted fleet of 8 honest units under one calibration y = 0.1 + x + 0.05 x² + noise:
unit 0 has 100× the rows of the others, unit 2 a few inputs at ~10× the others' range
(pollution episodes). Pooled least squares (degree 2) and fedgmi's Bayesian head upload sums
that grow with both (Gram X_iᵀX_i, X_iᵀy_i, n_i, RSS). Before their screen views the
fleet-median size screen rejected honest units here (leastsq: the episode unit; fedgmi: the
data-rich and the episode unit, by their head moments). A unit whose targets are ×1000 must
still be rejected by size, and one that multiplies all its statistics by 1000 by size or
by the consistency check.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcal.algorithms.fedgmi import FedGMI
from fedcal.algorithms.leastsq import LeastSquares
from fedcal.core.aggregation import AggregationPolicy, aggregate
from fedcal.core.bayes import F64
from fedcal.core.data import ClientData
from fedcal.core.robust import explained_rms
from fedcal.core.stages import view_sizes
from fedcal.core.task import Task
from fedcal.core.tree import expand, flatten, unflatten
from fedcal.models.mlp import MLP

UNITS, ROWS = 8, 30


def _fleet(target_factor: dict[int, float] | None = None) -> ClientData:
    rng = np.random.default_rng(0)
    data = []
    for i in range(UNITS):
        n = ROWS * (100 if i == 0 else 1)
        x = rng.uniform(-1.0, 1.0, n)
        if i == 2:  # episodes: 3 honest readings far out
            x[:3] = 10.0 * rng.uniform(0.8, 1.0, 3)
        y = 0.1 + x + 0.05 * x**2 + 0.05 * rng.standard_normal(n)
        y = y * (target_factor or {}).get(i, 1.0)
        data.append((x[:, None], y[:, None]))
    return ClientData.from_arrays(data, tuple(range(UNITS)), F64)


def _times1000(reply, client: int, keep: tuple[str, ...]):
    flat = {}
    for key, leaf in flatten(reply).items():
        if leaf.is_floating_point() and key not in keep:
            leaf = leaf.clone()
            leaf[client] = leaf[client] * 1000.0
        flat[key] = leaf
    return unflatten(flat)


def _rounds(alg, data, rounds: int, scaled: int | None = None, keep=()) -> list[dict]:
    """``rounds`` rounds through the default policy (size screen 10×, consistency check)."""
    params = alg.task.model.init(torch.Generator().manual_seed(0), F64)
    server = alg.server_init(params)
    states = alg.client_init(expand(alg.broadcast(server), UNITS))
    record: list[dict] = []
    for rnd in range(rounds):
        down = alg.broadcast(server)
        result = alg.client_update(expand(down, UNITS), states, data)
        reply = result.reply if scaled is None else _times1000(result.reply, scaled, keep)
        before = len(record)
        server, _, _ = aggregate(
            alg, server, down, reply, data.count.to(F64), AggregationPolicy(), rnd, record=record
        )
        for r in record[before:]:
            r["round"] = rnd
        states = result.state
    return record


def _leastsq():
    return LeastSquares(Task(MLP(in_features=1)), degree=2, pooled=True)


def _fedgmi():
    # The head's statistics (fedgmi_posterior_frozen): a trained body's update is a model
    # update, judged by its size like fedavg's (a unit taking 100× the SGD steps moves it
    # further; not addressed here).
    task = Task(MLP(in_features=1, hidden=(3,), activation="tanh"))
    return FedGMI(task, interpolation="posterior", evaluate="global_body", local_epochs=0)


METHODS = {"leastsq": (_leastsq, 1), "fedgmi_posterior": (_fedgmi, 2)}


@pytest.fixture(scope="module", autouse=True)
def _threads():
    torch.set_num_threads(1)


def test_explained_rms_is_the_rms_of_the_units_own_fit():
    """√(mᵀG⁺m/n) against lstsq's fitted values, and unchanged by rows × k or x × 10."""
    x = torch.linspace(-1, 1, 9, dtype=F64)
    phi = torch.stack([torch.ones_like(x), x, x**2], -1)
    y = torch.sin(3 * x)
    fit = phi @ torch.linalg.lstsq(phi, y.unsqueeze(-1)).solution[:, 0]
    want = fit.pow(2).mean().sqrt()
    got = explained_rms((phi.T @ phi)[None], (phi.T @ y)[None], torch.tensor([9.0]))
    assert torch.allclose(got, want.reshape(1), rtol=1e-10)
    rep = phi.repeat(5, 1)  # the same points 5 times: same RMS
    got5 = explained_rms((rep.T @ rep)[None], (rep.T @ y.repeat(5))[None], torch.tensor([45.0]))
    assert torch.allclose(got5, want.reshape(1), rtol=1e-10)
    wide = torch.stack([torch.ones_like(x), 10 * x, 100 * x**2], -1)  # inputs ×10
    gotw = explained_rms((wide.T @ wide)[None], (wide.T @ y)[None], torch.tensor([9.0]))
    assert torch.allclose(gotw, want.reshape(1), rtol=1e-8)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_honest_units_of_every_kind_pass(method):
    make, rounds = METHODS[method]
    data = _fleet()
    assert int(data.count[0]) == 100 * int(data.count[3])  # the planted inequality
    assert _rounds(make(), data, rounds) == []


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("unit", [0, 2, 5])  # the data-rich one, the episodes, a plain one
def test_a_unit_with_x1000_targets_is_rejected_by_size_and_no_other(method, unit):
    make, rounds = METHODS[method]
    record = _rounds(make(), _fleet({unit: 1000.0}), rounds)
    assert {r["client"] for r in record} == {unit}
    assert [r["round"] for r in record] == list(range(rounds))
    assert all(r["reason"] == "size" and r["ratio"] > 100.0 for r in record)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_all_statistics_x1000_are_rejected(method):
    """Every float leaf ×1000 but the row count: caught (by size or by G_00 ≠ n)."""
    make, rounds = METHODS[method]
    record = _rounds(make(), _fleet(), rounds, scaled=5, keep=("n", "count"))
    assert {r["client"] for r in record} == {5}
    assert [r["round"] for r in record] == list(range(rounds))


def test_leastsq_count_must_be_the_declared_rows():
    """A unit that claims 1000× its rows (Gram and count ×1000, its fit RMS then ÷ 31.6:
    not large) is caught by count ≠ declared rows."""
    record = _rounds(_leastsq(), _fleet(), 1, scaled=5, keep=("moment",))
    assert [r["client"] for r in record] == [5]
    assert record[0]["reason"].startswith("row count")


def test_view_sizes_sums_pass_per_row_scale_free_leaves_do_not():
    """Hand-computed, rows (1, 1, 1, 100). Client 3's scale is 1 (the plain median, and the
    others' median); clients 0–2's is the smaller of 1 and the others' rows-weighted
    median, which client 3's 100 rows set."""
    rows = torch.tensor([1.0, 1.0, 1.0, 100.0], dtype=F64)
    accepted = torch.ones(4, dtype=torch.bool)
    grows = torch.tensor([1.0, 1.0, 1.0, 100.0], dtype=F64)  # ∝ rows: per row all 1
    small = torch.tensor([0.01, 0.01, 0.01], dtype=F64)
    got = view_sizes({"sum/rss": grows}, accepted, rows, {})  # per row: client 3 passes
    assert torch.allclose(got, torch.cat([small, torch.ones(1, dtype=F64)]))
    got = view_sizes({"distance": grows}, accepted, rows, {})  # not a sum: 100 × the others
    assert torch.allclose(got, torch.cat([small, torch.tensor([100.0], dtype=F64)]))
    # a model leaf is judged as its update from the broadcast: 2, 2, 2, 6 − 1 = 1, 1, 1, 5
    got = view_sizes({"w": grows.clamp_max(5.0) + 1.0}, accepted, rows, {"w": torch.tensor(1.0)})
    assert torch.allclose(got, torch.tensor([0.2, 0.2, 0.2, 5.0], dtype=F64))
