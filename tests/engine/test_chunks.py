"""Chunks of clients and the device option: the numbers never depend on either.

A run trained ``chunk_size`` clients at a time equals the run trained as one
cohort to the bit (float32, clients with different row counts, partial
participation, evaluation every round), and the device path — copy each
chunk to the device, run under ``torch.device``, copy the results back — gives
the same numbers when the device is the CPU (CI has no GPU).
"""

from __future__ import annotations

import math

import pytest
import torch

from fedcal.algorithms import REGISTRY
from fedcal.config import ConfigError, load_config
from fedcal.core.task import Task
from fedcal.core.tree import flatten
from fedcal.engine import chunks
from fedcal.engine.simulation import EngineConfig, prepare, simulate
from fedcal.models.mlp import MLP

COUNTS = [40, 25, 33, 12, 40, 18, 29]  # rows per client: chunks end at different steps


def run(name, make_fleet, **engine):
    tensors = prepare(make_fleet(num_clients=len(COUNTS), train=COUNTS))
    alg = REGISTRY[name](Task(MLP(hidden=(16, 16))), local_epochs=2, batch_size=8)
    config = EngineConfig(rounds=3, seed=2, participation=0.6, **engine)
    return simulate(alg, tensors, config)


def same_row(a: dict, b: dict) -> bool:
    """Equal values, NaN equal to NaN (clients that sat a round out have NaN metrics)."""
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        both_nan = isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y)
        if not (both_nan or x == y):
            return False
    return True


def assert_identical(a, b):
    assert len(a.history) == len(b.history) > 0
    assert all(same_row(r, s) for r, s in zip(a.history, b.history, strict=True))
    assert all(same_row(r, s) for r, s in zip(a.final, b.final, strict=True))
    for part in ("personal", "server", "states"):
        fa, fb = flatten(getattr(a, part)), flatten(getattr(b, part))
        assert fa.keys() == fb.keys()
        for k in fa:
            assert torch.equal(fa[k], fb[k]), (part, k)


@pytest.mark.parametrize("name", ["fedgmi", "fedavg", "ditto", "fedrep"])
def test_chunked_runs_equal_the_whole_cohort_to_the_bit(name, make_fleet):
    whole = run(name, make_fleet)
    # The trained models differ from round to round (the comparison can fail).
    assert len({r["test_rmse"] for r in whole.history}) > 1
    for chunk_size in (1, 3, len(COUNTS)):
        assert_identical(run(name, make_fleet, chunk_size=chunk_size), whole)


def test_device_path_on_the_cpu_gives_the_same_numbers(make_fleet, monkeypatch):
    whole = run("fedgmi", make_fleet)
    moved: list[str] = []
    to_device = chunks.to_device

    def counting(tree, device):
        moved.append(str(device))
        return to_device(tree, device)

    # Treat the CPU as a device: every chunk is copied to it and back, under torch.device.
    monkeypatch.setattr(chunks, "is_host", lambda device: False)
    monkeypatch.setattr(chunks, "to_device", counting)
    for chunk_size in (0, 3):
        moved.clear()
        assert_identical(run("fedgmi", make_fleet, chunk_size=chunk_size, device="cpu"), whole)
        assert "cpu" in moved  # the copies did happen


def test_bad_chunk_size_or_missing_device_is_refused():
    with pytest.raises(ValueError, match="chunk_size: must be >= 0"):
        EngineConfig(chunk_size=-1)
    with pytest.raises(ValueError, match="expected 'cpu', 'cuda' or 'cuda:N'"):
        EngineConfig(device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device here"):
            EngineConfig(device="cuda")


def test_spans_cover_every_client_once():
    assert [s.tolist() for s in chunks.spans(7, 3)] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [s.tolist() for s in chunks.spans(4, 0)] == [[0, 1, 2, 3]]
    assert [s.tolist() for s in chunks.spans(2, 5)] == [[0, 1]]


def test_engine_section_takes_chunk_size_and_device(tmp_path):
    path = tmp_path / "big.toml"
    path.write_text('[engine]\nchunk_size = 64\ndevice = "cpu"\n')
    cfg = load_config(path)
    assert (cfg.engine.chunk_size, cfg.engine.device) == (64, "cpu")
    assert load_config(None).engine.chunk_size == 0  # the default: the whole cohort at once
    path.write_text("[engine]\nchunk_size = -1\n")
    with pytest.raises(ConfigError, match=r"big.toml \[engine\] chunk_size: must be >= 0, got -1"):
        load_config(path)
    path.write_text('[engine]\ndevice = "gpu0"\n')
    with pytest.raises(ConfigError, match=r"big.toml \[engine\] device 'gpu0': expected"):
        load_config(path)


def test_assembled_chunks_equal_their_concatenation_and_keep_one_tensor_where_shared():
    a, b = torch.arange(6.0).reshape(3, 2), torch.arange(6.0, 10.0).reshape(2, 2)
    c = b + 100  # in the second chunk the "state" is another tensor than the "reply"
    parts = [
        {"reply": {"m": a}, "state": {"m": a, "empty": {}}, "metrics": {"loss": a[:, 0]}},
        {"reply": {"m": b}, "state": {"m": c, "empty": {}}, "metrics": {"loss": b[:, 0]}},
    ]
    cohort = chunks.Assembly(5)
    cohort.add(parts[0], 0)
    shared = cohort.trees()
    assert shared["reply"]["m"] is shared["state"]["m"]  # one tensor while chunks share it
    cohort.add(parts[1], 3)
    out = cohort.trees()
    assert torch.equal(out["reply"]["m"], torch.cat([a, b]))
    assert torch.equal(out["state"]["m"], torch.cat([a, c]))  # split, the rows so far kept
    assert torch.equal(out["metrics"]["loss"], torch.cat([a[:, 0], b[:, 0]]))
    assert out["state"]["empty"] == {}


def test_a_chunked_round_keeps_the_reply_and_the_state_one_tensor(make_fleet):
    tensors = prepare(make_fleet(num_clients=len(COUNTS), train=COUNTS))
    alg = REGISTRY["fedgmi"](Task(MLP(hidden=(8,))), local_epochs=1, batch_size=8)
    down = alg.broadcast(alg.server_init(alg.task.model.init(torch.Generator(), torch.float32)))
    states = alg.client_init(chunks.expand(down, len(COUNTS)))
    whole = chunks.client_update(alg, down, states, tensors.train)
    chunked = chunks.client_update(alg, down, states, tensors.train, chunk_size=3)
    for k, leaf in chunked.reply["model"].items():
        assert leaf is chunked.state["model"][k]  # FedGMI uploads its trained model
        assert torch.equal(leaf, whole.reply["model"][k])
