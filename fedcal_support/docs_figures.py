"""The figures README.md and docs/ quote for the default run and the API, measured in one
place (``benchmarks/docs_figures.py`` writes them to ``docs/figures.json``), and the quotes
that must equal them (``tests/test_docs_figures.py``; issue 37.6).

A quote is a regular expression on one doc page whose groups are numbers; each number is
checked against a figure, within half a unit of its last quoted digit (the number is the
figure rounded to the digits the page shows: 0.100 stands for 0.0995 … 0.1005). The default
run is deterministic (same configuration and fleet seed, same numbers), so no other
tolerance is needed; a page that quotes a figure the run no longer gives fails the suite.
"""

from __future__ import annotations

import re
from decimal import Decimal
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "figures.json"
N = r"([0-9]+(?:\.[0-9]+)?)"  # one quoted number

# (page, pattern with one group per number, the figure of each group). A key ending in "%"
# is the figure × 100 (a share quoted in percent).
QUOTES: list[tuple[str, str, tuple[str, ...]]] = [
    (
        "README.md",
        rf"\| polynomial \(the unit's own fit\) \| {N} / {N} \| – \| {N} \|",
        ("run.polynomial.new_mean", "run.polynomial.new_worst", "run.polynomial.ref_mean"),
    ),
    (
        "README.md",
        rf"\| \*\*fedprior\*\* \| \*\*{N} / {N}\*\* \| {N} \| {N} \|",
        (
            "run.fedprior.new_mean",
            "run.fedprior.new_worst",
            "run.fedprior.new_coverage",
            "run.fedprior.ref_mean",
        ),
    ),
    (
        "README.md",
        rf"\| fedgmi \(training seed 0; [^|]*\) \| {N} / {N} \| – \| {N} \|",
        ("run.fedgmi.new_mean", "run.fedgmi.new_worst", "run.fedgmi.ref_mean"),
    ),
    ("README.md", rf"footprint: {N} bytes per fedprior unit", ("c_header.fedprior_bytes",)),
    (
        "docs/getting-started.md",
        rf"new units polynomial {N} / {N} hPa \(mean /\s+worst\), fedprior {N} / {N} with "
        rf"95 % intervals covering {N}, FedGMI {N} / {N}",
        (
            "run.polynomial.new_mean",
            "run.polynomial.new_worst",
            "run.fedprior.new_mean",
            "run.fedprior.new_worst",
            "run.fedprior.new_coverage",
            "run.fedgmi.new_mean",
            "run.fedgmi.new_worst",
        ),
    ),
    (
        "docs/quick-tour.md",
        rf"\| polynomial \(each unit's own fit\) \| {N} \| {N} \| – \| {N} \| {N} \| – \|",
        (
            "run.polynomial.new_mean",
            "run.polynomial.new_worst",
            "run.polynomial.ref_mean",
            "run.polynomial.ref_worst",
        ),
    ),
    (
        "docs/quick-tour.md",
        rf"\| fedprior \| {N} \| {N} \| {N} \| {N} \| {N} \| {N} \|",
        (
            "run.fedprior.new_mean",
            "run.fedprior.new_worst",
            "run.fedprior.new_coverage",
            "run.fedprior.ref_mean",
            "run.fedprior.ref_worst",
            "run.fedprior.ref_coverage",
        ),
    ),
    (
        "docs/quick-tour.md",
        rf"mean \({N} / {N}\)\s+and 14× below it on the worst unit \({N} / {N}\)\. Its 95 % "
        rf"intervals hold {N} % of the\s+held-out points",
        (
            "run.polynomial.new_mean",
            "run.fedprior.new_mean",
            "run.polynomial.new_worst",
            "run.fedprior.new_worst",
            "run.fedprior.new_coverage%",
        ),
    ),
    (
        "docs/firmware.md",
        rf"footprint: {N} bytes of constants per unit \(16 basis terms, with σ\)",
        ("c_header.fedprior_bytes",),
    ),
    (
        "docs/firmware.md",
        rf"\| fedprior \(BIC chose orders \(3, 3\)\) \| 16 \| {N} \|",
        ("c_header.fedprior_bytes",),
    ),
    *(
        (
            "docs/python-api.md",
            rf"\| {seed} \| {N} \| {N} \| {N} \| {N} \| [0-9.]+ \|",
            tuple(
                f"api.{seed}.{k}" for k in ("new_mean", "new_worst", "coverage", "coverage_worst")
            ),
        )
        for seed in (0, 1, 2)
    ),
    (
        "docs/python-api.md",
        rf"Across the three seeds the mean is {N} hPa and the worst unit is at {N} hPa",
        ("api.all.new_mean", "api.all.new_worst"),
    ),
]


