"""fedprior's noise model (σ(x) in the inputs, Student-t rows; fedprior_noise) on Flower: its
uploads travel the wire and σ, coverage and errors are the simulator's."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fedcal.apps.flower_server import build, federation
from fedcal.engine.simulation import EngineConfig, prepare, simulate
from fedcal_support.flower_hostile import run_in_process

from .test_flower_interval import ROWS
from .test_flower_wire import CONFIG, POLICY, SITES, _assert_same_as_simulator, _node_cfgs

pytest.importorskip("flwr")


def test_noise_model_on_flower_equals_the_simulator(make_fleet, tmp_path) -> None:
    params = {
        **CONFIG.method_params["fedprior"],
        "interval": "calibrated",
        "noise_shape": "inputs",
        "noise_tail": "auto",  # t rows by the fleet's evidence (N6): its d_i travel too
    }
    config = replace(CONFIG, method_params={**CONFIG.method_params, "fedprior": params})
    fleet = make_fleet(num_clients=6, train=ROWS)
    cfgs = _node_cfgs(fleet, tmp_path, SITES)
    fed = federation(config, "fedprior", seed=4)
    run_in_process(fed, cfgs, run_id=19)
    assert fed.rejected == {} and all(f == {} for f in fed.failed.values())
    alg = build(config, "fedprior", 2)
    assert (alg.noise_shape, alg.noise_tail) == ("inputs", "auto")
    res = simulate(
        alg,
        prepare(fleet, dtype="float64"),
        EngineConfig(rounds=3, seed=4, dtype="float64", aggregation=POLICY),
    )
    # γ's scoring iterate moved (its sums arrived) and is the simulator's
    assert float(res.server["noise_gamma_fit"].abs().max()) > 0
    torch.testing.assert_close(fed.server["noise_gamma_fit"], res.server["noise_gamma_fit"])
    # the tail's evidence Σ d_i arrived (non-zero) and chose as the simulator's
    assert float(res.server["tail_ratio"]) != 0.0
    torch.testing.assert_close(fed.server["tail_ratio"], res.server["tail_ratio"])
    assert float(fed.server["noise_student"]) == float(res.server["noise_student"])
    _assert_same_as_simulator(fed, res, cfgs, 19)
