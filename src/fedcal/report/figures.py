"""The report's figures, drawn with matplotlib (Agg backend: no display, no network).

Each function takes plain tables (pandas) and returns a matplotlib Figure; none
of them reads files or computes a metric the run did not write, except the
residuals, which come from the saved models (:func:`fedcal.report.rundir.residuals`).
NaN errors (a diverged run) are never drawn as numbers: they are named in the
panel instead.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # headless: the report is written to a file, never shown

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from fedcal.report.rundir import plateaus
from fedcal.status import Status, most_severe

COLORS = plt.get_cmap("tab10").colors


def _color(i: int) -> tuple:
    return COLORS[i % len(COLORS)]


def _diverged_note(
    ax, names: list[str], lead: str = "diverged (not drawn): ", wrap: bool = False
) -> None:
    """The panel's note of what it does not draw (top left, crimson)."""
    if names:
        ax.text(
            0.01,
            0.99,
            lead + ", ".join(names),
            transform=ax.transAxes,
            va="top",
            fontsize=8,
            color="crimson",
            wrap=wrap,
        )


def error_vs_round(metrics: pd.DataFrame, methods: list[str], unit: str) -> Figure:
    """Test RMSE per round: median sensor (solid) and worst sensor (dashed), mean over seeds."""
    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    diverged = []
    for i, method in enumerate(methods):
        m = metrics[metrics["method"] == method]
        per_round = m.groupby(["seed", "round"])["test_rmse"].agg(
            median=lambda s: float(np.median(s.to_numpy())),
            worst=lambda s: s.to_numpy().max(),
        )
        curve = per_round.groupby("round").agg(lambda s: s.to_numpy().mean())
        if curve.empty or not np.isfinite(curve.to_numpy()).all():
            diverged.append(method)
            curve = curve[np.isfinite(curve).all(axis=1)]
        if curve.empty:
            continue
        style = {"marker": "o"} if len(curve) == 1 else {}
        ax.plot(curve.index, curve["median"], color=_color(i), label=method, **style)
        ax.plot(curve.index, curve["worst"], color=_color(i), linestyle="--", **style)
    ax.set_yscale("log")
    ax.set_xlabel("round")
    ax.set_ylabel(f"test RMSE ({unit})")
    ax.set_title("error against round — solid: median sensor, dashed: worst sensor")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncols=2)
    _diverged_note(ax, diverged)
    return fig


# A sensor's dot by its status: ok in the method's colour, every other status its own marker
# and colour, named in the legend (statuses: fedcal.status, docs/statuses.md).
STATUS_STYLE = {
    Status.WEAK: ("s", "darkorange"),
    Status.UNCONVERGED: ("^", "tab:purple"),
    Status.REJECTED: ("X", "crimson"),
}
NOT_DRAWN = (Status.DIVERGED, Status.REFUSED)  # no calibration to draw: named in the panel


def sensor_points(per_sensor: pd.DataFrame, methods: list[str]) -> pd.DataFrame:
    """One row per (method, sensor) of the per-sensor figure: ``rmse`` (mean over seeds of
    its test RMSE), ``status`` (``ok`` if ok in every seed, else its most severe other
    status, in :mod:`fedcal.status`'s order of precedence) and ``drawn`` (a finite RMSE and
    not diverged or refused). A table without a status column: every sensor ``ok``."""
    rows = []
    for method in methods:
        part = per_sensor[per_sensor["method"] == method]
        status = part["status"] if "status" in part else pd.Series("ok", index=part.index)
        status = status.fillna(Status.DIVERGED).astype(str)
        for client, idx in part.groupby("client", sort=True).groups.items():
            rmse = float(part.loc[idx, "test_rmse"].astype(float).to_numpy().mean())
            seen = set(status[idx])
            # a status no Status spells (another fedcal's file) is not ok: ranked just above
            # it; ties broken by name, not by the set's hash order (determinism)
            worst = most_severe(sorted(seen))
            drawn = bool(np.isfinite(rmse)) and worst not in NOT_DRAWN
            rows.append(
                {"method": method, "client": client, "rmse": rmse, "status": worst, "drawn": drawn}
            )
    return pd.DataFrame(rows, columns=["method", "client", "rmse", "status", "drawn"])


