"""fedprior's calibrated interval (the design-matched hold-out, fedprior "Intervals") on
Flower: σ, τ² and coverage are the simulator's."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from fedcal.apps.flower_server import build, federation
from fedcal.engine.simulation import EngineConfig, prepare, simulate
from fedcal_support.flower_hostile import run_in_process

from .test_flower_wire import CONFIG, POLICY, SITES, _assert_same_as_simulator, _node_cfgs

pytest.importorskip("flwr")

# Two few-point units (the probe: 6 points) and four with at least twice as many, which
# emulate the probe and learn τ².
ROWS = [6, 30, 14, 26, 6, 20]


@pytest.mark.parametrize("own_folds", [0, 3])
def test_calibrated_interval_on_flower_equals_the_simulator(
    make_fleet, tmp_path, own_folds: int
) -> None:
    # own_folds = 3: the rich units' own-row τ² (I4) also travels and equals the simulator's
    params = {**CONFIG.method_params["fedprior"], "interval": "calibrated", "own_folds": own_folds}
    config = replace(CONFIG, method_params={**CONFIG.method_params, "fedprior": params})
    fleet = make_fleet(num_clients=6, train=ROWS)
    cfgs = _node_cfgs(fleet, tmp_path, SITES)
    fed = federation(config, "fedprior", seed=4)
    run_in_process(fed, cfgs, run_id=17)
    assert fed.rejected == {} and all(f == {} for f in fed.failed.values())
    alg = build(config, "fedprior", 2)
    assert alg.interval == "calibrated"
    res = simulate(
        alg,
        prepare(fleet, dtype="float64"),
        EngineConfig(rounds=3, seed=4, dtype="float64", aggregation=POLICY),
    )
    # the hold-out ran on both: a 6-point probe, no decline, the same τ² (0 on this toy
    # fleet: the residual-dof σ² already covers the held-out points), σ stated on every unit
    for server in (res.server, fed.server):
        assert float(server["probe_n"]) == 6 and int(server["declined"]) == 0
        assert float(server["dof"]) == pytest.approx(float(res.server["dof"]), rel=1e-10)
    assert float(fed.server["disc_var"]) == float(res.server["disc_var"])
    assert ("disc_own" in res.server) == bool(own_folds)
    if own_folds:
        assert float(fed.server["disc_own"]) == pytest.approx(float(res.server["disc_own"]))
    final = pd.DataFrame(fed.final_rows())
    assert np.isfinite(final[["test_pred_sd", "test_coverage95"]].to_numpy()).all()
    # per round and sensor: σ (pred_sd), coverage and errors equal the simulator's
    _assert_same_as_simulator(fed, res, cfgs, 17)
