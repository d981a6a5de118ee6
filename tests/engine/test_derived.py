"""Per-client data an algorithm derives once (``DerivesData.derive``, ``ClientData.derived``).

fedprior's moments (Φ_iᵀΦ_i, Φ_iᵀy_i, y_iᵀy_i, n_i) depend on a unit's data alone: the engine
forms them once (:func:`fedcal.engine.simulation.with_derived`) and every round's E-step and
the evaluation's posterior read them. A run must give the same numbers as a run that forms
them in every round and is given every client's seeds (the reference: the same class with
``derive`` off and ``reads_seeds`` on), in the assembled and in the streamed round, and the
shipped settings (select = "bic", interval = "calibrated") as well as the benchmark's
(select = "none", interval = "posterior").
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fedcal.algorithms.fedprior import FedPrior
from fedcal.core.bayes import F64, moments
from fedcal.core.task import Task
from fedcal.core.tree import expand, flatten
from fedcal.data.simulator import FleetSpec, simulate_fleet
from fedcal.engine import streamed
from fedcal.engine.simulation import EngineConfig, prepare, simulate, with_derived
from fedcal.models.mlp import MLP


@dataclasses.dataclass(frozen=True)
class Uncached(FedPrior):
    """fedprior forming its moments in every round, and given its clients' seeds (the
    reference: fedprior's closed form reads none, ``reads_seeds = False``)."""

    derive = None
    reads_seeds = True


@pytest.fixture(scope="module")
def fleet():
    return prepare(simulate_fleet(FleetSpec(num_sensors=9, train_design="4x3"), seed=2))


SETTINGS = {
    "benchmark": {"orders": (2, 2), "select": "none", "interval": "posterior"},
    "shipped": {"orders": (2, 2), "select": "bic", "interval": "calibrated"},
}


def _same(a, b, tol: float = 1e-12) -> None:
    fa, fb = flatten(a), flatten(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        x, y = fa[k].to(F64), fb[k].to(F64)
        scale = float(y.abs().max()) if y.numel() else 0.0
        assert torch.allclose(x, y, rtol=0, atol=tol * max(scale, 1.0), equal_nan=True), k


def test_derived_moments_are_the_moments_and_follow_select(fleet):
    alg = FedPrior(Task(MLP()), orders=(2, 2))
    data = with_derived(alg, fleet, chunk_size=4).train
    design = alg.design(fleet.train.x, fleet.train.branch)
    ref = moments(design, fleet.train.y[..., 0], fleet.train.mask)
    for k, v in ref._asdict().items():
        assert torch.equal(data.derived[f"fedprior/{k}"], v), k
    # Units 7 and 2 (chunks 2 and 1): their own moments, in the selection's order.
    picked = data.select(torch.tensor([7, 2]))
    assert torch.equal(picked.derived["fedprior/gram"], ref.gram[[7, 2]])
    assert torch.equal(picked.with_seeds((5, 6)).derived["fedprior/n"], ref.n[[7, 2]])
    # The constant term of the Gram counts the unit's rows (φ_0 ≡ 1).
    assert torch.equal(ref.gram[:, 0, 0], fleet.train.count.to(F64))


def test_noise_weighted_rows_derive_nothing(fleet):
    alg = FedPrior(Task(MLP()), orders=(2, 2), noise_tail="student")
    assert alg.derive(fleet.train) is None
    assert with_derived(alg, fleet, chunk_size=4).train.derived is None


@pytest.mark.parametrize("name", list(SETTINGS))
def test_client_update_with_derived_equals_without(fleet, name):
    alg = FedPrior(Task(MLP()), **SETTINGS[name])
    server = alg.server_init(alg.task.model.init(torch.Generator().manual_seed(0), F64))
    down = alg.broadcast(server)
    states = alg.client_init(expand(down, fleet.num_clients))
    cached = with_derived(alg, fleet, chunk_size=0).train
    a = alg.client_update(expand(down, fleet.num_clients), states, fleet.train)
    b = alg.client_update(expand(down, fleet.num_clients), states, cached)
    _same(a._asdict(), b._asdict(), tol=0.0)  # the same function of the same data: the bits


@pytest.mark.parametrize(
    ("name", "stream"),
    [("benchmark", False), ("benchmark", True), ("shipped", False), ("shipped", True)],
)
def test_run_with_derived_equals_run_without(fleet, name, stream, monkeypatch):
    # 0: every eligible round streamed, chunk by chunk; else the assembled round
    monkeypatch.setattr(streamed, "STREAM_ABOVE", 0 if stream else 2**62)
    config = EngineConfig(rounds=3, seed=0, eval_every=3, chunk_size=4)
    runs = [
        simulate(cls(Task(MLP()), **SETTINGS[name]), fleet, config) for cls in (FedPrior, Uncached)
    ]
    _same(runs[0].server, runs[1].server)
    _same(runs[0].personal, runs[1].personal)
    for a, b in zip(runs[0].final, runs[1].final, strict=True):
        assert a["client_index"] == b["client_index"]
        assert a["test_rmse"] == pytest.approx(b["test_rmse"], rel=1e-12, abs=0)


def test_a_fleet_derived_for_another_basis_gives_the_uncached_result(fleet):
    """Moments derived for the (2, 2) basis, then a (1, 1) run: with_derived forms the (1, 1)
    moments again (they were trusted, and the (1, 1) E-step read the (2, 2) Gram), fedprior
    itself does not read moments another design made, and the run equals the uncached run.
    The same algorithm again: the fleet is trusted as it is (not formed twice)."""
    stale = with_derived(FedPrior(Task(MLP()), orders=(2, 2)), fleet, chunk_size=4)
    settings = {**SETTINGS["benchmark"], "orders": (1, 1)}
    alg = FedPrior(Task(MLP()), **settings)
    data = with_derived(alg, stale, chunk_size=4)
    ref = moments(
        alg.design(fleet.train.x, fleet.train.branch), fleet.train.y[..., 0], fleet.train.mask
    )
    for k, v in ref._asdict().items():
        assert torch.equal(data.train.derived[f"fedprior/{k}"], v), k
    assert with_derived(alg, data, chunk_size=4) is data
    assert torch.equal(alg._moments(stale.train).gram, ref.gram)  # engine bypassed
    config = EngineConfig(rounds=2, seed=0, eval_every=2, chunk_size=4)
    a, b = simulate(alg, stale, config), simulate(Uncached(Task(MLP()), **settings), fleet, config)
    _same(a.server, b.server)
    _same(a.personal, b.personal)
