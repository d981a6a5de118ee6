"""Loading fleets from CSV/Parquet: round trips, validation messages, seeded split."""

from __future__ import annotations

import pickle
import re

import numpy as np
import pandas as pd
import pytest

from fedcal.data.fleet import Fleet
from fedcal.data.loader import Bounds, FleetDataError, load_fleet, save_fleet

HEADER = "sensor_id,frequency_hz,temperature_c,pressure_hpa,split"


def good_rows(sensors=("S1", "S2"), n_train=4, n_test=2) -> list[str]:
    rows = []
    for s in sensors:
        for i in range(n_train + n_test):
            split = "train" if i < n_train else "test"
            rows.append(f"{s},{30000 + 10 * i},{20 + i},{900 + 5 * i},{split}")
    return rows


def write_csv(tmp_path, rows, header=HEADER, name="fleet.csv"):
    path = tmp_path / name
    path.write_text("\n".join([header, *rows]) + "\n", encoding="utf-8")
    return path


def load_error(path, **kwargs) -> FleetDataError:
    with pytest.raises(FleetDataError) as info:
        load_fleet(path, **kwargs)
    return info.value


def has_line(message: str, n: int, kind: str = "line") -> bool:
    return re.search(rf"\b{kind} {n}\b", message) is not None


def sample_fleet(seed: int = 0) -> Fleet:
    rng = np.random.default_rng(seed)
    n = 24
    frame = pd.DataFrame(
        {
            "sensor_id": np.repeat(["S1", "S2", "S3"], n // 3),
            "frequency_hz": rng.uniform(29000, 33000, n),
            "temperature_c": rng.uniform(-10, 40, n),
            "pressure_hpa": rng.uniform(500, 1100, n),
            "split": np.tile(["train"] * 6 + ["test"] * 2, 3),
            "family": rng.integers(0, 3, n),
            "batch": rng.choice(["lot-a", "lot-b, 2024"], n),
        }
    )
    return Fleet(frame, meta={"source": "sim"})


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("suffix", [".csv", ".parquet", ".pq"])
def test_round_trip(tmp_path, suffix):
    fleet = sample_fleet()
    path = tmp_path / f"fleet{suffix}"
    save_fleet(fleet, path)
    loaded = load_fleet(path)
    pd.testing.assert_frame_equal(loaded.frame.drop(columns="source_line"), fleet.frame)
    assert loaded.frame["frequency_hz"].dtype == np.float64
    assert loaded.frame["family"].dtype == np.int64
    assert loaded.frame["source_line"].dtype == np.int64
    first = 2 if suffix == ".csv" else 0  # CSV: header is line 1; Parquet: record 0
    assert loaded.frame["source_line"].tolist() == list(range(first, first + len(fleet.frame)))
    assert loaded.meta == {"source": str(path), "split": "file"}
    assert (loaded.features, loaded.target, loaded.client_column) == (
        fleet.features,
        fleet.target,
        fleet.client_column,
    )
    # Saving a loaded fleet drops source_line; loading regenerates it.
    save_fleet(loaded, path)
    pd.testing.assert_frame_equal(load_fleet(path).frame, loaded.frame)
    assert [x.shape for x, _ in loaded.arrays("train")] == [(6, 2)] * 3


def test_split_values_normalized_and_blank_lines_counted(tmp_path):
    rows = good_rows()
    rows[0] = rows[0].replace(",train", ", TRAIN ")
    rows[4] = "  "  # a blank line is skipped but still counted
    path = write_csv(tmp_path, ["", *rows])  # line 2 is blank too
    fleet = load_fleet(path)
    assert fleet.frame["split"].iloc[0] == "train"
    assert fleet.frame["source_line"].iloc[0] == 3
    assert 7 not in fleet.frame["source_line"].tolist()
    assert fleet.frame["source_line"].iloc[4] == 8


def test_custom_split_column_name(tmp_path):
    path = write_csv(tmp_path, good_rows(), header=HEADER.replace("split", "partition"))
    fleet = load_fleet(path, split_column="partition")
    assert "partition" not in fleet.frame.columns
    assert fleet.frame["split"].value_counts().to_dict() == {"train": 8, "test": 4}


# --------------------------------------------------------------------------- file-level errors


def test_unsupported_suffix(tmp_path):
    path = tmp_path / "fleet.txt"
    path.write_text(HEADER + "\n")
    msg = str(load_error(path))
    assert "fleet.txt" in msg and ".csv" in msg and ".parquet" in msg and ".pq" in msg


def test_missing_file(tmp_path):
    path = tmp_path / "nope.csv"
    msg = str(load_error(path))
    assert "nope.csv" in msg and "not found" in msg


def test_empty_file_and_header_only(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    assert "empty.csv" in str(load_error(empty)) and "empty" in str(load_error(empty))
    header_only = write_csv(tmp_path, [], name="header.csv")
    err = load_error(header_only)
    assert "header.csv" in str(err) and "no data rows" in str(err)
    pq = tmp_path / "empty.parquet"
    sample_fleet().frame.iloc[:0].to_parquet(pq)
    assert "no data rows" in str(load_error(pq))


def test_ragged_row(tmp_path):
    rows = good_rows()
    rows[2] += ",extra"  # line 4
    rows[3] = rows[3].rsplit(",", 2)[0]  # line 5, two fields short
    rows[4] += ",,"  # trailing empty cells are fine
    err = load_error(write_csv(tmp_path, rows))
    msg = str(err)
    assert has_line(msg, 4) and "6 fields" in msg and has_line(msg, 5) and "3 fields" in msg
    assert err.rows == [4, 5] and "fleet.csv" in msg


def test_corrupt_parquet(tmp_path):
    path = tmp_path / "bad.parquet"
    path.write_bytes(b"not parquet at all")
    assert "bad.parquet" in str(load_error(path))


# --------------------------------------------------------------------------- column errors


def test_missing_columns_named_with_present_ones(tmp_path):
    path = write_csv(tmp_path, ["S1,30000,train"], header="sensor_id,frequency_hz,split")
    err = load_error(path)
    msg = str(err)
    assert "fleet.csv" in msg and "temperature_c" in msg and "pressure_hpa" in msg
    assert "'sensor_id', 'frequency_hz', 'split'" in msg
    assert err.field == "temperature_c, pressure_hpa" and has_line(msg, 1)


def test_missing_column_hint(tmp_path):
    path = write_csv(tmp_path, good_rows(), header=HEADER.replace("pressure_hpa", "Pressure_hPa"))
    assert "did you mean 'Pressure_hPa'" in str(load_error(path))


def test_unknown_split_value(tmp_path):
    rows = good_rows()
    rows[2] = rows[2].replace(",train", ",validation")
    err = load_error(write_csv(tmp_path, rows))
    msg = str(err)
    assert "fleet.csv" in msg and has_line(msg, 4) and "'split'" in msg and "validation" in msg
    assert err.rows == [4] and err.field == "split"


# --------------------------------------------------------------------------- value errors


def test_non_numeric_value(tmp_path):
    rows = good_rows()
    rows[3] = "S1,30030,abc,915,train"  # line 5
    err = load_error(write_csv(tmp_path, rows))
    msg = str(err)
    assert "fleet.csv" in msg and has_line(msg, 5) and "temperature_c" in msg and "abc" in msg
    assert err.rows == [5] and err.field == "temperature_c"


def test_empty_nan_inf_cells(tmp_path):
    rows = good_rows()
    rows[0] = "S1,30000,20,,train"  # line 2: empty
    rows[1] = "S1,30010,21,NaN,train"  # line 3
    rows[2] = "S1,30020,22,-inf,train"  # line 4
    rows[3] = "S1,30030,23,1e999,train"  # line 5: overflows to inf
    err = load_error(write_csv(tmp_path, rows))
    msg = str(err)
    assert err.field == "pressure_hpa" and err.rows == [2, 3, 4, 5]
    assert "empty cell" in msg and "'NaN'" in msg and "'-inf'" in msg and "'1e999'" in msg
    assert all(has_line(msg, n) for n in (2, 3, 4, 5))


def test_many_bad_rows_are_truncated(tmp_path):
    rows = [f"S1,{30000 + i},x,{900 + i},train" for i in range(8)] + good_rows(("S2",))
    err = load_error(write_csv(tmp_path, rows))
    assert err.rows == list(range(2, 10))
    assert "and 3 more" in str(err) and not has_line(str(err), 9)


def test_other_bad_fields_mentioned(tmp_path):
    rows = good_rows()
    rows[0] = "S1,30000,abc,x,train"
    msg = str(load_error(write_csv(tmp_path, rows)))
    assert "temperature_c" in msg and "also bad values in 'pressure_hpa'" in msg


def test_empty_sensor_id(tmp_path):
    rows = good_rows()
    rows[5] = " ," + rows[5].split(",", 1)[1]  # line 7: blank sensor id
    err = load_error(write_csv(tmp_path, rows))
    assert err.field == "sensor_id" and has_line(str(err), 7)


def test_parquet_bad_values_reported_as_records(tmp_path):
    frame = sample_fleet().frame
    frame.loc[2, "pressure_hpa"] = np.nan
    frame.loc[5, "pressure_hpa"] = np.inf
    path = tmp_path / "fleet.parquet"
    frame.to_parquet(path)
    err = load_error(path)
    msg = str(err)
    assert "fleet.parquet" in msg and "pressure_hpa" in msg and err.rows == [2, 5]
    assert has_line(msg, 2, "record") and has_line(msg, 5, "record") and "inf" in msg


def test_parquet_string_column_converted_or_reported(tmp_path):
    frame = sample_fleet().frame
    frame["temperature_c"] = frame["temperature_c"].map(repr).astype(object)
    path = tmp_path / "fleet.parquet"
    frame.to_parquet(path)
    loaded = load_fleet(path)
    assert loaded.frame["temperature_c"].dtype == np.float64
    np.testing.assert_array_equal(loaded.frame["temperature_c"], sample_fleet().frame.temperature_c)
    frame.loc[3, "temperature_c"] = "abc"
    frame.to_parquet(path)
    err = load_error(path)
    assert has_line(str(err), 3, "record") and "abc" in str(err) and "temperature_c" in str(err)


# --------------------------------------------------------------------------- duplicates


def test_repeated_rows_are_kept_and_counted_in_one_warning(tmp_path):
    """Without a time column, repeated rows (same sensor, inputs, target) are data (issue
    34.5: dry days of a rain gauge, quantized readings): kept, their share in one line."""
    rows = good_rows()
    rows.insert(5, rows[1])  # line 7 repeats line 3
    fleet = load_fleet(write_csv(tmp_path, rows))
    assert len(fleet.frame) == len(rows)
    (warning,) = fleet.meta["warnings"]
    share = 100 * 1 / len(rows)
    assert "fleet.csv: 1 repeated rows" in warning  # the file named, its share next
    assert f"({share:.3g} % of the rows" in warning and "line 7 repeats line 3" in warning


def test_a_repeat_is_found_numerically_and_across_splits(tmp_path):
    rows = good_rows()
    rows.append("S1,30010.0,21.00,905,test")  # same point as line 3, written differently
    (warning,) = load_fleet(write_csv(tmp_path, rows)).meta["warnings"]
    assert f"line {len(rows) + 1} repeats line 3" in warning


def test_a_clean_file_has_no_warning(tmp_path):
    assert "warnings" not in load_fleet(write_csv(tmp_path, good_rows())).meta


def test_same_inputs_different_target_is_fine(tmp_path):
    rows = good_rows()
    rows.append("S1,30010,21,905.5,train")  # hysteresis: same inputs, another target
    rows.append("S2,30010,21,905.5,train")  # the same values on another sensor
    assert len(load_fleet(write_csv(tmp_path, rows)).frame) == len(rows)


# --------------------------------------------------------------------------- counts


def test_too_few_train_points(tmp_path):
    rows = good_rows(("S1",)) + good_rows(("S2",), n_train=2)
    err = load_error(write_csv(tmp_path, rows))
    msg = str(err)
    assert "fleet.csv" in msg and "'S2' has 2" in msg and "train" in msg
    assert err.field == "sensor_id" and err.rows == list(range(8, 12))
    assert load_fleet(write_csv(tmp_path, rows), min_train_points=2).num_clients == 2


def test_too_few_test_points(tmp_path):
    rows = good_rows(("S1",)) + good_rows(("S9",), n_test=0)
    msg = str(load_error(write_csv(tmp_path, rows)))
    assert "'S9' has 0" in msg and "test" in msg and "sensor_id" in msg


# --------------------------------------------------------------------------- physical bounds


@pytest.mark.parametrize(
    ("row", "field", "value"),
    [
        ("S1,30020,22,-3.5,train", "pressure_hpa", "-3.5"),
        ("S1,0,22,910,train", "frequency_hz", "0.0"),
        ("S1,-5,22,910,train", "frequency_hz", "-5.0"),
        ("S1,30020,-274,910,train", "temperature_c", "-274.0"),
    ],
)
def test_physically_impossible(tmp_path, row, field, value):
    rows = good_rows()
    rows[2] = row  # line 4
    err = load_error(write_csv(tmp_path, rows))
    msg = str(err)
    assert "fleet.csv" in msg and has_line(msg, 4) and field in msg and value in msg
    assert err.field == field and err.rows == [4]


def test_bounds_edges_and_overrides(tmp_path):
    rows = good_rows()
    rows[2] = "S1,30020,22,0,train"  # zero pressure is allowed (inclusive)
    path = write_csv(tmp_path, rows)
    assert load_fleet(path).frame["pressure_hpa"].iloc[2] == 0.0
    err = load_error(path, physical_bounds={"pressure_hpa": (1, 2000)})
    assert has_line(str(err), 4) and ">= 1" in str(err)
    err = load_error(path, physical_bounds={"pressure_hpa": Bounds(0, None, lo_inclusive=False)})
    assert "> 0" in str(err)
    rows[2] = "S1,30020,22,-1,train"
    assert load_fleet(write_csv(tmp_path, rows), physical_bounds={"pressure_hpa": None})
    with pytest.raises(ValueError, match="rh_percent"):
        load_fleet(path, physical_bounds={"rh_percent": (0, 100)})


# --------------------------------------------------------------------------- other schemas


def test_humidity_fleet(tmp_path):
    header = "node,capacitance_pf,temperature_c,rh_percent"
    rng = np.random.default_rng(1)
    rows = [
        f"H{s},{rng.uniform(150, 200):.4f},{rng.uniform(0, 40):.2f},{rng.uniform(5, 95):.2f}"
        for s in range(3)
        for _ in range(10)
    ]
    path = write_csv(tmp_path, rows, header=header, name="humidity.csv")
    kw = dict(features=("capacitance_pf", "temperature_c"), target="rh_percent")
    fleet = load_fleet(path, client_column="node", **kw)
    assert fleet.features == ("capacitance_pf", "temperature_c") and fleet.target == "rh_percent"
    assert fleet.client_ids == ["H0", "H1", "H2"] and fleet.meta["split"] == "seeded"
    assert [x.shape[1] for x, _ in fleet.arrays("train")] == [2, 2, 2]
    rows[4] = "H0,170,20,120"  # line 6, RH above 100 % with a user bound
    err = load_error(
        write_csv(tmp_path, rows, header=header, name="humidity.csv"),
        client_column="node",
        physical_bounds={"rh_percent": (0, 100)},
        **kw,
    )
    assert "humidity.csv" in str(err) and has_line(str(err), 6) and err.field == "rh_percent"


# --------------------------------------------------------------------------- seeded split


def test_seeded_split(tmp_path):
    rows = [r.rsplit(",", 1)[0] for r in good_rows(("A", "B", "C"), n_train=30, n_test=7)]
    path = write_csv(tmp_path, rows, header=HEADER.rsplit(",", 1)[0])
    a, b = load_fleet(path, seed=3), load_fleet(path, seed=3)
    assert a.meta["split"] == "seeded" and a.meta["split_seed"] == 3
    pd.testing.assert_frame_equal(a.frame, b.frame)
    counts = a.frame.groupby("sensor_id")["split"].apply(lambda s: (s == "test").sum())
    assert counts.to_dict() == {"A": 5, "B": 5, "C": 5}  # round(37 * 0.135) = 5
    c = load_fleet(path, seed=4)
    assert not c.frame["split"].equals(a.frame["split"])
    assert load_fleet(path, test_fraction=0.5).frame["split"].eq("test").sum() == 3 * 19
    # A sensor's split does not depend on the other sensors in the file.
    only_b = write_csv(tmp_path, [r for r in rows if r.startswith("B")], HEADER.rsplit(",", 1)[0])
    alone = load_fleet(only_b, seed=3).frame["split"].tolist()
    assert alone == a.frame.loc[a.frame.sensor_id == "B", "split"].tolist()


def test_seeded_split_keeps_one_of_each(tmp_path):
    rows = [f"S1,{30000 + i},20,{900 + i}" for i in range(3)]
    path = write_csv(tmp_path, rows, header=HEADER.rsplit(",", 1)[0])
    fleet = load_fleet(path, test_fraction=0.01, min_train_points=1)
    assert fleet.frame["split"].tolist().count("test") == 1
    fleet = load_fleet(path, test_fraction=0.99, min_train_points=1)
    assert fleet.frame["split"].tolist().count("train") == 1


def test_split_column_none_ignores_file_split(tmp_path):
    rows = good_rows(n_train=20, n_test=0)
    fleet = load_fleet(write_csv(tmp_path, rows), split_column=None)
    assert fleet.meta["split"] == "seeded" and (fleet.frame["split"] == "test").sum() == 2 * 3


# --------------------------------------------------------------------------- atomic save


@pytest.mark.parametrize(("suffix", "writer"), [(".csv", "to_csv"), (".parquet", "write_table")])
def test_failed_save_leaves_existing_file(tmp_path, monkeypatch, suffix, writer):
    import pyarrow.parquet as pq

    path = tmp_path / f"fleet{suffix}"
    path.write_bytes(b"precious")

    def broken(self, fh, *args, **kwargs):
        fh.write("half," if suffix == ".csv" else b"PAR1half")
        raise OSError("disk full")

    if writer == "to_csv":
        monkeypatch.setattr(pd.DataFrame, writer, broken)
    else:
        monkeypatch.setattr(pq, writer, broken)
    with pytest.raises(OSError, match="disk full"):
        save_fleet(sample_fleet(), path)
    assert path.read_bytes() == b"precious"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left


def test_save_unsupported_suffix(tmp_path):
    with pytest.raises(ValueError, match=r"\.xlsx"):
        save_fleet(sample_fleet(), tmp_path / "fleet.xlsx")


def test_error_pickles():
    err = FleetDataError("f.csv", "bad", [3, 4], "x")
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.rows, back.field, back.path) == (str(err), [3, 4], "x", "f.csv")
