"""Resuming never follows a symbolic link planted in a run folder (issue 36.5).

``runs/<name>/`` (or ``runs/``) replaced by a link to a folder elsewhere used to be followed
on resume: its done.json was read as this run's result, and a run not finished there wrote
its checkpoint and models outside --out. Now the rerun is refused in one line naming the
link, and nothing is written through it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedcal.cli import app
from fedcal.data.simulator import FleetSpec, simulate_fleet

runner = CliRunner(env={"COLUMNS": "1000"})


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("resume_link")
    simulate_fleet(FleetSpec(num_sensors=3), seed=1).frame.to_csv(root / "f.csv", index=False)
    args = ["run", "--data", str(root / "f.csv"), "--methods", "local", "--seeds", "1"]
    args += ["--rounds", "2", "--out", str(root / "run"), "--quiet"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return root, args


def _files(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("link", ["runs/local_tp0_seed0", "runs"])
def test_a_symlinked_run_folder_is_refused_on_resume(finished, tmp_path, link) -> None:
    root, args = finished
    out = tmp_path / "run"
    shutil.copytree(root / "run", out)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(out / link, elsewhere)
    (out / link).symlink_to(elsewhere, target_is_directory=True)
    (elsewhere / ("local_tp0_seed0" if link == "runs" else "") / "done.json").unlink()
    before = _files(elsewhere)
    result = runner.invoke(app, [*args[:-3], "--out", str(out), "--quiet"])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error:"), lines
    assert f"{out / link} is a symbolic link" in lines[0]
    assert _files(elsewhere) == before  # nothing written through the link
