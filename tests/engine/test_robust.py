"""Divergence contained: rejected replies, rolled-back private state, diverged status,
failing methods reported while the others run, robust policies in the engine."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from fedcal.algorithms import REGISTRY
from fedcal.algorithms.fedavg import FedAvg
from fedcal.algorithms.local import LocalOnly
from fedcal.config import ConfigError, default_config
from fedcal.core.aggregation import AggregationPolicy
from fedcal.core.data import client_round_seed
from fedcal.core.task import Task
from fedcal.core.tree import expand, leaves
from fedcal.engine.history import block_rows
from fedcal.engine.simulation import EngineConfig, _evaluate, prepare, simulate
from fedcal.experiment import run_experiment, summary_row
from fedcal.models.mlp import MLP

POISONED = 1
F64 = torch.float64


def poisoned(make_fleet, factor: float):
    """Four toy sensors in float64; sensor 1's training targets multiplied by ``factor``."""
    tensors = prepare(make_fleet(num_clients=4), dtype="float64")
    y = tensors.train.y.clone()
    y[POISONED] = y[POISONED] * factor
    return replace(tensors, train=replace(tensors.train, y=y))


def alg(cls, **kw):
    return cls(Task(MLP(hidden=(6, 6))), local_epochs=1, batch_size=4, lr=0.1, **kw)


def test_a_diverging_sensor_is_rejected_and_the_others_stay_finite(make_fleet):
    # ×1e200: the poisoned sensor's squared error overflows to inf at once → NaN reply.
    tensors = poisoned(make_fleet, 1e200)
    result = simulate(alg(FedAvg), tensors, EngineConfig(rounds=3, dtype="float64"))
    assert all(torch.isfinite(t).all() for t in leaves(result.server))
    rejected = {row["client_index"]: row["rejected_rounds"] for row in result.final}
    assert rejected == {0: 0, 1: 3, 2: 0, 3: 0}
    assert [r["accepted"] for r in result.extra["aggregation"]] == [3.0, 3.0, 3.0]
    # After one round the server is the mean of the three honest replies.
    fedavg = alg(FedAvg)
    server = fedavg.server_init(fedavg.task.model.init(torch.Generator().manual_seed(0), F64))
    down = expand(fedavg.broadcast(server), 4)
    data = tensors.train.with_seeds(tuple(client_round_seed(0, 0, i) for i in range(4)))
    replies = fedavg.client_update(down, fedavg.client_init(down), data).reply["model"]
    one = simulate(fedavg, tensors, EngineConfig(rounds=1, dtype="float64")).server["model"]
    for k, v in one.items():
        assert torch.allclose(v, replies[k][[0, 2, 3]].mean(0), atol=1e-12)


def test_rejected_clients_private_state_is_rolled_back(make_fleet):
    tensors = poisoned(make_fleet, 1e200)
    local = alg(LocalOnly)
    result = simulate(local, tensors, EngineConfig(rounds=2, dtype="float64"))
    init = local.task.model.init(torch.Generator().manual_seed(0), torch.float64)
    # Its local training produced NaN every round: its model stays the initial one.
    for k, v in init.items():
        assert torch.equal(result.states["model"][k][POISONED], v)
        assert not torch.equal(result.states["model"][k][0], v)
    assert all(row["status"] == "ok" for row in result.final)


def test_non_finite_personal_model_is_reported_diverged_and_propagates(make_fleet):
    tensors = prepare(make_fleet(num_clients=3), dtype="float64")
    fedavg = alg(FedAvg)
    result = simulate(fedavg, tensors, EngineConfig(rounds=1, dtype="float64"))
    personal = {k: v.clone() for k, v in expand(result.server["model"], 3).items()}
    personal["l0.weight"][2, 0, 0] = float("nan")
    config = EngineConfig(rounds=1, dtype="float64")
    device = torch.device("cpu")
    args = (fedavg, tensors, result.server, result.states, config, 0, device)
    block, _, _ = _evaluate(*args, personal=personal)
    rows = block_rows(block)  # the evaluation's columns, as rows
    assert [r["status"] for r in rows] == ["ok", "ok", "diverged"]
    result.final = [{**r, "rejected_rounds": 0} for r in rows]
    row = summary_row("fedavg", 0, 0, result, 1500.0, fedavg.task)
    # Left out of the means, and said so (issue 20): the mean and worst are the ok sensors'.
    assert row["diverged"] == 1 and row["excluded"] == 1 and row["sensors"] == 3
    assert row["rmse_mean"] == pytest.approx((rows[0]["test_rmse"] + rows[1]["test_rmse"]) / 2)
    assert row["rmse_worst"] == max(rows[0]["test_rmse"], rows[1]["test_rmse"])


def test_robust_rule_and_dp_are_deterministic_in_the_engine(make_fleet):
    tensors = poisoned(make_fleet, 50.0)
    for policy in (
        AggregationPolicy(rule="median"),
        AggregationPolicy(rule="krum"),
        AggregationPolicy(dp_noise_multiplier=1.0, dp_clip=0.5),
    ):
        config = EngineConfig(rounds=2, dtype="float64", aggregation=policy)
        a = simulate(alg(FedAvg), tensors, config)
        b = simulate(alg(FedAvg), tensors, config)
        assert all(torch.equal(a.personal[k], b.personal[k]) for k in a.personal)


