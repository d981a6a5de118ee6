"""fedprior_drift on Flower (issue 26): each site carries its rows' times, so the learned
drift, the σ growing after t_i and recalibrate_at (computed at each site, in the ServerApp's
final table) are the simulator's."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from fedcal.apps.flower_server import build, federation
from fedcal.data.fleet import Fleet
from fedcal.engine.flower.loop import run_federation
from fedcal.engine.flower.nodes import load_site_file, prepare_site_files
from fedcal.engine.simulation import EngineConfig, prepare, simulate
from fedcal_support.flower_hostile import InProcess

from .test_flower_wire import CONFIG, POLICY, SITES, _assert_same_as_simulator, _node_cfgs

pytest.importorskip("flwr")

ROWS = [30, 24, 28, 26, 30, 22]


def drifting_fleet(make_fleet) -> Fleet:
    """The toy fleet with a time column (days, test rows after the train rows) and each
    sensor's gain walking in time: a drift fedprior_drift can learn (q > 0). The last
    sensor's rows are 6 h apart (the others' a day): a short co-location, so the long units
    emulate it (fedprior_short) on Flower too."""
    fleet = make_fleet(num_clients=6, train=ROWS, test=8, seed=3)
    frame = fleet.frame.copy()
    rng = np.random.default_rng(7)
    t = np.zeros(len(frame))
    for _, idx in frame.groupby("sensor_id", sort=False).groups.items():
        rows = frame.loc[idx]
        order = np.r_[
            np.flatnonzero(rows["split"] == "train"), np.flatnonzero(rows["split"] == "test")
        ]
        days = np.empty(len(rows))
        step = 0.25 if len(rows) == ROWS[-1] + 8 else 1.0  # the last sensor: a short span
        days[order] = step * np.arange(len(rows), dtype=float)
        walk = np.cumsum(rng.normal(0.0, 0.03, len(rows)))[np.argsort(np.argsort(days))]
        t[frame.index.get_indexer(idx)] = days
        frame.loc[idx, "frequency_hz"] += walk * rows["pressure_hpa"].to_numpy()
    frame["time"] = t
    return Fleet(frame, meta={**fleet.meta, "time_column": "time"})


def test_a_site_file_carries_each_rows_time(make_fleet, tmp_path) -> None:
    fleet = drifting_fleet(make_fleet)
    (_, _, path), *_ = prepare_site_files(fleet, tmp_path, SITES)
    site = load_site_file(path)
    for split, got in (("train", site.train_time), ("test", site.test_time)):
        want = fleet.row_times(split)
        for k, index in enumerate(site.client_indices):
            np.testing.assert_array_equal(got[k], want[index])


def test_fedprior_drift_on_flower_equals_the_simulator(make_fleet, tmp_path) -> None:
    params = {**CONFIG.method_params["fedprior"]}
    config = replace(CONFIG, method_params={**CONFIG.method_params, "fedprior_drift": params})
    fleet = drifting_fleet(make_fleet)
    cfgs = _node_cfgs(fleet, tmp_path, SITES)
    fed = federation(config, "fedprior_drift", seed=4)
    result = run_federation(fed, InProcess(cfgs, 23, None, None, None, []))
    assert fed.rejected == {} and all(f == {} for f in fed.failed.values())
    alg = build(config, "fedprior_drift", 2)
    tensors = prepare(fleet, dtype="float64")
    res = simulate(
        alg, tensors, EngineConfig(rounds=3, seed=4, dtype="float64", aggregation=POLICY)
    )
    # the sites' times reached the algorithm: a time scale and a drift were learned
    for server in (res.server, fed.server):
        assert float(server["drift"]["scale"]) > 0 and float(server["drift"]["q"]) > 0
    last = [float(t.max()) for t in fleet.row_times("train")]
    np.testing.assert_array_equal(res.personal["t_ref"].numpy(), last)  # t_i: its last row
    final = pd.DataFrame(fed.final_rows())
    assert np.isfinite(final["test_pred_sd"].to_numpy(float)).all()
    _assert_same_as_simulator(fed, res, cfgs, 23)
    short = res.server["drift"]["short"]  # the short co-location step ran (S2 held rows)
    assert float(short["held"]) > 0 and float(fed.server["drift"]["short"]["held"]) > 0
    # recalibrate_at: each site computes it from its units' personalized models and
    # calibration rows (which stay there); the ServerApp's final table (result.json) carries
    # what fedcal run writes to per_sensor.csv from the simulator (experiment: unit_columns).
    want = alg.unit_columns(res.personal, tensors.train)["recalibrate_at"]
    assert np.isfinite(want).all() and (want > last).all()
    got = {row["client_index"]: row["recalibrate_at"] for row in result["final"]}
    assert sorted(got) == list(range(len(want)))
    np.testing.assert_allclose([got[i] for i in range(len(want))], want, rtol=1e-9)
    assert fed.unit_columns() == {i: {"recalibrate_at": got[i]} for i in got}


def test_a_site_s_unit_columns_are_checked() -> None:
    from flwr.app import ConfigRecord, MetricRecord

    from fedcal.engine.flower.validation import check_units

    row = {"client": "s0", "test_rmse": 1.0}
    ok = MetricRecord({"recalibrate_at": float("nan")})  # NaN: no drift learned, never
    assert check_units(ok, row)[1] is None and np.isnan(check_units(ok, row)[0]["recalibrate_at"])
    missing = "no per-unit columns (units record) in the last evaluation"
    assert check_units(None, row)[1] == check_units(ConfigRecord({"a": "x"}), row)[1] == missing
    clash = check_units(MetricRecord({"test_rmse": 0.0}), row)[1]
    assert clash == "per-unit columns ['test_rmse'] name columns of the evaluation row"
