"""Result tables: short numbers, diverged runs named as such, readable at 100 columns."""

import math

import numpy as np
import pandas as pd
import pytest
from rich.console import Console

from fedcal.algorithms import REGISTRY
from fedcal.report.tables import aggregate, fmt_num, fmt_pm, rich_tables, table_columns


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0.043242, "0.0432"),
        (7.7812, "7.78"),
        (104.26, "104"),
        (1412.7, "1413"),
        (12.0, "12"),
        (0.1, "0.1"),
        (0.00028803, "2.88e-4"),
        (2.5e6, "2.50e6"),
        (0.0, "0"),
        (float("nan"), "diverged"),
    ],
)
def test_fmt_num_is_short_and_names_nan(value, text):
    assert fmt_num(value) == text


def test_fmt_pm():
    assert fmt_pm(7.78, 0.41) == "7.78 ±0.41"
    assert fmt_pm(0.00288, 4.3e-19) == "0.00288 ±0"  # float noise of identical seeds
    assert fmt_pm(5.0, float("nan")) == "5"  # one seed: no spread to show
    assert fmt_pm(float("nan"), 1.0) == "diverged"


def summary_frame(status: bool = True) -> pd.DataFrame:
    rows = [
        # method, seed, rmse_mean, rmse_worst, status
        ("polynomial", 0, 0.04, 0.07, "ok"),
        ("polynomial", 1, 0.06, 0.09, "ok"),
        ("fedbn", 0, 5.0, 9.0, "ok"),
        ("fedbn", 1, 6.0, 8.0, "diverged"),  # a finite number from a diverged run
        ("fedrep", 0, float("nan"), float("nan"), "diverged"),
        ("fedrep", 1, 3.0, 4.0, "ok"),
    ]
    frame = pd.DataFrame(rows, columns=["method", "seed", "rmse_mean", "rmse_worst", "status"])
    frame.insert(2, "train_points", 0)
    frame["wall_s"] = [1.0, 3.0, 2.0, 2.0, 4.0, 6.0]
    # a column only one method writes (as fedprior's weak_directions): NaN for the others
    frame["weak_directions"] = [np.nan, np.nan, np.nan, np.nan, 1.0, 3.0]
    return frame if status else frame.drop(columns="status")


def test_aggregate_mean_std_and_diverged_never_averaged_away():
    table = aggregate(summary_frame()).set_index("method")
    assert table.loc["polynomial", "rmse_mean"] == pytest.approx(0.05)
    assert table.loc["polynomial", "rmse_mean_std"] == pytest.approx(0.01)  # ddof = 0
    # one diverged seed makes the method's error NaN, whether the number was NaN or not
    assert math.isnan(table.loc["fedbn", "rmse_mean"])
    assert math.isnan(table.loc["fedrep", "rmse_worst"])
    assert table.loc["fedbn", "diverged_seeds"] == 1
    # cost columns stay numbers
    assert table.loc["fedrep", "wall_s"] == pytest.approx(5.0)
    assert list(table.index) == ["polynomial", "fedbn", "fedrep"]
    # a method without the method-specific column is not diverged because of it
    assert table.loc["polynomial", "diverged_seeds"] == 0
    assert math.isnan(table.loc["polynomial", "weak_directions"])
    # without a status column a NaN metric alone marks the seed
    plain = aggregate(summary_frame(status=False)).set_index("method")
    assert math.isnan(plain.loc["fedrep", "rmse_mean"])
    assert plain.loc["fedbn", "rmse_mean"] == pytest.approx(5.5)


def wide_summary() -> pd.DataFrame:
    """Every registered method (long names too), large and small errors, one diverged."""
    rng = np.random.default_rng(0)
    names = [*sorted(REGISTRY, key=len, reverse=True)[:10], "fedgmi_nointerp"]
    rows = []
    for i, name in enumerate(names):
        for seed in range(3):
            scale = 10.0 ** rng.uniform(-4, 4)
            rows.append(
                {
                    "method": name,
                    "seed": seed,
                    "train_points": 0,
                    "rmse_mean": scale * (1 + 0.1 * seed),
                    "rmse_worst": 3 * scale * (1 + 0.2 * seed),
                    "mae_mean": scale,
                    "max_abs_worst": 7 * scale * (1 + 0.3 * seed),
                    "rmse_mean_pct_fs": scale / 15.5,
                    "max_abs_worst_pct_fs": scale / 2.2,
                    "wall_s": 1234.5 + seed,
                    "bytes_up_per_round": 1.41e6,
                    "bytes_down_per_round": 1.41e6,
                    "status": "diverged" if i == 3 else "ok",
                }
            )
    return pd.DataFrame(rows)


@pytest.mark.parametrize(
    ("show_bytes", "width"), [(False, 100), (True, 100), (False, 80)], ids=["run", "compare", "80"]
)
def test_table_fits_100_columns_with_whole_names_and_numbers(show_bytes, width):
    summary = wide_summary()
    table = aggregate(summary)
    console = Console(width=width, record=True, force_terminal=False, color_system=None)
    for t in rich_tables(table, table_columns(table, "hPa", show_bytes), "hPa"):
        console.print(t)
    text = console.export_text()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    assert "…" not in text
    body = [line for line in lines if line.startswith("│")]
    assert len(body) == table.shape[0]  # one line per method: no cell wrapped
    for line, (_, row) in zip(body, table.iterrows(), strict=True):
        cells = [c.strip() for c in line.strip("│").split("│")]
        assert cells[0] == row["method"]  # the whole name
        if row["diverged_seeds"]:
            assert cells[1] == "diverged"
        else:
            mean, _, std = cells[1].partition(" ±")
            assert float(mean) == pytest.approx(row["rmse_mean"], rel=5e-3)
            assert float(std) == pytest.approx(row["rmse_mean_std"], rel=5e-2)


def test_design_sweeps_get_sections_and_fleet_seeds_are_pooled():
    rows = []
    for design, base in (("3x2", 1.0), ("6x4", 0.1)):
        for fleet_seed in (0, 1):
            for seed in (0, 1):
                value = base * (1 + fleet_seed + 0.5 * seed)
                rows.append(("polynomial", seed, fleet_seed, design, 12, value))
    summary = pd.DataFrame(
        rows, columns=["method", "seed", "fleet_seed", "design", "train_points", "rmse_mean"]
    )
    table = aggregate(summary)
    assert table["design"].tolist() == ["3x2", "6x4"] and (table["seeds"] == 4).all()
    # pooled over training seeds and fleet seeds: (1 + {0,1} + {0,0.5}) · base
    assert table["rmse_mean"].tolist() == pytest.approx([1.75, 0.175])
    assert "fleet_seed" not in table.columns and "fleet_seed_std" not in table.columns
    console = Console(width=100, record=True, color_system=None)
    for t in rich_tables(table, [("rmse_mean", "RMSE mean")], "hPa"):
        console.print(t)
    text = " ".join(console.export_text().split())  # titles wrap to the table's width
    assert "design 3x2, calibration points per sensor: 12" in text
    assert "design 6x4, calibration points per sensor: 12" in text