def test_median_limits_a_poisoned_sensors_pull(make_fleet):
    clean = prepare(make_fleet(num_clients=4), dtype="float64")
    tensors = poisoned(make_fleet, 1000.0)
    plain = EngineConfig(rounds=1, dtype="float64")
    median = replace(plain, aggregation=AggregationPolicy(rule="median"))
    ref = simulate(alg(FedAvg), clean, plain).server["model"]
    drift = {
        name: sum(
            float((simulate(alg(FedAvg), tensors, cfg).server["model"][k] - ref[k]).norm())
            for k in ref
        )
        for name, cfg in (("plain", plain), ("median", median))
    }
    assert drift["median"] < 0.2 * drift["plain"]


@dataclasses.dataclass(frozen=True)
class Boom(FedAvg):
    name = "boom"

    def client_update(self, down, state, data):
        raise RuntimeError("clustering failed\n" + "tensor([[1., 2.]])\n" * 500)


@pytest.fixture
def boom_registered(monkeypatch):
    monkeypatch.setitem(REGISTRY, "boom", Boom)


def small_config():
    cfg = default_config()
    return replace(
        cfg,
        seeds=2,
        engine=replace(cfg.engine, rounds=2),
        model=replace(cfg.model, hidden=(6, 6)),
        train=replace(cfg.train, local_epochs=1),
        unconverged_tol=1.0,  # 2 rounds are unconverged by design (tests/test_status.py)
    )


def test_a_failing_method_is_reported_in_one_line_and_the_others_run(
    tmp_path, make_fleet, boom_registered
):
    failures = []
    summary = run_experiment(
        small_config(),
        make_fleet(num_clients=3),
        tmp_path,
        ["boom", "fedavg"],
        on_fail=lambda label, why: failures.append((label, why)),
    )
    assert failures == [("boom tp=all seed=0", "RuntimeError: clustering failed")]
    assert (tmp_path / "runs" / "boom_tp0_seed0" / "failed.txt").read_text().strip() == (
        "RuntimeError: clustering failed"
    )
    done = summary[summary["failed"] == 0]
    assert list(done["method"]) == ["fedavg", "fedavg"] and done["rmse_mean"].notna().all()
    assert summary.loc[summary["method"] == "boom", "failed"].tolist() == [1]


def test_cli_prints_the_table_and_exits_1_when_a_method_failed(
    tmp_path, make_fleet, boom_registered
):
    from fedcal.cli import app
    from fedcal.data.loader import save_fleet

    data = tmp_path / "fleet.csv"
    save_fleet(make_fleet(num_clients=3), data)
    cfg = tmp_path / "c.toml"
    cfg.write_text("[run]\nseeds = 1\n[engine]\nrounds = 2\n[model]\nhidden = [4]\n")
    result = CliRunner().invoke(
        app,
        ["run", "--data", str(data), "--config", str(cfg), "--methods", "boom,fedavg",
         "--out", str(tmp_path / "out")],
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert "failed boom tp=all seed=0: RuntimeError: clustering failed" in text
    assert "fedavg" in text and "tensor(" not in text


def test_incompatible_methods_are_refused_before_anything_trains(tmp_path, make_fleet):
    cfg = replace(small_config(), aggregation=replace(default_config().aggregation, rule="median"))
    with pytest.raises(ConfigError, match="clustered: rule 'median'"):
        run_experiment(cfg, make_fleet(num_clients=3), tmp_path, ["fedavg", "clustered"])
    assert not (tmp_path / "runs").exists()
    # the schema refuses an unknown rule as soon as the section is built
    with pytest.raises(ValueError, match="rule"):
        replace(cfg.aggregation, rule="mode")


def test_privacy_is_accounted_and_written(tmp_path, make_fleet):
    cfg = small_config()
    cfg = replace(cfg, seeds=1, privacy=replace(cfg.privacy, epsilon=4.0, clip=0.5))
    summary = run_experiment(cfg, make_fleet(num_clients=3), tmp_path, ["fedavg"])
    import json

    spent = json.loads((tmp_path / "privacy.json").read_text())
    assert spent["accountant"] == "opacus RDP" and spent["rounds"] == 2
    assert 3.9 < spent["epsilon"] <= 4.0 and spent["noise_multiplier"] > 0
    assert summary["epsilon"].tolist() == [spent["epsilon"]]
    # [privacy] delta omitted: min(1/N², 1e-5); for 3 units 1/9 would be meaningless: 1e-5
    assert spent["delta"] == 1e-5 and spent["delta_rule"].startswith("1e-5 (1/N^2 would be")
    with pytest.raises(ConfigError, match="needs clip > 0"):
        run_experiment(
            replace(cfg, privacy=replace(cfg.privacy, clip=0.0)),
            make_fleet(num_clients=3),
            tmp_path / "y",
            ["fedavg"],
        )


def test_dp_with_federated_scaling_statistics_is_refused(tmp_path, make_fleet):
    # A column without a physical range is scaled by the fleet's mean and std, un-noised and
    # sent to every site: outside the accountant's ε, so DP refuses it before anything runs.
    cfg = small_config()
    cfg = replace(cfg, seeds=1, privacy=replace(cfg.privacy, epsilon=4.0, clip=0.5))
    fleet = make_fleet(num_clients=3)
    renamed = dataclasses.replace(
        fleet, frame=fleet.frame.rename(columns={"pressure_hpa": "pm25_ugm3"}), target="pm25_ugm3"
    )
    with pytest.raises(ConfigError, match=r"\[data\] scaling.*pm25_ugm3"):
        run_experiment(cfg, renamed, tmp_path / "a", ["fedavg"])
    assert not (tmp_path / "a" / "privacy.json").exists()
    fed = replace(cfg, data=replace(cfg.data, scaling="federated"))
    with pytest.raises(ConfigError, match="frequency_hz"):
        run_experiment(fed, fleet, tmp_path / "b", ["fedavg"])
