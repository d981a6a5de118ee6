"""A mixed fleet's terminal table: new and reference units apart, coverage, 80 columns."""

from __future__ import annotations

import pandas as pd
from rich.console import Console

from fedcal.report.tables import NO_INTERVAL, aggregate, rich_tables, table_columns


def mixed_summary() -> pd.DataFrame:
    rows = []
    for method, new, ref, cov in [
        ("polynomial", 3.098, 0.0451, None),
        ("fedprior", 0.1001, 0.0453, 0.955),
        ("fedgmi", 16.02, 9.553, None),
    ]:
        for seed in range(3):
            row = {"method": method, "seed": seed, "train_points": 0, "status": "ok"}
            row.update(rmse_mean=(new + ref) / 2, rmse_worst=2 * new, max_abs_worst=3 * new)
            row.update(rmse_mean_pct_fs=0.1, max_abs_worst_pct_fs=0.3, wall_s=12.5)
            row.update(rmse_mean_new=new + 0.01 * seed, rmse_worst_new=2 * new)
            row.update(rmse_mean_reference=ref, rmse_worst_reference=2 * ref)
            row.update(bytes_up_per_round=8.474e6)
            if cov is not None:
                row.update(coverage95_mean_new=cov, coverage95_mean_reference=0.975)
            rows.append(row)
    rows[-1]["rmse_mean_new"] = float("nan")  # fedgmi's last seed diverged
    return pd.DataFrame(rows)


def test_mixed_table_splits_roles_shows_coverage_and_fits_80_columns():
    table = aggregate(mixed_summary())
    columns = table_columns(table, "hPa", show_bytes=True)
    assert [c for c, _ in columns][:5] == [
        "rmse_mean_new",
        "rmse_worst_new",
        "coverage95_mean_new",
        "rmse_mean_reference",
        "coverage95_mean_reference",
    ]
    console = Console(width=80, record=True, force_terminal=False, color_system=None)
    for t in rich_tables(table, columns, "hPa"):
        console.print(t)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80 and "…" not in text
    rows = {
        line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
        for line in text.splitlines()
        if line.startswith("│") and line.split("│")[1].strip()
    }
    assert rows["polynomial"][0].split()[0] == "3.11"  # mean of 3.098, 3.108, 3.118
    assert rows["polynomial"][2] == NO_INTERVAL  # no σ: no coverage, and not "diverged"
    assert rows["fedprior"][2].split()[0] == "0.955"
    assert rows["fedgmi"][0] == "diverged"  # a diverged seed is never averaged away
    assert "cov95: share of held-out points inside the 95 % interval" in " ".join(text.split())
