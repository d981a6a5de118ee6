"""Hostile files: special files, size limit, unit mistakes, checksummed Parquet, and the corpus.

The corpus (fedcal_support/fuzz_files.py, >= 200 mutated files) is loaded case by
case in a worker process with a time limit; its counts are the table of docs/safety.md.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pandas as pd
import pytest

from fedcal.data.fleet import Fleet
from fedcal.data.loader import PARQUET_META_KEY, FleetDataError, load_fleet, save_fleet
from fedcal_support import fuzz_files


def fuzz_module():
    return fuzz_files


@pytest.fixture(scope="module")
def base():
    return fuzz_module().base_frame()


def error(path, **kwargs) -> str:
    with pytest.raises(FleetDataError) as info:
        load_fleet(path, **kwargs)
    text = str(info.value)
    assert str(path) in text and "\n" not in text
    return text


# --------------------------------------------------------------------------- special files


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_named_pipe_is_refused_without_waiting_for_a_writer(tmp_path, suffix):
    fifo = tmp_path / f"pipe{suffix}"
    os.mkfifo(fifo)
    start = time.monotonic()
    assert "named pipe (FIFO)" in error(fifo)
    assert time.monotonic() - start < 30  # generous: a hang would block forever


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null"])
def test_symlink_to_a_device_is_refused_unread(tmp_path, device):
    link = tmp_path / "fleet.csv"
    link.symlink_to(device)
    assert "character device" in error(link)


def test_directory_and_missing_file(tmp_path):
    (tmp_path / "d.csv").mkdir()
    assert "directory" in error(tmp_path / "d.csv")
    assert "file not found" in error(tmp_path / "nope.csv")


def test_size_limit_argument_and_environment(tmp_path, base, monkeypatch):
    path = tmp_path / "fleet.csv"
    save_fleet(Fleet(base), path)
    size = path.stat().st_size
    assert f"{size} bytes, over the limit of 1000 bytes" in error(path, max_bytes=1000)
    monkeypatch.setenv("FEDCAL_MAX_FILE_BYTES", "1000")
    assert "FEDCAL_MAX_FILE_BYTES" in error(path)
    monkeypatch.setenv("FEDCAL_MAX_FILE_BYTES", str(size))
    assert len(load_fleet(path).frame) == len(base)  # the limit is inclusive


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize(
    ("column", "transform", "words"),
    [
        ("pressure_hpa", lambda v: v * 100, "is it in Pa?"),
        ("pressure_hpa", lambda v: v / 10, "is it in kPa or psi?"),
        ("frequency_hz", lambda v: v / 1000, "is it in kHz?"),
        ("temperature_c", lambda v: v + 273.15, "is it in kelvin?"),
    ],
)
def test_unit_mistakes_are_named(tmp_path, base, column, transform, words):
    path = tmp_path / "fleet.csv"
    save_fleet(Fleet(base.assign(**{column: transform(base[column])})), path)
    text = error(path)
    assert words in text and f"field '{column}'" in text


def test_a_users_bounds_replace_the_plausible_range(tmp_path, base):
    path = tmp_path / "fleet.csv"
    save_fleet(Fleet(base.assign(pressure_hpa=base.pressure_hpa * 100)), path)
    fleet = load_fleet(path, physical_bounds={"pressure_hpa": (0, 2e5)})
    assert fleet.frame["pressure_hpa"].max() == pytest.approx(base.pressure_hpa.max() * 100)


@pytest.mark.parametrize("value", [1e308, -1e308, 2e15])
def test_absurd_magnitudes_are_refused_in_any_column(tmp_path, base, value):
    frame = base.assign(note=1.0)
    frame.loc[3, "pressure_hpa"] = value
    path = tmp_path / "fleet.csv"
    save_fleet(Fleet(frame), path)
    text = error(path)
    assert "absurd magnitude" in text and "line 5" in text  # header line 1, row 3 → line 5
    # ... also in a column the loader knows nothing about
    frame = base.rename(columns={"pressure_hpa": "level_mm"})
    frame.loc[3, "level_mm"] = value
    save_fleet(Fleet(frame), path)
    assert "absurd magnitude" in error(path, target="level_mm")


# --------------------------------------------------------------------------- Parquet


def test_saved_parquet_has_page_checksums_and_a_row_record(tmp_path, base):
    import pyarrow.parquet as pq

    path = tmp_path / "fleet.parquet"
    save_fleet(Fleet(base), path)
    record = json.loads(pq.ParquetFile(path).schema_arrow.metadata[PARQUET_META_KEY])
    assert record["rows"] == len(base) and record["client_column"] == "sensor_id"
    assert record["rows_per_sensor"] == base["sensor_id"].value_counts().to_dict()
    pd.testing.assert_frame_equal(
        load_fleet(path).frame[base.columns.tolist()], base, check_dtype=False
    )


def test_a_bit_flip_in_a_data_page_is_a_checksum_error(tmp_path, base):
    path = tmp_path / "fleet.parquet"
    save_fleet(Fleet(base), path)
    data = path.read_bytes()
    # The pressure column's page holds this value's 8 little-endian bytes verbatim (PLAIN).
    needle = np.float64(base["pressure_hpa"].iloc[10]).tobytes()
    at = data.find(needle)
    assert at > 0
    flipped = bytearray(data)
    flipped[at + 3] ^= 0x01  # a different, still plausible pressure
    path.write_bytes(bytes(flipped))
    assert "fails its checksum" in error(path)


def test_rows_edited_behind_the_metadata_are_refused(tmp_path, base):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "fleet.parquet"
    save_fleet(Fleet(base), path)
    meta = pq.read_table(path).schema.metadata
    relabelled = base.assign(sensor_id=base["sensor_id"].replace({"S01": "S02"}))
    table = pa.Table.from_pandas(relabelled, preserve_index=False).replace_schema_metadata(meta)
    pq.write_table(table, path)
    text = error(path)
    assert "rows per sensor differ" in text and "'S01': 0 read, 30 recorded" in text


# --------------------------------------------------------------------------- the corpus


def test_fuzz_corpus_no_traceback_no_hang_nothing_silently_accepted(tmp_path):
    fuzz = fuzz_module()
    cases = fuzz.build_corpus(tmp_path / "corpus")
    assert len(cases) >= 200
    results = fuzz.run_corpus(cases, timeout=30.0)
    bad = [
        (case.name, outcome, detail)
        for case, outcome, detail in results
        if outcome in ("traceback", "hang", "silently accepted", "wrongly refused")
    ]
    assert bad == []
    counts = fuzz.tally(results)
    assert counts["checked"]["clear error"] >= 180
    assert counts["checked"]["accepted, valid"] >= 10  # harmless changes still load
