"""``fedcal run`` on large fleets: sensor statuses judged by chunks, the chunk size chosen
from the fleet (issue 25.1).

The judging (each sensor's flags at its test rows and its own least-squares fit) ran on
every unit at once and was a 10,000-unit run's peak memory; it now runs ``chunk_size``
units at a time and must give what it gave at once, in the fleet's order. Without
``--chunk-size`` the run chooses one from the fleet's units and rows a unit, says so, and
config.json records it; a small fleet runs all at once as before.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pandas as pd
import pytest
import torch

from fedcal.build import (
    AUTO_CHUNK_ROWS,
    auto_chunk_size,
    build_algorithm,
    build_task,
    client_inputs,
    load_run_data,
    with_auto_chunk,
)
from fedcal.config import default_config
from fedcal.core.tree import tree_map
from fedcal.data.loader import save_chunks
from fedcal.data.simulator import FleetSpec, simulate_chunks
from fedcal.engine.simulation import EngineConfig, simulate
from fedcal.experiment import _own_fit, judge_sensors

SPEC = FleetSpec(num_reference=3, num_new=4, reference_design="4x3", train_design="3x2")


@pytest.fixture(scope="module")
def fleet_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("runmemory") / "fleet.parquet"
    save_chunks(simulate_chunks(SPEC, seed=1, chunk_size=3), path)
    return path


def config(path, chunk_size=0):
    cfg = default_config()
    return replace(
        cfg,
        seeds=1,
        engine=replace(cfg.engine, rounds=2, chunk_size=chunk_size),
        data=replace(cfg.data, path=str(path)),
    )


@pytest.fixture(scope="module")
def trained(fleet_file):
    cfg = config(fleet_file)
    fleet, _ = load_run_data(cfg)
    tensors = fleet.tensors
    task = build_task(cfg, tensors.train.x.shape[-1], fleet.meta, client_inputs(tensors))
    algorithm = build_algorithm("fedprior_fixed", cfg, task)
    result = simulate(algorithm, tensors, EngineConfig(rounds=2, seed=0))
    return algorithm, result, tensors, task


def test_auto_chunk_size_by_hand():
    assert AUTO_CHUNK_ROWS == 450_000
    assert auto_chunk_size(1_000, 444) == 0  # 444,000 rows: one chunk
    assert auto_chunk_size(1_014, 444) == 1_000  # 450,216 rows: 450,000 // 444 = 1,013
    assert auto_chunk_size(100_000, 444) == 1_000
    assert auto_chunk_size(100_000, 66) == 6_800  # 6,818 rounded down to a hundred
    assert auto_chunk_size(50, 100_000) == 4  # fewer than 100 fit: as many as fit
    assert auto_chunk_size(10, 10**7) == 1


def test_judging_by_chunks_equals_judging_at_once(trained, monkeypatch):
    """Chunks of 3 of 7 units (3, 3, 1): the same flags, own fits and statuses, in order.

    fedprior's own flag is the same for every unit of this fleet, so a flag that differs
    from unit to unit is added (``refused`` for units whose first coefficient is above the
    fleet's median, read off each unit's own parameters), absent from a chunk where no unit
    has it: a chunk put in the wrong place, or its flags lost, changes the statuses."""
    algorithm, result, tensors, task = trained
    first = result.personal["coef"][:, 0]
    median = float(first.median())
    assert len(set(first.tolist())) == 7
    own = type(algorithm).client_status

    def status(self, server, personal, x, mask):
        flags = own(self, server, personal, x, mask)
        refused = personal["coef"][:, 0] > median
        return {**flags, "refused": refused} if bool(refused.any()) else flags

    monkeypatch.setattr(type(algorithm), "client_status", status)
    history = pd.DataFrame(result.history)
    whole = judge_sensors(algorithm, result, tensors, history, task.primary_metric)
    refused = [s == "refused" for s in whole[0]]
    assert refused == (first > median).tolist() and any(refused) and not all(refused)
    for size in (1, 3, 7, 100):  # 1: a chunk without the flag
        got = judge_sensors(algorithm, result, tensors, history, task.primary_metric, None, size)
        assert got[0] == whole[0] and got[1] == whole[1]
        pd.testing.assert_frame_equal(got[2], whole[2])
    at_once = _own_fit(algorithm, result, tensors, task.primary_metric)
    by_chunks = _own_fit(algorithm, result, tensors, task.primary_metric, 3)
    assert at_once is not None and list(by_chunks) == list(range(7))
    for i in range(7):  # the same per-unit computations: equal to the bit
        assert by_chunks[i] == at_once[i]
    assert len({v[1] for v in at_once.values()}) == 7


def test_a_nan_unit_is_diverged_and_the_others_unchanged(trained):
    """A unit whose personal model is NaN (every leaf: cov, noise, coefficients), its final row
    marked diverged as the engine marks a non-finite model: judging does not raise (the weak
    flag's eigensolver did, stopping the run), that unit is "diverged", the others keep their
    statuses and reasons, at once and in chunks."""
    algorithm, result, tensors, task = trained
    history = pd.DataFrame(result.history)
    before = judge_sensors(algorithm, result, tensors, history, task.primary_metric)

    def spoil(v):
        v = v.clone()
        if torch.is_floating_point(v):
            v[2] = float("nan")
        return v

    final = [dict(r, status="diverged") if r["client_index"] == 2 else r for r in result.final]
    spoiled = replace(result, personal=tree_map(spoil, result.personal), final=final)
    for size in (0, 1, 3):
        got = judge_sensors(algorithm, spoiled, tensors, history, task.primary_metric, None, size)
        assert got[0][2] == "diverged"
        assert got[0][:2] + got[0][3:] == before[0][:2] + before[0][3:]
        assert got[1][:2] + got[1][3:] == before[1][:2] + before[1][3:]

    # a diverged fleet: the server's support NaN too (its eigensolver raised as well)
    def nan(v):
        return v.clone().fill_(float("nan")) if torch.is_floating_point(v) else v

    fleet = replace(
        result,
        server=tree_map(nan, result.server),
        personal=tree_map(nan, result.personal),
        final=[dict(r, status="diverged") for r in result.final],
    )
    got = judge_sensors(algorithm, fleet, tensors, history, task.primary_metric, None, 3)
    assert got[0] == ["diverged"] * 7


def test_the_run_chooses_and_records_a_chunk_size(fleet_file, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import fedcal.build.data as build  # where the run reads AUTO_CHUNK_ROWS
    from fedcal.cli import app

    cfg = config(fleet_file)
    fleet, _ = load_run_data(cfg)
    rows = int(fleet.tensors.train.x.shape[1]) + int(fleet.tensors.test.x.shape[1])
    assert with_auto_chunk(cfg, fleet) == (cfg, "")  # small: all at once, unchanged
    monkeypatch.setattr(build, "AUTO_CHUNK_ROWS", 3 * rows)  # 3 units a chunk
    chosen, note = with_auto_chunk(cfg, fleet)
    assert chosen.engine.chunk_size == 3 and f"chunk size 3 units (7 units × {rows} rows" in note
    kept = replace(cfg, engine=replace(cfg.engine, chunk_size=5))
    assert with_auto_chunk(kept, fleet) == (kept, "")  # the user's value stays
    args = ["run", "--data", str(fleet_file), "--methods", "local", "--rounds", "1"]
    runner = CliRunner(env={"COLUMNS": "1000"})
    result = runner.invoke(app, [*args, "--seeds", "1", "-q", "--out", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    assert "note: chunk size 3 units" in result.output
    saved = json.loads((tmp_path / "a" / "config.json").read_text())
    assert saved["engine"]["chunk_size"] == 3
    result = runner.invoke(
        app, [*args, "--seeds", "1", "-q", "--chunk-size", "0", "--out", str(tmp_path / "b")]
    )
    assert result.exit_code == 0, result.output
    assert "chunk size" not in result.output
    assert json.loads((tmp_path / "b" / "config.json").read_text())["engine"]["chunk_size"] == 0


def test_a_chunk_size_in_the_users_config_file_is_their_choice(fleet_file, tmp_path, monkeypatch):
    """``chunk_size = 0`` written in the user's --config file stays all at once, as
    ``--chunk-size 0`` does; a file without it, or the shipped default's 0, is no choice."""
    from typer.testing import CliRunner

    import fedcal.build.data as build  # where the run reads AUTO_CHUNK_ROWS
    from fedcal.cli import app
    from fedcal.config import file_sets

    fleet, _ = load_run_data(config(fleet_file))
    rows = int(fleet.tensors.train.x.shape[1]) + int(fleet.tensors.test.x.shape[1])
    monkeypatch.setattr(build, "AUTO_CHUNK_ROWS", 3 * rows)  # unchosen: 3 units a chunk
    (tmp_path / "zero.toml").write_text("[engine]\nchunk_size = 0\n")
    (tmp_path / "other.toml").write_text("[engine]\neval_every = 1\n")
    assert file_sets(tmp_path / "zero.toml", "engine", "chunk_size")
    assert not file_sets(tmp_path / "other.toml", "engine", "chunk_size")
    assert not file_sets("default", "engine", "chunk_size") and not file_sets(None, "engine", "x")
    args = ["run", "--data", str(fleet_file), "--methods", "local", "--rounds", "1", "--seeds"]
    result = CliRunner(env={"COLUMNS": "1000"}).invoke(
        app, [*args, "1", "-q", "--config", str(tmp_path / "zero.toml"), "--out", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    assert "chunk size" not in result.output
    assert json.loads((tmp_path / "config.json").read_text())["engine"]["chunk_size"] == 0


def test_auto_chunk_counts_a_whole_table_fleets_padded_rows(fleet_file, tmp_path, monkeypatch):
    """A fleet read as one table (CSV) with one unit 41 times as many rows as before: the
    engine pads every unit to the largest train and the largest test count, so the rows a
    unit are that unit's, 41 × its 12 train + 60 test rows = 2,952 — not the average."""
    import fedcal.build.data as build  # where the run reads AUTO_CHUNK_ROWS

    frame = pd.read_parquet(fleet_file)
    first = frame[frame["sensor_id"] == frame["sensor_id"].iloc[0]]
    assert (first["split"] == "train").sum() == 12 and (first["split"] == "test").sum() == 60
    copies = [first.assign(pressure_hpa=first["pressure_hpa"] + 1e-3 * j) for j in range(1, 41)]
    path = tmp_path / "uneven.csv"
    pd.concat([frame, *copies], ignore_index=True).to_csv(path, index=False)
    cfg = replace(config(path), engine=replace(config(path).engine, chunk_size=0))
    fleet, _ = load_run_data(cfg)
    assert fleet.num_clients == 7 and len(fleet.frame) // 7 < 2952 // 3
    monkeypatch.setattr(build, "AUTO_CHUNK_ROWS", 3 * 2952)
    chosen, note = with_auto_chunk(cfg, fleet)
    assert chosen.engine.chunk_size == 3 and "7 units × 2952 rows a unit" in note
