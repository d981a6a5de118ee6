"""The history as columns (issue 36.1): the rows it reads back are the rows the engine built
one dict at a time (``schedule.result_row`` / ``history_row``), its DataFrame and CSV are
``pd.DataFrame(rows)``'s, and a checkpoint keeps it (an older checkpoint's rows resume too).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from fedcal.core.tensorfile import load_trees, save_trees
from fedcal.engine.history import (
    History,
    as_frame,
    block_rows,
    evaluation_block,
    round_block,
)
from fedcal.engine.schedule import history_row, result_row

NAN, INF = float("nan"), float("inf")


def same_rows(a: list[dict], b: list[dict]) -> bool:
    """Equal keys in order, values of the same Python type and equal (NaN equal to NaN)."""
    if len(a) != len(b):
        return False
    for r, s in zip(a, b, strict=True):
        if list(r) != list(s):
            return False
        for k in r:
            x, y = r[k], s[k]
            if type(x) is not type(y):
                return False
            if not (x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y))):
                return False
    return True


def evaluation(seed: int):
    """A hand-built evaluation of 4 units: rmse in float32 (unit 2's test error ∞: diverged),
    a declined interval (NaN coverage: not diverged) in float64, unit 3's model not finite."""
    g = torch.Generator().manual_seed(seed)
    test = {
        "rmse": torch.tensor([0.5, 1.25, INF, 0.75], dtype=torch.float32) + seed,
        "coverage95": torch.tensor([0.9, NAN, 1.0, 0.95], dtype=torch.float64),
    }
    train = {"rmse": torch.rand(4, generator=g, dtype=torch.float32)}
    return test, train, torch.tensor([True, True, True, False])


def rows_one_at_a_time(test, train, finite, clients, round_number, rejected, metrics, ids):
    """The rows as the engine built them before the columns (simulation._evaluate_round)."""
    test_l = {k: v.tolist() for k, v in test.items()}
    train_l = {k: v.tolist() for k, v in train.items()}
    evals = [
        result_row(i, cid, {k: v[i] for k, v in test_l.items()},
                   {k: v[i] for k, v in train_l.items()}, ok)
        for (i, cid), ok in zip(enumerate(clients), finite.tolist(), strict=True)
    ]  # fmt: skip
    values = {name: v.tolist() for name, v in metrics.items()}
    trained = {i: {name: v[j] for name, v in values.items()} for j, i in enumerate(ids)}
    return [
        history_row(r, round_number, rejected[r["client_index"]],
                    trained.get(r["client_index"], {}), list(values))
        for r in evals
    ]  # fmt: skip


def two_rounds():
    """(History, rows): round 1 with every unit training (a float32 loss, an int count),
    round 3 with units 0 and 2 (the others NaN; the int count becomes objects with NaN)."""
    clients = ("a", "b", "c", "d")
    index = np.arange(4)
    names = np.empty(4, dtype=object)
    names[:] = clients
    history, rows = History(), []
    for round_number, ids, seed in ((1, [0, 1, 2, 3], 0), (3, [0, 2], 1)):
        test, train, finite = evaluation(seed)
        metrics = {
            "train_loss": torch.arange(len(ids), dtype=torch.float32) / 3,
            "steps": torch.tensor([7] * len(ids)),
        }
        rejected = np.array([0, seed, 0, 2 * seed])
        block = evaluation_block(index, names, test, train, finite)
        history.add(round_block(block, round_number, rejected, metrics, ids))
        rows += rows_one_at_a_time(
            test, train, finite, clients, round_number, rejected.tolist(), metrics, ids
        )
    return history, rows


def test_the_columns_read_back_the_rows_the_engine_built_one_at_a_time():
    history, rows = two_rounds()
    assert len(history) == len(rows) == 8
    assert same_rows(list(history), rows)
    assert same_rows(history[-3:], rows[-3:]) and same_rows([history[5]], [rows[5]])
    assert [r["status"] for r in rows[:4]] == ["ok", "ok", "diverged", "diverged"]
    with pytest.raises(IndexError):
        history[8]


def test_the_frame_and_its_csv_are_those_of_the_rows():
    history, rows = two_rounds()
    want = pd.DataFrame(rows)
    pd.testing.assert_frame_equal(history.frame(), want)
    assert history.frame().to_csv(index=False) == want.to_csv(index=False)
    pd.testing.assert_frame_equal(as_frame(rows), want)  # a list (calibrate's RunResult)
    assert as_frame(History()).empty


def test_a_checkpoint_keeps_the_columns_and_an_older_one_its_rows(tmp_path):
    history, rows = two_rounds()
    tensors, layout = history.saved()
    # the unit indices and names, shared by both rounds, are saved once
    assert sum(1 for b in layout["blocks"] for e in b if e[1] == "same") == 2
    path = tmp_path / "h.safetensors"
    save_trees(path, {"history": tensors}, {}, {"history": layout})
    trees, _, blobs = load_trees(path)
    back = History.restored(trees["history"], blobs["history"])
    assert same_rows(list(back), rows)
    pd.testing.assert_frame_equal(back.frame(), pd.DataFrame(rows))
    old = History.restored({}, rows)  # a checkpoint written before the columns
    assert same_rows(list(old), rows) and len(old.blocks) == 2


def test_the_final_rows_are_one_block_read_back():
    test, train, finite = evaluation(0)
    names = np.empty(4, dtype=object)
    names[:] = list("abcd")
    block = evaluation_block(np.arange(4), names, test, train, finite)
    rows = block_rows({**block, "rejected_rounds": np.array([0, 1, 0, 0])})
    assert [r["rejected_rounds"] for r in rows] == [0, 1, 0, 0]
    assert rows[1]["test_rmse"] == 1.25 and type(rows[1]["client_index"]) is int


@pytest.mark.parametrize(
    "layout",
    [{"format": "other"}, {"format": "columns", "blocks": [[["x", "codes", "c0", ["ok"]]]]}],
)
def test_a_bad_history_layout_is_a_one_line_error(layout):
    with pytest.raises((ValueError, KeyError)) as err:
        History.restored({}, layout)
    assert "\n" not in str(err.value)


def test_columns_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match="different lengths"):
        History([{"a": np.zeros(2), "b": np.zeros(3)}])


