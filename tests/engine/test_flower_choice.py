"""fedprior with the time-respecting choice on Flower (issue 34, review B): the no-harm
``fallback`` travels as a number (a Flower reply carries numbers) and is named in the tables;
the raw-reading candidate (``[data] raw_column``) exists on both sides with the same map."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from fedcal.apps.flower_server import build, federation
from fedcal.build import with_raw_column
from fedcal.core.hooks import labelled_units
from fedcal.engine.flower.loop import run_federation
from fedcal.engine.simulation import EngineConfig, prepare, simulate
from fedcal_support.flower_hostile import InProcess

from .test_flower_drift import drifting_fleet
from .test_flower_wire import CONFIG, POLICY, SITES, _assert_same_as_simulator, _node_cfgs

pytest.importorskip("flwr")


@pytest.mark.parametrize("method", ["fedprior", "fedprior_drift"])
def test_fedprior_with_the_choice_and_a_raw_column_on_flower_equals_the_simulator(
    make_fleet, tmp_path, method
) -> None:
    params = {**CONFIG.method_params["fedprior"], "choose": "time"}
    fleet = drifting_fleet(make_fleet)
    data = replace(CONFIG.data, raw_column=CONFIG.data.features[0])
    config = replace(CONFIG, data=data, method_params={**CONFIG.method_params, method: params})
    cfgs = _node_cfgs(fleet, tmp_path, SITES)
    fed = federation(config, method, seed=4)
    result = run_federation(fed, InProcess(cfgs, 23, None, None, None, []))
    assert fed.rejected == {} and all(f == {} for f in fed.failed.values())
    tensors = prepare(fleet, dtype="float64")
    alg = with_raw_column(build(config, method, 2), config, tensors)
    assert alg.choose == "time" and alg.time_choice.raw_coef is not None
    # the Flower server's algorithm has the raw candidate with the simulator's map
    assert fed.algorithm.raw_input == alg.raw_input == 0
    np.testing.assert_allclose(fed.algorithm.raw_map, alg.raw_map, rtol=1e-12)
    res = simulate(
        alg, tensors, EngineConfig(rounds=3, seed=4, dtype="float64", aggregation=POLICY)
    )
    _assert_same_as_simulator(fed, res, cfgs, 23)
    # the raw candidate was scored on both sides (its summed score is a number, not 0 by
    # absence: the fleet's data are not the raw reading)
    assert float(res.server["forward_scores"][-1]) > 0
    # fallback: codes on the wire, the same names in both final tables
    want = labelled_units(alg, alg.unit_columns(res.personal, tensors.train))["fallback"]
    got = {row["client_index"]: row["fallback"] for row in result["final"]}
    assert [got[i] for i in range(len(want))] == list(want)
    assert set(want) <= {"prior", "own_linear", "pooled_linear", "raw"}
