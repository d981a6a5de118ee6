"""`fedcal simulate` in chunks of sensors: the same fleet, the same file's content.

The simulator's chunks concatenate to simulate_fleet's frame to the bit; the Parquet
file written one row group per chunk (save_chunks) records the same digest as
save_fleet's whole-frame write and loads to the same fleet; its CSV is the same bytes.
"""

from __future__ import annotations

import json

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fedcal.data.loader import PARQUET_META_KEY, load_fleet, save_chunks, save_fleet
from fedcal.data.simulator import FleetSpec, simulate_chunks, simulate_fleet

SPEC = FleetSpec(num_sensors=7, train_design="3x2", family="silicon", num_lots=2)


@pytest.fixture(scope="module")
def whole():
    return simulate_fleet(SPEC, seed=2)


def test_chunks_concatenate_to_the_whole_frame(whole):
    parts = list(simulate_chunks(SPEC, seed=2, chunk_size=3))
    assert [p["sensor_id"].nunique() for p in parts] == [3, 3, 1]
    pd.testing.assert_frame_equal(
        pd.concat(parts, ignore_index=True), whole.frame, check_exact=True
    )


def test_row_groups_carry_the_whole_frames_digest_and_load_equal(whole, tmp_path):
    save_fleet(whole, tmp_path / "whole.parquet")
    rows, sensors = save_chunks(simulate_chunks(SPEC, 2, 3), tmp_path / "chunks.parquet")
    assert (rows, sensors) == (len(whole.frame), 7)
    meta = [pq.ParquetFile(tmp_path / f) for f in ("whole.parquet", "chunks.parquet")]
    assert meta[1].num_row_groups == 3
    a, b = (json.loads(m.schema_arrow.metadata[PARQUET_META_KEY]) for m in meta)
    assert a["sha256"] == b["sha256"] and a["rows"] == b["rows"]
    assert a["rows_per_sensor"] == b["rows_per_sensor"]
    one, two = (load_fleet(tmp_path / f) for f in ("whole.parquet", "chunks.parquet"))
    pd.testing.assert_frame_equal(one.frame, two.frame, check_exact=True)


def test_a_changed_row_group_is_refused(tmp_path):
    path = tmp_path / "chunks.parquet"
    save_chunks(simulate_chunks(SPEC, 2, 3), path)
    frame = pq.read_table(path).to_pandas()
    frame.loc[len(frame) - 1, "frequency_hz"] += 1.0  # the last row group's last row
    changed = pq.ParquetFile(path)
    pq.write_table(pa.Table.from_pandas(frame, schema=changed.schema_arrow), path)
    with pytest.raises(ValueError, match="differs from the digest"):
        load_fleet(path)


def test_csv_in_chunks_is_the_same_bytes(whole, tmp_path):
    save_fleet(whole, tmp_path / "whole.csv")
    save_chunks(simulate_chunks(SPEC, 2, 3), tmp_path / "chunks.csv")
    assert (tmp_path / "whole.csv").read_bytes() == (tmp_path / "chunks.csv").read_bytes()


def test_parts_that_do_not_line_up_are_refused_naming_the_file(tmp_path):
    """A part whose columns differ in order from the first part's was written under the
    first header (CSV: values in the wrong columns); a column typed only in a later part
    (all missing in the first: Arrow's null type) failed with an Arrow error naming nothing.
    Both are a ValueError naming the file, the part and the columns."""
    a = pd.DataFrame({"sensor_id": ["A"] * 2, "frequency_hz": [3.0e4, 3.1e4], "note": [None] * 2})
    b = a.assign(sensor_id="B", note="x")
    swapped = b[["sensor_id", "note", "frequency_hz"]]
    for suffix in (".csv", ".parquet"):
        path = tmp_path / f"f{suffix}"
        with pytest.raises(ValueError, match=rf"f\{suffix}: part 2 has the columns"):
            save_chunks(iter([a, swapped]), path)
        assert not path.exists()
    with pytest.raises(ValueError, match=r"f2\.parquet: part 2: .*hold: note \("):
        save_chunks(iter([a, b]), tmp_path / "f2.parquet")
    # the same parts in the order that types every column first: written and loadable
    rows, sensors = save_chunks(iter([b, a]), tmp_path / "f3.parquet")
    assert (rows, sensors) == (4, 2) and pq.ParquetFile(tmp_path / "f3.parquet").num_row_groups == 2


def test_a_missing_text_cell_loads_back_from_either_writer(whole, tmp_path):
    """A text column with a missing cell: save_fleet hashed the frame in memory (None →
    "None") but the file reads back NaN ("nan"), so load_fleet refused its own file as
    changed; the digest is of the table as it reads back, as save_chunks' is (equal)."""
    frame = whole.frame.assign(note=None)
    frame.loc[0, "note"] = "checked"
    fleet = type(whole)(frame, whole.features, whole.target, whole.client_column, whole.meta)
    save_fleet(fleet, tmp_path / "whole.parquet")
    save_chunks(iter([frame.iloc[:100], frame.iloc[100:]]), tmp_path / "chunks.parquet")
    loaded = [load_fleet(tmp_path / f) for f in ("whole.parquet", "chunks.parquet")]
    pd.testing.assert_frame_equal(loaded[0].frame, loaded[1].frame, check_exact=True)
    assert loaded[0].frame["note"].iloc[0] == "checked" and loaded[0].frame["note"].isna().sum()
    a, b = (
        json.loads(pq.ParquetFile(tmp_path / f).schema_arrow.metadata[PARQUET_META_KEY])
        for f in ("whole.parquet", "chunks.parquet")
    )
    assert a["sha256"] == b["sha256"]
