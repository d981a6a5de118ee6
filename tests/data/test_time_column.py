"""A time column (issue 26): dates or numbers, time splits, identical rows at distinct times."""

from __future__ import annotations

import numpy as np
import pytest

from fedcal.config import ConfigError, load_config, override
from fedcal.data.field import FieldSpec, field_fleet, field_frame, shorten
from fedcal.data.loader import FleetDataError, load_fleet, time_split

HEADER = "sensor_id,time,pm25_raw,rh,pm25_ref"


def write(tmp_path, rows, name="net.csv"):
    path = tmp_path / name
    path.write_text("\n".join([HEADER, *rows]) + "\n", encoding="utf-8")
    return path


def daily(sensor: str, days: int, start: int = 1) -> list[str]:
    return [
        f"{sensor},2024-01-{d:02d},{10 + d},{50 + d % 3},{8 + d}" for d in range(start, days + 1)
    ]


def test_identical_values_at_distinct_times_are_data_and_at_one_time_a_duplicate(tmp_path):
    rows = daily("A", 8) + daily("B", 8)
    rows[3] = rows[2].replace("2024-01-03", "2024-01-04")  # same values as the day before
    path = write(tmp_path, rows)
    kw = {"features": ("pm25_raw", "rh"), "target": "pm25_ref", "split_column": None}
    # without a time column they are repeated rows: kept, said, and the time column named
    untimed = load_fleet(path, **kw)
    repeated, recommended = untimed.meta["warnings"]
    assert "1 repeated rows (6.25 % of the rows" in repeated and len(untimed.frame) == 16
    assert "column 'time' looks like each row's time; declare it (--time-column time" in (
        recommended
    )
    fleet = load_fleet(path, time_column="time", **kw)
    assert len(fleet.frame) == 16 and "warnings" not in fleet.meta
    rows[3] = rows[2]  # now the same time too: a real duplicate (line 5 repeats line 4)
    with pytest.raises(FleetDataError, match="line 5 duplicates line 4"):
        load_fleet(write(tmp_path, rows), time_column="time", **kw)


def test_the_time_split_tests_each_sensor_on_the_last_quarter_of_its_own_time(tmp_path):
    rows = daily("A", 9) + daily("B", 20, start=12)  # A: days 1–9, B: days 12–20
    fleet = load_fleet(
        write(tmp_path, rows[::-1]),  # file order does not matter
        features=("pm25_raw", "rh"),
        target="pm25_ref",
        split_column=None,
        time_column="time",
        split_by="time",
        test_fraction=0.25,
    )
    assert fleet.meta["split"] == "time" and fleet.meta["time_column"] == "time"
    day = 1 + (fleet.frame["time"] - fleet.frame["time"].min()) / 86400
    test_days = {
        s: sorted(day[(fleet.frame.sensor_id == s) & (fleet.frame.split == "test")])
        for s in ("A", "B")
    }
    # A spans 8 days: test is t > 9 − 2 = day 7 → days 8, 9; B: t > 20 − 2 → days 19, 20.
    assert test_days == {"A": [8.0, 9.0], "B": [19.0, 20.0]}


def test_numeric_times_and_the_split_keep_one_train_and_one_test_row():
    ids = np.array(["A"] * 3 + ["B"] * 2)
    times = np.array([5.0, 1.0, 2.0, 7.0, 7.5])
    assert time_split(ids, times, 0.01).tolist() == ["test", "train", "train", "train", "test"]
    assert time_split(ids, times, 0.99).tolist() == ["test", "train", "test", "train", "test"]


def test_an_unreadable_time_is_refused_naming_its_line(tmp_path):
    rows = daily("A", 6)
    rows[2] = rows[2].replace("2024-01-03", "next tuesday")
    with pytest.raises(FleetDataError, match=r"field 'time'.*line 4.*'next tuesday'"):
        load_fleet(
            write(tmp_path, rows),
            features=("pm25_raw", "rh"),
            target="pm25_ref",
            split_column=None,
            time_column="time",
        )


def test_split_by_time_needs_a_time_column():
    cfg = load_config(None)
    with pytest.raises(ConfigError, match="split_by: 'time' needs a time_column"):
        override(cfg, {"data": {"split_by": "time"}})
    ok = override(cfg, {"data": {"split_by": "time", "time_column": "t"}})
    assert ok.data.time_column == "t"


def test_the_field_generator_is_seeded_and_has_what_it_promises():
    a, b = field_frame(FieldSpec(), 0), field_frame(FieldSpec(), 0)
    assert a.equals(b) and not a.equals(field_frame(FieldSpec(), 1))
    spec = FieldSpec(extra_channels=5)
    fleet = field_fleet(spec, 0)
    assert fleet.features == ("pm25_raw", *[f"pm25_raw_b{k}" for k in range(1, 6)], "rh", "temp")
    frame = fleet.frame
    sizes = frame.groupby("sensor_id").size()
    assert sizes.min() < 0.8 * sizes.max()  # unequal data
    assert np.corrcoef(frame.pm25_raw, frame.pm25_raw_b1)[0, 1] > 0.99  # collinear channels
    assert np.corrcoef(frame.rh, frame.temp)[0, 1] < -0.3  # RH and T move with the season
    short = shorten(frame, fraction=0.5, keep=0.1, seed=0)
    train = short[short.split == "train"].groupby("sensor_id").size()
    assert (train < 0.2 * frame[frame.split == "train"].groupby("sensor_id").size()).sum() == 6
    assert short[short.split == "test"].shape[0] == frame[frame.split == "test"].shape[0]


def test_a_non_finite_time_in_a_frame_built_in_memory_is_refused_naming_it():
    # The loader refuses unreadable times in files; a frame built in memory reaches
    # row_times unchecked (the simulator ran it, the Flower site file refused it).
    import pandas as pd

    from fedcal.data.fleet import Fleet

    frame = pd.DataFrame(
        {
            "sensor_id": ["A", "A", "B", "B"],
            "t": [0.0, 1.0, np.nan, 3.0],
            "x": [1.0, 2.0, 3.0, 4.0],
            "y": [1.0, 2.0, 3.0, 4.0],
            "split": ["train"] * 4,
        }
    )
    fleet = Fleet(frame, features=("x",), target="y", meta={"time_column": "t"})
    with pytest.raises(ValueError, match=r"row 2 \(sensor B\): column 't' must be a finite"):
        fleet.row_times("train")
