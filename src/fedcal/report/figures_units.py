"""The report's per-unit figures: each unit's error beside the σ it states, and the prior's
spread across units (issue 37.4). Plain tables in, a matplotlib Figure out (Agg backend)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # headless: the report is written to a file, never shown

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from fedcal.report.figures import _color

MAX_UNIT_METHODS = 3  # methods per panel of the per-unit figure: more is unreadable
ROLE_TITLES = {"new": "new units", "reference": "reference units", "": "all units"}


def unit_means(per_sensor: pd.DataFrame) -> pd.DataFrame:
    """One row per (method, client, role): mean over seeds of every test column."""
    frame = per_sensor.copy()
    if "role" not in frame:
        frame["role"] = ""
    frame["role"] = frame["role"].fillna("").astype(str)
    tests = [c for c in frame.columns if c.startswith(("test_", "train_rmse"))]
    frame[tests] = frame[tests].astype(float)
    return frame.groupby(["method", "client", "role"], sort=False)[tests].mean().reset_index()


def unit_error_and_sigma(per_sensor: pd.DataFrame, methods: list[str], unit: str) -> Figure:
    """Per unit (one panel per role, units ordered by the first method's error): each
    method's test RMSE (dot) and, for a method that states a σ, that σ averaged over the
    unit's test points (dash, joined to the dot). A σ that is right has RMSE ≈ σ; the stated
    95 % interval is ±1.96σ."""
    means = unit_means(per_sensor)
    methods = methods[:MAX_UNIT_METHODS]
    roles = [r for r in ("new", "reference", "") if (means["role"] == r).any()]
    counts = [means.loc[means["role"] == r, "client"].nunique() for r in roles]
    fig, axes = plt.subplots(
        1,
        len(roles),
        figsize=(11, 4.6),
        layout="constrained",
        squeeze=False,
        width_ratios=[max(c, 4) for c in counts],
    )
    for ax, role in zip(axes[0], roles, strict=True):
        part = means[means["role"] == role]
        lead = part[part["method"] == methods[0]].sort_values("test_rmse")
        order = list(lead["client"]) + sorted(set(part["client"]) - set(lead["client"]))
        pos = {c: i for i, c in enumerate(order)}
        width = 0.6 / max(len(methods), 1)
        for k, method in enumerate(methods):
            rows = part[part["method"] == method]
            x = rows["client"].map(pos).to_numpy(float) + (k - (len(methods) - 1) / 2) * width
            rmse = rows["test_rmse"].to_numpy()
            ax.scatter(x, rmse, s=14, color=_color(k), label=f"{method}: RMSE", zorder=3)
            sd = rows["test_pred_sd"].to_numpy() if "test_pred_sd" in rows else None
            if sd is not None and np.isfinite(sd).any():
                ax.vlines(x, np.minimum(rmse, sd), np.maximum(rmse, sd), color=_color(k), lw=0.8)
                ax.scatter(x, sd, marker="_", s=60, color=_color(k), label=f"{method}: stated σ")
        ax.set_yscale("log")
        ax.set_title(f"{ROLE_TITLES[role]} ({len(order)})", fontsize=10)
        ticks = range(len(order))
        if len(order) <= 40:
            ax.set_xticks(ticks, order, rotation=90, fontsize=7)
        else:
            ax.set_xticks([])
            ax.set_xlabel("units, ordered by error")
        ax.grid(True, axis="y", which="both", alpha=0.3)
    axes[0][0].set_ylabel(f"on held-out points ({unit})" if unit else "on held-out points")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="outside lower center", ncols=len(labels))
    fig.suptitle("each unit's test RMSE (dot) and the σ it states (dash)", fontsize=11)
    return fig


def prior_spread(prior: dict, unit: str) -> Figure:
    """The fleet prior's spread across units (prior.json: μ, Σ of the basis coefficients,
    scaled target units): left, per basis term, √Σ_kk and |μ_k| in the target's unit;
    right (two inputs), √(φ(x)ᵀ Σ φ(x)) over the prior's input range — how far a unit of
    the fleet lies from the fleet's mean curve before it is calibrated (1σ)."""
    from fedcal.report.linear_export import LinearForm

    terms = np.asarray(prior["terms"], int)
    t = len(terms)
    scale = abs(float(np.ravel(prior["scaler"]["y_scale"])[0]))
    sigma = np.asarray(prior["sigma"], float)[:t, :t]
    mu = np.asarray(prior["mu"], float)[:t]
    features = list(prior.get("features", []))
    names = list(prior.get("term_names") or [str(list(a)) for a in terms])[:t]
    for j, name in enumerate(features):  # short labels: x0, x1 (named in the x label)
        names = [n.replace(name, f"x{j}") for n in names]
    two = len(features) == 2 and "input_range" in prior
    fig, axes = plt.subplots(1, 2 if two else 1, figsize=(11, 4.2), layout="constrained")
    axes = np.atleast_1d(axes)
    ax = axes[0]
    ax.bar(range(t), np.sqrt(np.clip(np.diag(sigma), 0, None)) * scale, color="tab:blue")
    ax.scatter(range(t), np.abs(mu) * scale, color="black", s=12, label="|μ| (fleet mean)")
    ax.set_xticks(range(t), names, rotation=90, fontsize=7)
    ax.set_xlabel(", ".join(f"x{j}: {c}" for j, c in enumerate(features)), fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel(f"coefficient ({unit})" if unit else "coefficient")
    ax.set_title("spread across units per basis term: bars √Σkk", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    if two:
        lo = np.array([prior["input_range"][c][0] for c in features], float)
        hi = np.array([prior["input_range"][c][1] for c in features], float)
        g0, g1 = np.linspace(lo[0], hi[0], 60), np.linspace(lo[1], hi[1], 40)
        grid = np.stack(np.meshgrid(g0, g1), -1).reshape(-1, 2)
        off = np.ravel(prior["scaler"]["x_offset"]).astype(float)
        z = (grid - off) / np.ravel(prior["scaler"]["x_scale"]).astype(float)
        form = LinearForm("prior", str(prior.get("basis_family", "legendre")), terms, mu[None],
                          None, None, None, None, ("prior",))  # fmt: skip
        phi = form.features(z, 0)
        spread = np.sqrt(np.clip(np.einsum("rt,ts,rs->r", phi, sigma, phi), 0, None)) * scale
        mesh = axes[1].pcolormesh(g0, g1, spread.reshape(len(g1), len(g0)), shading="auto")
        fig.colorbar(mesh, ax=axes[1], label=f"1σ across units ({unit})" if unit else "1σ")
        axes[1].set_xlabel(features[0])
        axes[1].set_ylabel(features[1])
        axes[1].set_title("spread of the calibration curve across units", fontsize=10)
    return fig
