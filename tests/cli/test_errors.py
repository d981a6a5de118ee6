"""An internal error is one line and a hint; --debug gives the trace; locals are never shown."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedcal.cli import app

SRC = str(Path(__file__).resolve().parents[2] / "src")


# A bug nobody anticipated: reading a run folder raises a KeyError (a broken run folder
# itself is refused as bad input, exit 2: tests/cli/test_hostile_rundir.py).
BUG = (
    "import fedcal.report.rundir as r\n"
    "def _open(path):\n"
    "    raise KeyError('method')\n"
    "r.RunDir.open = staticmethod(_open)\n"
)


@pytest.fixture(autouse=True)
def _bug(monkeypatch):
    import fedcal.report.rundir as rundir

    def _open(path):
        raise KeyError("method")

    monkeypatch.setattr(rundir.RunDir, "open", staticmethod(_open))


def broken_run_dir(tmp_path):
    (tmp_path / "summary.csv").write_text("a,b\n1,2\n")
    return tmp_path


def test_a_broken_run_folder_is_refused_input_not_an_internal_error(tmp_path, monkeypatch, capsys):
    monkeypatch.undo()  # the real reader
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_:
        app(["report", str(broken_run_dir(tmp_path))])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "summary.csv: missing column(s) method" in err
    assert len(err.strip().splitlines()) == 1


def test_internal_error_is_one_line_with_the_debug_hint(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        app(["report", str(broken_run_dir(tmp_path))])
    assert exit_.value.code == 3
    err = capsys.readouterr().err
    assert err == (
        "fedcal: internal error: KeyError: 'method' (run with --debug for the full trace)\n"
    )


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_flag_anywhere_lets_the_exception_through(tmp_path, where):
    args = ["report", str(broken_run_dir(tmp_path))]
    args = ["--debug", *args] if where == "before" else [*args, "--debug"]
    with pytest.raises(KeyError, match="method"):
        app(args)


def test_expected_errors_keep_their_own_message(tmp_path, monkeypatch, capsys):
    monkeypatch.undo()  # the real reader
    with pytest.raises(SystemExit) as exit_:
        app(["report", str(tmp_path / "nothing")])
    assert exit_.value.code == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_real_process_prints_no_traceback_and_no_locals(tmp_path):
    env = {**os.environ, "PYTHONPATH": SRC, "COLUMNS": "120"}
    env.pop("FEDCAL_DEBUG", None)
    cmd = [sys.executable, "-c", BUG + "from fedcal.cli import app; app()", "report"]
    run_dir = str(broken_run_dir(tmp_path))
    quiet = subprocess.run([*cmd, run_dir], env=env, capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 3
    assert "Traceback" not in quiet.stderr and len(quiet.stderr.strip().splitlines()) == 1
    loud = subprocess.run(
        [*cmd, run_dir, "--debug"], env=env, capture_output=True, text=True, timeout=120
    )
    assert loud.returncode == 1 and "KeyError" in loud.stderr
    assert "Traceback" in loud.stderr
    # typer's locals panel would print the frame's variables, e.g. run_dir = PosixPath(...)
    assert "locals" not in loud.stderr.lower() and "run_dir = " not in loud.stderr
    assert app.pretty_exceptions_show_locals is False
