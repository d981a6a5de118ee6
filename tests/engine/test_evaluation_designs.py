"""The evaluation forms each basis design once (issue 36.1): the same numbers, to the bit.

``errors`` scores a set of rows by fedprior's prediction, σ, interval and support guard,
each of which forms the same Legendre design; within ``reused_designs`` it is formed once.
The run's history (``metrics.csv``) and final rows (``per_sensor.csv``) must be those of
forming it every time.
"""

from __future__ import annotations

import contextlib
import math

import pytest

from fedcal.build import build_algorithm, build_task, client_inputs
from fedcal.config import load_config
from fedcal.data.simulator import FleetSpec, simulate_fleet
from fedcal.engine import evaluation
from fedcal.engine.simulation import EngineConfig, prepare, simulate
from fedcal.models import families


def same_row(a: dict, b: dict) -> bool:
    """Equal keys and values, NaN equal to NaN."""
    if a.keys() != b.keys():
        return False
    nan = [isinstance(a[k], float) and isinstance(b[k], float) and math.isnan(a[k]) for k in a]
    return all((n and math.isnan(b[k])) or a[k] == b[k] for n, k in zip(nan, a, strict=True))


@pytest.fixture(scope="module")
def prior_run():
    """The default fedprior on 30 simulated units (basis by BIC, interval, hold-out)."""
    config = load_config(None)
    fleet = simulate_fleet(FleetSpec(num_sensors=30), seed=3)
    tensors = prepare(fleet, config.data.scaling, config.engine.dtype)
    task = build_task(config, tensors.train.x.shape[-1], fleet.meta, client_inputs(tensors))
    algorithm = build_algorithm("fedprior", config, task)
    return algorithm, tensors, EngineConfig(rounds=3, seed=0, chunk_size=7)


def test_reused_designs_give_the_rows_of_fresh_ones_to_the_bit(prior_run, monkeypatch):
    algorithm, tensors, engine = prior_run
    calls: list[int] = []
    form = families.BasisFamily._products
    monkeypatch.setattr(families.BasisFamily, "_products", lambda *a: calls.append(1) or form(*a))
    reused = simulate(algorithm, tensors, engine)
    formed_reused = len(calls)
    monkeypatch.setattr(evaluation, "reused_designs", contextlib.nullcontext)
    calls.clear()
    fresh = simulate(algorithm, tensors, engine)
    assert len(calls) > formed_reused  # the designs were reused (the comparison is not void)
    assert len(fresh.history) == len(reused.history) == 30 * fresh.rounds_done > 30
    assert all(same_row(a, b) for a, b in zip(fresh.history, reused.history, strict=True))
    assert all(same_row(a, b) for a, b in zip(fresh.final, reused.final, strict=True))
    # the guard's rows (the linearized design) and a stated interval are among those scored
    assert any(r["test_beyond_support"] > 0 for r in fresh.history)
    assert any(0 < r["test_coverage95"] <= 1 for r in fresh.final)
    assert len({r["train_rmse"] for r in fresh.history}) > 30  # the rounds' numbers differ