def per_sensor_rmse(per_sensor: pd.DataFrame, methods: list[str], unit: str) -> Figure:
    """Each sensor's test RMSE (mean over seeds) per method: a box over the ok sensors and
    one dot per sensor, marked by status (:func:`sensor_points`), so that a reader sees
    which sensors the means exclude. Diverged and refused sensors have no error to draw:
    the panel names them with their status."""
    points = sensor_points(per_sensor, methods)
    roles = _roles(per_sensor)  # a mixed fleet: new and reference units in boxes apart
    if roles:
        points["role"] = points["client"].map(roles)
    groups = [(m, r) for m in methods for r in ("new", "reference")] if roles else methods
    width = max(6, 0.9 * len(groups) + 2)
    fig, ax = plt.subplots(figsize=(min(width, 11), 4.5), layout="constrained")
    missing, labelled = [], set()
    for i, group in enumerate(groups):
        method, role = group if roles else (group, None)
        part = points[points["method"] == method]
        if role:
            part = part[part["role"] == role]
        color = _color(methods.index(method))
        gone = part[~part["drawn"]]
        missing += [
            f"{method}: {c} ({s})" for c, s in zip(gone["client"], gone["status"], strict=True)
        ]
        part = part[part["drawn"]]
        if part.empty:
            continue
        ok = part["status"] == "ok"
        if ok.any():
            ax.boxplot(part.loc[ok, "rmse"].to_numpy(), positions=[i], widths=0.5, showfliers=False)
        offsets = np.linspace(-0.18, 0.18, len(part)) if len(part) > 1 else np.zeros(1)
        for status, rows in part.groupby("status", sort=False):
            marker, dot = STATUS_STYLE.get(status, ("o", color))
            if status != "ok" and status not in STATUS_STYLE:
                marker, dot = "D", "dimgray"  # a status this figure does not know
            label = f"{status} (not in the means)" if status != "ok" else None
            ax.scatter(
                i + offsets[part.index.get_indexer(rows.index)],
                rows["rmse"],
                s=10 if status == "ok" else 28,
                marker=marker,
                color=dot,
                zorder=3 if status == "ok" else 4,
                label=label if label not in labelled else None,
                gid=f"{method}|{status}" + (f"|{role}" if role else ""),
            )
            labelled.add(label)
    names = [f"{m}\n{r[:3]}" for m, r in groups] if roles else methods
    if roles:
        ax.set_xticks(range(len(groups)), names)
    else:
        ax.set_xticks(range(len(groups)), names, rotation=30, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel(f"test RMSE per sensor ({unit})")
    ax.set_title("per-sensor test RMSE (one dot per sensor; box: the ok sensors)")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    if labelled - {None}:
        ax.legend(fontsize=7, loc="lower right")
    _diverged_note(ax, missing, lead="no error to draw: ", wrap=True)
    return fig


def _roles(per_sensor: pd.DataFrame) -> dict[str, str]:
    """{sensor: role} of a mixed fleet (new and reference units both present), else {}."""
    if "role" not in per_sensor:
        return {}
    roles = per_sensor.drop_duplicates("client").set_index("client")["role"].astype(str)
    return roles.to_dict() if {"new", "reference"} <= set(roles) else {}


def _sensor_rmse(res: pd.DataFrame) -> pd.Series:
    return res.groupby("sensor")["residual"].agg(lambda r: float(np.sqrt(np.mean(r**2))))


def residuals_by_plateau(
    residuals: dict[str, pd.DataFrame],
    target: str,
    temperature: str | None,
    unit: str,
    statuses: dict[str, dict[str, str]] | None = None,
) -> Figure:
    """Residual against reference, one line per temperature plateau (off-grid points: dots
    per temperature bin); best and worst sensor.

    ``statuses`` ({method: {sensor: status}}, the shown seed's): a sensor that is not ok
    has its status in the panel's title (it is left out of the means)."""
    rows = len(residuals)
    fig, axes = plt.subplots(
        rows, 2, figsize=(11, 2.8 * rows + 0.5), layout="constrained", squeeze=False
    )
    for r, (method, res) in enumerate(residuals.items()):
        rmse = _sensor_rmse(res)
        finite = rmse[np.isfinite(rmse)]
        for c, which in enumerate(("best", "worst")):
            ax = axes[r, c]
            if finite.empty:
                ax.text(0.5, 0.5, f"{method}: diverged", ha="center", color="crimson")
                ax.set_axis_off()
                continue
            sensor = finite.idxmin() if which == "best" else finite.idxmax()
            s = res[res["sensor"] == sensor]
            groups = plateaus(s[temperature]) if temperature else np.zeros(len(s), int)
            for g in np.unique(groups):
                part = s[groups == g].sort_values(target)
                label = f"{round(part[temperature].mean()):d} °C" if temperature else None
                # off-grid points binned by temperature (no plateau): dots, not a zigzag line
                binned = temperature and np.ptp(part[temperature].to_numpy(float)) > 5.0
                if binned:
                    lo, hi = part[temperature].min(), part[temperature].max()
                    label = f"{round(lo):d}…{round(hi):d} °C"
                style = {"linestyle": "none", "marker": "o", "markersize": 3} if binned else {}
                ax.plot(part[target], part["residual"], **({"marker": "."} | style), label=label)
            ax.axhline(0, color="black", linewidth=0.6)
            status = (statuses or {}).get(method, {}).get(str(sensor), "ok")
            marked = "" if status == "ok" else f" [{status}, not in the means]"
            ax.set_title(
                f"{method} — {which} sensor {sensor}{marked}: RMSE {finite[sensor]:.3g} {unit}",
                fontsize=9,
                color="black" if status == "ok" else "darkorange",
            )
            ax.set_xlabel(f"{target} (reference)")
            ax.set_ylabel(f"residual ({unit})")
            ax.grid(True, alpha=0.3)
            if temperature and c == 1:
                ax.legend(fontsize=7, title=temperature, title_fontsize=7, loc="best")
    return fig


def error_map(
    residuals: dict[str, pd.DataFrame], target: str, temperature: str, unit: str
) -> Figure:
    """RMS over sensors of the test residual in cells of the (target, temperature) plane."""
    n = len(residuals)
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(4.2 * cols + 0.6, 3.4 * rows), layout="constrained", squeeze=False
    )
    for ax in axes.ravel()[n:]:
        ax.set_axis_off()
    for ax, (method, res) in zip(axes.ravel(), residuals.items(), strict=False):
        ok = res[np.isfinite(res["residual"])]
        if ok.empty:
            ax.text(0.5, 0.5, f"{method}: diverged", ha="center", color="crimson")
            ax.set_axis_off()
            continue
        sq = ok["residual"].to_numpy() ** 2
        hb = ax.hexbin(
            ok[target],
            ok[temperature],
            C=sq,
            reduce_C_function=lambda v: float(np.sqrt(np.mean(v))),
            gridsize=(10, 5),
            cmap="viridis",
            norm=LogNorm() if (sq > 0).all() else None,  # colours span the cells' own range
        )
        fig.colorbar(hb, ax=ax, label=f"RMS residual ({unit})")
        ax.set_title(method, fontsize=9)
        ax.set_xlabel(f"{target} (reference)")
        ax.set_ylabel(temperature)
    return fig


