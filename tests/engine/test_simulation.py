"""The simulator's scheduling: determinism, partial participation, resume."""

import pandas as pd
import pytest
import torch

from fedcal.algorithms.fedgmi import FedGMI
from fedcal.core.task import Task
from fedcal.core.tensorfile import load_trees
from fedcal.engine.simulation import CheckpointError, EngineConfig, cohort, prepare, simulate
from fedcal.models.mlp import MLP


def setup(make_fleet):
    tensors = prepare(make_fleet(num_clients=4, train=[10, 14, 6, 9]), dtype="float64")
    return FedGMI(Task(MLP(hidden=(6, 6))), local_epochs=1, batch_size=4), tensors


def test_same_seed_same_numbers_other_seed_other_numbers(make_fleet):
    alg, tensors = setup(make_fleet)
    a = simulate(alg, tensors, EngineConfig(rounds=2, seed=3, dtype="float64"))
    b = simulate(alg, tensors, EngineConfig(rounds=2, seed=3, dtype="float64"))
    c = simulate(alg, tensors, EngineConfig(rounds=2, seed=4, dtype="float64"))
    assert all(torch.equal(a.personal[k], b.personal[k]) for k in a.personal)
    assert a.final == b.final
    assert not torch.equal(a.personal["l0.weight"], c.personal["l0.weight"])


def test_cohort_is_seeded_sorted_and_sized():
    picks = [cohort(0, t, 10, 0.3).tolist() for t in range(5)]
    assert all(len(p) == 3 and p == sorted(p) for p in picks)
    assert picks == [cohort(0, t, 10, 0.3).tolist() for t in range(5)]
    assert len({tuple(p) for p in picks}) > 1
    assert cohort(0, 0, 10, 1.0).tolist() == list(range(10))


def test_interrupted_run_resumes_with_identical_numbers(tmp_path, make_fleet):
    alg, tensors = setup(make_fleet)
    config = EngineConfig(rounds=4, seed=1, participation=0.5, dtype="float64")
    straight = simulate(alg, tensors, config)
    ckpt = tmp_path / "ckpt.pt"

    def interrupt(t, summary):
        if t == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        simulate(alg, tensors, config, on_round=interrupt, checkpoint=ckpt, checkpoint_every=2)
    assert load_trees(ckpt)[1]["round"] == 2
    resumed = simulate(alg, tensors, config, checkpoint=ckpt, checkpoint_every=2)
    assert all(torch.equal(straight.personal[k], resumed.personal[k]) for k in straight.personal)
    pd.testing.assert_frame_equal(pd.DataFrame(straight.history), pd.DataFrame(resumed.history))


def test_checkpoint_of_another_run_is_refused(tmp_path, make_fleet):
    alg, tensors = setup(make_fleet)
    ckpt = tmp_path / "ckpt.pt"
    simulate(alg, tensors, EngineConfig(rounds=1, dtype="float64"), checkpoint=ckpt)
    with pytest.raises(ValueError, match="belongs to another run"):
        simulate(alg, tensors, EngineConfig(rounds=2, dtype="float64"), checkpoint=ckpt)


def test_checkpoint_is_tensors_only_and_a_damaged_one_is_a_clear_error(tmp_path, make_fleet):
    alg, tensors = setup(make_fleet)
    ckpt = tmp_path / "ckpt.pt"
    config = EngineConfig(rounds=2, dtype="float64")
    simulate(alg, tensors, config, checkpoint=ckpt, checkpoint_every=1)
    data = ckpt.read_bytes()
    assert data[8:9] == b"{"  # a safetensors JSON header, not a pickle stream
    flipped = bytearray(data)
    flipped[-20] ^= 0x04  # a bit inside the tensors/history payload
    for name, content in (("flipped", bytes(flipped)), ("truncated", data[: len(data) // 2])):
        bad = tmp_path / f"{name}.pt"
        bad.write_bytes(content)
        with pytest.raises(CheckpointError, match="start this run afresh") as err:
            simulate(alg, tensors, config, checkpoint=bad)
        assert str(bad) in str(err.value) and "\n" not in str(err.value)
