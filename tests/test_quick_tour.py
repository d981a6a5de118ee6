"""docs/quick-tour.md runs as written: its bash block, from `fedcal simulate` to the exports."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd

TOUR = Path(__file__).resolve().parents[1] / "docs" / "quick-tour.md"


def tour_block() -> str:
    blocks = re.findall(r"```bash\n(.*?)\n```", TOUR.read_text(), re.S)
    assert len(blocks) == 1, "the quick tour has one bash block (the one a reader runs)"
    return blocks[0]


def test_quick_tour_runs_as_written(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # `fedcal` and `python` as an installed environment provides them: this interpreter
    launcher = "import sys; from fedcal.cli import main; sys.argv[0] = 'fedcal'; main()"
    (bin_dir / "fedcal").write_text(f'#!/bin/sh\nexec "{sys.executable}" -c "{launcher}" "$@"\n')
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    work = tmp_path / "tour"
    work.mkdir()
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "COLUMNS": "80"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # this checkout's fedcal
    done = subprocess.run(
        ["bash", "-c", tour_block()], cwd=work, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    # it made its own inputs, and every step wrote what the tour says it writes
    new_units, readings = (
        pd.read_csv(work / "new_units.csv"),
        pd.read_csv(work / "new_readings.csv"),
    )
    assert new_units.groupby("sensor_id").size().tolist() == [6, 6, 6]
    calibrated = pd.read_csv(work / "calibrated.csv")
    assert len(calibrated) == len(readings) == 180
    assert (calibrated["pressure_hpa_std"] > 0).all()
    assert "fedcal_calibrate_std" in (work / "calibration.h").read_text()  # the C header
    truth = pd.read_csv(work / "new_fleet.csv").query("split == 'test'")["pressure_hpa"]
    err = calibrated["pressure_hpa_calibrated"].to_numpy() - truth.to_numpy()
    assert float(abs(err).max()) < 2.0  # 6 points per unit, off-grid readings, hPa
    assert sorted(p.name for p in (work / "onnx").iterdir()) == [f"S00{i}.onnx" for i in range(3)]
    assert (work / "new_units.json").stat().st_size > 0
    # nothing printed was cut at 80 columns
    assert "…" not in done.stdout
