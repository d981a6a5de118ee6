"""Checkpoints of every registered method: tensors only, and a resume gives the same numbers."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from fedcal.algorithms import REGISTRY
from fedcal.core.task import Task
from fedcal.core.tree import flatten
from fedcal.engine.simulation import EngineConfig, prepare, simulate
from fedcal.models.mlp import MLP

REGRESSION = sorted(n for n, cls in REGISTRY.items() if cls.task_kind == "regression")


@pytest.mark.parametrize("name", REGRESSION)
def test_resume_from_checkpoint_equals_a_straight_run(name, make_fleet, tmp_path):
    tensors = prepare(make_fleet(num_clients=3, train=[11, 6, 9]), dtype="float64")
    alg = REGISTRY[name](Task(MLP(hidden=(5, 4))), local_epochs=1, batch_size=4)
    config = EngineConfig(rounds=3, seed=2, dtype="float64")
    straight = simulate(alg, tensors, config)
    ckpt = tmp_path / "checkpoint.safetensors"

    stop = 1 if alg.one_shot else 2  # a one-shot method runs one round (Algorithm.one_shot)

    def stop_after_two(t, summary):
        if t == stop:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        simulate(alg, tensors, config, on_round=stop_after_two, checkpoint=ckpt, checkpoint_every=1)
    resumed = simulate(alg, tensors, config, checkpoint=ckpt, checkpoint_every=1)
    a, b = flatten(straight.personal), flatten(resumed.personal)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), name
    pd.testing.assert_frame_equal(pd.DataFrame(straight.history), pd.DataFrame(resumed.history))
    # a checkpoint of a finished run: nothing left to train, the last round evaluated again
    again = simulate(alg, tensors, config, checkpoint=ckpt, checkpoint_every=1)
    for run in (resumed, again):
        c = flatten(run.personal)
        assert c.keys() == a.keys() and all(torch.equal(a[k], c[k]) for k in a), name
        pd.testing.assert_frame_equal(pd.DataFrame(straight.final), pd.DataFrame(run.final))
    # the final table is the last evaluation's rows, without the per-round columns
    assert straight.rounds_done == (1 if alg.one_shot else config.rounds)
    last = pd.DataFrame([r for r in straight.history if r["round"] == straight.rounds_done])
    final = pd.DataFrame(straight.final)
    pd.testing.assert_frame_equal(final, last[list(final.columns)].reset_index(drop=True))
    assert "round" not in final.columns and "train_loss" not in final.columns
