"""IFCA: recovers planted families; k = 1 is FedAvg; per-cluster averaging by hand."""

import numpy as np
import pandas as pd
import torch

from fedcal.algorithms.fedavg import FedAvg
from fedcal.algorithms.ifca import IFCA
from fedcal.core.data import ClientData
from fedcal.core.task import Task
from fedcal.core.tree import expand
from fedcal.data.fleet import Fleet
from fedcal.engine.simulation import EngineConfig, prepare, simulate
from fedcal.models.mlp import MLP

F64 = torch.float64


def two_family_fleet(per_family: int = 4, train: int = 24, test: int = 6, seed: int = 0):
    """Sensors of two families: frequency rises with pressure in one, falls in the other
    (each sensor with its own offset and gains, as in the conftest toy fleet)."""
    rng = np.random.default_rng(seed)
    rows, family = [], []
    for c in range(2 * per_family):
        fam = c % 2  # interleaved, so the family is not the client order
        family.append(fam)
        sign, f_ref = (1.0, 33_000.0) if fam == 0 else (-1.0, 36_500.0)
        f0, k, tc = rng.normal(f_ref, 150), rng.normal(2.3, 0.2), rng.normal(0.4, 0.2)
        for split, m in (("train", train), ("test", test)):
            p = rng.uniform(50, 1550, m)
            t = rng.uniform(-40, 60, m)
            f = f0 + sign * k * p + tc * t + 2e-4 * p * t
            rows += [(f"S{c:02d}", fi, ti, pi, split) for fi, ti, pi in zip(f, t, p, strict=True)]
    frame = pd.DataFrame(
        rows, columns=["sensor_id", "frequency_hz", "temperature_c", "pressure_hpa", "split"]
    )
    return Fleet(frame), family


def same_partition(a, b) -> bool:
    """Equal up to renaming the labels (adjusted Rand index 1)."""
    pairs = set(zip(a, b, strict=True))
    return len(pairs) == len(set(a)) == len(set(b))


def test_recovers_planted_families():
    fleet, family = two_family_fleet()
    data = prepare(fleet, dtype="float64")
    alg = IFCA(Task(MLP(hidden=(16, 16))), clusters=2, local_epochs=2, batch_size=8)
    res = simulate(alg, data, EngineConfig(rounds=10, seed=0, dtype="float64"))
    models = expand(alg.broadcast(res.server), data.num_clients)["models"]
    found = alg.cluster_losses(models, data.train).argmin(dim=1).tolist()
    assert len(set(found)) == 2 and same_partition(found, family)
    # and the cluster models fit their families better than one model fits both
    avg = simulate(
        FedAvg(Task(MLP(hidden=(16, 16))), local_epochs=2, batch_size=8),
        data,
        EngineConfig(rounds=10, seed=0, dtype="float64"),
    )
    ifca_rmse = np.mean([r["test_rmse"] for r in res.final])
    avg_rmse = np.mean([r["test_rmse"] for r in avg.final])
    assert ifca_rmse < 0.9 * avg_rmse


def test_one_cluster_is_fedavg_exactly(make_fleet):
    data = prepare(make_fleet(num_clients=3, train=[11, 6, 9]), dtype="float64")
    task = Task(MLP(hidden=(5, 4)))
    config = EngineConfig(rounds=3, seed=1, dtype="float64")
    one = simulate(IFCA(task, clusters=1, local_epochs=1, batch_size=4), data, config)
    avg = simulate(FedAvg(task, local_epochs=1, batch_size=4), data, config)
    for k, v in avg.server["model"].items():
        assert torch.equal(one.server["models"][k][0], v), k
    for k, v in avg.personal.items():
        assert torch.equal(one.personal[k], v), k


