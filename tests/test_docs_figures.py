"""Docs that cannot drift (issue 37.6): every number README.md and docs/ quote for the default
run, the C header and the Python API equals docs/figures.json — what
``benchmarks/docs_figures.py`` measured — to the digits quoted; the measurement itself is
checked on a small run here and re-run in full with ``pytest -m slow``.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from fedcal.cli import app
from fedcal.data.simulator import FleetSpec, simulate_fleet
from fedcal_support.docs_figures import (
    FIGURES,
    QUOTES,
    check,
    half_unit,
    header_figures,
    run_figures,
)


def test_every_quoted_figure_equals_the_figures_script_s_output():
    figures = json.loads(FIGURES.read_text())
    problems, checked = check(figures)
    assert problems == []
    assert checked == sum(len(keys) for _, _, keys in QUOTES) >= 40


def test_a_drifted_figure_fails_the_check(tmp_path):
    """The check is not vacuous: one figure moved by more than its quoted rounding, or a
    page that no longer has the quote, is reported with the page."""
    figures = json.loads(FIGURES.read_text())
    figures["run"]["fedprior"]["new_coverage"] += 0.002  # 0.972 → 0.974 (quoted: 3 digits)
    problems, _ = check(figures)
    pages = {line.split(":")[0] for line in problems}
    assert {"README.md", "docs/getting-started.md", "docs/quick-tour.md"} <= pages
    assert half_unit("0.100") == pytest.approx(5e-4) and half_unit("749") == 0.5


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("docsfig")
    spec = FleetSpec(num_reference=5, num_new=3, train_design="3x2", test_design="random")
    data = root / "fleet.csv"
    simulate_fleet(spec, seed=0).frame.to_csv(data, index=False)
    # 5 rounds judge nobody unconverged (1 never flags: the engine scores rounds 4 and 5,
    # and the prior is still moving after 5): the test reads figures, not statuses
    config = "[run]\nunconverged_tol = 1.0\n[engine]\nrounds = 5\neval_every = 5\n"
    (root / "c.toml").write_text(config)
    run = root / "run"
    args = ["run", "--data", str(data), "--methods", "fedprior,polynomial", "--seeds", "1"]
    args += ["--config", str(root / "c.toml"), "--out", str(run), "--quiet"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return run


def test_the_measurement_reads_the_run_s_summary_and_header(small_run):
    """run_figures is summary.csv's per-role columns; the header's bytes per unit are what
    `fedcal export` prints."""
    figures = run_figures(small_run)
    summary = pd.read_csv(small_run / "summary.csv").set_index("method")
    for method in ("fedprior", "polynomial"):
        row = summary.loc[method]
        assert figures[method]["new_mean"] == row["rmse_mean_new"]
        assert figures[method]["ref_worst"] == row["rmse_worst_reference"]
    assert figures["fedprior"]["new_coverage"] == summary.loc["fedprior", "coverage95_mean_new"]
    assert figures["polynomial"]["new_coverage"] is None  # no interval: none stated
    result = CliRunner().invoke(
        app, ["export", str(small_run), "--method", "fedprior", "--format", "c", "--out",
              str(small_run.parent / "cal.h")],
    )  # fmt: skip
    assert f"footprint: {header_figures(small_run)['fedprior_bytes']} bytes" in result.output


@pytest.mark.slow
def test_the_figures_file_is_what_the_default_run_gives_today(tmp_path):
    """The full measurement (make run's command; minutes): equal to docs/figures.json to
    1e-9 relative (the default run is deterministic)."""
    from fedcal.cli import app as cli

    run = tmp_path / "default"
    cli(["run", "--config", "quickstart", "--out", str(run), "--quiet"], standalone_mode=False)
    stored = json.loads(FIGURES.read_text())
    fresh = {"run": run_figures(run), "c_header": header_figures(run)}
    for part, values in fresh.items():
        for key, value in values.items():
            if isinstance(value, dict):
                for k, v in value.items():
                    want = stored[part][key][k]
                    assert v == want if want is None else v == pytest.approx(want, rel=1e-9)
            else:
                assert value == stored[part][key]
