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


def test_the_options_are_load_fleets(fleet_file):
    """load_fleet_chunks takes load_fleet's options by name, with its defaults: a seeded split
    of its own (the file's split column ignored, another fraction and seed) splits each sensor
    as load_fleet does. An unknown option is a TypeError at the call; a bad value is refused
    at the first row group (a generator checks nothing before)."""
    options = {"split_column": None, "test_fraction": 0.3, "seed": 4}
    whole = load_fleet(fleet_file, **options)
    parts = list(load_fleet_chunks(fleet_file, **options))
    joined = pd.concat([p.frame for p in parts], ignore_index=True)
    pd.testing.assert_frame_equal(joined, whole.frame.reset_index(drop=True))
    assert all(p.meta["split"] == "seeded" for p in parts)
    default = load_fleet(fleet_file, split_column=None).frame["split"].tolist()
    assert joined["split"].tolist() != default  # the fraction and seed reached the split
    with pytest.raises(TypeError, match="test_fractions"):
        load_fleet_chunks(fleet_file, test_fractions=0.3)
    chunks = load_fleet_chunks(fleet_file, test_fraction=1.5)
    with pytest.raises(ValueError, match=r"test_fraction must be in \[0, 1\), got 1.5"):
        next(chunks)


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


def _two_groups(table: pa.Table, path, first_rows: int) -> None:
    """``table`` without fedcal's metadata as two row groups: its first ``first_rows`` rows
    (whole sensors), then the rest."""
    with pq.ParquetWriter(path, table.schema) as w:
        w.write_table(table.slice(0, first_rows))
        w.write_table(table.slice(first_rows))


def _sensor_border(table: pa.Table) -> int:
    ids = table.column("sensor_id").to_pylist()
    return next(i for i in range(1, len(ids)) if ids[i] != ids[i - 1])


def test_a_unit_mistake_in_one_row_group_is_refused_as_load_fleet_refuses_it(fleet_file, tmp_path):
    """The second row group's frequencies in mHz (×1000): alone it has a consistent median,
    so a per-group check passes it; the file's median (the first group's Hz) refuses it, as
    load_fleet does. Pressures of the second group in kPa (÷10): the file's largest pressure
    still reaches ambient, so both readers pass them (the reach check is the file's)."""
    table = pq.read_table(fleet_file).replace_schema_metadata(None)
    border = _sensor_border(table)  # the first sensor alone in the first row group
    f = table.column("frequency_hz").to_numpy()
    scaled = f.copy()
    scaled[border:] *= 1000.0
    bad = table.set_column(
        table.column_names.index("frequency_hz"), "frequency_hz", pa.array(scaled)
    )
    path = tmp_path / "mhz.parquet"
    _two_groups(bad, path, border)
    with pytest.raises(FleetDataError, match="away from the column's median"):
        load_fleet(path)
    with pytest.raises(FleetDataError, match="away from the column's median"):
        list(load_fleet_chunks(path))
    p = table.column("pressure_hpa").to_numpy().copy()
    p[border:] /= 10.0
    kpa = table.set_column(table.column_names.index("pressure_hpa"), "pressure_hpa", pa.array(p))
    path = tmp_path / "kpa.parquet"
    _two_groups(kpa, path, border)
    assert len(load_fleet(path).frame) == sum(len(c.frame) for c in load_fleet_chunks(path))


def test_a_padded_id_in_a_later_row_group_is_the_same_sensor(fleet_file, tmp_path):
    """Ids are read stripped: "S" in one row group and "S " in the next are one sensor over
    two row groups, refused naming it (they were two units with one id)."""
    table = pq.read_table(fleet_file).replace_schema_metadata(None)
    border = _sensor_border(table)
    ids = table.column("sensor_id").to_pylist()
    sensor = ids[0]
    ids[border] = ids[border + 1] = sensor + " "  # two rows of the next sensor, padded
    padded = table.set_column(table.column_names.index("sensor_id"), "sensor_id", pa.array(ids))
    path = tmp_path / "padded.parquet"
    _two_groups(padded, path, border)
    with pytest.raises(FleetDataError, match=f"sensor '{sensor}' has rows in row group 2"):
        list(load_fleet_chunks(path))


def test_prepare_chunks_refuses_an_id_in_two_parts(fleet_file):
    """Parts that repeat a sensor id (not from load_fleet_chunks, which refuses it) would
    become two units with one id: refused naming it."""
    whole = load_fleet(fleet_file)
    part = next(iter(load_fleet_chunks(fleet_file)))
    with pytest.raises(ValueError, match=f"sensor '{part.client_ids[0]}' is in two parts"):
        prepare_chunks(lambda: iter([part, whole]))
