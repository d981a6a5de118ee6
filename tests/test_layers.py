"""The import contracts of pyproject.toml ([tool.importlinter]) hold for this tree.

The layers — data, models, core → algorithms → engine → config/build → experiment →
report → calibration → planning → CLI/apps — and no import cycle between sibling modules.
``make lint`` runs the same check; this test makes ``make test`` (and so CI) run it too.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept(tmp_path) -> None:
    env = dict(os.environ)
    # this tree's fedcal, whatever fedcal is installed
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    lint = Path(sys.executable).parent / "lint-imports"
    res = subprocess.run(
        [str(lint), "--cache-dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert ", 0 broken." in res.stdout, res.stdout
