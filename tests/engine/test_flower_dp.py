"""Client-level DP for fedprior on Flower: the noisy, projected sums are the simulator's."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fedcal.apps.flower_server import build, federation, privacy_record
from fedcal.build import build_policy
from fedcal.config import PrivacySection
from fedcal.engine.simulation import EngineConfig, prepare, simulate
from fedcal_support.flower_hostile import run_in_process

from .test_flower_wire import CONFIG, SITES, TRAIN_ROWS, _assert_same_as_simulator, _node_cfgs

pytest.importorskip("flwr")


@pytest.mark.parametrize("epsilon", [1.0, 8.0])
def test_fedprior_under_dp_on_flower_equals_the_simulator(epsilon, make_fleet, tmp_path):
    # seeded: the simulator and the Flower server draw the same noise (a secret would differ)
    config = replace(CONFIG, privacy=PrivacySection(epsilon=epsilon, clip=1.0, noise="seeded"))
    policy, spent = build_policy(config)
    assert policy.dp and spent["noise_multiplier"] > 0
    fleet = make_fleet(num_clients=6, train=TRAIN_ROWS)
    cfgs = _node_cfgs(fleet, tmp_path, SITES)
    fed = federation(config, "fedprior", seed=4)
    run_in_process(fed, cfgs, run_id=3)
    assert fed.rejected == {} and all(f == {} for f in fed.failed.values())
    res = simulate(
        build(config, "fedprior", 2),
        prepare(fleet, dtype="float64"),
        EngineConfig(rounds=3, seed=4, dtype="float64", aggregation=policy),
    )
    assert torch.linalg.eigvalsh(res.server["sigma"]).min() > 0  # a valid prior after noise
    # the per-statistic path ran (8 declared statistics), with noise on them
    assert all(r["dp_statistics"] == 8 and r["dp_noise_std"] > 0 for r in res.extra["aggregation"])
    _assert_same_as_simulator(fed, res, cfgs, 3)


def test_flower_rounds_override_is_accounted():
    # The run config's `rounds` replaces engine.rounds: σ must be the accountant's for the
    # rounds actually run (σ for 3 rounds over 12 spends more than ε).
    config = replace(CONFIG, privacy=PrivacySection(epsilon=1.0, clip=1.0))
    assert config.engine.rounds == 3
    fed = federation(config, "fedprior", seed=4, rounds=12)
    longer = replace(config, engine=replace(config.engine, rounds=12))
    spent = build_policy(longer)[1]
    assert fed.rounds == 12
    assert fed.policy.dp_noise_multiplier == pytest.approx(spent["noise_multiplier"])
    assert fed.policy.dp_noise_multiplier > build_policy(config)[1]["noise_multiplier"]
    # result.json's record: the ε the accountant spent over the 12 rounds run
    record = privacy_record(config, 12)
    assert record["rounds"] == 12 and 0.99 < record["epsilon"] <= 1.0
    assert record["noise_multiplier"] == pytest.approx(fed.policy.dp_noise_multiplier)


def test_flower_refuses_dp_with_federated_scaling(make_fleet, tmp_path):
    # The handshake's scaler (un-noised fleet means and stds) would go to every site.
    config = replace(CONFIG, privacy=PrivacySection(epsilon=1.0, clip=1.0))
    config = replace(config, data=replace(config.data, scaling="federated"))
    cfgs = _node_cfgs(make_fleet(num_clients=6, train=TRAIN_ROWS), tmp_path, SITES)
    with pytest.raises(RuntimeError, match="client-level DP needs every column"):
        run_in_process(federation(config, "fedprior", seed=4), cfgs, run_id=5)
