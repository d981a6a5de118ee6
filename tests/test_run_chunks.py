"""``fedcal run`` on a Parquet fleet file read by row groups (``build.load_run_data``).

A mixed fleet of 7 sensors written 3 a row group (``save_chunks``, as ``fedcal simulate``
writes), run once from ``load_data``'s whole frame and once from ``load_outline``'s row
groups: every file of the run directory is the same apart from wall times (physical and
federated scaling; the latter reads the file twice). A file whose sensor spans two row
groups is read whole, with a note; bad data gets ``load_fleet``'s one-line error.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from fedcal.build import FleetOutline, _Gather, load_data, load_run_data
from fedcal.config import ConfigError, default_config
from fedcal.data.fleet import Fleet
from fedcal.data.loader import FleetDataError, save_chunks
from fedcal.data.simulator import FleetSpec, simulate_chunks
from fedcal.experiment import full_scale, run_experiment, valid_ranges

SPEC = FleetSpec(num_reference=3, num_new=4, reference_design="4x3", train_design="3x2")
TIMED = {"wall_s"}  # wall time: the one thing that may differ


@pytest.fixture(scope="module")
def fleet_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("runchunks") / "fleet.parquet"
    save_chunks(simulate_chunks(SPEC, seed=1, chunk_size=3), path)
    assert pq.ParquetFile(path).num_row_groups == 3
    return path


def config(path, scaling="auto"):
    cfg = default_config()
    return replace(
        cfg,
        seeds=1,
        engine=replace(cfg.engine, rounds=2),
        data=replace(cfg.data, path=str(path), scaling=scaling),
    )


def files(out):
    found = {}
    for p in sorted(out.rglob("*")):
        if p.suffix == ".csv":
            frame = pd.read_csv(p)
            found[str(p.relative_to(out))] = frame.drop(columns=[c for c in frame if c in TIMED])
        elif p.suffix == ".json":
            # as text: NaN (a mean over no ok sensor) is not equal to itself
            data = json.loads(p.read_text())
            if isinstance(data, dict):
                data = {k: v for k, v in data.items() if k not in TIMED}
            found[str(p.relative_to(out))] = json.dumps(data, sort_keys=True)
        elif p.suffix == ".safetensors":  # its header's key order varies from write to write
            tensors = {k: v.tobytes() for k, v in load_file(p).items()}
            with safe_open(p, "np") as f:
                found[str(p.relative_to(out))] = (tensors, f.metadata())
        elif p.is_file():
            found[str(p.relative_to(out))] = p.read_bytes()
    return found


@pytest.mark.parametrize("scaling", ["auto", "federated"])
def test_a_run_by_row_groups_equals_the_run_of_the_whole_frame(
    fleet_file, tmp_path, scaling, monkeypatch
):
    if scaling == "federated":  # the digest's column bytes spilled to a file (as at 10,000 units)
        monkeypatch.setattr(_Gather, "SPILL", 100)
    cfg = config(fleet_file, scaling)
    whole = load_data(cfg)
    outline, note = load_run_data(cfg)
    assert isinstance(whole, Fleet) and isinstance(outline, FleetOutline) and note == ""
    assert outline.content_digest() == whole.content_digest()
    assert outline.roles == whole.roles and outline.num_clients == whole.num_clients == 7
    # the summary's means are over ok sensors (none after 2 rounds): compared here directly
    assert outline.full_scale == full_scale(whole)
    assert outline.valid_ranges == valid_ranges(whole)
    run_experiment(cfg, whole, tmp_path / "whole", ["fedprior_fixed"])
    run_experiment(cfg, outline, tmp_path / "rows", ["fedprior_fixed"])
    a, b = files(tmp_path / "whole"), files(tmp_path / "rows")
    assert sorted(a) == sorted(b)
    assert any(k.endswith("per_sensor.csv") for k in a) and "summary.csv" in a
    assert any(k.endswith("prior.json") for k in a)
    for name in a:
        if isinstance(a[name], pd.DataFrame):
            pd.testing.assert_frame_equal(a[name], b[name], check_exact=True, obj=name)
        else:
            assert a[name] == b[name], name


def test_a_budget_of_points_reads_the_whole_frame(fleet_file, tmp_path):
    fleet, note = load_run_data(config(fleet_file), train_points=(3,))
    assert isinstance(fleet, Fleet) and note == ""
    with pytest.raises(ConfigError, match="train_points need the fleet's frame"):
        outline = load_run_data(config(fleet_file))[0]
        run_experiment(config(fleet_file), outline, tmp_path, ["local"], (3,))
    assert not any(tmp_path.iterdir())  # refused before anything is written


def test_a_sensor_over_two_row_groups_is_read_whole_with_a_note(fleet_file, tmp_path):
    table = pq.read_table(fleet_file).replace_schema_metadata(None)
    path = tmp_path / "split.parquet"
    pq.write_table(table, path, row_group_size=100)  # a sensor's rows over the border
    fleet, note = load_run_data(config(path))
    assert isinstance(fleet, Fleet)
    assert note.startswith("sensor '") and "row group 2" in note and note.endswith("(one frame)")
    assert fleet.content_digest() == load_data(config(fleet_file)).content_digest()


def write_by_sensor(frame, path) -> None:
    """``frame`` to Parquet, one row group per sensor (no fedcal metadata: values were
    changed on purpose)."""
    groups = [g for _, g in frame.groupby("sensor_id", sort=False)]
    writer = pq.ParquetWriter(path, pa.Table.from_pandas(groups[0], preserve_index=False).schema)
    for g in groups:
        writer.write_table(pa.Table.from_pandas(g, preserve_index=False))
    writer.close()


def test_bad_data_gets_the_same_error_both_ways(fleet_file, tmp_path):
    table = pq.read_table(fleet_file).replace_schema_metadata(None)
    col = table.column_names.index("pressure_hpa")
    values = np.array(table.column(col).to_pylist())
    values[250] = np.nan  # row group 3 (rows 200–)
    path = tmp_path / "bad.parquet"
    frame = table.set_column(col, "pressure_hpa", pa.array(values)).to_pandas()
    write_by_sensor(frame, path)
    with pytest.raises(FleetDataError) as whole:
        load_data(config(path))
    with pytest.raises(FleetDataError) as rows:
        load_run_data(config(path))
    assert str(rows.value) == str(whole.value)
    assert rows.value.rows == [250] and rows.value.field == "pressure_hpa"


def test_a_sensor_with_two_roles_is_refused_at_load_naming_its_rows(fleet_file, tmp_path):
    """Both paths refuse before a run writes anything, naming the file, field and rows (the
    row-group path called it a "[data] scaling" error; the whole-frame path raised after
    writing config.json)."""
    frame = pq.read_table(fleet_file).replace_schema_metadata(None).to_pandas()
    first = frame["sensor_id"].iloc[0]
    rows = np.flatnonzero(frame["sensor_id"].to_numpy() == first)
    frame["role"] = "reference"
    frame.loc[rows[3], "role"] = "new"
    path = tmp_path / "roles.parquet"
    write_by_sensor(frame, path)
    with pytest.raises(FleetDataError) as whole:
        load_data(config(path))
    with pytest.raises(FleetDataError) as by_rows:
        load_run_data(config(path))
    assert str(by_rows.value) == str(whole.value)
    assert whole.value.field == "role" and whole.value.rows == [int(rows[3])]
    assert f"sensor '{first}' has more than one role ('reference' at record {rows[0]}" in str(
        whole.value
    )


def test_the_cli_says_when_it_reads_a_file_whole(fleet_file, tmp_path):
    from typer.testing import CliRunner

    from fedcal.cli import app

    table = pq.read_table(fleet_file).replace_schema_metadata(None)
    path = tmp_path / "split.parquet"
    pq.write_table(table, path, row_group_size=100)
    args = ["run", "--data", str(path), "--methods", "local", "--rounds", "1", "--seeds", "1"]
    result = CliRunner(env={"COLUMNS": "1000"}).invoke(app, [*args, "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert "note: sensor '" in result.output and "read whole (one frame)" in result.output
    assert (tmp_path / "o" / "summary.csv").exists()
