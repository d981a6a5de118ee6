"""The one command-line shape of benchmarks/ and studies/: seeds are a list, ``0,1,2``;
and a study's run of ``fedcal compare`` as a user would type it."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


def seed_list(text: str) -> list[int]:
    """``--seeds`` / ``--fleet-seeds``: distinct non-negative integers, comma-separated.

    An argparse ``type``: anything else is a one-line error naming the value.
    """
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seeds like 0,1,2, got {text!r}") from None
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(
            f"expected distinct non-negative seeds like 0,1,2, got {text!r}"
        )
    return seeds


def compare_in(where: Path, config: str) -> None:
    """``fedcal compare --config where/run.toml --out where/run -q`` in a child process (the
    CLI as a user runs it), ``config`` written to ``where/run.toml`` first; what it printed
    lands in ``where/stderr.txt``. A failed run leaves no summary: the study reports it."""
    (where / "run.toml").write_text(config)
    cmd = [sys.executable, "-c", "from fedcal.cli import app; app()", "compare"]
    cmd += ["--config", str(where / "run.toml"), "--out", str(where / "run"), "-q"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    (where / "stderr.txt").write_text(done.stdout + done.stderr)
