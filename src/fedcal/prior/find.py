"""Where a stored prior is: ``prior.json`` itself, or the one of a run folder (torch-free)."""

from __future__ import annotations

from pathlib import Path

from fedcal.core import runnames
from fedcal.core.paths import safe_name


def find_prior(
    path: str | Path, method: str = "fedprior", seed: int = 0, train_points: int = 0
) -> Path:
    """``prior.json`` itself, or the one of ``method``/``seed`` in a run directory."""
    path = Path(path)
    if path.exists() and not path.is_dir():  # a FIFO or device too: load_prior refuses it
        return path
    folder = runnames.run_name(safe_name(method, "--method"), train_points, seed)
    candidate = path / runnames.RUNS / folder / runnames.PRIOR
    if not candidate.exists():
        found = sorted(p.parent.name for p in path.glob(f"{runnames.RUNS}/*/{runnames.PRIOR}"))
        hint = f"; runs with a prior: {', '.join(found)}" if found else ""
        raise FileNotFoundError(f"no fleet prior at {candidate}{hint}")
    return candidate