def point_sweep(
    table: pd.DataFrame, methods: list[str], points: dict[int, int], unit: str
) -> Figure:
    """Fleet mean test RMSE (mean ± std over seeds) against calibration points per sensor."""
    fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
    diverged = []
    for i, method in enumerate(methods):
        part = table[table["method"] == method].copy()
        part["n"] = part["train_points"].map(points)
        bad = part[~np.isfinite(part["rmse_mean"])]
        diverged += [f"{method} @ {int(n)}" for n in bad["n"]]
        part = part[np.isfinite(part["rmse_mean"])].sort_values("n")
        if part.empty:
            continue
        ax.errorbar(
            part["n"], part["rmse_mean"], yerr=part["rmse_mean_std"], marker="o",
            color=_color(i), label=method, capsize=3,
        )  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(sorted(set(points.values())), [str(v) for v in sorted(set(points.values()))])
    ax.xaxis.set_minor_formatter(NullFormatter())  # only the budgets of the run are labelled
    ax.set_xlabel("calibration points per sensor")
    ax.set_ylabel(f"test RMSE, fleet mean ({unit})")
    ax.set_title("calibration-point sweep")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    _diverged_note(ax, diverged)
    return fig


def uncertainty_bands(
    residuals: dict[str, pd.DataFrame], target: str, temperature: str | None, unit: str
) -> tuple[Figure, dict[str, float]]:
    """Per method: the ±2σ predictive band of its median sensor, and every residual over σ.

    Left panel: that sensor's 2σ per temperature plateau (lines) and |residual|
    (dots) against reference. Right panel: residual / σ of every held-out point
    of every sensor, with the ±1.96 lines of a 95 % interval. Returns the figure
    and, per method, the share of points within ±1.96σ (empirical coverage).
    """
    n = len(residuals)
    fig, axes = plt.subplots(n, 2, figsize=(11, 3.4 * n), layout="constrained", squeeze=False)
    coverage = {}
    for (ax, az), (method, res) in zip(axes, residuals.items(), strict=True):
        ok = res[np.isfinite(res["residual"]) & np.isfinite(res["std"])]
        coverage[method] = (
            float((ok["residual"].abs() <= 1.96 * ok["std"]).mean()) if len(ok) else float("nan")
        )
        rmse = _sensor_rmse(ok)
        if rmse.empty:
            for a in (ax, az):
                a.text(0.5, 0.5, f"{method}: diverged", ha="center", color="crimson")
                a.set_axis_off()
            continue
        sensor = rmse.sort_values().index[len(rmse) // 2]
        s = ok[ok["sensor"] == sensor]
        groups = plateaus(s[temperature]) if temperature else np.zeros(len(s), int)
        for i, g in enumerate(np.unique(groups)):
            part = s[groups == g].sort_values(target)
            label = f"2σ, {round(part[temperature].mean()):d} °C" if temperature else "2σ"
            ax.plot(part[target], 2 * part["std"], color=_color(i), label=label)
            ax.plot(part[target], part["residual"].abs(), ".", color=_color(i))
        ax.set_title(f"{method} — sensor {sensor}: 2σ (lines), |residual| (dots)", fontsize=9)
        ax.set_xlabel(f"{target} (reference)")
        ax.set_ylabel(unit)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        az.plot(ok[target], ok["residual"] / ok["std"], ".", markersize=3)
        for bound in (-1.96, 1.96):
            az.axhline(bound, color="crimson", linewidth=0.8)
        az.set_title(
            f"{method} — all sensors: residual / σ; within ±1.96: {coverage[method]:.1%}",
            fontsize=9,
        )
        az.set_xlabel(f"{target} (reference)")
        az.set_ylabel("residual / σ")
        az.grid(True, alpha=0.3)
    return fig, coverage


def unit_fleet_distance(units: pd.DataFrame) -> Figure:
    """Each new unit's fleet distance d² against its QA threshold (flagged units in red)."""
    fig, ax = plt.subplots(figsize=(8, 0.6 + 0.3 * len(units)), layout="constrained")
    ratio = (units["d2"] / units["d2_threshold"]).to_numpy(float)
    colors = ["crimson" if flag else "tab:blue" for flag in units["unlike_fleet"]]
    y = np.arange(len(units))
    ax.barh(y, np.where(np.isfinite(ratio), ratio, 0.0), color=colors)
    ax.axvline(1.0, color="k", lw=1, ls="--")
    ax.set_yticks(y, units["sensor_id"].astype(str))
    ax.invert_yaxis()
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlabel("d² / threshold; right of the dashed line: unlike the fleet")
    return fig


def unit_sigma(units: pd.DataFrame, unit: str) -> Figure:
    """Mean and maximum predictive σ of each unit over the operating range."""
    fig, ax = plt.subplots(figsize=(8, 0.6 + 0.3 * len(units)), layout="constrained")
    y = np.arange(len(units))
    ax.barh(y - 0.2, units["sigma_mean"], height=0.4, label="mean σ")
    ax.barh(y + 0.2, units["sigma_max"], height=0.4, label="max σ")
    ax.set_yticks(y, units["sensor_id"].astype(str))
    ax.invert_yaxis()
    ax.set_xlabel(f"predictive σ over the fleet's operating range ({unit})")
    ax.legend(loc="lower right")
    return fig


def unit_residuals(points: pd.DataFrame, target: str, unit: str) -> Figure:
    """Residual (calibrated − reference) at every calibration point, ±2σ bars, per unit."""
    fig, ax = plt.subplots(figsize=(8, 4), layout="constrained")
    groups = list(points.groupby("sensor_id", sort=False))
    span = float(points[target].max() - points[target].min()) or 1.0
    for i, (sensor, rows) in enumerate(groups):
        shift = (i - (len(groups) - 1) / 2) * 0.006 * span  # units side by side at a point
        ax.errorbar(
            rows[target] + shift,
            rows["residual"],
            yerr=2 * rows["sigma"],
            fmt="o",
            ms=3,
            capsize=2,
            color=_color(i),
            label=str(sensor),
        )
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xlabel(f"{target} reference ({unit})")
    ax.set_ylabel(f"calibrated − reference ({unit})")
    if points["sensor_id"].nunique() <= 12:
        ax.legend(fontsize=7, ncol=2)
    return fig