def test_a_checkpoint_with_rows_from_before_the_columns_resumes(make_fleet, tmp_path):
    """A run interrupted after round 2, its checkpoint rewritten as the engine wrote it
    before the columns (the history a list of row dicts, no history tensors), resumes to the
    straight run's history and final table."""
    from fedcal.algorithms import REGISTRY
    from fedcal.core.task import Task
    from fedcal.engine.simulation import EngineConfig, prepare, simulate
    from fedcal.models.mlp import MLP

    tensors = prepare(make_fleet(num_clients=3, train=[11, 6, 9]), dtype="float64")
    alg = REGISTRY["fedavg"](Task(MLP(hidden=(5, 4))), local_epochs=1, batch_size=4)
    config = EngineConfig(rounds=3, seed=2, dtype="float64", participation=0.7)
    straight = simulate(alg, tensors, config)
    ckpt = tmp_path / "checkpoint.safetensors"

    def stop(t, summary):
        if t == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        simulate(alg, tensors, config, on_round=stop, checkpoint=ckpt, checkpoint_every=1)
    trees, meta, blobs = load_trees(ckpt)
    assert isinstance(blobs["history"], dict) and trees["history"]  # written as columns
    rows = list(History.restored(trees.pop("history"), blobs["history"]))
    save_trees(ckpt, trees, meta, {**blobs, "history": rows})
    resumed = simulate(alg, tensors, config, checkpoint=ckpt, checkpoint_every=1)
    pd.testing.assert_frame_equal(straight.history.frame(), resumed.history.frame())
    assert same_rows(list(straight.history), list(resumed.history))
    assert same_rows(straight.final, resumed.final)
