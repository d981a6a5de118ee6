"""The optional sweep-direction column: read, normalized, signs per row; bad values refused."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from fedcal.config import ConfigError, from_dict, load_config
from fedcal.data.fleet import Fleet
from fedcal.data.loader import FleetDataError, load_fleet
from fedcal.data.simulator import FleetSpec, simulate_fleet
from fedcal.engine.simulation import prepare

HEADER = "sensor_id,frequency_hz,temperature_c,pressure_hpa,split,direction"


def write(tmp_path, directions):
    rows = []
    for i, d in enumerate(directions):
        sensor, split = ("S1", "S2")[i // 6], "train" if i % 6 < 4 else "test"
        rows.append(f"{sensor},{30000 + 10 * i},{20 + i},{900 + 5 * i},{split},{d}")
    path = tmp_path / "fleet.csv"
    path.write_text("\n".join([HEADER, *rows]) + "\n", encoding="utf-8")
    return path


def test_directions_are_read_normalized_and_become_row_signs(tmp_path):
    dirs = ["up", " Down", "UP", "down", "up", "down"] * 2
    fleet = load_fleet(write(tmp_path, dirs))
    assert fleet.frame["direction"].tolist() == [d.strip().lower() for d in dirs]
    signs = fleet.branch_signs("train")
    np.testing.assert_array_equal(signs[0], [1, -1, 1, -1])
    np.testing.assert_array_equal(fleet.branch_signs("test")[1], [1, -1])
    t = prepare(fleet)
    assert t.train.branch.tolist() == [[1, -1, 1, -1]] * 2
    assert t.test.branch.tolist() == [[1, -1]] * 2


def test_a_bad_direction_is_refused_naming_file_line_and_column(tmp_path):
    dirs = ["up"] * 12
    dirs[7] = "sideways"
    with pytest.raises(FleetDataError) as info:
        load_fleet(write(tmp_path, dirs))
    msg = str(info.value)
    assert "fleet.csv" in msg and "line 9" in msg and "'sideways'" in msg and "\n" not in msg
    assert info.value.field == "direction" and info.value.rows == [9]
    dirs[7] = ""
    with pytest.raises(FleetDataError, match="empty cell"):
        load_fleet(write(tmp_path, dirs))


def test_fleets_without_the_column_carry_no_branch_and_in_memory_frames_are_checked():
    frame = simulate_fleet(FleetSpec(num_sensors=2), seed=0).frame
    assert prepare(Fleet(frame.drop(columns=["direction"]))).train.branch is None
    t = prepare(Fleet(frame))
    up = frame[frame["split"] == "train"]["direction"].eq("up").to_numpy()
    assert t.train.branch.flatten().tolist() == np.where(up, 1.0, -1.0).tolist()
    bad = frame.assign(direction=frame["direction"].where(frame.index != 5, "both"))
    with pytest.raises(ValueError, match=r"row 5 \(sensor S000\): column 'direction' must be"):
        prepare(Fleet(pd.DataFrame(bad), meta={"source": "sim"}))
    missing = frame.assign(direction=frame["direction"].where(frame.index != 9, None))
    with pytest.raises(ValueError, match=r"row 9 \(sensor S000\): .* got nan"):
        prepare(Fleet(pd.DataFrame(missing)))


def test_signs_align_with_arrays_per_client_including_a_client_without_rows():
    """S2 has no test rows: both give it an empty entry, in ``client_ids`` order, and
    rows keep their frame order; an unknown split is refused by both."""
    frame = pd.DataFrame(
        {
            "sensor_id": ["S1", "S2", "S1", "S2", "S1"],
            "frequency_hz": [1.0, 2.0, 3.0, 4.0, 5.0],
            "temperature_c": [0.0] * 5,
            "pressure_hpa": [10.0, 20.0, 30.0, 40.0, 50.0],
            "split": ["train", "train", "test", "train", "test"],
            "direction": ["up", "Down", "down", "up", "UP"],
        }
    )
    fleet = Fleet(frame)
    for split, signs, targets in (
        ("train", [[1.0], [-1.0, 1.0]], [[10.0], [20.0, 40.0]]),
        ("test", [[-1.0, 1.0], []], [[30.0, 50.0], []]),
    ):
        assert [s.tolist() for s in fleet.branch_signs(split)] == signs
        assert [y[:, 0].tolist() for _, y in fleet.arrays(split)] == targets
    assert fleet.arrays("test")[1][0].shape == (0, 2)
    for method in (fleet.arrays, fleet.branch_signs):
        with pytest.raises(ValueError, match="split must be one of"):
            method("validation")


def test_the_config_schema_validates_branch_orders():
    cfg = from_dict({"methods": {"fb": {"base": "fedprior", "branch_orders": [2, 0]}}}, "t.toml")
    assert tuple(cfg.method_params["fb"]["branch_orders"]) == (2, 0)
    shipped = load_config("fewpoint")
    assert "fedprior_branch" in shipped.methods
    assert list(shipped.method_params["fedprior_branch"]["branch_orders"]) == [2, 0]
    with pytest.raises(ConfigError, match="branch_orders"):
        from_dict({"methods": {"fb": {"base": "fedprior", "branch_orders": "up"}}}, "t.toml")
    with pytest.raises(ConfigError, match="branch_orders"):
        from_dict({"methods": {"fb": {"base": "fedprior", "branch_orders": [1.5]}}}, "t.toml")
