"""One small compare run (3 toy sensors, two point budgets, two seeds) for the report tests."""

import pytest
from typer.testing import CliRunner

from fedcal.cli import app
from fedcal.data.loader import save_fleet

# 2-3 rounds are unconverged by design: these tests are about files and tables, so the
# convergence status is off (unconverged_tol = 1; tested in tests/test_status.py).
SMALL = "[run]\nunconverged_tol = 1\n" + (
    "[model]\nhidden = [8, 6]\n[train]\nlocal_epochs = 1\n[engine]\nrounds = 3\n"
)
METHODS = "polynomial,fedpoly,fedgmi"


@pytest.fixture(scope="session")
def compare_run(tmp_path_factory, make_fleet):
    """(data file, run directory, HTML report path, CLI output) of one ``fedcal compare --html``."""
    root = tmp_path_factory.mktemp("report")
    data = root / "fleet.csv"
    save_fleet(make_fleet(num_clients=3), data)
    cfg = root / "small.toml"
    cfg.write_text(SMALL)
    out = root / "run"
    html = root / "report.html"
    args = ["compare", "--data", str(data), "--methods", METHODS, "--seeds", "2"]
    args += ["--config", str(cfg), "--train-points", "12,24", "--out", str(out)]
    result = CliRunner(env={"COLUMNS": "100"}).invoke(app, [*args, "--html", str(html)])
    assert result.exit_code == 0, result.output
    return data, out, html, result.output
