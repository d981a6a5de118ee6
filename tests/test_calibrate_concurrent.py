"""Two `fedcal calibrate` runs against one prior at the same time (issue 36, part 5).

A fleet prior (fedprior on 4 simulated sensors) is read by two processes calibrating
2,000 new units each, started together: both finish (exit 0), every file each writes is
byte-identical to a lone run's, and no file of the prior's run folder is changed or touched
(content and modification time), nor any file added to it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import torch
from typer.testing import CliRunner

from fedcal.cli import app
from fedcal.core.tensorfile import load_trees
from fedcal.core.tree import flatten
from fedcal.data.simulator import FleetSpec, simulate_fleet

SRC = str(Path(__file__).resolve().parents[1] / "src")
UNITS = 2000


def _state(root: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _calibrate(prior: Path, data: Path, out: Path) -> subprocess.Popen:
    """A ``fedcal calibrate`` process; its console output to ``<out>.log`` (a pipe would
    fill with the 2,000 units' table and block the process)."""
    code = "import sys; from fedcal.cli import app; app(sys.argv[1:])"
    args = ["calibrate", "--prior", str(prior), "--data", str(data), "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    with open(f"{out}.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-c", code, *args], env=env, stdout=log, stderr=subprocess.STDOUT
        )


def _finished(proc: subprocess.Popen, out: Path) -> None:
    assert proc.wait(timeout=600) == 0, Path(f"{out}.log").read_text()[-2000:]


def _same_model(a: Path, b: Path) -> None:
    """The same trees (to the bit) and metadata in two model files."""
    trees_a, meta_a, blobs_a = load_trees(a)
    trees_b, meta_b, blobs_b = load_trees(b)
    assert (meta_a, blobs_a) == (meta_b, blobs_b)
    flat_a, flat_b = flatten(trees_a), flatten(trees_b)
    assert flat_a.keys() == flat_b.keys()
    assert all(torch.equal(flat_a[k], flat_b[k]) for k in flat_a), b


def test_two_calibrate_runs_on_one_prior_at_once(tmp_path) -> None:
    fleet = simulate_fleet(FleetSpec(num_sensors=4), seed=3).frame
    fleet.to_csv(tmp_path / "fleet.csv", index=False)
    args = ["run", "--data", str(tmp_path / "fleet.csv"), "--methods", "fedprior"]
    args += ["--seeds", "1", "--rounds", "2", "--out", str(tmp_path / "prior"), "--quiet"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    # 2,000 new units of 6 points, each a reference sensor's points (in the prior's range)
    train = fleet[fleet["split"] == "train"].drop(columns="split")
    ids = sorted(train["sensor_id"].unique())
    parts = [
        train[train["sensor_id"] == ids[k % len(ids)]].head(6).assign(sensor_id=f"U{k:04d}")
        for k in range(UNITS)
    ]
    pd.concat(parts).to_csv(tmp_path / "new.csv", index=False)
    prior = tmp_path / "prior"
    before = _state(prior)

    _finished(_calibrate(prior, tmp_path / "new.csv", tmp_path / "lone"), tmp_path / "lone")
    both = {n: _calibrate(prior, tmp_path / "new.csv", tmp_path / n) for n in ("a", "b")}
    for name, proc in both.items():  # started together, running at once
        _finished(proc, tmp_path / name)

    expected = _state(tmp_path / "lone")
    assert len(pd.read_csv(tmp_path / "lone" / "units.csv")) == UNITS
    for name in ("a", "b"):
        got = _state(tmp_path / name)
        assert got.keys() == expected.keys(), name
        for rel, (content, _) in expected.items():
            if rel.endswith(".safetensors"):  # its header's key order is the writer's hash map
                _same_model(tmp_path / "lone" / rel, tmp_path / name / rel)
            else:
                assert got[rel][0] == content, (name, rel)
    assert _state(prior) == before  # the prior: not changed, not touched, nothing added
