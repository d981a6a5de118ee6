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


def test_a_checkpoint_of_fedgmi_posterior_from_before_the_split_resumes(
    make_fleet, tmp_path, monkeypatch
):
    """Before the split, ``fedgmi_posterior`` was a FedGMI (``interpolation = "posterior"``)
    and its checkpoint's fingerprint hashed ``repr`` of that FedGMI. Such a checkpoint, its
    fingerprint computed that old way, resumes (equal to a straight run): the fingerprint
    names a class a setting selects by its base (``Algorithm.configured_repr``); every
    other registered class keeps ``repr`` exactly (their checkpoints are unchanged)."""
    from fedcal.algorithms.fedgmi import FedGMI
    from fedcal.core.algorithm import Algorithm
    from fedcal.core.tensorfile import load_trees, save_trees
    from fedcal.engine.simulation import _fingerprint

    tensors = prepare(make_fleet(num_clients=3, train=[11, 6, 9]), dtype="float64")
    task = Task(MLP(hidden=(5, 4)))
    settings = {"interpolation": "posterior", "local_epochs": 1, "batch_size": 4}
    alg = FedGMI(task, **settings)
    assert type(alg).__name__ == "FedGMIPosterior"  # the split: a class of its own
    # the pre-split object: a plain FedGMI with the same fields (its __new__ bypassed)
    before = object.__new__(FedGMI)
    FedGMI.__init__(before, task, **settings)
    assert repr(before).startswith("FedGMI(") and repr(alg).startswith("FedGMIPosterior(")
    config = EngineConfig(rounds=3, seed=2, dtype="float64")
    with monkeypatch.context() as m:  # the old formula: sha256 of repr(algorithm), ...
        m.setattr(Algorithm, "configured_repr", lambda self: repr(self))
        old_way = _fingerprint(before, tensors, config)
        assert _fingerprint(alg, tensors, config) != old_way  # why it used to be refused
    assert _fingerprint(alg, tensors, config) == old_way
    straight = simulate(alg, tensors, config)
    ckpt = tmp_path / "checkpoint.safetensors"

    def stop_after_two(t, summary):
        if t == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        simulate(alg, tensors, config, on_round=stop_after_two, checkpoint=ckpt, checkpoint_every=1)
    trees, meta, blobs = load_trees(ckpt)  # as the pre-split fedcal wrote it
    save_trees(ckpt, trees, {**meta, "fingerprint": old_way}, blobs)
    resumed = simulate(alg, tensors, config, checkpoint=ckpt, checkpoint_every=1)
    a, b = flatten(straight.personal), flatten(resumed.personal)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    pd.testing.assert_frame_equal(pd.DataFrame(straight.history), pd.DataFrame(resumed.history))
    for name in REGRESSION:  # no other checkpoint's fingerprint moves
        other = REGISTRY[name](task, local_epochs=1, batch_size=4)
        assert other.configured_repr() == repr(other) or name == "fedgmi_bayes", name
