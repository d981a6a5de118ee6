"""CLI habits: methods validated before training, the values `methods` shows, quiet, exit codes."""

import re

import pandas as pd
import pytest
from rich.console import Console
from typer.testing import CliRunner

from fedcal import cli
from fedcal.cli import app
from fedcal.data.loader import save_fleet

runner = CliRunner(env={"COLUMNS": "100"})
wide = CliRunner(env={"COLUMNS": "2000"})  # `methods` rows on one line each, for searching
# 2-3 rounds are unconverged by design: these tests are about files and tables, so the
# convergence status is off (unconverged_tol = 1; tested in tests/test_status.py).
SMALL = "[run]\nunconverged_tol = 1\n" + (
    "[model]\nhidden = [8, 8]\n[train]\nlocal_epochs = 1\n[engine]\nrounds = 2\n"
)


@pytest.fixture
def files(tmp_path, make_fleet):
    data = tmp_path / "fleet.csv"
    save_fleet(make_fleet(num_clients=3), data)
    cfg = tmp_path / "small.toml"
    cfg.write_text(SMALL)
    return data, cfg


def run_args(data, cfg, methods: str, out) -> list[str]:
    args = ["run", "--data", str(data), "--config", str(cfg), "--seeds", "1"]
    return [*args, "--methods", methods, "--out", str(out)]


@pytest.mark.parametrize(
    ("methods", "extra", "message"),
    [
        ("local,fedgmi_typo", "", "unknown method(s) fedgmi_typo"),
        ("local,local", "", "--methods names local more than once"),
        (",", "", "--methods is empty"),
        ("all,local", "", "cannot be combined"),
        # a later method's bad parameter is found before the first method trains
        (
            "local,bad",
            '[methods.bad]\nbase = "fedgmi"\nmagic = 1\n',
            "[methods.bad] magic: unknown",
        ),
        ("local,fedgmi", '[methods.fedgmi]\nmagnitude = "huge"\n', "magnitude: must be one of"),
    ],
)
def test_methods_fully_validated_before_training(files, tmp_path, methods, extra, message):
    data, cfg = files
    cfg.write_text(SMALL + extra)
    out = tmp_path / "out"
    result = runner.invoke(app, run_args(data, cfg, methods, out))
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())
    assert result.output.startswith("error:") and result.output.count("error:") == 1
    assert not out.exists()  # nothing trained, nothing written


def test_methods_shows_the_values_a_run_uses(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[train]\nlr = 0.3\n[methods.fedgmi]\nfinetune_steps = 4\nlr = 0.2\n")
    output = wide.invoke(app, ["methods", "--config", str(cfg)]).output
    rows = {
        line.split("│")[1].strip(): line for line in output.splitlines() if line.startswith("│")
    }
    assert output.startswith("local recipe ([train]) of every method without its own: lr=0.3,")
    assert "finetune_steps=4*" in rows["fedgmi"] and "lr=0.2*" in rows["fedgmi"]
    assert "lr=" not in rows["fedavg"]  # fedavg runs the shared recipe
    # a variant inherits its base's table and shows its own change
    joint = rows["fedgmi_joint"]
    assert "finetune_steps=4*" in joint and "normalize='joint'*" in joint
    lines = output.splitlines()
    assert lines[lines.index(joint) + 1].startswith("│(of fedgmi) ")  # its base, below its name
    # the shipped default's recipe (lr 0.1), not the class default (0.05), is what runs
    default = wide.invoke(app, ["methods"]).output
    assert default.startswith("local recipe ([train]) of every method without its own: lr=0.1,")
    assert not re.search(r"[ (]lr=0\.05,", default)
    bad = tmp_path / "bad.toml"
    bad.write_text('[methods.x]\nbase = "fedgmi"\nmagic = 1\n')
    result = wide.invoke(app, ["methods", "--config", str(bad)])
    assert result.exit_code == 2 and "[methods.x] magic: unknown parameter" in result.output


def test_quiet_prints_nothing_and_still_writes(files, tmp_path):
    data, cfg = files
    out = tmp_path / "q"
    html = tmp_path / "q.html"
    args = [*run_args(data, cfg, "local", out), "--quiet", "--html", str(html)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0 and result.output == ""
    assert len(pd.read_csv(out / "summary.csv")) == 1 and html.exists()


def test_progress_bar_only_on_a_terminal(files, tmp_path, monkeypatch):
    data, cfg = files
    result = runner.invoke(app, run_args(data, cfg, "local", tmp_path / "p"))
    assert result.exit_code == 0 and "ETA" not in result.output and "rounds" not in result.output
    # the bar reads the console of the module that defines it (fedcal.cli.base)
    monkeypatch.setattr(cli.base, "err_console", Console(force_terminal=True))
    assert cli.progress_bar(quiet=False).disable is False
    assert cli.progress_bar(quiet=True).disable is True
    monkeypatch.setattr(cli.base, "err_console", Console(force_terminal=False))
    assert cli.progress_bar(quiet=False).disable is True


def test_exit_codes_are_documented():
    text = cli.__doc__
    assert "Exit codes: 0 done" in " ".join(text.split())
    assert "2 refused input" in " ".join(text.split())


def test_interrupt_exits_130_and_nothing_is_printed_as_a_result(files, tmp_path, monkeypatch):
    import fedcal.experiment

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(fedcal.experiment, "run_experiment", interrupted)
    data, cfg = files
    result = runner.invoke(app, run_args(data, cfg, "local", tmp_path / "i"))
    assert result.exit_code == 130 and "RMSE" not in result.output


def test_methods_is_readable_at_80_columns():
    """Nothing cut: every method's whole name, every line within 80 columns, a legend."""
    from fedcal.algorithms import REGISTRY

    narrow = CliRunner(env={"COLUMNS": "80"})
    output = narrow.invoke(app, ["methods"]).output
    lines = output.splitlines()
    assert max(len(line) for line in lines) <= 80 and "…" not in output
    names = {line.split("│")[1].strip() for line in lines if line.startswith("│")}
    assert set(REGISTRY) <= names
    assert "fed: federated (y/n); task: reg = regression" in " ".join(output.split())