def test_per_cluster_average_and_empty_cluster_keeps_its_model():
    """k = 3; clients 0, 2 chose cluster 0, client 1 chose 1, nobody chose 2.
    Uploads 1, 5, 3 → θ_0 = (1 + 3)/2 = 2, θ_1 = 5, θ_2 unchanged (−7)."""
    alg = IFCA(Task(MLP()), clusters=3)
    server = {
        "models": {"w": torch.tensor([[0.0], [0.0], [-7.0]], dtype=F64)},
        "round": torch.tensor(10.0, dtype=F64),  # past the warm-up
    }
    replies = {
        "model": {"w": torch.tensor([[1.0], [5.0], [3.0]], dtype=F64)},
        "assignment": torch.tensor([[1.0, 0, 0], [0, 1.0, 0], [1.0, 0, 0]], dtype=F64),
    }
    out = alg.server_update(server, replies, torch.tensor([10, 1, 1]))
    assert out["models"]["w"].flatten().tolist() == [2.0, 5.0, -7.0]
    weighted = IFCA(Task(MLP()), clusters=3, sample_weighted=True)
    out = weighted.server_update(server, replies, torch.tensor([3, 1, 1]))
    assert out["models"]["w"].flatten().tolist() == [1.5, 5.0, -7.0]  # (3·1 + 1·3)/4


def test_each_client_trains_its_least_loss_model():
    """Cluster 1 is exactly the client's map (y = 0 via zero output weights); cluster 0 is not."""
    model = MLP(hidden=(3,))
    alg = IFCA(Task(model), clusters=2, local_epochs=1, batch_size=4, lr=1e-9)
    base = model.init(torch.Generator().manual_seed(0), F64)
    exact = {
        **base,
        "l1.weight": torch.zeros(1, 3, dtype=F64),
        "l1.bias": torch.zeros(1, dtype=F64),
    }
    models = {k: torch.stack([base[k] + 1.0, exact[k]]) for k in base}
    x = torch.randn(1, 5, 2, dtype=F64)
    data = ClientData(x, torch.zeros(1, 5, 1, dtype=F64), torch.tensor([5]), (0,))
    result = alg.client_update({"models": expand(models, 1)}, {}, data)
    assert result.reply["assignment"].tolist() == [[0.0, 1.0]]
    assert result.metrics["cluster"].tolist() == [1.0]
    for k in base:  # zero residual, zero gradient: the upload is the chosen model itself
        assert torch.equal(result.reply["model"][k][0], exact[k])


def test_split_models_differ_deterministically():
    """Centred perturbations: the k models average to θ, differ, and depend on init_seed."""
    model = MLP(hidden=(4,))
    params = model.init(torch.Generator().manual_seed(0), F64)
    a = IFCA(Task(model), clusters=3, init_seed=5, warmup_rounds=0).server_init(params)["models"]
    b = IFCA(Task(model), clusters=3, init_seed=5, warmup_rounds=0).server_init(params)["models"]
    c = IFCA(Task(model), clusters=3, init_seed=6, warmup_rounds=0).server_init(params)["models"]
    for k, v in params.items():
        assert torch.allclose(a[k].mean(0), v, atol=1e-15) and torch.equal(a[k], b[k])
        assert not torch.equal(a[k][1], a[k][2]) and not torch.equal(a[k][1], c[k][1])


def test_warmup_trains_one_shared_model_then_splits_it(make_fleet):
    """Before round W all k models are equal (everyone ties onto θ_1); at W they split
    around the averaged model."""
    data = prepare(make_fleet(num_clients=3), dtype="float64")
    task = Task(MLP(hidden=(5,)))
    alg = IFCA(task, clusters=2, warmup_rounds=2, local_epochs=1, batch_size=8)
    config = lambda r: EngineConfig(rounds=r, seed=0, dtype="float64")  # noqa: E731
    one = simulate(alg, data, config(1)).server["models"]
    assert all(torch.equal(v[0], v[1]) for v in one.values())
    two = simulate(alg, data, config(2)).server["models"]
    expected = alg.split({k: v.mean(0) for k, v in two.items()})  # centred: θ is their mean
    assert all(torch.allclose(two[k], expected[k], rtol=0, atol=1e-14) for k in two)
    assert not torch.equal(two["l0.weight"][0], two["l0.weight"][1])


def test_two_model_split_is_symmetric():
    """k = 2: θ ± δ·e, so both models carry the same curvature cost and only ⟨∇F_i, e⟩ decides."""
    model = MLP(hidden=(4,))
    params = model.init(torch.Generator().manual_seed(0), F64)
    split = IFCA(Task(model), clusters=2).split(params)
    for k, v in params.items():
        assert torch.allclose(split[k][0] - v, v - split[k][1], atol=1e-15)