def figure(figures: dict, key: str) -> float:
    """The figure a quote's key names ("run.fedprior.new_mean"; "…%": × 100)."""
    percent = key.endswith("%")
    value: object = figures
    for part in key.rstrip("%").split("."):
        value = value[part]  # type: ignore[index]
    number = np.nan if value is None else float(value)  # type: ignore[arg-type]
    return number * (100.0 if percent else 1.0)


def half_unit(text: str) -> float:
    """Half a unit of the last digit of a quoted number ("0.100" → 0.0005, "749" → 0.5)."""
    exponent = Decimal(text).as_tuple().exponent
    return 0.5 * 10.0 ** int(exponent)


def check(figures: dict, root: Path = ROOT) -> tuple[list[str], int]:
    """(problems, numbers checked): each quote found once on its page, each number the
    figure rounded to its quoted digits."""
    problems, checked = [], 0
    for page, pattern, keys in QUOTES:
        text = (root / page).read_text(encoding="utf-8")
        found = re.findall(pattern, text)
        if len(found) != 1:
            problems.append(f"{page}: {len(found)} matches (want 1) of {pattern!r}")
            continue
        groups = found[0] if isinstance(found[0], tuple) else (found[0],)
        for quoted, key in zip(groups, keys, strict=True):
            want = figure(figures, key)
            checked += 1
            if not abs(float(quoted) - want) <= half_unit(quoted) * (1 + 1e-9):
                problems.append(f"{page}: quotes {quoted} for {key}, the figure is {want:.6g}")
    return problems, checked


def _number(value: object) -> float | None:
    """A figure for JSON: None where there is none (NaN: e.g. no interval stated)."""
    return None if value is None or pd.isna(value) else float(value)  # type: ignore[arg-type]


def run_figures(run_dir: Path) -> dict:
    """Per method of a mixed-fleet run (summary.csv, mean over its runs): the new and the
    reference units' mean and worst RMSE and their 95 % coverage (NaN: no interval)."""
    summary = pd.read_csv(Path(run_dir) / "summary.csv")
    out = {}
    for method, rows in summary.groupby("method", sort=False):
        mean = rows.select_dtypes("number").mean()
        out[str(method)] = {
            "new_mean": float(mean["rmse_mean_new"]),
            "new_worst": float(mean["rmse_worst_new"]),
            "new_coverage": _number(mean.get("coverage95_mean_new")),
            "ref_mean": float(mean["rmse_mean_reference"]),
            "ref_worst": float(mean["rmse_worst_reference"]),
            "ref_coverage": _number(mean.get("coverage95_mean_reference")),
        }
    return out


def header_figures(run_dir: Path) -> dict:
    """The fedprior C header's bytes of constants per unit (what ``fedcal export`` prints)."""
    from fedcal.report.export import load_models
    from fedcal.report.linear_export import linear_form

    form = linear_form(load_models(run_dir, "fedprior"), "fedprior")
    return {"fedprior_bytes": form.bytes_per_unit(), "fedprior_terms": len(form.terms)}


def api_figures(seeds: tuple[int, ...] = (0, 1, 2), rounds: int | None = None) -> dict:
    """docs/python-api.md's table: ``FleetPrior().fit(reference)`` on mixed fleets (20
    reference + 20 new units, 3x2), the new units calibrated and tested on their test rows:
    per seed the RMSE mean and worst over units, the share inside ±1.96σ (mean, worst)."""
    from fedcal import FleetPrior
    from fedcal.data.simulator import FleetSpec, simulate_fleet

    spec = FleetSpec(num_reference=20, num_new=20, train_design="3x2", test_design="random")
    out: dict = {}
    per_unit = []
    for seed in seeds:
        frame = simulate_fleet(spec, seed=seed).frame
        reference, new = frame[frame.role == "reference"], frame[frame.role == "new"]
        prior = FleetPrior(**({"rounds": rounds} if rounds else {})).fit(reference)
        units = prior.calibrate(new[new.split == "train"])
        test = new[new.split == "test"]
        mean, std = units.predict(test, return_std=True)
        err = mean - test.pressure_hpa.to_numpy()
        per = (
            test.assign(e2=err**2, inside=np.abs(err) <= 1.959964 * std)
            .groupby("sensor_id")
            .agg(rmse=("e2", lambda v: np.sqrt(v.mean())), cov=("inside", "mean"))
        )
        per_unit.append(per)
        out[str(seed)] = {
            "new_mean": float(per.rmse.mean()),
            "new_worst": float(per.rmse.max()),
            "coverage": float(per["cov"].mean()),
            "coverage_worst": float(per["cov"].min()),
        }
    means = [out[str(s)]["new_mean"] for s in seeds]
    out["all"] = {
        "new_mean": float(np.mean(means)),
        "new_worst": float(max(p.rmse.max() for p in per_unit)),
    }
    return out
