"""A sparser evaluation that judges as the every-round one (issue 36.1).

The "unconverged" status reads each unit's train error in the last two evaluated rounds
(``status.still_improving``). With ``eval_every = k > 1`` the engine also scores the round
before the last — on schedule when the run's length is the cap, late when the algorithm
ends the run itself (fedprior's ``converge_tol``) — so the statuses are those of ``k = 1``.
``eval_every = "auto"`` is 1 below 10,000 units and 10 from there, and a run records the
number it used.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest

from fedcal.algorithms import REGISTRY
from fedcal.core.task import Task
from fedcal.engine import simulation
from fedcal.engine.history import as_frame
from fedcal.engine.schedule import evaluates
from fedcal.engine.settings import AUTO_EVAL_EVERY, AUTO_EVAL_UNITS, resolve_eval_every
from fedcal.engine.simulation import EngineConfig, prepare, simulate
from fedcal.models.mlp import MLP
from fedcal.status import sensor_statuses, still_improving


def test_the_schedule_scores_every_kth_round_the_last_and_the_one_before():
    def scored(rounds, k):
        return [t + 1 for t in range(rounds) if evaluates(t, rounds, k)]

    assert scored(10, 1) == list(range(1, 11))
    assert scored(10, 4) == [4, 8, 9, 10]
    assert scored(10, 10) == [9, 10] == scored(10, 50)
    assert scored(1, 5) == [1] and scored(2, 5) == [1, 2]


def test_auto_is_every_round_below_the_threshold_and_every_tenth_from_it():
    assert (AUTO_EVAL_UNITS, AUTO_EVAL_EVERY) == (10_000, 10)
    assert resolve_eval_every("auto", AUTO_EVAL_UNITS - 1) == 1
    assert resolve_eval_every("auto", AUTO_EVAL_UNITS) == AUTO_EVAL_EVERY
    assert resolve_eval_every(3, 10**6) == 3  # a number is the user's: kept


def judged(result, rounds: int, tolerance: float) -> list[str]:
    final = pd.DataFrame(result.final)
    statuses, _ = sensor_statuses(
        final, as_frame(result.history), [], {}, rounds, "rmse", tolerance
    )
    return statuses


def judged_frame(result, history: pd.DataFrame, rounds: int, tolerance: float) -> list[str]:
    final = pd.DataFrame(result.final)
    return sensor_statuses(final, history, [], {}, rounds, "rmse", tolerance)[0]


@pytest.fixture(scope="module")
def fedavg_runs():
    """FedAvg on 8 units, 8 rounds, every round evaluated and every 3rd (rounds 3, 6, 7, 8)."""
    from tests.conftest import toy_fleet

    tensors = prepare(toy_fleet(num_clients=8, train=[30, 12, 25, 18, 30, 9, 21, 16]))
    alg = REGISTRY["fedavg"](Task(MLP(hidden=(8, 8))), local_epochs=1, batch_size=8)
    runs = {k: simulate(alg, tensors, EngineConfig(rounds=8, seed=1, eval_every=k)) for k in (1, 3)}
    return runs


def test_every_third_round_judges_as_every_round(fedavg_runs):
    every, third = fedavg_runs[1], fedavg_runs[3]
    assert sorted({r["round"] for r in third.history}) == [3, 6, 7, 8]
    falling = still_improving(as_frame(every.history), "train_rmse")
    # a tolerance between the units' rates: some flagged, some not (the test can tell)
    tol = float(np.median(list(falling.values())))
    want = judged(every, 8, tol)
    assert {"unconverged", "ok"} <= set(want)
    assert judged(third, 8, tol) == want
    assert still_improving(as_frame(third.history), "train_rmse") == falling
    # the schedule before (rounds 3, 6 and 8: not the one before the last) read the pair
    # (6, 8) and judged otherwise
    frame = as_frame(every.history)
    before = frame[frame["round"].isin([3, 6, 8])]
    assert still_improving(before, "train_rmse") != falling
    assert judged_frame(every, before, 8, tol) != want


@pytest.fixture(scope="module")
def converging():
    """The shipped fedprior with its stop at convergence (R3, ε = 1e-4) on 30 campaign
    units: it ends the run itself, before the cap of 30 rounds."""
    from fedcal.data.simulator import FleetSpec
    from tests.algorithms.test_fedprior_rounds import _shipped

    alg, tensors = _shipped(FleetSpec(num_sensors=30))
    return dataclasses.replace(alg, converge_tol=1e-4), tensors


def _last_two(result) -> pd.DataFrame:
    frame = as_frame(result.history)
    last = frame["round"].max()
    return frame[frame["round"] >= last - 1].reset_index(drop=True)


def test_a_run_its_algorithm_ends_scores_the_round_before_the_end_late(converging, tmp_path):
    alg, tensors = converging
    every = simulate(alg, tensors, EngineConfig(rounds=30, seed=0, eval_every=1))
    sparse = simulate(alg, tensors, EngineConfig(rounds=30, seed=0, eval_every=30))
    s = every.rounds_done
    assert s == sparse.rounds_done < 30  # it ended the run itself
    assert sorted({r["round"] for r in sparse.history}) == [s - 1, s]  # s - 1 scored late
    pd.testing.assert_frame_equal(_last_two(sparse), _last_two(every))
    for tol in (1e-3, 1e-2, 0.05):
        assert judged(sparse, s, tol) == judged(every, s, tol)

    # interrupted after round s - 1 (not evaluated): the resumed run scores it late too
    ckpt = tmp_path / "checkpoint.safetensors"
    config = EngineConfig(rounds=30, seed=0, eval_every=30)
    save = simulation.save_checkpoint

    def stop_after(path, fingerprint, round_done, *args):
        save(path, fingerprint, round_done, *args)
        if round_done == s - 1:
            raise KeyboardInterrupt

    simulation.save_checkpoint = stop_after
    try:
        with pytest.raises(KeyboardInterrupt):
            simulate(alg, tensors, config, checkpoint=ckpt, checkpoint_every=1)
    finally:
        simulation.save_checkpoint = save
    resumed = simulate(alg, tensors, config, checkpoint=ckpt, checkpoint_every=1)
    pd.testing.assert_frame_equal(as_frame(resumed.history), as_frame(sparse.history))


def test_a_run_records_the_eval_every_it_used(tmp_path, monkeypatch):
    """``fedcal run`` with the default "auto" on a fleet at the threshold (lowered to its 20
    units here): config.json says 10, and metrics.csv holds rounds 10, 11 and 12."""
    from typer.testing import CliRunner

    from fedcal.cli import app
    from fedcal.engine import settings

    monkeypatch.setattr(settings, "AUTO_EVAL_UNITS", 20)
    (tmp_path / "c.toml").write_text('[engine]\nrounds = 12\neval_every = "auto"\n')
    out = tmp_path / "run"
    args = ["run", "--methods", "fedavg", "--config", str(tmp_path / "c.toml"), "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["engine"]["eval_every"] == 10
    metrics = pd.read_csv(next(out.glob("runs/fedavg*/metrics.csv")))
    assert sorted(set(metrics["round"])) == [10, 11, 12]
