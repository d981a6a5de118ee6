"""Tables of results: per-method mean ± std over seeds, as data and as text."""

from __future__ import annotations

import numpy as np
import pandas as pd


def aggregate(summary: pd.DataFrame) -> pd.DataFrame:
    """Mean and std over seeds per ([design,] train_points, method), methods in given order.

    With a design sweep the rows are per design too; with a fleet-seed sweep
    the mean and std are over training seeds and fleet seeds together. A NaN
    run (a diverged sensor) makes its group NaN: it is never skipped.
    """
    keys = [k for k in ("design", "train_points") if k in summary.columns]
    metrics = [c for c in summary.columns if c not in ("method", "seed", "fleet_seed", *keys)]
    order = {m: i for i, m in enumerate(pd.unique(summary["method"]))}
    grouped = summary.groupby([*keys, "method"], sort=False)[metrics]
    table = pd.concat(
        [grouped.mean(skipna=False), grouped.std(ddof=0, skipna=False).add_suffix("_std")],
        axis=1,
    ).reset_index()
    table["seeds"] = grouped.size().to_numpy()
    table["_order"] = table["method"].map(order)
    return table.sort_values([*keys, "_order"]).drop(columns="_order").reset_index(drop=True)


def fmt_pm(mean: float, std: float, digits: int = 3) -> str:
    if np.isnan(std):
        return f"{mean:.{digits}g}"
    return f"{mean:.{digits}g} ± {std:.2g}"


def to_markdown(table: pd.DataFrame, columns: list[tuple[str, str]]) -> str:
    """A Markdown table of ``aggregate`` output: method, then ``(column, header)`` as mean ± std."""
    lines = []
    sections = list(sections_of(table))
    for title, part in sections:
        if len(sections) > 1:
            lines.append(f"\n{title}\n")
        lines.append("| method | " + " | ".join(h.replace("|", "\\|") for _, h in columns) + " |")
        lines.append("|---|" + "---:|" * len(columns))
        for _, row in part.iterrows():
            cells = [fmt_pm(row[c], row[f"{c}_std"]) for c, _ in columns]
            lines.append(f"| {row['method']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sections_of(table: pd.DataFrame):
    """(title, rows) per ([design,] train_points) of an ``aggregate`` table, in its order."""
    keys = [k for k in ("design", "train_points") if k in table.columns]
    for values, part in table.groupby(keys, sort=False):
        named = dict(zip(keys, values, strict=True))
        tp = named["train_points"]
        title = "calibration points per sensor: " + ("all" if tp == 0 else str(tp))
        if "design" in named:
            title = f"design {named['design']}, " + title
        yield title, part
