"""A Parquet fleet file read one row group at a time (``load_fleet_chunks``).

A mixed fleet of 7 sensors written 3 a row group (``save_chunks``, what ``fedcal simulate``
does), read by row groups: the row groups' frames concatenated are ``load_fleet``'s frame
(values, record numbers, split), and ``prepare_chunks`` of them gives ``prepare``'s tensors
of the whole file to the bit. A changed value is refused before the first row group (the
file's digest), a sensor split over two row groups is refused naming it, a CSV file too.
"""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from fedcal.data.loader import FleetDataError, load_fleet, load_fleet_chunks, save_chunks
from fedcal.data.simulator import FleetSpec, simulate_chunks
from fedcal.engine.simulation import prepare, prepare_chunks

SPEC = FleetSpec(num_reference=3, num_new=4, reference_design="4x3", train_design="3x2")


@pytest.fixture(scope="module")
def fleet_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("chunks") / "fleet.parquet"
    save_chunks(simulate_chunks(SPEC, seed=1, chunk_size=3), path)
    return path


def test_row_groups_equal_the_whole_file(fleet_file):
    assert pq.ParquetFile(fleet_file).num_row_groups == 3
    whole = load_fleet(fleet_file)
    parts = list(load_fleet_chunks(fleet_file))
    assert [p.num_clients for p in parts] == [3, 3, 1]
    joined = pd.concat([p.frame for p in parts], ignore_index=True)
    pd.testing.assert_frame_equal(joined, whole.frame.reset_index(drop=True))
    assert all(p.meta == whole.meta for p in parts)
    # The record numbers run over the whole file (messages name rows of the file).
    assert joined["source_line"].tolist() == list(range(len(joined)))
    a, b = prepare_chunks(lambda: load_fleet_chunks(fleet_file)), prepare(whole)
    assert a.client_ids == b.client_ids
    for split in ("train", "test"):
        for name in ("x", "y", "count", "branch"):
            t, u = getattr(getattr(a, split), name), getattr(getattr(b, split), name)
            assert torch.equal(t, u), (split, name)


def test_a_changed_value_is_refused_before_any_row_group(fleet_file, tmp_path):
    table = pq.read_table(fleet_file)
    col = table.column_names.index("pressure_hpa")
    values = table.column(col).to_pylist()
    values[5] += 0.001
    changed = table.set_column(col, "pressure_hpa", pa.array(values))
    path = tmp_path / "changed.parquet"
    pq.write_table(changed, path, row_group_size=400)  # keeps fedcal's metadata
    with pytest.raises(FleetDataError, match="differs from the digest"):
        next(load_fleet_chunks(path))


def test_a_sensor_over_two_row_groups_is_refused(fleet_file, tmp_path):
    table = pq.read_table(fleet_file).replace_schema_metadata(None)
    path = tmp_path / "split.parquet"
    pq.write_table(table, path, row_group_size=100)  # row 100 starts row group 2
    ids = table.column("sensor_id").to_pylist()
    sensor = ids[100]
    assert ids[99] == sensor  # this sensor's rows run over the groups' border
    with pytest.raises(FleetDataError, match=f"sensor '{sensor}' has rows in row group 2"):
        list(load_fleet_chunks(path))


def test_csv_is_refused(tmp_path):
    path = tmp_path / "fleet.csv"
    path.write_text("sensor_id,frequency_hz,temperature_c,pressure_hpa\n")
    with pytest.raises(FleetDataError, match="give a Parquet file"):
        next(load_fleet_chunks(path))
